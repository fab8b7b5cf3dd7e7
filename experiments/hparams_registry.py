"""DomainBed-style hyperparameters: defaults and seeded random draws.

Every hyperparameter has a default and a random search distribution
(``hparams_seed`` 0 means the defaults, as in DomainBed's sweeps). The
distributions follow DomainBed (Gulrajani & Lopez-Paz, ICLR 2021) for the
baselines and PGrad's appendix A.10 table for the PGrad variants, whose search
is deliberately narrow: only dropout and weight decay are drawn.

Batch sizes are per domain. PGrad-B splits every domain's batch into ``B``
chunks, so its batch is rounded to the nearest multiple of ``B``: 32 -> 33
(11 examples per chunk, as the paper's "11 samples in each small batch") and
DomainBed's 64 for the MNIST-like datasets -> 63.

Each hyperparameter draws from its own random stream, seeded by the seeds and
its name, so adding a hyperparameter never changes the draws of the others.
"""

from __future__ import annotations

from collections.abc import Callable
import zlib
from typing import Any

import numpy as np

# Datasets of small images, trained with DomainBed's MNIST CNN from scratch.
SMALL_IMAGES = ("RotatedDigits", "ColoredDigits", "RotatedMNIST",
                "ColoredMNIST")
# The datasets built from scikit-learn's bundled digits.
EMBEDDED = ("RotatedDigits", "ColoredDigits")
# Algorithms built on a PGrad rollout, which use the paper's search space.
PGRAD_ALGORITHMS = ("PGrad", "PGrad-F", "PGrad-B", "PGrad-BMix",
                    "PGradParallel")
# Chunks per domain batch of the "-B" variants.
PGRAD_B = 3

Draw = Callable[[np.random.Generator], Any]


# WILDS datasets (experiments.wilds) -> WILDS's network: a multispectral
# ResNet-18 for PovertyMap, an ImageNet DenseNet-121 for FMoW.
WILDS_MODELS = {"PovertyMap": "resnet18", "FMoW": "densenet121"}


def wilds_name(dataset: str) -> str | None:
  """``"PovertyMap"`` for any PovertyMap fold, ``"FMoW"``, else ``None``."""
  base = dataset.split("-")[0]
  return base if base in WILDS_MODELS else None


def default_model(dataset: str) -> str:
  """The network for ``dataset``: DomainBed's MNIST CNN or ResNet-50, WILDS's."""
  if wilds_name(dataset):
    return WILDS_MODELS[wilds_name(dataset)]
  return "mnist_cnn" if dataset in SMALL_IMAGES else "resnet50"


def _wilds_hparams(algorithm: str, dataset: str) -> dict[str, Any]:
  """Fixed hyperparameters on WILDS, which the paper does not search.

  From WILDS's ``examples/configs/datasets.py``: Adam at lr 1e-3
  (PovertyMap) or 1e-4 (FMoW) without weight decay; batches of 64 examples
  from ``n_groups_per_batch`` = 8 domains, i.e. 8 per domain; BatchNorm
  trained; IRM's lambda 1; CORAL's weight 10 (PovertyMap) or 0.1 (FMoW).
  From the paper (appendix "WILDS"): PGrad's inner Adam at lr 1e-3 on
  PovertyMap, and the outer lr gamma = c / n-hat with c = 0.1 (PovertyMap) or
  0.01 (FMoW), n-hat the domains sampled per step (8 here, as WILDS's
  groups per batch; the paper does not state it).
  """
  poverty = wilds_name(dataset) == "PovertyMap"
  hparams = {"lr": 1e-3 if poverty else 1e-4, "weight_decay": 0.0,
             "batch_size": 8, "domains_per_step": 8, "bn_mode": "train",
             "resnet_dropout": 0.0}
  if algorithm in PGRAD_ALGORITHMS:
    b = PGRAD_B if algorithm in ("PGrad-B", "PGrad-BMix") else 1
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
  if algorithm in ("MixUp", "PGrad-BMix"):
    hparams["mixup_alpha"] = 0.2
  return hparams


def round_to_multiple(size: int, multiple: int) -> int:
  """The positive multiple of ``multiple`` nearest to ``size`` (ties go down).

  >>> [round_to_multiple(size, 3) for size in (32, 64, 24)]
  [33, 63, 24]
  """
  return multiple * max(1, round(size / multiple))


