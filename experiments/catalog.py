"""Every dataset, model and algorithm by name, with its facts.

Adding one is a few lines here: a ``register`` call naming its builder (in
``digit_datasets.py``, ``photo_datasets.py``, ``wilds.py``, ``models/`` or
``algorithms/``) and its facts. An algorithm's block here also declares its
hparams, with their defaults, random searches and WILDS values
(``entries.AlgorithmEntry.hparams``), unless it takes those of a ``family``. A folder
dataset in DomainBed's layout is one row of `FOLDER_DATASETS`.
``experiments/README.md`` lists every file that an addition touches.

This module imports no builder: it is what parses the command line, before
JAX starts (see `registry`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from experiments import entries
from experiments import registry
# As `hp`, the name the blocks below and experiments/README.md use.
from experiments import search_space as hp


DATASETS = registry.Registry("dataset", entries.DatasetEntry)
MODELS = registry.Registry("model", entries.ModelEntry)
ALGORITHMS = registry.Registry("algorithm", entries.AlgorithmEntry)

# ----------------------------------------------------------------------------
# Datasets. The digits train in a few minutes on two CPU cores (their domains
# hold ~240 training images, so 100 steps of 63 images are ~25 epochs); the
# others follow the paper (5,000 steps; DomainNet 6,000) and DomainBed's
# evaluation frequency.
#
# Their domains are DomainBed's ENVIRONMENTS (domainbed/datasets.py at
# b93c22a1: RotatedMNIST 164, "0" to "75", written here with their degree
# sign; ColoredMNIST 124; the folder datasets' are their sorted folders,
# 189-190, which its ENVIRONMENTS abbreviate: DomainNet's "clip", "info", ...
# at 243).

_DIGITS = {"model": "mnist_cnn", "small_images": True}
_ROTATED = {"domains": tuple(f"{angle}°" for angle in range(0, 90, 15)),
            **_DIGITS}
_COLORED = {"domains": ("+90%", "+80%", "-90%"), **_DIGITS}
DATASETS.register("RotatedDigits",
                  "experiments.data.digit_datasets:rotated_digits",
                  steps=300, checkpoint_freq=50, upsampled=True, **_ROTATED)
DATASETS.register("ColoredDigits",
                  "experiments.data.digit_datasets:colored_digits",
                  steps=300, checkpoint_freq=50, upsampled=True, **_COLORED)
DATASETS.register("RotatedMNIST",
                  "experiments.data.digit_datasets:rotated_mnist",
                  checkpoint_freq=100, **_ROTATED)
DATASETS.register("ColoredMNIST",
                  "experiments.data.digit_datasets:colored_mnist",
                  checkpoint_freq=100, **_COLORED)
DATASETS.register("DomainNet", "experiments.data.photo_datasets:domainnet",
                  steps=6000, checkpoint_freq=1000, small_batches=True,
                  domains=("clipart", "infograph", "painting", "quickdraw",
                           "real", "sketch"))

# DomainBed's folder datasets: name -> (folder under data_dir, the domain
# folders its download script writes). Domains are their sorted folders.
FOLDER_DATASETS = {
    "PACS": ("PACS", ("art_painting", "cartoon", "photo", "sketch")),
    "VLCS": ("VLCS", ("Caltech101", "LabelMe", "SUN09", "VOC2007")),
    "OfficeHome": ("office_home", ("Art", "Clipart", "Product",
                                   "Real World")),
    "TerraIncognita": ("terra_incognita", ("location_100", "location_38",
                                           "location_43", "location_46")),
}
for _name, (_folder, _domains) in FOLDER_DATASETS.items():
  DATASETS.register(_name,
                    "experiments.data.photo_datasets:image_folder_dataset",
                    options={"name": _name, "folder": _folder,
                             "domains": _domains}, domains=_domains)

DATASETS.register("RotatedMNIST5k",
                  "experiments.data.digit_datasets:rotated_mnist_5k",
                  **_ROTATED)
DATASETS.register("ColoredMNIST5k",
                  "experiments.data.digit_datasets:colored_mnist_5k",
                  **_COLORED)

# WILDS's datasets train WILDS's networks for the paper's epochs (its
# appendix "WILDS": PovertyMap 200, FMoW 10): an ImageNet DenseNet-121 for
# FMoW, a multispectral ResNet-18 from scratch for PovertyMap (every fold).
# Their domains are their training domains (experiments/data/wilds.py), then
# WILDS's evaluation splits: in distribution, then out of distribution.
WILDS_EVAL_SPLITS = ("id_val", "id_test", "val", "test")
# WILDS's country folds (wilds/datasets/poverty_dataset.py 22-64 at v2.0.0,
# SURVEY_NAMES['2009-17<fold>']): fold -> (train, val, test) countries. The
# training countries are the domains.
POVERTY_FOLDS = {
    "A": (("cameroon", "democratic_republic_of_congo", "ghana", "kenya",
           "lesotho", "malawi", "mozambique", "nigeria", "senegal", "togo",
           "uganda", "zambia", "zimbabwe"),
          ("benin", "burkina_faso", "guinea", "sierra_leone", "tanzania"),
          ("angola", "cote_d_ivoire", "ethiopia", "mali", "rwanda")),
    "B": (("angola", "cote_d_ivoire", "democratic_republic_of_congo",
           "ethiopia", "kenya", "lesotho", "mali", "mozambique", "nigeria",
           "rwanda", "senegal", "togo", "uganda", "zambia"),
          ("cameroon", "ghana", "malawi", "zimbabwe"),
          ("benin", "burkina_faso", "guinea", "sierra_leone", "tanzania")),
    "C": (("angola", "benin", "burkina_faso", "cote_d_ivoire", "ethiopia",
           "guinea", "kenya", "lesotho", "mali", "rwanda", "senegal",
           "sierra_leone", "tanzania", "zambia"),
          ("democratic_republic_of_congo", "mozambique", "nigeria", "togo",
           "uganda"),
          ("cameroon", "ghana", "malawi", "zimbabwe")),
    "D": (("angola", "benin", "burkina_faso", "cameroon", "cote_d_ivoire",
           "ethiopia", "ghana", "guinea", "malawi", "mali", "rwanda",
           "sierra_leone", "tanzania", "zimbabwe"),
          ("kenya", "lesotho", "senegal", "zambia"),
          ("democratic_republic_of_congo", "mozambique", "nigeria", "togo",
           "uganda")),
    "E": (("benin", "burkina_faso", "cameroon", "democratic_republic_of_congo",
           "ghana", "guinea", "malawi", "mozambique", "nigeria",
           "sierra_leone", "tanzania", "togo", "uganda", "zimbabwe"),
          ("angola", "cote_d_ivoire", "ethiopia", "mali", "rwanda"),
          ("kenya", "lesotho", "senegal", "zambia")),
}
# FMoW's training domains are the years of WILDS's year column (from 2002,
# wilds/datasets/fmow_dataset.py 160-168 at v2.0.0) before its OOD
# validation years (from 2013 in the official time_after_2016 split, 99-105).
DATASETS.register(
    "FMoW", "experiments.data.wilds:fmow", steps=None, epochs=10,
    checkpoint_freq=500, model="densenet121", wilds="FMoW",
    domains=tuple(map(str, range(2002, 2013))) + WILDS_EVAL_SPLITS)
for _fold, (_countries, _, _) in POVERTY_FOLDS.items():
  DATASETS.register(
      "PovertyMap" if _fold == "A" else f"PovertyMap-{_fold}",
      "experiments.data.wilds:poverty_map", options={"fold": _fold},
      steps=None, epochs=200, checkpoint_freq=500, model="resnet18",
      from_scratch=True, wilds="PovertyMap",
      domains=_countries + WILDS_EVAL_SPLITS)

# ----------------------------------------------------------------------------
# Models.


def _cnn_options(hparams: Mapping[str, Any]) -> dict[str, Any]:
  """The MNIST CNN's widths: ``cnn_width``, then twice it."""
  if "cnn_width" not in hparams:
    return {}
  width = hparams["cnn_width"]
  return {"widths": (width, 2 * width, 2 * width, 2 * width)}


