"""Where a run stops before its ``--steps``, and why: ERM++'s learning-rate
schedule changed for the third time (hparam ``auto_lr``), its second stage
reached its first stage's last step (``--lr_schedule_from``), SWAD's loss
valley ended (``--averaging swad``), or the run plateaued
(``--plateau_check_freq``). The training loop (`loop`) asks `stops_at` after
every evaluation, and says `stop_reason` at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments import config as config_lib
from experiments import second_stage
from experiments.rundir import records
from experiments.runs import convergence
from experiments.training import weight_averaging


# A record's key of ERM++'s learning-rate schedule (``auto_lr``): its
# `lr_plateau.PlateauState`, as `lr_plateau.to_record` writes it.
LR_SCHEDULE_KEY = "lr_schedule"


def stops_at(config: config_lib.Config, run_records: Sequence[records.Record],
             step: int) -> bool:
  """Whether a run stops at ``step`` before its last: its learning-rate
  schedule stopped there (`lr_schedule_stopped`), or, a second stage
  (``--lr_schedule_from``), its first stage's did; with ``--averaging
  swad``, the step whose record says that the valley died; or, with
  ``plateau_check_freq``, a check step at which its records so far have
  plateaued (`convergence.run_end`).

  A resumed run reads its records so far from its results file, so a run
  killed after stopping and resumed stops again at the same step."""
  if step == second_stage.last_step(config) or lr_schedule_stopped(
      run_records, step) or (
      run_records and run_records[-1]["step"] == step
      and run_records[-1].get(weight_averaging.SWAD_DEAD)):
    return True
  if not config.plateau_check_freq or not step or (
      step % config.plateau_check_freq):
    return False
  return convergence.run_end(run_records).plateaued


def lr_schedule_stopped(run_records: Sequence[records.Record],
                        step: int) -> bool:
  """Whether the record of ``step``, the last, says that ERM++'s
  learning-rate schedule stopped there (`lr_plateau`: its third change)."""
  return bool(run_records) and run_records[-1]["step"] == step and (
      run_records[-1].get(LR_SCHEDULE_KEY, {}).get("stopped", False))


def stop_reason(run_records: Sequence[records.Record]) -> str:
  """Why a run that `stops_at` its last record's step stopped there."""
  args = run_records[-1]["args"]
  if "lr_schedule" in args:
    return (f"the first stage (--lr_schedule_from {args['lr_schedule_from']}) "
            "ended there")
  if lr_schedule_stopped(run_records, run_records[-1]["step"]):
    return ("finished, the learning rate changed for the third time (hparam "
            "auto_lr)")
  if run_records[-1].get(weight_averaging.SWAD_DEAD):
    return "SWAD's loss valley ended (--averaging swad), where swad stops"
  return "plateaued (--plateau_check_freq)"
