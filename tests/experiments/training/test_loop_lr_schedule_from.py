"""Tests for ERM++'s second stage (``--lr_schedule_from``, DomainBed's
``train_autolr.py`` lines 260-422) in the loop: its replay of the first
stage's learning rates, its stop, its data, and its resume.

(The first stage, hparam ``auto_lr``, is test_loop_auto_lr.py's; the
second stage's resolving and refusals are test_second_stage.py's.)
"""

import contextlib
import io
import json
import shutil
import signal

import pytest

from experiments import train
from experiments.data import datasets
from experiments.rundir import checkpoints
from experiments.rundir import records
from test_loop_auto_lr import LR, MAX_STEPS, _assert_same_run, _flags
from test_train import _SIGNAL_IN_STEP, _train_command
from test_train import kill_at_first_checkpoint, read_records, run_after
from test_train import run_here

# The tiny ERM++ of test_loop_auto_lr.py stops at its third change, before
# MAX_STEPS; a first stage of SHORT_STEPS trains all its steps.
SHORT_STEPS = 4


def _stage2(output_dir, stage1, *flags, holdout="0", **kwargs):
  return [*_flags(output_dir, **kwargs), "--holdout_fraction", holdout,
          "--lr_schedule_from", str(stage1), *flags]


@pytest.fixture(name="stage1", scope="module")
def fixture_stage1(tmp_path_factory):
  """An uninterrupted first stage, stopped at its third change."""
  output_dir = tmp_path_factory.mktemp("stage1")
  assert train.main(_flags(output_dir)) == 0
  return output_dir


@pytest.fixture(name="stage2", scope="module")
def fixture_stage2(stage1, tmp_path_factory):
  """Its second stage's output directory and what the command printed."""
  output_dir = tmp_path_factory.mktemp("stage2") / "run"
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = train.main(_stage2(output_dir, stage1))
  assert status == 0, err.getvalue()
  return output_dir, out.getvalue(), err.getvalue()


def test_stage2_replays_stage1s_learning_rates_and_ends_where_it_did(
    stage1, stage2):
  first = read_records(stage1)
  output_dir, out, err = stage2
  second = read_records(output_dir)
  last = first[-1]["step"]
  assert first[-1]["lr_schedule"]["stopped"] and last < MAX_STEPS
  # The same evaluations, each at the learning rate the first stage set
  # there, to the first stage's last step (DomainBed's stops one before).
  assert [(r["step"], r["lr"]) for r in second] == [
      (r["step"], r["lr"]) for r in first]
  assert len({r["lr"] for r in second}) == 4
  # It follows no validation loss, and has none.
  assert not any({"sma_val_loss", "lr_schedule"} & r.keys() for r in second)
  assert records.is_done(output_dir)
  assert (f"Stopped at step {last} of at most {MAX_STEPS}: the first stage "
          f"(--lr_schedule_from {stage1}) ended there") in err
  # The final line is the last record's held-out accuracy.
  held_out = second[-1]["env0_in_acc"]
  assert out.splitlines()[-1].startswith(
      f"Held-out accuracy after {last} steps")
  assert f"(env0) {held_out:.4f}." in out.splitlines()[-1]


def test_stage2_of_a_first_stage_that_never_stopped_trains_all_its_steps(
    tmp_path, capsys):
  # DomainBed's fails at its last evaluation here (schedule[0] of an empty
  # list); this one ends on --steps, as the first stage did.
  first = tmp_path / "first"
  assert train.main(_flags(first, steps=SHORT_STEPS)) == 0
  assert not read_records(first)[-1]["lr_schedule"]["stopped"]
  second = run_here(_stage2(tmp_path / "second", first, steps=SHORT_STEPS),
                    capsys)
  assert second.returncode == 0, second.stderr
  assert "Stopped at step" not in second.stderr
  # Two evaluations after the probe: the first improves on no loss, so at
  # most one is bad, and patience 1 changes nothing.
  assert [(r["step"], r["lr"]) for r in read_records(tmp_path / "second")] == [
      (r["step"], r["lr"]) for r in read_records(first)] == [
          (step, 1.0) for step in range(1, SHORT_STEPS + 1)]


