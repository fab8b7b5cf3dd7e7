"""DomainBed-style hyperparameters: defaults and seeded random draws.

Every hyperparameter has a default, a random search distribution
(``hparams_seed`` 0 means the defaults, as in DomainBed's sweeps) and the
values it accepts, which `check_hparams` enforces on overrides and
`describe_hparams` lists. The distributions follow DomainBed (Gulrajani &
Lopez-Paz, ICLR 2021) for the baselines and PGrad's appendix A.10 table for
the PGrad variants, whose search is deliberately narrow: only dropout and
weight decay are drawn.

Batch sizes are per domain. PGrad-B splits every domain's batch into ``B``
chunks, so its batch is rounded to the nearest multiple of ``B``: 32 -> 33
(11 examples per chunk, as the paper's "11 samples in each small batch") and
DomainBed's 64 for the MNIST-like datasets -> 63.

Each hyperparameter draws from its own random stream, seeded by the seeds and
its name, so adding a hyperparameter never changes the draws of the others.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from experiments import catalog

# Chunks per domain batch of the "-B" variants
# (`catalog.AlgorithmEntry.chunked`): the paper's B = 3, and B = 2 on
# DomainNet (section 5.1), where memory limits the batch to 24 and two chunks
# keep 12 examples each, near the 11 of B = 3 at 32 (appendix A.10).
PGRAD_B = 3
PGRAD_B_SMALL_BATCHES = 2


def _chunks(algorithm: str, facts: catalog.DatasetEntry) -> int:
  """``B`` by default: `PGRAD_B` for the "-B" variants (fewer where batches
  are small), 1 for the rest of PGrad's family."""
  if not catalog.ALGORITHMS[algorithm].chunked:
    return 1
  return PGRAD_B_SMALL_BATCHES if facts.small_batches else PGRAD_B


def _family(algorithm: str) -> str:
  """The algorithm whose hparams ``algorithm`` has (`catalog`'s family)."""
  return catalog.ALGORITHMS[algorithm].family or algorithm


def _wilds_hparams(algorithm: str, dataset: str) -> dict[str, Any]:
  """Fixed hyperparameters on WILDS, which the paper does not search.

  From WILDS's ``examples/configs/datasets.py``: Adam at lr 1e-3
  (PovertyMap) or 1e-4 (FMoW) without weight decay; batches of 64 examples
  from ``n_groups_per_batch`` = 8 domains, i.e. 8 per domain; BatchNorm
  trained; IRM's lambda 1; CORAL's weight 10 (PovertyMap) or 0.1 (FMoW).
  From the paper (appendix "WILDS"): PGrad's inner Adam at lr 1e-3 on
  PovertyMap, and the outer lr gamma = c / n-hat with c = 0.1 (PovertyMap) or
  0.01 (FMoW), n-hat the domains sampled per step (8 here, as WILDS's
  groups per batch; the paper does not state it). ``data_augmentation``:
  PovertyMap's training flips and colour jitter, on by default as in WILDS
  1.x's examples and Fish (`wilds_augmentation`); FMoW has none to toggle.
  """
  entry = catalog.ALGORITHMS[algorithm]
  poverty = catalog.DATASETS[dataset].wilds == "PovertyMap"
  hparams = {"lr": 1e-3 if poverty else 1e-4, "weight_decay": 0.0,
             "batch_size": 8, "domains_per_step": 8, "bn_mode": "train",
             "resnet_dropout": 0.0}
  if poverty:
    hparams["data_augmentation"] = True
  if _family(algorithm) == "PGrad":
    b = _chunks(algorithm, catalog.DATASETS[dataset])
    hparams.update(outer_lr=0.1 if poverty else 0.01,
                   outer_lr_per_domain=True, k=4, B=b,
                   batch_size=round_to_multiple(8, b))
  elif algorithm == "Fish":
    hparams["meta_lr"] = 0.5
  elif algorithm == "Fishr":
    hparams.update({"lambda": 1000.0, "penalty_anneal_iters": 1500,
                    "ema": 0.95})
  elif algorithm == "IRM":
    hparams.update(irm_lambda=1.0, irm_penalty_anneal_iters=500)
  elif algorithm == "CORAL":
    hparams["mmd_gamma"] = 10.0 if poverty else 0.1
  if entry.mixup:
    hparams["mixup_alpha"] = 0.2
  return hparams


def round_to_multiple(size: int, multiple: int) -> int:
  """The positive multiple of ``multiple`` nearest to ``size`` (ties go down).

  >>> [round_to_multiple(size, 3) for size in (32, 64, 24)]
  [33, 63, 24]
  """
  return multiple * max(1, round(size / multiple))