def _imagenet_options(hparams: Mapping[str, Any]) -> dict[str, Any]:
  """BatchNorm's mode and the feature dropout of an ImageNet network."""
  return {"bn_mode": hparams.get("bn_mode", "frozen"),
          "dropout": hparams.get("resnet_dropout", 0.0)}


MODELS.register("mnist_cnn", "experiments.models:MNISTCNN",
                hparams_options=_cnn_options)
# torchvision's IMAGENET1K_V1 files (torchvision/models/resnet.py and
# densenet.py): the hex digits start their SHA-256.
# timm's AugMix weights: DomainBed's resnet50_augmix (domainbed/networks.py
# at b93c22a, lines 119-121: timm.create_model("resnet50.ram_in1k",
# pretrained=True)).
for _depth, _weights, _augmix in (
    (18, "resnet18-f37072fd.pth", None),
    (50, "resnet50-0676ba61.pth", "resnet50.ram_in1k")):
  MODELS.register(f"resnet{_depth}", "experiments.models:ResNet",
                  options={"depth": _depth}, hparams_options=_imagenet_options,
                  imagenet_weights=_weights, augmix_weights=_augmix)
MODELS.register("densenet121", "experiments.models:DenseNet",
                hparams_options=_imagenet_options,
                imagenet_weights="densenet121-a639ec97.pth")

