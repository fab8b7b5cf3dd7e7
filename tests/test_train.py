"""Tests for experiments/train.py: whole runs, resumed, on several devices.

The runs train the default command (PGrad-B on RotatedDigits) on a short
schedule: two training domains, tiny batches, small evaluation subsets. They
run in subprocesses, as a user would, and share a JAX compilation cache so
that only the first one compiles.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import config as config_lib
from experiments import convergence
from experiments import training
from test_model_selection import make_record


REPO = Path(__file__).resolve().parents[1]
STEPS, FREQ = 10, 2
FLAGS = [
    "--steps", str(STEPS), "--checkpoint_freq", str(FREQ),
    "--test_envs", "0", "1", "2", "3", "--hparams", '{"batch_size": 6}',
    "--eval_examples", "16", "--eval_batch_size", "16", "--loss_examples", "8",
]
NUM_DOMAINS, TRAIN_DOMAINS, B = 6, 2, 3


def _command(output_dir):
  return [sys.executable, "-m", "experiments.train", *FLAGS,
          "--output_dir", str(output_dir)]


@pytest.fixture(name="reference", scope="module")
def fixture_reference(tmp_path_factory):
  """The output directory of an uninterrupted run."""
  output_dir = tmp_path_factory.mktemp("reference")
  result = subprocess.run(_command(output_dir), cwd=REPO,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert "Held-out accuracy" in result.stdout
  return output_dir


def read_records(output_dir):
  lines = (output_dir / "results.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def _params(output_dir):
  with np.load(output_dir / "final_params.npz") as npz:
    return {key: npz[key] for key in npz.files}


def test_run_writes_domainbed_results_and_done(reference):
  records = read_records(reference)
  assert [r["step"] for r in records] == list(range(FREQ, STEPS + 1, FREQ))
  assert (reference / "done").exists()
  for record in records:
    assert record["args"]["algorithm"] == "PGrad-B"
    assert record["args"]["test_envs"] == [0, 1, 2, 3]
    assert record["domains"] == ["0°", "15°", "30°", "45°", "60°", "75°"]
    assert record["hparams"]["B"] == B and record["hparams"]["batch_size"] == 6
    for key in ("epoch", "loss", "step_time", "ref_norm"):
      assert np.isfinite(record[key]), key
    assert record["num_skipped"] == 0
    for i in range(NUM_DOMAINS):
      assert 0 <= record[f"env{i}_in_acc"] <= 1
      assert 0 <= record[f"env{i}_out_acc"] <= 1
      assert np.isfinite(record[f"env{i}_in_loss"])
    eigenvalues = np.array(record["eigenvalues"])
    assert eigenvalues.shape == (TRAIN_DOMAINS * B + 1,)
    np.testing.assert_allclose(eigenvalues.sum(), 1.0, rtol=1e-5)
    assert np.all(np.diff(eigenvalues) <= 0)
  params = _params(reference)
  assert "params/head/kernel" in params
  assert all(np.all(np.isfinite(v)) for v in params.values())


# Prepended to a train command: once checkpoint STEP is on disk, the run
# SIGKILLs itself, so the kill lands between that checkpoint and the end of
# the run without the test watching the disk.
_DIE_AFTER_CHECKPOINT = """\
import os, signal
import orbax.checkpoint as ocp
save = ocp.CheckpointManager.save
def save_then_die(self, step, *args, **kwargs):
  saved = save(self, step, *args, **kwargs)
  if step == {step}:
    self.wait_until_finished()
    os.kill(os.getpid(), signal.SIGKILL)  # No clean-up at all.
  return saved