class Search(NamedTuple):
  """A random search distribution.

  Attributes:
    draw: ``draw(rng) -> value``, one random draw.
    description: the distribution as `--list_hparams` prints it.
  """

  draw: Callable[[np.random.Generator], Any]
  description: str


def log_uniform(low: float, high: float, base: int = 10) -> Search:
  """``base ** U(low, high)``."""
  return Search(lambda rng: base**rng.uniform(low, high),
                f"{base}^U({low}, {high})")


def int_log_uniform(low: float, high: float, base: int = 2) -> Search:
  """``int(base ** U(low, high))``; base 2 is DomainBed's batch size search."""
  return Search(lambda rng: int(base**rng.uniform(low, high)),
                f"int({base}^U({low}, {high}))")


def uniform(low: float, high: float, cast: type = float) -> Search:
  """``cast(U(low, high))``."""
  return Search(lambda rng: cast(rng.uniform(low, high)),
                f"{cast.__name__}(U({low}, {high}))")


def choice(options: Sequence[Any], cast: type = float) -> Search:
  """``cast`` of one of ``options``, uniformly."""
  return Search(lambda rng: cast(rng.choice(options)),
                "one of " + ", ".join(map(str, options)))


@dataclasses.dataclass(frozen=True)
class Allowed:
  """The values a hyperparameter accepts: a type and a range, or choices.

  Attributes:
    kind: ``int``, ``float``, ``str`` or ``bool``. A ``float`` accepts
      integers too.
    low: the lower bound, or ``None`` for none.
    high: the upper bound, or ``None`` for none.
    low_open: whether ``low`` itself is excluded.
    high_open: whether ``high`` itself is excluded.
    choices: the accepted strings: all of them for ``str``, or named values
      beside a number's range (``k="all"``).
  """

  kind: type
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[str, ...] = ()

  def __str__(self) -> str:
    choices = "one of " + ", ".join(repr(c) for c in self.choices)
    if self.kind is str:
      return choices
    if self.kind is bool:
      return "true or false"
    kind = "an integer" if self.kind is int else "a number"
    if self.low is not None and self.high is not None:
      kind += (f" in {'(' if self.low_open else '['}{self.low}, "
               f"{self.high}{')' if self.high_open else ']'}")
    elif self.low is not None:
      kind += f" {'>' if self.low_open else '>='} {self.low}"
    return f"{kind} or {choices}" if self.choices else kind

  def accepts(self, value: Any) -> bool:
    """Whether ``value`` has the right type and lies in the range."""
    if self.kind is bool:
      return isinstance(value, bool)
    if isinstance(value, str) or self.kind is str:
      return value in self.choices
    # Python's bool is an int: a JSON true is no number here.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if self.kind is int and not isinstance(value, int):
      return False
    if not math.isfinite(value):
      return False
    if self.low is not None and (
        value < self.low or (self.low_open and value == self.low)):
      return False
    return self.high is None or (
        value < self.high or (not self.high_open and value == self.high))


POSITIVE = Allowed(float, low=0, low_open=True)
NON_NEGATIVE = Allowed(float, low=0)
POSITIVE_INT = Allowed(int, low=1)
NON_NEGATIVE_INT = Allowed(int, low=0)
FRACTION = Allowed(float, low=0, high=1, high_open=True)


class HParam(NamedTuple):
  """One hyperparameter of an algorithm on a dataset.

  Attributes:
    default: its value when ``hparams_seed`` is 0.
    search: its random search distribution, or ``None`` when the search keeps
      the default.
    allowed: the values it accepts, checked by `check_hparams`.
  """

  default: Any
  search: Search | None
  allowed: Allowed

  def draw(self, rng: np.random.Generator) -> Any:
    return self.default if self.search is None else self.search.draw(rng)


def _hparams(algorithm: str, dataset: str) -> dict[str, HParam]:
  """Every hyperparameter of ``algorithm`` on ``dataset``, by name."""
  entry = catalog.ALGORITHMS[algorithm]
  if entry.variant_of:
    hp = _hparams(entry.variant_of, dataset)
    for name, value in entry.fixed_hparams.items():
      hp[name] = HParam(value, None, hp[name].allowed)
    return hp
  facts = catalog.DATASETS[dataset]
  hp = _searched_hparams(algorithm, facts)
  if not facts.wilds:
    return hp
  # WILDS's are photos: every name and its allowed values are those of
  # DomainBed's photo datasets, with WILDS's values fixed, since the paper
  # does not search there.
  del hp["image_size"]  # WILDS's images keep their own sizes.
  allowed = {"domains_per_step": POSITIVE_INT,
             "outer_lr_per_domain": Allowed(bool),
             "data_augmentation": Allowed(bool)}
  wilds_values = _wilds_hparams(algorithm, dataset)
  if "data_augmentation" not in wilds_values:
    # WILDS augments no training images of this dataset (FMoW).
    hp.pop("data_augmentation", None)
  for name, value in wilds_values.items():
    allowed.setdefault(name, hp[name].allowed if name in hp else None)
    hp[name] = HParam(value, None, allowed[name])
  return {name: hparam._replace(search=None) for name, hparam in hp.items()}