# ----------------------------------------------------------------------------
# Algorithms, one block each: its hparams, as DomainBed's ``_hparam`` calls
# (domainbed/hparams_registry.py at b93c22a1, whose values these are unless
# said), and its entry. Every algorithm also has DomainBed's training hparams
# (unless its ``training_hparams`` replace them) and the dataset's
# (`search_space`). On WILDS every hparam is fixed, at WILDS's value
# (``wilds=``) or else its default: the paper searches nothing there.
#
# Grouped as experiments/algorithms/ is: by the paper's categories.
_OPTIMIZATION = "experiments.algorithms.optimization"
_PRINCIPAL_GRADIENTS = "experiments.algorithms.principal_gradients:pgrad"
_GRADIENTS = "experiments.algorithms.gradient_manipulation"
_MIXING = "experiments.algorithms.mixing"
_INVARIANCE = "experiments.algorithms.invariance"
_ADVERSARIAL = "experiments.algorithms.adversarial"

ALGORITHMS.register("ERM", f"{_OPTIMIZATION}:erm")


def _sd(space: hp.SearchSpace) -> None:
  space.add("sd_reg", 0.1, hp.NON_NEGATIVE, hp.log_uniform(-5, -1))


ALGORITHMS.register("SD", f"{_OPTIMIZATION}:sd", hparams=_sd)

