"""Whether a run finished training: the study's convergence criterion.

A comparison of models that are still learning says nothing about
generalization, so the report shows, next to every results table, where each
run ended: its final training-domain loss and accuracy, how much its
training-domain validation accuracy moved over the last `WINDOW` of its
steps, and how long it trained. A run has *plateaued* when that move is at
most one standard error of the validation accuracy, sqrt(p (1 - p) / n) over
the n validation examples (docs/study.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from experiments.rundir.records import (Record, env_key, has_training_losses,
                                      train_envs)

WINDOW = 0.2  # The last fifth of the steps.


class RunEnd(NamedTuple):
  """Where one run ended.

  Attributes:
    loss: the final training-domain loss, averaged over training domains;
      NaN where the records hold none (`records.has_training_losses`).
    accuracy: the final training-domain accuracy on their ``in`` splits.
    validation_change: |change| of the training-domain validation accuracy
      over the last `WINDOW` of the steps (from the evaluation before the
      last where the window holds no other); NaN for a single evaluation.
    validation_se: the standard error of the final validation accuracy;
      NaN where the records do not count their examples.
    plateaued: ``validation_change <= validation_se``.
    seconds: training time (evaluation excluded, compilation included);
      NaN where the records do not time their steps.
  """
  loss: float
  accuracy: float
  validation_change: float
  validation_se: float
  plateaued: bool
  seconds: float


def _pooled(record: Record, split: str, metric: str) -> tuple[float, int]:
  """A metric over every training domain's split, weighted by its examples.

  Returns the metric and the number of examples, 0 where the record does not
  count them (then the domains weigh equally).
  """
  envs = train_envs(record)
  values = [record[env_key(i, split, metric)] for i in envs]
  counts = [record.get(env_key(i, split, "examples")) for i in envs]
  if None in counts:
    return float(np.mean(values)), 0
  return float(np.average(values, weights=counts)), int(sum(counts))


def run_end(run: Sequence[Record]) -> RunEnd:
  """Where a run ended.

  Args:
    run: one run's records (one per evaluation), in step order.

  Returns:
    The run's `RunEnd`.
  """
  last = run[-1]
  start = next(i for i, r in enumerate(run)
               if r["step"] >= (1 - WINDOW) * last["step"])
  # A window that holds the last evaluation alone shows no move: it reaches
  # back to the evaluation before instead. With none before, the run
  # cannot have plateaued.
  start = min(start, len(run) - 2)
  validation, n = _pooled(last, "out", "acc")
  se = np.sqrt(validation * (1 - validation) / n) if n else float("nan")
  change = (abs(validation - _pooled(run[start], "out", "acc")[0])
            if start >= 0 else float("nan"))
  steps = np.diff([0] + [r["step"] for r in run])
  return RunEnd(
      loss=(_pooled(last, "in", "loss")[0] if has_training_losses(last)
            else float("nan")),
      accuracy=_pooled(last, "in", "acc")[0],
      validation_change=change,
      validation_se=float(se),
      plateaued=bool(change <= se),
      seconds=float(sum(r.get("step_time", np.nan) * s
                        for r, s in zip(run, steps))))


def run_ends(run: Sequence[Record]) -> list[tuple[int, RunEnd]]:
  """Where the run would have ended at each of its evaluations.

  The i-th entry is ``(step, run_end(run[:i + 1]))``: what the criterion
  says of the same run stopped at that step. It tells how long a run still
  learning at its end needs (`experiments.runs.study`'s ``longer`` command).
  """
  return [(record["step"], run_end(run[:i + 1]))
          for i, record in enumerate(run)]


def settled_step(ends: Sequence[tuple[int, RunEnd]]) -> int | None:
  """The first step from which the run has plateaued at every evaluation,
  or None if it had not at its last. The criterion alone can hold by chance
  at one evaluation while the run is still learning; from this step on it
  always holds."""
  settled = None
  for step, end in ends:
    if not end.plateaued:
      settled = None
    elif settled is None:
      settled = step
  return settled
