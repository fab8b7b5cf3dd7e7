"""Tests for experiments/runs/convergence.py against loops over hand-made
records."""

import math

import pytest

from experiments.runs import convergence
from test_model_selection import make_record

# 3 domains, domain 0 held out; evaluations at steps 10, 20, ..., 50.
STEPS = (10, 20, 30, 40, 50)
OUT_EXAMPLES = (7, 30, 10)  # Per domain; the held-out domain's is not used.
IN_EXAMPLES = (28, 120, 40)


def _run(final_validation_1, counted=True):
  records = []
  for j, step in enumerate(STEPS):
    out_accs = [0.1, 0.5 + 0.05 * j, 0.8]
    if step == STEPS[-1]:
      out_accs[1] = final_validation_1
    record = make_record("ColoredDigits", "ERM", 0, 0, 0, step,
                         in_accs=[0.3, 0.9, 0.7], out_accs=out_accs,
                         step_time=0.5 + j)
    for i in range(3):
      record[f"env{i}_in_loss"] = 2.0 / (j + 1) + i
      if counted:
        record[f"env{i}_out_examples"] = OUT_EXAMPLES[i]
        record[f"env{i}_in_examples"] = IN_EXAMPLES[i]
    records.append(record)
  return records


def _pooled_by_loop(values, counts):
  total = 0.0
  for value, count in zip(values, counts):
    total += value * count
  return total / sum(counts)


@pytest.mark.parametrize("final_validation_1, plateaued", [
    (0.68, True), (0.80, False)])
def test_run_end_matches_a_loop(final_validation_1, plateaued):
  end = convergence.run_end(_run(final_validation_1))
  # The last 20% of 50 steps starts at step 40 (0.5 + 0.15 on domain 1).
  validation = _pooled_by_loop([final_validation_1, 0.8], OUT_EXAMPLES[1:])
  before = _pooled_by_loop([0.65, 0.8], OUT_EXAMPLES[1:])
  se = math.sqrt(validation * (1 - validation) / sum(OUT_EXAMPLES[1:]))
  assert end.validation_change == pytest.approx(abs(validation - before))
  assert end.validation_se == pytest.approx(se)
  assert end.plateaued is plateaued
  assert end.plateaued == (abs(validation - before) <= se)
  assert end.loss == pytest.approx(_pooled_by_loop(
      [2.0 / 5 + 1, 2.0 / 5 + 2], IN_EXAMPLES[1:]))
  assert end.accuracy == pytest.approx(_pooled_by_loop([0.9, 0.7],
                                                       IN_EXAMPLES[1:]))
  # Every interval is 10 steps of its record's step_time.
  assert end.seconds == pytest.approx(sum(10 * (0.5 + j) for j in range(5)))


def test_uncounted_records_weigh_domains_equally_and_never_plateau():
  end = convergence.run_end(_run(0.68, counted=False))
  assert end.accuracy == pytest.approx((0.9 + 0.7) / 2)
  assert math.isnan(end.validation_se) and not end.plateaued


def _climbing_run(validations):
  """Evaluations every 10 steps with these validation accuracies on the
  training domains (300 validation examples: one SE is 2-3 points)."""
  records = []
  for j, validation in enumerate(validations):
    record = make_record("ColoredDigits", "ERM", 0, 0, 0, 10 * (j + 1),
                         in_accs=[0.3, 0.9, 0.7],
                         out_accs=[0.1, validation, validation],
                         step_time=0.5)
    for i in range(3):
      record[f"env{i}_in_loss"] = 1.0
      record[f"env{i}_out_examples"] = 150
    records.append(record)
  return records


def test_run_ends_stop_the_run_at_every_evaluation_and_settled_step():
  # Climbs 10 points per evaluation up to step 50, then holds, except for a
  # dip at step 80.
  validations = [0.3, 0.4, 0.5, 0.6, 0.7, 0.7, 0.7, 0.6, 0.7, 0.7, 0.7]
  run = _climbing_run(validations)
  ends = convergence.run_ends(run)
  assert [step for step, _ in ends] == [10 * (j + 1) for j in range(11)]
  for i, (_, end) in enumerate(ends):
    # NaN (step 10's move) compares unequal to itself: compare as text.
    assert repr(end) == repr(convergence.run_end(run[:i + 1]))
  plateaued = [end.plateaued for _, end in ends]
  # The window is the last 20% of the steps so far. Up to step 40 it holds
  # the last evaluation alone, so it reaches back to the one before (10
  # points each); step 10 has none before. From 50 it starts one evaluation
  # earlier (50: 0.6 -> 0.7; 80: the dip; 90 and 100: from or to it), and at
  # 110 it starts at 90.
  assert plateaued == [False, False, False, False, False, True, True, False,
                       False, False, True]
  assert math.isnan(ends[0][1].validation_change)
  assert ends[1][1].validation_change == pytest.approx(0.1)
  assert convergence.settled_step(ends) == 110
  assert convergence.settled_step(ends[:8]) is None
  assert convergence.settled_step(ends[:1]) is None