# PGrad: the paper's table (appendix A.10), whose search is deliberately
# narrow: only dropout and weight decay are drawn. Chunks per domain batch of
# the "-B" variants (`entries.AlgorithmEntry.chunked`): the paper's B = 3, and B = 2
# on DomainNet (section 5.1), where memory limits the batch to 24 and two
# chunks keep 12 examples each, near the 11 of B = 3 at 32.
PGRAD_B = 3
PGRAD_B_SMALL_BATCHES = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class PGradHParams:
  """PGrad's hparams as its builder takes them
  (``algorithms.principal_gradients.pgrad``).

  Attributes:
    lr: the inner Adam's learning rate.
    outer_lr: the outer SGD's learning rate (c of the paper's WILDS step
      gamma = c / n-hat, with `outer_lr_per_domain`).
    k: the principal components kept: a positive int, or ``"all"``.
    components: which: ``"top"`` or ``"bottom"``.
    B: the chunks every domain's batch is cut into, an inner step each.
    weight_decay: the outer step's weight decay.
    outer_lr_per_domain: the outer step is ``outer_lr / num_domains``.
    mixup_alpha: MixUp's inside every chunk (PGrad-BMix), or ``None``.
  """

  lr: float
  outer_lr: float
  k: int | str
  components: str
  B: int  # pylint: disable=invalid-name
  weight_decay: float
  outer_lr_per_domain: bool = False
  mixup_alpha: float | None = None

  @classmethod
  def from_hparams(cls, hparams: Mapping[str, Any]) -> PGradHParams:
    """Reads the hparams that the PGrad blocks declare."""
    return cls(lr=hparams["lr"], outer_lr=hparams["outer_lr"],
               k=hparams["k"], components=hparams["components"],
               B=hparams["B"], weight_decay=hparams["weight_decay"],
               outer_lr_per_domain=hparams.get("outer_lr_per_domain", False),
               mixup_alpha=hparams.get("mixup_alpha"))

  @property
  def batch_chunks(self) -> int:
    """The equal chunks every domain's batch is cut into: `B`."""
    return self.B


def _pgrad_training(space: hp.SearchSpace) -> None:
  data = space.dataset
  small = data.small_images
  # The inner (Adam) learning rate; the paper does not search it. On WILDS,
  # WILDS's (the paper's appendix "WILDS": 1e-3 on PovertyMap).
  space.add("lr", 1e-3 if small else 5e-5, hp.POSITIVE,
            wilds=hp.wilds_lr(data))
  # On WILDS the outer step is gamma = c / n-hat (`_pgrad_wilds`), c = 0.1
  # on PovertyMap and 0.01 on FMoW (the paper's appendix "WILDS").
  space.add("outer_lr", 0.1, hp.POSITIVE,
            wilds=0.1 if data.wilds == "PovertyMap" else 0.01)
  space.add("k", 4, hp.Allowed(int, low=1, choices=("all",)))
  space.add("components", "top", hp.Allowed(str, choices=("top", "bottom")))
  chunks = 1
  if space.algorithm.chunked:
    chunks = PGRAD_B_SMALL_BATCHES if data.small_batches else PGRAD_B
  space.add("B", chunks, hp.POSITIVE_INT)
  # Every domain's batch is cut into B chunks, so it is rounded to the
  # nearest multiple of B: 32 -> 33 (11 examples a chunk, the paper's "11
  # samples in each small batch"), DomainBed's 64 on the MNIST-like datasets
  # -> 63, WILDS's 8 -> 9.
  batch = 64 if small else 24 if data.small_batches else 32
  space.add("batch_size", hp.round_to_multiple(batch, chunks),
            hp.POSITIVE_INT,
            wilds=hp.round_to_multiple(hp.WILDS_BATCH_SIZE, chunks))
  space.add("weight_decay", 0.0, hp.NON_NEGATIVE, hp.log_uniform(-6, -4))


def _pgrad_wilds(space: hp.SearchSpace) -> None:
  # The paper's WILDS protocol divides the outer step by n-hat, the domains
  # sampled per step (WILDS's groups per batch; the paper does not state it).
  space.add_wilds("outer_lr_per_domain", True, hp.Allowed(bool))


def _register_pgrad(name: str, **facts: Any) -> None:
  """Registers PGrad or a variant: its builder with typed hparams."""
  ALGORITHMS.register(name, _PRINCIPAL_GRADIENTS, hparams_type=PGradHParams,
                      **facts)


# MixUp's mixing weight, of its examples (MixUp) or of PGrad-BMix's chunks.
def _mixup(space: hp.SearchSpace) -> None:
  space.add("mixup_alpha", 0.2, hp.POSITIVE, hp.log_uniform(-1, 1))