def _searched_hparams(
    algorithm: str, facts: catalog.DatasetEntry
) -> dict[str, HParam]:
  """DomainBed's search space of ``algorithm`` on a dataset of ``facts``, or
  the paper's for PGrad's family."""
  entry = catalog.ALGORITHMS[algorithm]
  small = facts.small_images
  family = _family(algorithm)
  hp: dict[str, HParam] = {}

  def add(name: str, default: Any, allowed: Allowed,
          search: Search | None = None) -> None:
    hp[name] = HParam(default, search, allowed)

  if family == "PGrad":
    # Inner (Adam) learning rate; the paper does not search it.
    add("lr", 1e-3 if small else 5e-5, POSITIVE)
    add("outer_lr", 0.1, POSITIVE)
    add("k", 4, Allowed(int, low=1, choices=("all",)))
    add("components", "top", Allowed(str, choices=("top", "bottom")))
    add("B", _chunks(algorithm, facts), POSITIVE_INT)
    batch = round_to_multiple(64 if small else 24 if facts.small_batches
                              else 32, hp["B"].default)
    add("batch_size", batch, POSITIVE_INT)
    add("weight_decay", 0.0, NON_NEGATIVE, log_uniform(-6, -4))
  else:
    if small:
      add("lr", 1e-3, POSITIVE, log_uniform(-4.5, -2.5))
      add("batch_size", 64, POSITIVE_INT, int_log_uniform(3, 9))
      add("weight_decay", 0.0, NON_NEGATIVE)
    else:
      add("lr", 5e-5, POSITIVE, log_uniform(-5, -3.5))
      top = 5 if facts.small_batches else 5.5
      if algorithm == "ARM":
        # ARM's support sets are its batches: 8 images on photos.
        add("batch_size", 8, POSITIVE_INT)
      else:
        add("batch_size", 32, POSITIVE_INT, int_log_uniform(3, top))
      add("weight_decay", 0.0, NON_NEGATIVE, log_uniform(-6, -2))
  if small:
    # The MNIST CNN's first width (the rest are twice it). DomainBed's is 64;
    # the embedded digits are 8x8 scans upsampled, so a quarter of that width
    # learns them as well and trains in minutes on a CPU.
    add("cnn_width", 16 if facts.upsampled else 64, POSITIVE_INT)
    # The image side the network sees; DomainBed's 28 (see
    # datasets.resized for why the embedded digits can take 14).
    add("image_size", 28, POSITIVE_INT)
  if not small:
    add("resnet_dropout", 0.0, FRACTION, choice([0.0, 0.1, 0.5]))
    # DomainBed fine-tunes ResNets with frozen BatchNorm statistics.
    add("bn_mode", "frozen", Allowed(str, choices=("frozen", "train")))
    # DomainBed's default: its training augmentation of the training domains
    # (experiments/data/photo_augmentation.py).
    add("data_augmentation", True, Allowed(bool))
    # The photos' side: DomainBed's 224. A smaller side trains the photo
    # path on a CPU in seconds.
    add("image_size", 224, POSITIVE_INT)

  if algorithm == "Fish":
    add("meta_lr", 0.5, POSITIVE, choice([0.05, 0.1, 0.5]))
    # DomainBed's placement and order; see
    # experiments/algorithms/gradient_manipulation.py.
    add("fish_weight_decay", "inner", Allowed(str, choices=("inner", "outer")))
    add("fish_order", "fixed", Allowed(str, choices=("fixed", "random")))
  elif algorithm == "Fishr":
    add("lambda", 1000.0, NON_NEGATIVE, log_uniform(1, 4))
    add("penalty_anneal_iters", 1500, NON_NEGATIVE_INT, uniform(0, 5000, int))
    add("ema", 0.95, FRACTION, uniform(0.90, 0.99))
  elif algorithm == "IRM":
    add("irm_lambda", 1e2, NON_NEGATIVE, log_uniform(-1, 5))
    add("irm_penalty_anneal_iters", 500, NON_NEGATIVE_INT,
        int_log_uniform(0, 4, base=10))
  elif family == "MMD":
    add("mmd_gamma", 1.0, NON_NEGATIVE, log_uniform(-1, 1))
  elif algorithm == "GroupDRO":
    add("groupdro_eta", 1e-2, NON_NEGATIVE, log_uniform(-3, -1))
  elif algorithm == "MLDG":
    add("mldg_beta", 1.0, NON_NEGATIVE, log_uniform(-1, 1))
    add("n_meta_test", 2, POSITIVE_INT, choice([1, 2], int))
    # DomainBed's pairing at b93c22a1, or its earlier random pairs; see
    # experiments/algorithms/optimization.py.
    add("mldg_pairs", "meta_test_split",
        Allowed(str, choices=("meta_test_split", "random_pairs")))
  elif algorithm == "DANN":
    add("lambda", 1.0, NON_NEGATIVE, log_uniform(-2, 2))
    add("weight_decay_d", 0.0, NON_NEGATIVE, log_uniform(-6, -2))
    add("d_steps_per_g_step", 1, POSITIVE_INT, int_log_uniform(0, 3))
    add("grad_penalty", 0.0, NON_NEGATIVE, log_uniform(-2, 1))
    add("beta1", 0.5, FRACTION, choice([0.0, 0.5]))
    add("mlp_width", 256, POSITIVE_INT, int_log_uniform(6, 10))
    add("mlp_depth", 3, Allowed(int, low=2), choice([3, 4, 5], int))
    add("mlp_dropout", 0.0, FRACTION, choice([0.0, 0.1, 0.5]))
    # The generator's and the discriminator's Adams, at the lr of the size.
    for name in ("lr_g", "lr_d"):
      add(name, hp["lr"].default, POSITIVE, hp["lr"].search)
    add("weight_decay_g", 0.0, NON_NEGATIVE, hp["weight_decay"].search)
  if entry.mixup:
    add("mixup_alpha", 0.2, POSITIVE, log_uniform(-1, 1))
  return hp