def _hparams(algorithm: str, dataset: str) -> dict[str, tuple[Any, Draw]]:
  """Every hyperparameter as ``name -> (default, draw(rng))``."""
  if wilds_name(dataset):
    return {name: (value, lambda rng, value=value: value)
            for name, value in _wilds_hparams(algorithm, dataset).items()}
  small = dataset in SMALL_IMAGES
  pgrad = algorithm in PGRAD_ALGORITHMS
  hp: dict[str, tuple[Any, Draw]] = {}

  def add(name: str, default: Any, draw: Draw | None = None) -> None:
    hp[name] = (default, draw or (lambda rng: default))

  if pgrad:
    # Inner (Adam) learning rate; the paper does not search it.
    add("lr", 1e-3 if small else 5e-5)
    add("outer_lr", 0.1)
    add("k", 4)
    add("B", PGRAD_B if algorithm in ("PGrad-B", "PGrad-BMix") else 1)
    batch = round_to_multiple(64 if small else 24 if dataset == "DomainNet"
                              else 32, hp["B"][0])
    add("batch_size", batch)
    add("weight_decay", 0.0, lambda rng: 10**rng.uniform(-6, -4))
  else:
    if small:
      add("lr", 1e-3, lambda rng: 10**rng.uniform(-4.5, -2.5))
      add("batch_size", 64, lambda rng: int(2**rng.uniform(3, 9)))
      add("weight_decay", 0.0)
    else:
      add("lr", 5e-5, lambda rng: 10**rng.uniform(-5, -3.5))
      top = 5 if dataset == "DomainNet" else 5.5
      add("batch_size", 32, lambda rng: int(2**rng.uniform(3, top)))
      add("weight_decay", 0.0, lambda rng: 10**rng.uniform(-6, -2))
  if small:
    # The MNIST CNN's first width (the rest are twice it). DomainBed's is 64;
    # the embedded digits are 8x8 scans upsampled, so a quarter of that width
    # learns them as well and trains in minutes on a CPU.
    add("cnn_width", 16 if dataset in EMBEDDED else 64)
  if not small:
    add("resnet_dropout", 0.0, lambda rng: float(rng.choice([0.0, 0.1, 0.5])))
    # DomainBed fine-tunes ResNets with frozen BatchNorm statistics.
    add("bn_mode", "frozen")

  if algorithm == "Fish":
    add("meta_lr", 0.5, lambda rng: float(rng.choice([0.05, 0.1, 0.5])))
  elif algorithm == "Fishr":
    add("lambda", 1000.0, lambda rng: 10**rng.uniform(1, 4))
    add("penalty_anneal_iters", 1500, lambda rng: int(rng.uniform(0, 5000)))
    add("ema", 0.95, lambda rng: rng.uniform(0.90, 0.99))
  elif algorithm == "IRM":
    add("irm_lambda", 1e2, lambda rng: 10**rng.uniform(-1, 5))
    add("irm_penalty_anneal_iters", 500,
        lambda rng: int(10**rng.uniform(0, 4)))
  elif algorithm == "CORAL":
    add("mmd_gamma", 1.0, lambda rng: 10**rng.uniform(-1, 1))
  if algorithm in ("MixUp", "PGrad-BMix"):
    add("mixup_alpha", 0.2, lambda rng: 10**rng.uniform(-1, 1))
  return hp


def default_hparams(algorithm: str, dataset: str) -> dict[str, Any]:
  """The default hyperparameters of ``algorithm`` on ``dataset``.

  Args:
    algorithm: an algorithm name, e.g. ``"PGrad-B"``.
    dataset: a dataset name, e.g. ``"RotatedDigits"``.

  Returns:
    A dict of hyperparameters.
  """
  return {name: default for name, (default, _) in
          _hparams(algorithm, dataset).items()}


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
  for name, (_, draw) in _hparams(algorithm, dataset).items():
    value = draw(np.random.default_rng(
        [seed, trial_seed, zlib.crc32(name.encode())]))
    # Plain Python numbers, for JSON and for hashing as static arguments.
    hparams[name] = value.item() if isinstance(value, np.generic) else value
  return hparams