def test_the_optimizer_steps_at_the_replayed_rate(stage1, stage2, tmp_path,
                                                  capsys):
  # A first stage whose first change went to another rate: the second
  # stage trains as the other until that evaluation, bit for bit, and
  # differently from the step after it.
  run = read_records(stage1)
  change = next(i for i, r in enumerate(run)
                if r["lr_schedule"]["changes"] == 1)
  edited = tmp_path / "edited"
  shutil.copytree(stage1, edited)
  run[change]["lr"] = run[change]["lr"] * 3
  (edited / records.RESULTS_FILE).write_text(
      "".join(json.dumps(r) + "\n" for r in run))
  other = run_here(_stage2(tmp_path / "run", edited), capsys)
  assert other.returncode == 0, other.stderr
  ours, theirs = read_records(stage2[0]), read_records(tmp_path / "run")
  metrics = lambda r: {k: v for k, v in r.items()
                       if k.startswith("env") or k == "loss"}
  assert [metrics(r) for r in theirs[:change + 1]] == [
      metrics(r) for r in ours[:change + 1]]
  # The record after: the network after one step at the other rate (its
  # training loss is the step's, before it).
  losses = lambda r: [v for k, v in sorted(r.items())
                      if k.startswith("env") and k.endswith("_loss")]
  assert all(a != b for a, b in zip(losses(theirs[change + 1]),
                                    losses(ours[change + 1]), strict=True))


def test_stage2_counts_its_epochs_over_whole_domains(stage1, stage2):
  output_dir, _, _ = stage2
  record = read_records(output_dir)[-1]
  dataset = datasets.get_dataset("RotatedDigits", seed=0)
  sizes = [len(domain) for domain in dataset.domains]
  # No out splits: no out metrics, and an epoch is a pass over the smallest
  # training domain whole (the first stage's, over its in split).
  assert not [key for key in record if key.startswith("env")
              and "_out_" in key]
  assert all(record[f"env{i}_in_examples"] == 16 for i in range(len(sizes)))
  assert record["epoch"] == record["step"] / (min(sizes[1:]) / 4)
  first = read_records(stage1)[-1]
  held = [n - datasets.held_out_size(n, 0.2) for n in sizes[1:]]
  assert first["epoch"] == first["step"] / (min(held) / 4)
  assert record["args"]["holdout_fraction"] == 0


def test_stage2_evaluates_every_example_in_the_in_splits(tmp_path, capsys):
  # One step, every example evaluated: the first stage's in splits hold
  # what the 20% held out leaves; the second's, every example, and it has
  # no out split.
  def every_example(flags):
    at = flags.index("--eval_examples")
    return flags[:at] + flags[at + 2:]
  first = tmp_path / "first"
  assert run_here(every_example(_flags(first, steps=1)), capsys).returncode == 0
  second = run_here(every_example(_stage2(tmp_path / "second", first,
                                          steps=1)), capsys)
  assert second.returncode == 0, second.stderr
  sizes = [len(d) for d in datasets.get_dataset("RotatedDigits",
                                                seed=0).domains]
  held_out = [datasets.held_out_size(n, 0.2) for n in sizes]
  [one] = read_records(first)
  assert [one[f"env{i}_in_examples"] for i in range(len(sizes))] == [
      n - h for n, h in zip(sizes, held_out)]
  assert [one[f"env{i}_out_examples"] for i in range(len(sizes))] == held_out
  [two] = read_records(tmp_path / "second")
  assert [two[f"env{i}_in_examples"] for i in range(len(sizes))] == sizes
  assert not [key for key in two if "_out_" in key]


@pytest.mark.slow
def test_a_second_stage_killed_after_a_change_resumes_bit_for_bit(
    stage1, stage2, tmp_path, capsys):
  change = next(r["step"] for r in read_records(stage1)
                if r["lr_schedule"]["changes"] == 1)
  output_dir = tmp_path / "run"
  flags = _stage2(output_dir, stage1)
  kill_at_first_checkpoint(_train_command(flags), output_dir, change)
  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  _assert_same_run(output_dir, stage2[0])


@pytest.mark.slow
def test_an_interrupt_between_evaluations_keeps_the_replayed_rate(
    tmp_path, capsys):
  # Evaluations every 2 steps; a signal in the step after the first
  # change: the interrupt's record has the rate that the change set, and
  # the resumed run ends as the uninterrupted one.
  first = tmp_path / "first"
  assert train.main(_flags(first, checkpoint_freq=2)) == 0
  change = next(r for r in read_records(first)
                if r["lr_schedule"]["changes"] == 1)
  reference = tmp_path / "reference"
  assert train.main(_stage2(reference, first, checkpoint_freq=2)) == 0
  output_dir = tmp_path / "run"
  flags = _stage2(output_dir, first, checkpoint_freq=2)
  stopped = run_after(
      _SIGNAL_IN_STEP.format(calls=change["step"] + 1,
                             sig=int(signal.SIGTERM)),
      _train_command(flags))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  interrupt = read_records(output_dir)[-1]
  assert interrupt["step"] == change["step"] + 1
  assert checkpoints.INTERRUPT_KEY in interrupt
  assert interrupt["lr"] == change["lr"] != LR
  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  _assert_same_run(output_dir, reference)
