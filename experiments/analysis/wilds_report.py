"""Model selection and the paper's results table on WILDS.

Every run's checkpoint is selected on its OOD validation split (``val``) by
the metric the paper's table reports (Table "WILDS"): FMoW's average
accuracy ``acc``, PovertyMap's Pearson ``r`` (the paper's appendix selects
PovertyMap "based on the average Pearson coefficient on validation
domains"). The table gives that metric on the validation and test splits, as
mean ± standard deviation over runs: FMoW's accuracy in percent, PovertyMap's
Pearson r. Every PovertyMap fold and seed is one run, as WILDS averages over
its five folds. WILDS's own scripts and Fish select on the worst group
instead (``acc_worst_region``, ``r_wg``); docs/wilds.md has the lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from experiments import catalog
from experiments.analysis import model_selection
from experiments.rundir.records import Record, env_key

# Dataset -> (the selection metric's suffix, its scale in the table, label).
METRICS = {"FMoW": ("acc", 100.0, "Accuracy (%)"),
           "PovertyMap": ("r", 1.0, "Pearson")}


def _split_env(record: Record, split: str) -> int:
  return record["domains"].index(split)


def wilds_name(record: Record) -> str | None:
  """The WILDS dataset a record's run is on (any PovertyMap fold is
  ``"PovertyMap"``), or ``None`` for another dataset, registered or not."""
  entry = catalog.DATASETS.get(record["args"]["dataset"])
  return None if entry is None else entry.wilds


def selected_metrics(run_records: Sequence[Record]) -> tuple[float, float]:
  """The ``(val, test)`` metric of a run's best checkpoint on ``val``."""
  dataset = wilds_name(run_records[0])
  metric = METRICS[dataset][0]

  def value(record: Record, split: str) -> float:
    return record[env_key(_split_env(record, split), "in", metric)]

  best = max(run_records, key=lambda record: value(record, "val"))
  return value(best, "val"), value(best, "test")


def wilds_records(records: Iterable[Record]) -> list[Record]:
  """The records of runs on a WILDS dataset."""
  return [r for r in records
          if wilds_name(r)]


def _format(values: Sequence[float], scale: float) -> str:
  if not values:
    return "X"
  values = scale * np.asarray(values, np.float64)
  digits = 1 if scale > 1 else 2
  return f"{values.mean():.{digits}f} ± {values.std():.{digits}f}"


def wilds_table(
    records: Iterable[Record]
) -> tuple[list[str], list[list[str]]] | None:
  """The paper's WILDS table: a row per algorithm, val and test per dataset.

  Args:
    records: results records of any runs; those not on WILDS are ignored.

  Returns:
    ``(header, rows)`` of the table, or ``None`` without WILDS records.
  """
  runs = model_selection.group_by(
      wilds_records(records),
      lambda r: (wilds_name(r),
                 r["args"]["algorithm"], r["args"]["dataset"],
                 r["args"]["seed"], r["args"]["hparams_seed"],
                 r["args"]["trial_seed"]))
  if not runs:
    return None
  cells: dict[tuple[str, str], list[tuple[float, float]]] = {}
  for (dataset, algorithm, *_), run in runs.items():
    cells.setdefault((dataset, algorithm), []).append(selected_metrics(run))
  algorithms = sorted({algorithm for _, algorithm in cells})
  header = ["Method"]
  for dataset, (_, _, label) in METRICS.items():
    header += [f"{dataset} Val. {label}", f"{dataset} Test {label}"]
  rows = []
  for algorithm in algorithms:
    row = [algorithm]
    for dataset, (_, scale, _) in METRICS.items():
      selected = cells.get((dataset, algorithm), [])
      row += [_format([val for val, _ in selected], scale),
              _format([test for _, test in selected], scale)]
    rows.append(row)
  return header, rows
