"""ERM++'s validation-driven learning rate: PyTorch's ``ReduceLROnPlateau``
and DomainBed's stop after its third change (``scripts/train_autolr.py``).

Host logic in float64 on the sequence of the averaged network's validation
losses, one per evaluation after the linear probe: `plateau_step` returns
the new `PlateauState`, whose ``lr`` the full optimizer takes from then on
and whose ``stopped`` ends the run. The training loop writes the state into
every record (`to_record`) and reads it back on resume (`from_record`), so a
resumed run decides as an uninterrupted one, bit for bit.

The rule, as PyTorch's ``torch.optim.lr_scheduler.ReduceLROnPlateau``
documents it, in DomainBed's use: ``ReduceLROnPlateau(optimizer, 'min',
patience=1)`` (DomainBed b93c22a1, ``domainbed/algorithms.py`` line 178),
so PyTorch's defaults ``factor=0.1``, ``threshold=1e-4``,
``threshold_mode='rel'``, ``cooldown=0``, ``min_lr=0`` and ``eps=1e-8``:

* a loss is an improvement where it is below ``best * (1 - threshold)``
  (``best`` starts at infinity, so the first finite loss improves; a NaN
  never does: every comparison with it is false); an improvement sets
  ``best`` and clears the count of bad evaluations, anything else adds one;
* during a cooldown, the cooldown counts down and the bad evaluations are
  cleared;
* once the bad evaluations exceed ``patience``, the learning rate becomes
  ``max(lr * factor, min_lr)``, unless that changes it by ``eps`` or less;
  the cooldown starts and the bad evaluations are cleared, ``best`` kept.

DomainBed's ``ERMPlusPlus.set_lr`` (lines 208-229) appends the learning rate
after each step to a list and counts a change where it differs from the one
before (lines 223-226); at the third change it marks the schedule's end
(line 228), and ``train_autolr.py`` stops training there (lines 220-223).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple


class PlateauConfig(NamedTuple):
  """``ReduceLROnPlateau``'s arguments as DomainBed sets them, and its stop.

  Attributes:
    factor: the learning rate's multiplier at a reduction.
    patience: the bad evaluations tolerated before a reduction.
    threshold: the relative improvement a loss must make on the best.
    cooldown: the evaluations after a reduction that count no bad one.
    min_lr: the learning rate's lower bound.
    eps: the least change of the learning rate that is made.
    max_changes: the changes after which the run stops (DomainBed's 3).
  """
  factor: float = 0.1
  patience: int = 1
  threshold: float = 1e-4
  cooldown: int = 0
  min_lr: float = 0.0
  eps: float = 1e-8
  max_changes: int = 3


class PlateauState(NamedTuple):
  """What the schedule knows after some evaluations, as Python numbers.

  Attributes:
    lr: the full optimizer's learning rate from now on (float64).
    best: the least loss so far that improved (infinity before one).
    bad_evaluations: the evaluations since ``best`` without improvement
      (PyTorch's ``num_bad_epochs``).
    cooldown_left: PyTorch's ``cooldown_counter``.
    evaluations: the losses the schedule has taken.
    changes: the learning rate's changes so far (DomainBed's
      ``lr_schedule_changes``).
    stopped: whether ``changes`` has reached ``max_changes``: the run ends.
  """
  lr: float
  best: float
  bad_evaluations: int
  cooldown_left: int
  evaluations: int
  changes: int
  stopped: bool


def plateau_init(lr: float) -> PlateauState:
  """The state before the first evaluation, at the hparam ``lr``."""
  return PlateauState(lr=float(lr), best=math.inf, bad_evaluations=0,
                      cooldown_left=0, evaluations=0, changes=0,
                      stopped=False)


def plateau_step(state: PlateauState, loss: float,
                 config: PlateauConfig = PlateauConfig()) -> PlateauState:
  """One evaluation: ``ReduceLROnPlateau.step(loss)`` and DomainBed's count.

  Args:
    state: the schedule's state; not stopped.
    loss: the averaged network's validation loss at this evaluation.
    config: the rule's arguments.

  Returns:
    The new state.

  Raises:
    ValueError: the schedule has stopped already.
  """
  if state.stopped:
    raise ValueError("The learning-rate schedule stopped at its change "
                     f"{state.changes}: the run has ended.")
  loss = float(loss)
  best, bad = state.best, state.bad_evaluations
  if loss < best * (1.0 - config.threshold):
    best, bad = loss, 0
  else:
    bad += 1
  cooldown_left = state.cooldown_left
  if cooldown_left > 0:
    cooldown_left -= 1
    bad = 0
  lr = state.lr
  if bad > config.patience:
    reduced = max(lr * config.factor, config.min_lr)
    if lr - reduced > config.eps:
      lr = reduced
    cooldown_left, bad = config.cooldown, 0
  # DomainBed compares each learning rate with the one before it in its
  # list, which the first evaluation's has none of.
  changes = state.changes + (state.evaluations > 0 and lr != state.lr)
  return PlateauState(lr=lr, best=best, bad_evaluations=bad,
                      cooldown_left=cooldown_left,
                      evaluations=state.evaluations + 1, changes=changes,
                      stopped=changes >= config.max_changes)


def to_record(state: PlateauState) -> dict[str, Any]:
  """The state as a record's JSON object (floats are exact in JSON)."""
  return state._asdict()


def from_record(entry: dict[str, Any]) -> PlateauState:
  """The state that `to_record` wrote."""
  return PlateauState(**entry)
