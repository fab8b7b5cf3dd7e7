"""DomainBed-style hyperparameters, as declared.

Every hyperparameter has a default, a random search distribution
(``hparams_seed`` 0 means the defaults, as in DomainBed's sweeps), the values
it accepts (`Allowed`) and its value on WILDS, which the paper does not
search.

An algorithm's hyperparameters on a dataset are declared in blocks that add
to one `SearchSpace`, in this order (the order
``hparams_registry.describe_hparams`` lists and a run's config file holds):

1. its training hyperparameters: DomainBed's learning rate, batch size and
   weight decay of the dataset (`domainbed_training`), unless its entry's
   ``training_hparams`` block declares its own;
2. the dataset's: its network's and images' (`dataset_hparams`);
3. its own terms: its entry's ``hparams`` block, after its family head's
   (``entries.AlgorithmEntry``).

WILDS's own hyperparameters, which DomainBed's datasets lack, come last. The
algorithms' blocks are in ``experiments/catalog.py``, each beside its entry;
this module names no algorithm, and imports no catalog: the catalog's blocks
are written in its terms. ``hparams_registry`` answers the queries on them.

Batch sizes are per domain.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from experiments import registry

# WILDS's fixed training hyperparameters (``examples/configs/datasets.py``):
# batches of 64 examples from ``n_groups_per_batch`` = 8 domains, i.e. 8 per
# domain, without weight decay (every weight decay's default, 0).
WILDS_BATCH_SIZE = 8
WILDS_DOMAINS_PER_STEP = 8


def wilds_lr(dataset: registry.Entry) -> float:
  """WILDS's Adam learning rate: 1e-3 on PovertyMap, 1e-4 on FMoW, of a
  dataset's ``entries.DatasetEntry``."""
  return 1e-3 if dataset.wilds == "PovertyMap" else 1e-4


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
    multiple_of: for ``int``, what the value must be a multiple of, or
      ``None``.
  """

  kind: type
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[str, ...] = ()
  multiple_of: int | None = None

  def __str__(self) -> str:
    choices = "one of " + ", ".join(repr(c) for c in self.choices)
    if self.kind is str:
      return choices
    if self.kind is bool:
      return "true or false"
    kind = "an integer" if self.kind is int else "a number"
    if self.multiple_of is not None:
      kind = f"a multiple of {self.multiple_of}"
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
    if self.multiple_of is not None and value % self.multiple_of:
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


# Stands for "the hparam's default" as its value on WILDS.
_DEFAULT = object()


class SearchSpace:
  """The hyperparameters of one algorithm on one dataset, as declared.

  The blocks (see the module docstring) `add` to it in turn; `hparams` is
  then the space on its dataset: on WILDS every value fixed at its WILDS
  value, unsearched, and WILDS's own hyperparameters (`add_wilds`) last.

  Attributes:
    algorithm: the algorithm's ``entries.AlgorithmEntry`` (a family member's
      own, whose facts its head's blocks read).
    dataset: the dataset's ``entries.DatasetEntry``.
  """

  def __init__(self, algorithm: registry.Entry, dataset: registry.Entry):
    self.algorithm = algorithm
    self.dataset = dataset
    self._declared: dict[str, tuple[HParam, Any]] = {}
    self._wilds_only: dict[str, HParam] = {}

  def add(self, name: str, default: Any, allowed: Allowed,
          search: Search | None = None, *, wilds: Any = _DEFAULT) -> None:
    """Declares hyperparameter ``name``.

    Args:
      name: its name, new to the space.
      default: its value when ``hparams_seed`` is 0.
      allowed: the values it accepts.
      search: its random search, or ``None`` when the search keeps the
        default.
      wilds: its value on WILDS; by default, its default.
    """
    if name in self._declared:
      raise ValueError(f"hparam {name!r} is declared twice; `update` "
                       "changes a declared one.")
    self._declared[name] = (HParam(default, search, allowed), wilds)

  def add_wilds(self, name: str, value: Any, allowed: Allowed) -> None:
    """Declares a hyperparameter that only WILDS's datasets have, fixed at
    ``value``: it follows every other, in the order declared."""
    if self.dataset.wilds:
      self._wilds_only[name] = HParam(value, None, allowed)

  def update(self, name: str, **changes: Any) -> None:
    """Changes a declared hyperparameter in place: its ``default``,
    ``search``, ``allowed`` or ``wilds`` (as `add` takes them)."""
    hparam, wilds = self._declared[name]
    wilds = changes.pop("wilds", wilds)
    self._declared[name] = (hparam._replace(**changes), wilds)

  def __getitem__(self, name: str) -> HParam:
    """A declared hyperparameter, as declared (its WILDS value aside)."""
    return self._declared[name][0]

  def hparams(self) -> dict[str, HParam]:
    """Every hyperparameter on the space's dataset, by name, in order."""
    if not self.dataset.wilds:
      return {name: hparam for name, (hparam, _) in self._declared.items()}
    # The paper searches nothing on WILDS.
    fixed = {name: HParam(hparam.default if wilds is _DEFAULT else wilds,
                          None, hparam.allowed)
             for name, (hparam, wilds) in self._declared.items()}
    return {**fixed, **self._wilds_only}