_register_pgrad("PGrad", data_parallel=True, training_hparams=_pgrad_training,
                hparams=_pgrad_wilds)
# The "-B" variants differ only in their hparams (B = 3). PGrad-BMix mixes
# the chunks of a batch across its domains, which the data axis cannot split.
_register_pgrad("PGrad-F", options={"order": "fixed"}, data_parallel=True,
                family="PGrad")
_register_pgrad("PGrad-B", data_parallel=True, family="PGrad", chunked=True)
_register_pgrad("PGrad-BMix", options={"mix": True}, family="PGrad",
                chunked=True, hparams=_mixup)
_register_pgrad("PGradParallel", options={"parallel": True},
                data_parallel=True, family="PGrad")
# The claims' ablations of PGrad. ``k="all"`` keeps every component of the
# trajectory; ``components="bottom"`` with ``k=1`` steps along the
# trajectory's least-varying direction (the paper's A.7).
for _name, _fixed in (("PGrad-k1", {"k": 1}), ("PGrad-k2", {"k": 2}),
                      ("PGrad-kall", {"k": "all"}),
                      ("PGrad-Bottom", {"components": "bottom", "k": 1})):
  _register_pgrad(_name, variant_of="PGrad", fixed_hparams=_fixed,
                  data_parallel=True)


def _fish(space: hp.SearchSpace) -> None:
  space.add("meta_lr", 0.5, hp.POSITIVE, hp.choice([0.05, 0.1, 0.5]))
  # DomainBed's placement and order; see
  # experiments/algorithms/gradient_manipulation.py.
  space.add("fish_weight_decay", "inner",
            hp.Allowed(str, choices=("inner", "outer")))
  space.add("fish_order", "fixed", hp.Allowed(str, choices=("fixed", "random")))


ALGORITHMS.register("Fish", f"{_GRADIENTS}:fish", data_parallel=True,
                    hparams=_fish)


def _fishr(space: hp.SearchSpace) -> None:
  space.add("lambda", 1000.0, hp.NON_NEGATIVE, hp.log_uniform(1, 4))
  space.add("penalty_anneal_iters", 1500, hp.NON_NEGATIVE_INT,
            hp.uniform(0, 5000, int))
  space.add("ema", 0.95, hp.FRACTION, hp.uniform(0.90, 0.99))


ALGORITHMS.register("Fishr", f"{_GRADIENTS}:fishr", hparams=_fishr)
ALGORITHMS.register("MixUp", f"{_MIXING}:mixup_algorithm",
                    hparams=_mixup)


def _irm(space: hp.SearchSpace) -> None:
  # On WILDS, WILDS's IRM lambda (its examples/configs).
  space.add("irm_lambda", 1e2, hp.NON_NEGATIVE, hp.log_uniform(-1, 5),
            wilds=1.0)
  space.add("irm_penalty_anneal_iters", 500, hp.NON_NEGATIVE_INT,
            hp.int_log_uniform(0, 4, base=10))


ALGORITHMS.register("IRM", f"{_INVARIANCE}:irm", hparams=_irm)


def _vrex(space: hp.SearchSpace) -> None:
  space.add("vrex_lambda", 1e1, hp.NON_NEGATIVE, hp.log_uniform(-1, 5))
  space.add("vrex_penalty_anneal_iters", 500, hp.NON_NEGATIVE_INT,
            hp.int_log_uniform(0, 4, base=10))


ALGORITHMS.register("VREx", f"{_INVARIANCE}:vrex", hparams=_vrex)


def _ib_erm(space: hp.SearchSpace) -> None:
  space.add("ib_lambda", 1e2, hp.NON_NEGATIVE, hp.log_uniform(-1, 5))
  space.add("ib_penalty_anneal_iters", 500, hp.NON_NEGATIVE_INT,
            hp.int_log_uniform(0, 4, base=10))


ALGORITHMS.register("IB_ERM", f"{_INVARIANCE}:ib_erm", hparams=_ib_erm)


