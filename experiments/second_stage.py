"""``--lr_schedule_from``: ERM++'s second stage, DomainBed's
``scripts/train_autolr.py`` lines 260-422 (b93c22a).

The first stage is a run of hparam ``auto_lr``, whose learning rate follows
its validation loss (`lr_plateau`). The second trains again from scratch,
with the same flags, hparams and seeds, on all of the training data
(``--holdout_fraction 0``: no out splits, every example in the in splits),
and sets at each evaluation the learning rate that the first stage set
there (every record's ``lr``), to the first stage's last step.

`resolve` reads the first stage's records once, checks them, and puts its
schedule into the config's ``lr_schedule``: the run's identity, so that a
different first stage is a different run; where the first stage lies
(``lr_schedule_from``) is not. Both fields are in a run's identity and
records only where it has them (``config.Config.record_args``), so that
every other run keeps the identity and records it had. This module imports
no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments import errors
from experiments.rundir import records

# The config's fields that --lr_schedule_from adds: the flag, and the
# schedule it resolves to, ``[[step, lr], ...]`` per first-stage record.
FIELDS = ("lr_schedule_from", "lr_schedule")
# The flags in which the second stage may differ from the first: where
# things are, the data it trains on, and the plateau check, which needs
# validation (the second stage ends where the first did).
_MAY_DIFFER = ("output_dir", "data_dir", "overwrite", "holdout_fraction",
               "plateau_check_freq", *FIELDS)


def last_step(config: Any) -> int | None:
  """The step at which a second stage ends: its first stage's last; None
  for a run that is none."""
  return None if config.lr_schedule is None else config.lr_schedule[-1][0]


def learning_rates(config: Any) -> dict[int, float]:
  """A second stage's learning rate from each evaluation step on."""
  return {step: lr for step, lr in config.lr_schedule}


def resolve(config: Any, hparams: Mapping[str, Any]) -> Any:
  """``config`` (a ``config.Config``, resolved but for its output
  directory) with its ``lr_schedule`` read from ``--lr_schedule_from``,
  checked against the run's ``hparams``; unchanged without the flag.

  Raises:
    errors.UsageError: ``--holdout_fraction`` is not 0 with the flag, or
      ``--plateau_check_freq`` is given; the first stage is not there, not
      finished, damaged, or has no schedule (no ``auto_lr``), or is a
      second stage itself; or its flags
      or hparams differ from this run's but where `_MAY_DIFFER`.
  """
  source = config.lr_schedule_from
  if source is None:
    return config
  if config.holdout_fraction != 0:
    raise errors.UsageError(
        f"--lr_schedule_from trains ERM++'s second stage on all of the "
        f"training data, and --holdout_fraction {config.holdout_fraction} "
        "holds some out: pass --holdout_fraction 0.")
  if config.plateau_check_freq:
    raise errors.UsageError(
        "--plateau_check_freq reads the validation accuracy, which a second "
        "stage (--lr_schedule_from, --holdout_fraction 0) has none of; it "
        "ends where its first stage did: drop --plateau_check_freq.")
  if not (Path(source) / records.RESULTS_FILE).is_file():
    raise errors.UsageError(
        f"--lr_schedule_from {source}: no run there (no "
        f"{records.RESULTS_FILE}); pass the directory of a finished ERM++ "
        "run of hparam auto_lr.")
  if not records.is_done(source):
    raise errors.UsageError(
        f"--lr_schedule_from {source}: that run is not finished; resume it "
        "with its own command, then start the second stage.")
  try:
    first = records.read_run(source).records
  except records.DamagedRunError as e:
    raise errors.UsageError(f"--lr_schedule_from: {e}.") from None
  if not first or any("lr" not in r for r in first):
    raise errors.UsageError(
        f"--lr_schedule_from {source}: that run has no learning-rate "
        "schedule to replay; pass a finished ERM++ run of hparam auto_lr "
        "(its first stage).")
  if first[-1]["args"].get("lr_schedule") is not None:
    raise errors.UsageError(
        f"--lr_schedule_from {source}: that run is a second stage itself; "
        "pass the first stage it replays (its --lr_schedule_from).")
  differences = _differences(first[-1]["args"], config.record_args(),
                             "--{} {}, the first stage's {}")
  differences += _differences(first[-1]["hparams"], hparams,
                              "hparam {} {}, the first stage's {}")
  if differences:
    raise errors.UsageError(
        f"--lr_schedule_from {source}: the second stage trains as the first "
        f"with --holdout_fraction 0, but {'; '.join(differences)}. Pass the "
        "first stage's flags and hparams.")
  return dataclasses.replace(
      config, lr_schedule=[[r["step"], r["lr"]] for r in first])


def _differences(first: Mapping[str, Any], second: Mapping[str, Any],
                 template: str) -> list[str]:
  """Each value of ``second`` that is not ``first``'s, but `_MAY_DIFFER`,
  said by ``template`` (name, this run's, the first stage's)."""
  return [template.format(name, second.get(name), first.get(name))
          for name in sorted(first.keys() | second.keys())
          if name not in _MAY_DIFFER and first.get(name) != second.get(name)]
