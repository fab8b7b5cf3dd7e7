"""DomainBed's model selection over the records of a sweep.

A *record* is one evaluation of a run (`experiments.rundir.records`): the run's
``args`` and ``hparams`` plus the accuracies of every domain ``i``,
``env{i}_in_acc`` and ``env{i}_out_acc``. A *run* is one
``(dataset, algorithm, test env, hparams_seed, trial_seed)`` training job.

As in DomainBed (Gulrajani & Lopez-Paz, ICLR 2021), a selection method first
reduces every run to one ``(val_acc, test_acc)`` pair, then, separately for
every trial, picks among the hparam draws the run with the best ``val_acc``
and reports its ``test_acc``. The test accuracy is always the held-out
domain's ``in`` split; the methods differ in what they validate on:

* `TrainingDomainValidation`: the mean ``out``-split accuracy of the training
  domains, maximised over a run's checkpoints (early stopping allowed).
* `OracleSelection`: the held-out domain's ``out`` split, read at a run's
  last checkpoint only (no early stopping).

A run that averages its weights (``--averaging``) is a method of its own,
``"ERM + SWAD"`` (`method`), and its model is the averaged one: selection
reads its records as `averaged_model` makes them.
"""

from __future__ import annotations

import abc
import collections
import json
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import ClassVar, NamedTuple

import numpy as np

from experiments import averaging_flags
from experiments import catalog
from experiments.rundir.records import Record, averaged_record, env_key
from experiments.rundir.records import held_out_env, train_envs


def method(record: Record) -> str:
  """What a record's run is reported as (`averaging_flags.method`): its
  algorithm, and its weight averaging where it has one ("ERM + SWAD")."""
  return averaging_flags.method(record["args"])


def averages(record: Record) -> bool:
  """Whether a record's run averages its weights (``--averaging``)."""
  return record["args"].get("averaging", "none") != "none"


def has_validation(record: Record) -> bool:
  """Whether a record's run holds out validation data, which every
  selection method reads: not so a run of ``--holdout_fraction 0`` (ERM++'s
  second stage, ``--lr_schedule_from``), which has no out splits."""
  return record["args"].get("holdout_fraction") != 0


def in_order(methods: Iterable[str]) -> list[str]:
  """Methods (`method`) in the order of the report's rows and legends: the
  registry's order of their algorithms, each algorithm's weight averagings
  after it.

  >>> in_order(["PGrad-B + SWAD", "ERM + SWAD", "PGrad-B", "ERM + SMA", "ERM"])
  ['ERM', 'ERM + SMA', 'ERM + SWAD', 'PGrad-B', 'PGrad-B + SWAD']
  """
  methods = set(methods)
  algorithm = lambda method: method.split(averaging_flags.JOINT)[0]
  algorithms = catalog.ALGORITHMS.in_order(map(algorithm, methods))
  return sorted(methods, key=lambda method: (
      algorithms.index(algorithm(method)), method))


def averaged_model(records: Iterable[Record]) -> list[Record]:
  """The records as model selection reads them: a run that averages its
  weights by its averaged model's metrics (`records.averaged_record`), at
  the evaluations that have them (EMA and SMA: every one; SWAD: its last,
  its final model, as swad reports it); the others as they are."""
  read = []
  for record in records:
    if averages(record):
      record = averaged_record(record)
    if record is not None:
      read.append(record)
  return read


class RunAccuracy(NamedTuple):
  """The accuracies a selection method credits one run with (in [0, 1])."""

  val_acc: float
  test_acc: float


def group_by(
    records: Iterable[Record], key: Callable[[Record], Hashable]
) -> dict[Hashable, list[Record]]:
  """Groups records by ``key(record)``, keeping first-seen key order."""
  groups = collections.defaultdict(list)
  for record in records:
    groups[key(record)].append(record)
  return dict(groups)


def by_run(records: Sequence[Record]) -> list[list[Record]]:
  """The records of every run (same args but the output), sorted by step."""
  runs = group_by(records, lambda r: json.dumps(
      {k: v for k, v in r["args"].items() if k != "output_dir"},
      sort_keys=True))
  return [sorted(run, key=lambda r: r["step"]) for run in runs.values()]


class SelectionMethod(abc.ABC):
  """A DomainBed model selection method.

  Subclasses define how a run is validated (`run_acc`); picking the best hparam
  draw (`sweep_acc`) is shared.
  """

  name: ClassVar[str]

  @classmethod
  @abc.abstractmethod
  def run_acc(cls, run_records: Sequence[Record]) -> RunAccuracy:
    """Reduces the records of one run to its validation and test accuracy.

    Args:
      run_records: the (non-empty) records of one run with one test env.

    Returns:
      The run's accuracies.
    """

  @classmethod
  def selected_run(cls, records: Sequence[Record]) -> list[Record]:
    """The hparam draw with the best validation accuracy.

    Args:
      records: the (non-empty) records of one
        ``(dataset, algorithm, test env, trial_seed)``, over hparam draws.

    Returns:
      The selected run's records. Ties go to the lowest hparams_seed.
    """
    runs = group_by(records, lambda r: r["args"]["hparams_seed"])
    return max((runs[seed] for seed in sorted(runs)),
               key=lambda run: cls.run_acc(run).val_acc)

  @classmethod
  def sweep_acc(cls, records: Sequence[Record]) -> float:
    """The test accuracy of `selected_run`."""
    return cls.run_acc(cls.selected_run(records)).test_acc


