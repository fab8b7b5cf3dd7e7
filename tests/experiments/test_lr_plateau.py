"""Tests for experiments/lr_plateau.py: its decisions against a float64
reimplementation of PyTorch's ``ReduceLROnPlateau`` as DomainBed's
``ERMPlusPlus.set_lr`` steps it and counts its changes."""

import json
import math

import numpy as np
import pytest

from experiments import lr_plateau


class _TorchPlateau:
  """``ReduceLROnPlateau(optimizer, 'min', patience)``'s documented rule
  over one param group, in NumPy float64, and DomainBed's list of learning
  rates with its change count (``set_lr``, lines 222-228)."""

  def __init__(self, lr, patience=1, factor=0.1, threshold=1e-4,
               cooldown=0, min_lr=0.0, eps=1e-8):
    self.lr = np.float64(lr)
    self.patience, self.factor, self.threshold = patience, factor, threshold
    self.cooldown, self.min_lr, self.eps = cooldown, min_lr, eps
    self.best = np.float64(np.inf)
    self.num_bad_epochs = 0
    self.cooldown_counter = 0
    self.lr_schedule = []
    self.changes = 0

  def step(self, metric):
    metric = np.float64(metric)
    # 'min' mode, 'rel' threshold: better than best * (1 - threshold).
    if metric < self.best * (np.float64(1) - np.float64(self.threshold)):
      self.best = metric
      self.num_bad_epochs = 0
    else:
      self.num_bad_epochs += 1
    if self.cooldown_counter > 0:
      self.cooldown_counter -= 1
      self.num_bad_epochs = 0
    if self.num_bad_epochs > self.patience:
      new_lr = max(self.lr * np.float64(self.factor), np.float64(self.min_lr))
      if self.lr - new_lr > self.eps:
        self.lr = new_lr
      self.cooldown_counter = self.cooldown
      self.num_bad_epochs = 0
    self.lr_schedule.append([float(self.lr)])
    if len(self.lr_schedule) > 1 and (self.lr_schedule[-1]
                                      != self.lr_schedule[-2]):
      self.changes += 1
    return self.changes == 3


def _run(losses, lr=5e-5, **kwargs):
  """The module's states over ``losses`` (up to its stop) and the
  reference's."""
  config = lr_plateau.PlateauConfig(**kwargs)
  reference = _TorchPlateau(lr, **kwargs)
  state = lr_plateau.plateau_init(lr)
  got, want = [], []
  for loss in losses:
    state = lr_plateau.plateau_step(state, loss, config)
    stop = reference.step(loss)
    got.append(state)
    want.append((reference.lr, reference.changes, stop,
                 reference.num_bad_epochs, reference.best))
    if stop:
      break
  return got, want


def _assert_same(got, want):
  assert len(got) == len(want)
  for state, (lr, changes, stop, bad, best) in zip(got, want):
    assert state.lr == lr and state.changes == changes
    assert state.stopped == stop and state.bad_evaluations == bad
    assert state.best == best or (math.isinf(state.best)
                                  and math.isinf(best))


SEQUENCES = {
    # Improving throughout: never a change.
    "improving": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5],
    # A plateau: the second bad evaluation in a row reduces, and so on to
    # the third change, where the schedule stops; the losses after it are
    # never taken.
    "plateau": [1.0] * 10,
    # Improvements of 0.5e-4 of the best: below the threshold, bad ones.
    "below_threshold": [1.0, 1.0 - 0.5e-4, 1.0 - 0.9e-4, 1.0 - 0.99e-4,
                        0.5, 0.5 - 0.4e-4, 0.5 - 0.45e-4, 0.1, 0.1, 0.1],
    # Improvements of 2e-4 of the best: above it, good ones.
    "above_threshold": [1.0 * (1 - 2e-4) ** k for k in range(12)],
    # Equal losses are not improvements.
    "equal": [0.3, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1],
    # A bad evaluation between good ones never reaches patience.
    "alternating": [1.0, 1.1, 0.9, 1.0, 0.8, 0.85, 0.7, 0.75, 0.6],
    # NaN is never an improvement, inf neither.
    "nan": [float("nan"), float("nan"), 1.0, float("nan"), float("inf"),
            float("nan"), 2.0, 2.0],
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_decisions_equal_torch_and_domainbed_in_float64(name):
  got, want = _run(SEQUENCES[name])
  _assert_same(got, want)


def test_a_plateau_changes_three_times_and_stops():
  got, _ = _run(SEQUENCES["plateau"])
  # Bad evaluations 2-3 reduce at the 3rd, 4-5 at the 5th, 6-7 at the 7th.
  assert [s.lr for s in got] == [5e-5, 5e-5, 5e-5 * 0.1, 5e-5 * 0.1,
                                 5e-5 * 0.1 * 0.1, 5e-5 * 0.1 * 0.1,
                                 5e-5 * 0.1 * 0.1 * 0.1]
  assert [s.changes for s in got] == [0, 0, 1, 1, 2, 2, 3]
  assert [s.stopped for s in got] == [False] * 6 + [True]
  with pytest.raises(ValueError, match="stopped"):
    lr_plateau.plateau_step(got[-1], 1.0)


def test_threshold_is_relative_to_the_best():
  below, _ = _run(SEQUENCES["below_threshold"])
  above, _ = _run(SEQUENCES["above_threshold"])
  assert below[3].changes == 1 and below[0].best == 1.0
  assert all(s.changes == 0 for s in above)
  assert above[-1].best == SEQUENCES["above_threshold"][-1]


@pytest.mark.parametrize("kwargs", [
    {"cooldown": 2}, {"patience": 0}, {"patience": 3},
    {"min_lr": 2e-6}, {"factor": 0.5}])
def test_other_arguments_follow_torch_too(kwargs):
  losses = [1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 0.5] + [0.5] * 20
  got, want = _run(losses, **kwargs)
  _assert_same(got, want)
  assert got[-1].changes >= 1


def test_a_change_of_eps_or_less_is_not_made_nor_counted():
  # From 1e-8, a tenth is a change of 9e-9, below eps: the schedule never
  # changes, and never stops.
  got, want = _run([1.0] * 12, lr=1e-8)
  _assert_same(got, want)
  assert all(s.lr == 1e-8 and s.changes == 0 for s in got)
  # From 1e-7 one change is made (9e-8), then none.
  got, want = _run([1.0] * 12, lr=1e-7)
  _assert_same(got, want)
  assert got[-1].lr == 1e-7 * 0.1 and got[-1].changes == 1


def test_the_state_round_trips_through_a_json_record_exactly():
  got, _ = _run([0.7310585786300049, 0.7310585786300049, 0.7310585786300049,
                 0.1 + 0.2])
  for state in got:
    entry = json.loads(json.dumps(lr_plateau.to_record(state)))
    assert lr_plateau.from_record(entry) == state


def test_a_change_at_the_first_evaluation_is_not_counted():
  # Only where patience is 0 and the first loss improves on nothing (NaN)
  # can the first evaluation reduce: DomainBed's list has no learning rate
  # before it to differ from.
  got, want = _run([float("nan"), 1.0, 1.0, 1.0], patience=0)
  _assert_same(got, want)
  assert got[0].lr == 5e-5 * 0.1 and got[0].changes == 0