def default_hparams(algorithm: str, dataset: str) -> dict[str, Any]:
  """The default hyperparameters of ``algorithm`` on ``dataset``.

  Args:
    algorithm: an algorithm name, e.g. ``"PGrad-B"``.
    dataset: a dataset name, e.g. ``"RotatedDigits"``.

  Returns:
    A dict of hyperparameters.
  """
  return {name: hparam.default
          for name, hparam in _hparams(algorithm, dataset).items()}


def random_hparams(
    algorithm: str, dataset: str, seed: int, trial_seed: int = 0
) -> dict[str, Any]:
  """A random draw from the search space; seed 0 gives the defaults.

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.
    seed: the hparams seed; 0 returns `default_hparams`.
    trial_seed: the trial, so that every trial draws its own hyperparameters.

  Returns:
    A dict of hyperparameters.
  """
  if seed == 0:
    return default_hparams(algorithm, dataset)
  hparams = {}
  for name, hparam in _hparams(algorithm, dataset).items():
    value = hparam.draw(np.random.default_rng(
        [seed, trial_seed, zlib.crc32(name.encode())]))
    # Plain Python numbers, for JSON and for hashing as static arguments.
    hparams[name] = value.item() if isinstance(value, np.generic) else value
  return hparams


def check_hparams(
    algorithm: str, dataset: str, hparams: Mapping[str, Any]
) -> None:
  """Checks names, types and ranges of hyperparameters against the registry.

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.
    hparams: hyperparameters, e.g. a draw updated with ``--hparams``.

  Raises:
    ValueError: naming the first unknown or out-of-range hyperparameter and
      what it accepts.
  """
  registry = _hparams(algorithm, dataset)
  unknown = sorted(hparams.keys() - registry.keys())
  if unknown:
    raise ValueError(f"Unknown hparams {unknown} for {algorithm} on {dataset}; "
                     f"known: {sorted(registry)}.")
  for name, value in hparams.items():
    allowed = registry[name].allowed
    if not allowed.accepts(value):
      raise ValueError(f"hparam {name!r} must be {allowed}, got {value!r}.")
  if "B" in hparams and hparams["batch_size"] % hparams["B"]:
    # Every domain's batch is cut into B equal chunks.
    raise ValueError(f"hparam 'batch_size' must be a multiple of B = "
                     f"{hparams['B']}, got {hparams['batch_size']}.")


def describe_hparams(algorithm: str, dataset: str) -> str:
  """A table of ``algorithm``'s hyperparameters on ``dataset``.

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.

  Returns:
    One line per hyperparameter: its name, default, random search
    distribution (``hparams_seed`` > 0) and accepted values.
  """
  rows = [("hparam", "default", "search (hparams_seed > 0)", "allowed")]
  for name, hparam in _hparams(algorithm, dataset).items():
    search = "fixed" if hparam.search is None else hparam.search.description
    rows.append((name, repr(hparam.default), search, str(hparam.allowed)))
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  return "\n".join(
      "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3]
      for row in rows)