ocp.CheckpointManager.save = save_then_die
"""


def kill_at_first_checkpoint(command, output_dir, step):
  """Runs ``command`` (``python -m module ...`` or ``python -c script ...``)
  until it has written checkpoint ``step``, then SIGKILLs it."""
  python, flag, target, *args = command
  main = (f"import runpy; runpy.run_module({target!r}, run_name='__main__', "
          "alter_sys=True)" if flag == "-m" else target)
  killed = subprocess.run(
      [python, "-c", _DIE_AFTER_CHECKPOINT.format(step=step) + main, *args],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert killed.returncode == -signal.SIGKILL, killed.stderr
  assert (output_dir / "checkpoints" / str(step)).is_dir()
  assert not (output_dir / "done").exists(), "the run ended before the kill"


@pytest.mark.slow
def test_run_killed_and_restarted_ends_bit_for_bit_as_uninterrupted(
    reference, tmp_path):
  output_dir = tmp_path / "run"
  kill_at_first_checkpoint(_command(output_dir), output_dir, FREQ)
  # A record newer than any checkpoint, and one cut short: both are dropped.
  with (output_dir / "results.jsonl").open("a") as f:
    f.write(json.dumps({"step": STEPS + 1}) + '\n{"step": 4, "env0_in')

  resumed = subprocess.run(_command(output_dir), cwd=REPO,
                           capture_output=True, text=True, check=False)
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from step" in resumed.stderr
  expected = _params(reference)
  got = _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  def comparable(record):
    record = {**record, "args": {**record["args"], "output_dir": None}}
    del record["step_time"]
    return record

  assert ([comparable(r) for r in read_records(output_dir)]
          == [comparable(r) for r in read_records(reference)])


@pytest.mark.slow
def test_run_stops_at_its_first_plateaued_check_even_when_killed_there(
    reference, tmp_path):
  # Checks at steps 4 and 8 of at most 10; the uninterrupted run's records
  # say where it first plateaued (its validation moves by one SE or less).
  check_freq = 2 * FREQ
  ends = dict(convergence.run_ends(read_records(reference)))
  stop = next(step for step in range(check_freq, STEPS, check_freq)
              if ends[step].plateaued)
  output_dir = tmp_path / "run"
  command = [*_command(output_dir), "--plateau_check_freq", str(check_freq)]
  # Killed once its checkpoint at the stop is saved, before it is done: the
  # resumed run reads its records, stops there again and trains no further.
  kill_at_first_checkpoint(command, output_dir, stop)
  resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                           check=False)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Stopped at step {stop} of at most {STEPS}" in resumed.stderr
  assert f"after {stop} steps" in resumed.stdout
  assert (output_dir / "done").exists()

  def comparable(record):
    return {k: v for k, v in record.items() if k not in ("args", "step_time")}

  records = read_records(output_dir)
  assert [comparable(r) for r in records] == [
      comparable(r) for r in read_records(reference) if r["step"] <= stop]
  assert all(r["args"]["plateau_check_freq"] == check_freq for r in records)


def test_stops_at_reads_the_records_at_check_steps_only(tmp_path):
  path = tmp_path / "results.jsonl"
  records = [make_record("RotatedDigits", "ERM", 0, 0, 0, step,
                         in_accs=[0.5] * 6, out_accs=[0.1] + [val] * 5)
             for step, val in ((100, 0.4), (200, 0.9), (300, 0.9),
                               (400, 0.9))]
  for record in records:
    for i in range(6):
      record[f"env{i}_out_examples"] = 60
      record[f"env{i}_in_loss"] = 1.0
  def stops(step, check_freq):
    path.write_text("".join(json.dumps(r) + "\n"
                            for r in records[:step // 100]))
    config = config_lib.Config(steps=1000, checkpoint_freq=100,
                               plateau_check_freq=check_freq)
    return training.stops_at(config, path, step)
  # 200: 0.4 -> 0.9 over the window (it reaches back to step 100); 300 and
  # 400: no move.
  assert [stops(s, 100) for s in (100, 200, 300, 400)] == [
      False, False, True, True]
  assert not stops(300, 200) and stops(400, 200)
  assert not stops(400, 0) and not stops(0, 100)


@pytest.mark.slow
def test_runs_data_parallel_on_several_devices(reference, tmp_path):
  # Same command on two (simulated) devices: the batches are split over a
  # data axis and the run agrees with the one-device run up to the order of
  # floating-point sums.
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                             "--xla_force_host_platform_device_count=2"}
  result = subprocess.run(_command(tmp_path), cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert ": 2 cpu devices." in result.stderr
  expected, got = _params(reference), _params(tmp_path)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-3, atol=1e-5,
                               err_msg=key)


def test_trajectory_snapshots_every_n_steps_end_at_the_final_params(
    tmp_path):
  flags = [f if f != str(STEPS) else "6" for f in FLAGS]
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", *flags, "--trajectory_freq",
       "3", "--output_dir", str(tmp_path)],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  trajectory = tmp_path / "trajectory"
  assert sorted(p.name for p in trajectory.iterdir()) == [
      "0000000.npy", "0000003.npy", "0000006.npy"]
  points = [np.load(trajectory / f"{s:07d}.npy") for s in (0, 3, 6)]
  assert points[0].dtype == np.float32
  assert len({p.size for p in points}) == 1
  assert not np.array_equal(points[0], points[1])
  final = np.load(tmp_path / "final_params.npz")
  params = np.concatenate([final[k].ravel() for k in final.files
                           if k.startswith("params/")])
  # Same values, possibly in another leaf order.
  np.testing.assert_array_equal(np.sort(points[2]), np.sort(params))