def _mmd(space: hp.SearchSpace) -> None:
  space.add("mmd_gamma", 1.0, hp.NON_NEGATIVE, hp.log_uniform(-1, 1))


def _coral(space: hp.SearchSpace) -> None:
  # WILDS's deep CORAL weight (examples/configs/datasets.py); WILDS has no
  # MMD.
  space.update("mmd_gamma",
               wilds=10.0 if space.dataset.wilds == "PovertyMap" else 0.1)


ALGORITHMS.register("CORAL", f"{_INVARIANCE}:coral", family="MMD",
                    hparams=_coral)
ALGORITHMS.register("MMD", f"{_INVARIANCE}:mmd", hparams=_mmd)


def _dann(space: hp.SearchSpace) -> None:
  space.add("lambda", 1.0, hp.NON_NEGATIVE, hp.log_uniform(-2, 2))
  space.add("weight_decay_d", 0.0, hp.NON_NEGATIVE, hp.log_uniform(-6, -2))
  space.add("d_steps_per_g_step", 1, hp.POSITIVE_INT,
            hp.int_log_uniform(0, 3))
  space.add("grad_penalty", 0.0, hp.NON_NEGATIVE, hp.log_uniform(-2, 1))
  space.add("beta1", 0.5, hp.FRACTION, hp.choice([0.0, 0.5]))
  space.add("mlp_width", 256, hp.POSITIVE_INT, hp.int_log_uniform(6, 10))
  space.add("mlp_depth", 3, hp.Allowed(int, low=2), hp.choice([3, 4, 5], int))
  space.add("mlp_dropout", 0.0, hp.FRACTION, hp.choice([0.0, 0.1, 0.5]))
  # The generator's and the discriminator's Adams, at the lr of the size.
  for name in ("lr_g", "lr_d"):
    space.add(name, space["lr"].default, hp.POSITIVE, space["lr"].search)
  space.add("weight_decay_g", 0.0, hp.NON_NEGATIVE,
            space["weight_decay"].search)


ALGORITHMS.register("DANN", f"{_ADVERSARIAL}:dann", hparams=_dann)
# DomainBed's DANN block is CDANN's too.
ALGORITHMS.register("CDANN", f"{_ADVERSARIAL}:cdann", family="DANN")


def _sagnet(space: hp.SearchSpace) -> None:
  space.add("sag_w_adv", 0.1, hp.NON_NEGATIVE, hp.log_uniform(-2, 1))


# SagNet's network has a style network beside its classifier
# (models.StyleClassifier).
ALGORITHMS.register("SagNet", f"{_ADVERSARIAL}:sagnet",
                    model_options={"style_head": True}, hparams=_sagnet)


def _group_dro(space: hp.SearchSpace) -> None:
  space.add("groupdro_eta", 1e-2, hp.NON_NEGATIVE, hp.log_uniform(-3, -1))


ALGORITHMS.register("GroupDRO", f"{_OPTIMIZATION}:group_dro",
                    data_parallel=True, hparams=_group_dro)


def _mldg(space: hp.SearchSpace) -> None:
  space.add("mldg_beta", 1.0, hp.NON_NEGATIVE, hp.log_uniform(-1, 1))
  space.add("n_meta_test", 2, hp.POSITIVE_INT, hp.choice([1, 2], int))
  # DomainBed's pairing at b93c22a1, or its earlier random pairs; see
  # experiments/algorithms/optimization.py.
  space.add("mldg_pairs", "meta_test_split",
            hp.Allowed(str, choices=("meta_test_split", "random_pairs")))


ALGORITHMS.register("MLDG", f"{_OPTIMIZATION}:mldg", data_parallel=True,
                    hparams=_mldg)


def _arm(space: hp.SearchSpace) -> None:
  if not space.dataset.small_images:
    # ARM's support sets are its batches: 8 images on photos.
    space.update("batch_size", default=8, search=None)


