"""Tests for experiments/analysis/wilds_report.py and the report's WILDS section."""

import numpy as np

from experiments.analysis import report
from experiments import catalog
from experiments.analysis import wilds_report

DOMAINS = ["a", "b", *catalog.WILDS_EVAL_SPLITS]  # val is env4, test env5.


def _record(dataset, algorithm, seed, step, val, test):
  metric = "acc" if dataset == "FMoW" else "r"
  return {"args": {"dataset": dataset, "algorithm": algorithm, "seed": seed,
                   "hparams_seed": 0, "trial_seed": 0,
                   "test_envs": [2, 3, 4, 5]},
          "domains": DOMAINS, "step": step,
          f"env4_in_{metric}": val, f"env5_in_{metric}": test}


def test_wilds_table_selects_on_val_and_reports_mean_and_std(tmp_path):
  records = [
      # FMoW PGrad, two seeds: the best val checkpoint's test accuracy.
      _record("FMoW", "PGrad", 0, 1, 0.50, 0.40),
      _record("FMoW", "PGrad", 0, 2, 0.60, 0.45),
      _record("FMoW", "PGrad", 1, 1, 0.58, 0.50),
      # PovertyMap folds A and B are runs of one column.
      _record("PovertyMap", "PGrad", 0, 1, 0.8, 0.7),
      _record("PovertyMap-B", "PGrad", 0, 1, 0.7, 0.9),
      _record("PovertyMap", "IRM", 0, 1, 0.5, 0.4),
  ]
  header, rows = wilds_report.wilds_table(records)
  assert header == ["Method", "FMoW Val. Accuracy (%)",
                    "FMoW Test Accuracy (%)", "PovertyMap Val. Pearson",
                    "PovertyMap Test Pearson"]
  by_method = {row[0]: row[1:] for row in rows}
  fmow_val, fmow_test = [60.0, 58.0], [45.0, 50.0]
  assert by_method["PGrad"] == [
      f"{np.mean(fmow_val):.1f} ± {np.std(fmow_val):.1f}",
      f"{np.mean(fmow_test):.1f} ± {np.std(fmow_test):.1f}",
      f"{np.mean([0.8, 0.7]):.2f} ± {np.std([0.8, 0.7]):.2f}",
      f"{np.mean([0.7, 0.9]):.2f} ± {np.std([0.7, 0.9]):.2f}"]
  assert by_method["IRM"] == ["X", "X", "0.50 ± 0.00", "0.40 ± 0.00"]

  markdown = report.render(records, tmp_path)
  assert "## WILDS" in markdown and "| PGrad | 59.0 ± 1.0 |" in markdown


def test_no_wilds_records_no_table():
  assert wilds_report.wilds_table([]) is None
