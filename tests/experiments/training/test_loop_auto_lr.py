"""Tests for experiments/training/loop.py's learning-rate schedule, ERM++'s
hparam ``auto_lr``: in a run, its stop and its resume.

(Whole runs of the default command, their resumes and their stops are
test_train.py's; the loop's claim is test_loop.py's.)
"""

import json
import signal

import numpy as np
import pytest

from experiments import train
from experiments.rundir import records
from test_lr_plateau import _TorchPlateau
from experiments.rundir import checkpoints
from test_train import TIMING, _SIGNAL_IN_STEP, _train_command
from test_train import kill_at_first_checkpoint, read_records, run_after
from test_train import run_here

# A tiny ERM++ on the digits, evaluated after every step: the probe takes
# updates 1-3, and a learning rate of 1 then makes the averaged network's
# validation loss worse than after the probe, so that the schedule changes
# three times within a few steps.
MAX_STEPS, LINEAR_STEPS, LR = 30, 2, 1.0


def _flags(output_dir, auto_lr=True, steps=MAX_STEPS, checkpoint_freq=1):
  hparams = {"batch_size": 4, "cnn_width": 8, "image_size": 8,
             "linear_steps": LINEAR_STEPS, "lr": LR, "auto_lr": auto_lr}
  return ["--algorithm", "ERMPlusPlus", "--steps", str(steps),
          "--checkpoint_freq", str(checkpoint_freq), "--test_envs", "0", "--eval_examples",
          "16", "--loss_examples", "16", "--num_workers", "0",
          "--output_dir", str(output_dir), "--hparams", json.dumps(hparams)]


@pytest.fixture(name="scheduled", scope="module")
def fixture_scheduled(tmp_path_factory):
  """The output directory of an uninterrupted run with ``auto_lr``."""
  output_dir = tmp_path_factory.mktemp("scheduled")
  assert train.main(_flags(output_dir)) == 0
  return output_dir


def _comparable(record):
  record = {k: v for k, v in record.items() if k not in TIMING}
  return {**record, "args": {**record["args"], "output_dir": None}}


def _params(output_dir):
  with np.load(output_dir / records.FINAL_PARAMS_FILE) as npz:
    return {key: npz[key] for key in npz.files}


def test_the_schedule_follows_domainbed_and_stops_after_three_changes(
    scheduled):
  run = read_records(scheduled)
  # Every step is evaluated, the probe's three included.
  assert [r["step"] for r in run] == list(range(1, len(run) + 1))
  assert [r["linear_probe"] for r in run[:4]] == [1.0, 1.0, 1.0, 0.0]
  # The schedule steps once the updates exceed linear_steps, on the
  # averaged network's validation loss, as PyTorch's ReduceLROnPlateau and
  # DomainBed's count decide in float64.
  reference = _TorchPlateau(LR)
  for record in run:
    if record["step"] <= LINEAR_STEPS:
      assert "sma_val_loss" not in record
      assert record["lr"] == LR and record["lr_schedule"]["evaluations"] == 0
      continue
    stop = reference.step(record["sma_val_loss"])
    assert record["lr"] == reference.lr
    assert record["lr_schedule"]["changes"] == reference.changes
    assert record["lr_schedule"]["stopped"] == stop
  # It stops at the third change, the last record, well before --steps,
  # and the run is finished.
  assert stop and reference.changes == 3 and run[-1]["step"] < MAX_STEPS
  assert sorted({r["lr"] for r in run}, reverse=True) == [
      LR, LR * 0.1, LR * 0.1 * 0.1, LR * 0.1 * 0.1 * 0.1]
  assert records.is_done(scheduled)


def test_without_auto_lr_a_run_records_no_schedule(tmp_path, capsys):
  done = run_here(_flags(tmp_path / "run", auto_lr=False, steps=4), capsys)
  assert done.returncode == 0, done.stderr
  run = read_records(tmp_path / "run")
  assert [r["step"] for r in run] == [1, 2, 3, 4]
  for record in run:
    assert not {"lr", "lr_schedule", "sma_val_loss"} & record.keys()


@pytest.mark.slow
def test_a_run_killed_at_a_change_resumes_bit_for_bit(scheduled, tmp_path,
                                                      capsys):
  # Killed once the checkpoint of the first change is saved: the resumed
  # run steps at the changed learning rate and decides on as the
  # uninterrupted one did.
  change = next(r["step"] for r in read_records(scheduled)
                if r["lr_schedule"]["changes"] == 1)
  output_dir = tmp_path / "run"
  kill_at_first_checkpoint(_train_command(_flags(output_dir)), output_dir,
                           change)
  resumed = run_here(_flags(output_dir), capsys)
  assert resumed.returncode == 0, resumed.stderr
  last = read_records(scheduled)[-1]["step"]
  assert (f"Stopped at step {last} of at most {MAX_STEPS}: finished, the "
          "learning rate changed for the third time") in resumed.stderr

  _assert_same_run(output_dir, scheduled)


def _assert_same_run(output_dir, reference):
  assert ([_comparable(r) for r in read_records(output_dir)]
          == [_comparable(r) for r in read_records(reference)])
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.mark.slow
def test_an_interrupt_between_evaluations_keeps_the_schedule(tmp_path,
                                                             capsys):
  # Evaluations every 2 steps; a signal in step 5, after the schedule's
  # first step (4): the interrupt's record holds the schedule as it stood,
  # and the resumed run ends as the uninterrupted one.
  reference = tmp_path / "reference"
  assert train.main(_flags(reference, checkpoint_freq=2)) == 0
  output_dir = tmp_path / "run"
  flags = _flags(output_dir, checkpoint_freq=2)
  stopped = run_after(_SIGNAL_IN_STEP.format(calls=5,
                                             sig=int(signal.SIGTERM)),
                      _train_command(flags))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  interrupt = read_records(output_dir)[-1]
  assert interrupt["step"] == 5 and checkpoints.INTERRUPT_KEY in interrupt
  at_4 = read_records(reference)[1]
  assert at_4["step"] == 4 and "sma_val_loss" in at_4
  assert "sma_val_loss" not in interrupt
  assert (interrupt["lr"], interrupt["lr_schedule"]) == (
      at_4["lr"], at_4["lr_schedule"])
  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  _assert_same_run(output_dir, reference)