# ARM's network sees a context channel (models.ContextClassifier).
ALGORITHMS.register("ARM", f"{_MIXING}:arm",
                    model_options={"context_net": True}, hparams=_arm)

# Agreements and moving-average weights: 0 to 1, both included.
_UNIT_INTERVAL = hp.Allowed(float, low=0, high=1)


def _andmask(space: hp.SearchSpace) -> None:
  # DomainBed's default is the integer 1.
  space.add("tau", 1.0, _UNIT_INTERVAL, hp.uniform(0.5, 1.0))


def _sandmask(space: hp.SearchSpace) -> None:
  space.add("tau", 1.0, _UNIT_INTERVAL, hp.uniform(0.0, 1.0))
  space.add("k", 10.0, hp.NON_NEGATIVE, hp.log_uniform(-3, 5))


def _iga(space: hp.SearchSpace) -> None:
  # DomainBed's default is the integer 1000.
  space.add("penalty", 1000.0, hp.NON_NEGATIVE, hp.log_uniform(1, 5))


def _rsc(space: hp.SearchSpace) -> None:
  for name in ("rsc_f_drop_factor", "rsc_b_drop_factor"):
    space.add(name, 1 / 3, hp.FRACTION, hp.uniform(0, 0.5))


def _mtl(space: hp.SearchSpace) -> None:
  space.add("mtl_ema", 0.99, _UNIT_INTERVAL,
            hp.choice([0.5, 0.9, 0.99, 1.0]))


# Every domain's gradient from its own pass, masked or penalised per
# parameter: the data axis splits each pass (`base.domain_gradients`).
ALGORITHMS.register("ANDMask", f"{_GRADIENTS}:andmask", data_parallel=True,
                    hparams=_andmask)
ALGORITHMS.register("SANDMask", f"{_GRADIENTS}:sandmask", data_parallel=True,
                    hparams=_sandmask)
ALGORITHMS.register("IGA", f"{_GRADIENTS}:iga", data_parallel=True,
                    hparams=_iga)
# RSC's batch percentile and SelfReg's class sort pool the domains, as
# does MTL's one featurizer pass where no BatchNorm trains.
ALGORITHMS.register("RSC", f"{_GRADIENTS}:rsc", hparams=_rsc)
ALGORITHMS.register("SelfReg", f"{_MIXING}:selfreg")
# MTL's head takes a domain embedding (models.EmbeddingClassifier).
ALGORITHMS.register("MTL", f"{_MIXING}:mtl",
                    model_options={"domain_embedding": True}, hparams=_mtl)

# The algorithms whose params paths the claims compare (the paper's appendix
# A.4): a sweep saves their snapshots (``--trajectory_freq``) by default.
TRAJECTORY_ALGORITHMS = ("ERM", "PGrad")


# ERM++ (DomainBed's ERMPlusPlus, lines 127-233 of domainbed/algorithms.py):
# ERM with a linear probe first, a moving average of the network, which it
# evaluates, and LARS as an option. DomainBed declares ``lars`` and
# ``linear_steps`` for every algorithm (hparams_registry.py lines 37-38),
# though only ERMPlusPlus reads them; here they are its own, beside its
# ``linear_lr`` (line 173). Its batch is pooled, as ERM's.
def _erm_plus_plus(space: hp.SearchSpace) -> None:
  space.add("lars", False, hp.Allowed(bool))
  space.add("linear_steps", 500, hp.NON_NEGATIVE_INT)
  space.add("linear_lr", 5e-5, hp.POSITIVE, hp.log_uniform(-5, -3.5))
  # DomainBed's ``--auto_lr`` of scripts/train_autolr.py (line 51), a flag
  # there; here an hparam of ERM++, whose ``set_lr`` it drives.
  space.add("auto_lr", False, hp.Allowed(bool))


ALGORITHMS.register("ERMPlusPlus", f"{_OPTIMIZATION}:erm_plus_plus",
                    hparams=_erm_plus_plus)