class TrainingDomainValidation(SelectionMethod):
  """DomainBed's ``IIDAccuracySelectionMethod``: training-domain validation.

  Every checkpoint is scored by the mean ``env{i}_out_acc`` over the training
  domains ``i``; a run's score is its best checkpoint's.
  """

  name = "training-domain validation set"

  @classmethod
  def run_acc(cls, run_records: Sequence[Record]) -> RunAccuracy:
    def checkpoint_acc(record: Record) -> RunAccuracy:
      val = [record[env_key(i, "out", "acc")] for i in train_envs(record)]
      return RunAccuracy(float(np.mean(val)),
                         record[env_key(held_out_env(record), "in", "acc")])

    return max(map(checkpoint_acc, run_records), key=lambda acc: acc.val_acc)


class OracleSelection(SelectionMethod):
  """DomainBed's ``OracleSelectionMethod``: test-domain validation.

  A run is scored by the held-out domain's ``out`` split at its last
  checkpoint only.
  """

  name = "test-domain validation set (oracle)"

  @classmethod
  def run_acc(cls, run_records: Sequence[Record]) -> RunAccuracy:
    last = max(run_records, key=lambda r: r["step"])
    held_out = held_out_env(last)
    return RunAccuracy(last[env_key(held_out, "out", "acc")],
                       last[env_key(held_out, "in", "acc")])


SELECTION_METHODS: tuple[type[SelectionMethod], ...] = (
    TrainingDomainValidation,
    OracleSelection,
)

# (dataset, algorithm, test env) -> {trial_seed: selected test accuracy}.
SelectedAccuracies = dict[tuple[str, str, int], dict[int, float]]


def selected_accuracies(
    records: Iterable[Record], method: type[SelectionMethod]
) -> SelectedAccuracies:
  """Applies a selection method to every trial of every sweep cell.

  Records of runs with more than one test env (DomainBed's leave-one-out
  runs) are ignored.

  Args:
    records: records of any number of runs.
    method: the selection method.

  Returns:
    For every ``(dataset, algorithm, test env)``, the selected test accuracy
    of each trial.
  """
  result: SelectedAccuracies = collections.defaultdict(dict)
  for (dataset, algorithm, env, trial), group in trial_groups(records).items():
    result[dataset, algorithm, env][trial] = method.sweep_acc(group)
  return dict(result)


def trial_groups(
    records: Iterable[Record]) -> dict[tuple[str, str, int, int], list[Record]]:
  """The records of every ``(dataset, algorithm, test env, trial_seed)``, among
  which a selection method picks one hparam draw, the algorithm being the
  `method`. Runs with more than one test env are left out."""
  single = [r for r in records if len(r["args"]["test_envs"]) == 1]
  return group_by(
      single,
      lambda r: (
          r["args"]["dataset"],
          method(r),
          held_out_env(r),
          r["args"]["trial_seed"],
      ),
  )


def draw_counts(
    records: Iterable[Record]) -> dict[tuple[str, str], list[int]]:
  """Per ``(dataset, algorithm)``, how many hparam draws each of its trial
  groups (`trial_groups`) holds: the draws a selection method picks among.
  A study whose random draws are unfinished holds fewer for some cells."""
  counts: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
  for (dataset, algorithm, _, _), group in trial_groups(records).items():
    counts[dataset, algorithm].append(
        len({r["args"]["hparams_seed"] for r in group}))
  return dict(counts)


def mean_and_error(accs: Sequence[float]) -> tuple[float, float]:
  """Mean and standard error over trials, in percent, as DomainBed reports.

  DomainBed's ``collect_results.format_mean`` computes
  ``100 * np.mean(accs)`` and ``100 * np.std(accs / sqrt(n))``, i.e. the
  population standard deviation (``ddof=0``) divided by ``sqrt(n)``.

  Args:
    accs: one accuracy in [0, 1] per trial; not empty.

  Returns:
    ``(mean, standard error)``, both in percent.
  """
  accs = np.asarray(accs, np.float64)
  return 100 * accs.mean(), 100 * accs.std() / np.sqrt(len(accs))


def format_mean(accs: Sequence[float]) -> str:
  """Formats accuracies over trials as ``"mean ± error"`` in percent.

  Args:
    accs: one accuracy in [0, 1] per trial.

  Returns:
    For example ``"81.3 ± 0.4"``; ``"X"`` when there are none; the mean and
    ``(n = 1)`` for one, which has no standard error.

  >>> format_mean([0.5, 0.7])
  '60.0 ± 7.1'
  >>> format_mean([0.8])
  '80.0 (n = 1)'
  >>> format_mean([])
  'X'
  """
  if not len(accs):
    return "X"
  mean, err = mean_and_error(accs)
  if len(accs) == 1:
    return f"{mean:.1f} (n = 1)"
  return f"{mean:.1f} ± {err:.1f}"