def domainbed_training(space: SearchSpace) -> None:
  """DomainBed's learning rate, batch size and weight decay of the dataset.

  DomainBed's ``hparams_registry.py`` at b93c22a1: its MNIST-like datasets'
  (small images) and the others' (photos), whose batch sizes are drawn up to
  2^5 rather than 2^5.5 where memory limits them (DomainNet). On WILDS,
  WILDS's (`WILDS_BATCH_SIZE`, `wilds_lr`).
  """
  data = space.dataset
  if data.small_images:
    space.add("lr", 1e-3, POSITIVE, log_uniform(-4.5, -2.5))
    space.add("batch_size", 64, POSITIVE_INT, int_log_uniform(3, 9))
    space.add("weight_decay", 0.0, NON_NEGATIVE)
  else:
    space.add("lr", 5e-5, POSITIVE, log_uniform(-5, -3.5),
              wilds=wilds_lr(data))
    top = 5 if data.small_batches else 5.5
    space.add("batch_size", 32, POSITIVE_INT, int_log_uniform(3, top),
              wilds=WILDS_BATCH_SIZE)
    space.add("weight_decay", 0.0, NON_NEGATIVE, log_uniform(-6, -2))


def dataset_hparams(space: SearchSpace) -> None:
  """The hyperparameters of the dataset's network and images.

  WILDS's: BatchNorm trained, no feature dropout, its images at their own
  sizes; PovertyMap's training flips and colour jitter on by default, as in
  WILDS 1.x's examples (`wilds_augmentation`), and FMoW none to toggle; and
  `WILDS_DOMAINS_PER_STEP` domains sampled per step.
  """
  data = space.dataset
  if data.small_images:
    # The MNIST CNN's first width (the rest are twice it). DomainBed's is 64;
    # the embedded digits are 8x8 scans upsampled, so a quarter of that width
    # learns them as well and trains in minutes on a CPU.
    # Each width is a multiple of its GroupNorm's 8 groups.
    space.add("cnn_width", 16 if data.upsampled else 64,
              Allowed(int, low=8, multiple_of=8))
    # The image side the network sees; DomainBed's 28 (see
    # datasets.resized for why the embedded digits can take 14).
    space.add("image_size", 28, POSITIVE_INT)
  else:
    space.add("resnet_dropout", 0.0, FRACTION, choice([0.0, 0.1, 0.5]))
    # DomainBed fine-tunes ResNets with frozen BatchNorm statistics.
    space.add("bn_mode", "frozen", Allowed(str, choices=("frozen", "train")),
              wilds="train")
    if data.wilds in (None, "PovertyMap"):
      # DomainBed's default: its training augmentation of the training
      # domains (experiments/augmentation.py).
      space.add("data_augmentation", True, Allowed(bool))
    if not data.wilds:
      # The photos' side: DomainBed's 224. A smaller side trains the photo
      # path on a CPU in seconds.
      space.add("image_size", 224, POSITIVE_INT)
  space.add_wilds("domains_per_step", WILDS_DOMAINS_PER_STEP, POSITIVE_INT)
