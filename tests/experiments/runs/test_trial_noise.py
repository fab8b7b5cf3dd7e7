"""Tests for experiments/runs/trial_noise.py: the numbers a study reports of
a run, and Student's t test of a retrained run against its cell's trials,
against SciPy's t distribution and NumPy's float64 moments."""

import math

import numpy as np
import scipy.stats

from experiments.runs import trial_noise
from test_rerun import run_records


def test_t_distribution_matches_scipys():
  for df in range(1, 13):
    for t in (0.0, 0.3, 1.0, 2.5, 9.9, 40.0):
      assert math.isclose(trial_noise.t_two_sided_cdf(t, df),
                          1 - 2 * scipy.stats.t.sf(t, df),
                          rel_tol=1e-12, abs_tol=1e-15), (df, t)
    for alpha in (0.2, 0.05, 0.01 / 3):
      assert math.isclose(trial_noise.t_critical(alpha, df),
                          scipy.stats.t.isf(alpha / 2, df), rel_tol=1e-9)
  # With 2 degrees of freedom, P(|T| > t) = 1 - t / sqrt(t^2 + 2).
  alpha = 0.01 / 3
  assert math.isclose(trial_noise.t_critical(alpha, 2), (1 - alpha) * math.sqrt(
      2 / (1 - (1 - alpha) ** 2)), rel_tol=1e-9)


def test_reported_numbers_are_the_selected_steps_and_the_final_loss():
  run = run_records([0.5, 0.7, 0.6], [(0.8, 0.7), (0.9, 0.7), (0.8, 0.6)],
                     [(0.5, 0.3), (0.2, 0.1), (0.04, 0.01)])
  numbers = trial_noise.reported_numbers(run)
  # Step 200 has the best mean validation accuracy, 0.8; the final loss
  # pools the training domains by their examples.
  assert numbers["held_out_acc"] == (0.7, 240)
  assert numbers["validation_acc"] == (np.mean([0.9, 0.7]), 110)
  assert math.isclose(numbers["log_final_loss"][0],
                      np.log((240 * 0.04 + 200 * 0.01) / 440), rel_tol=1e-12)
  assert numbers["log_final_loss"][1] == 0


def _numbers(held_out, validation, log_loss, examples=(240, 110)):
  return {"held_out_acc": (held_out, examples[0]),
          "validation_acc": (validation, examples[1]),
          "log_final_loss": (log_loss, 0)}


TRIALS = [_numbers(0.65, 0.70, -8.7), _numbers(0.62, 0.68, -8.8),
          _numbers(0.66, 0.68, -8.6)]


def test_judge_noise_holds_a_run_against_its_cells_trials():
  within = trial_noise.judge_noise(_numbers(0.70, 0.69, -8.9), TRIALS[0],
                                   TRIALS)
  factor = scipy.stats.t.isf(
      trial_noise.FALSE_ALARM_RATE / 3 / 2, 2) * np.sqrt(1 + 1 / 3)
  for name in trial_noise.NUMBERS:
    values = np.array([trial[name][0] for trial in TRIALS], np.float64)
    judged = within[name]
    assert judged["trials"] == list(values)
    assert judged["committed"] == TRIALS[0][name][0]
    assert math.isclose(judged["mean"], values.mean(), rel_tol=1e-12)
    assert math.isclose(judged["sd"], values.std(ddof=1), rel_tol=1e-12)
    assert math.isclose(judged["allowed"], factor * values.std(ddof=1),
                        rel_tol=1e-9)
    assert judged["within"], (name, judged)
  # A final loss e^1.5 times the trials' mean lies beyond: their log spread
  # is 0.1.
  beyond = trial_noise.judge_noise(_numbers(0.70, 0.69, -8.7 + 2.2),
                                   TRIALS[0], TRIALS)
  assert not beyond["log_final_loss"]["within"]
  assert beyond["held_out_acc"]["within"]
  # Tied trials spread over one example at least, not none.
  tied = [_numbers(0.65, 0.70, -8.7 + i / 10) for i in range(3)]
  one_example = trial_noise.judge_noise(
      _numbers(0.65 + 2 / 240, 0.70, -8.7), tied[0], tied)["held_out_acc"]
  assert one_example["sd"] == 0
  assert math.isclose(one_example["allowed"], factor / 240, rel_tol=1e-9)
  assert one_example["within"]
  # One trial has no spread to judge by.
  assert trial_noise.judge_noise(TRIALS[0], TRIALS[0], TRIALS[:1]) is None
