"""Tests for experiments/train.py: whole runs, resumed, on several devices,
refused when their records are damaged or their flags cannot run.

The runs train the default command (PGrad-B on RotatedDigits) on a short
schedule: two training domains, tiny batches, small evaluation subsets. The
runs that are killed or signalled, or that need devices of their own, run in
subprocesses, as a user would; the others, and the reruns that resume from
what a killed run left on disk, run in this process through `train.main`,
which spares each the seconds of importing JAX, Flax, Orbax and Grain. They
share a JAX compilation cache so that only the first one compiles.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import averaging_flags
from experiments import config as config_lib
from experiments import errors
from experiments.runs import convergence
from experiments.runs import environment
from experiments.rundir import records
from experiments import train
from experiments.rundir import checkpoints
from experiments.rundir import claim
from experiments.training import evaluate
from experiments.training import stopping
from experiments.training import progress
from experiments.training import steps as train_steps
from test_model_selection import make_record


REPO = Path(__file__).resolve().parents[2]
STEPS, FREQ = 10, 2
FLAGS = [
    "--steps", str(STEPS), "--checkpoint_freq", str(FREQ),
    "--test_envs", "0", "1", "2", "3", "--hparams", '{"batch_size": 6}',
    "--eval_examples", "16", "--eval_batch_size", "16", "--loss_examples", "8",
]
NUM_DOMAINS, TRAIN_DOMAINS, B = 6, 2, 3
# The fields of a record that time the run, which no rerun reproduces.
TIMING = records.TIMING_FIELDS


def _flags(output_dir):
  return [*FLAGS, "--output_dir", str(output_dir)]


def _with_steps(steps):
  """`FLAGS` with ``steps`` training steps."""
  flags = list(FLAGS)
  flags[flags.index("--steps") + 1] = str(steps)
  return flags


def _train_command(flags):
  """``python -m experiments.train`` with ``flags``."""
  return [sys.executable, "-m", "experiments.train", *flags]


def _command(output_dir):
  return _train_command(_flags(output_dir))


def run_here(flags, capsys):
  """Runs the train command with ``flags`` in this process (`train.main`,
  which the command's process runs) and returns it as a finished process:
  its exit status and what it printed."""
  status = train.main(flags)
  out, err = capsys.readouterr()
  return subprocess.CompletedProcess(flags, status, out, err)


@pytest.fixture(name="reference", scope="module")
def fixture_reference(tmp_path_factory):
  """The output directory of an uninterrupted run."""
  output_dir = tmp_path_factory.mktemp("reference")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert train.main(_flags(output_dir)) == 0
  assert "Held-out accuracy" in out.getvalue()
  assert out.getvalue().endswith(f"Run directory: {output_dir}\n")
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
    for key in ("epoch", "loss", *TIMING, "ref_norm"):
      assert np.isfinite(record[key]), key
    # Waiting for data and for the device are parts of a step's time.
    assert 0 <= record["data_wait_time"]
    assert 0 <= record["device_wait_time"]
    assert (record["data_wait_time"] + record["device_wait_time"]
            <= record["step_time"])
    # The model initialises before the first step.
    assert 0 < record["init_time"] < record["time_to_first_step"]
    assert record["num_skipped"] == 0
    for i in range(NUM_DOMAINS):
      assert 0 <= record[f"env{i}_in_acc"] <= 1
      assert 0 <= record[f"env{i}_out_acc"] <= 1
      assert np.isfinite(record[f"env{i}_in_loss"])
    eigenvalues = np.array(record["eigenvalues"])
    assert eigenvalues.shape == (TRAIN_DOMAINS * B + 1,)
    np.testing.assert_allclose(eigenvalues.sum(), 1.0, rtol=1e-5)
    assert np.all(np.diff(eigenvalues) <= 0)
  # Without --averaging, nothing of it: no keys, no averaged params.
  assert not [key for key in records[-1] if key.startswith(
      ("averaged_", "swad_")) or key.endswith("_out_loss")]
  assert not set(averaging_flags.FIELDS) & set(records[-1]["args"])
  assert not (reference / "averaged_params.npz").exists()
  params = _params(reference)
  assert "params/head/kernel" in params
  assert all(np.all(np.isfinite(v)) for v in params.values())


def test_a_run_records_the_machine_it_trained_on(reference):
  [entry] = records.read_environment(reference)
  assert entry["backend"] == jax.default_backend()
  assert entry["jax"] == jax.__version__
  # This process trained it.
  assert entry == environment.describe()


# Prepended to a train command: once checkpoint STEP is on disk, the run
# sends itself SIG (a SIGKILL, or Ctrl-C's SIGINT), so the signal lands
# between that checkpoint and the end of the run without the test watching
# the disk.
_DIE_AFTER_CHECKPOINT = """\
import os, signal
import orbax.checkpoint as ocp
save = ocp.CheckpointManager.save
def save_then_die(self, step, *args, **kwargs):
  saved = save(self, step, *args, **kwargs)
  if step == {step}:
    self.wait_until_finished()
    os.kill(os.getpid(), {sig})  # SIGKILL: no clean-up at all.
  return saved
ocp.CheckpointManager.save = save_then_die
"""


# Python leaves SIGINT ignored in a process started ignoring it, as a shell
# starts a command sent to the background (`pytest &`): the runs here take
# Ctrl-C as from a terminal, however the tests were started.
_CTRL_C_FROM_A_TERMINAL = """\
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
"""


def run_after(prelude, command, **kwargs):
  """Runs ``command`` (``python -m module ...`` or ``python -c script ...``)
  after the Python code ``prelude``, in the same process."""
  python, flag, target, *args = command
  main = (f"import runpy; runpy.run_module({target!r}, run_name='__main__', "
          "alter_sys=True)" if flag == "-m" else target)
  return subprocess.run([python, "-c", _CTRL_C_FROM_A_TERMINAL + prelude + main,
                         *args], cwd=REPO,
                        capture_output=True, text=True, check=False, **kwargs)


def kill_at_first_checkpoint(command, output_dir, step, sig=signal.SIGKILL):
  """Runs ``command`` until it has written checkpoint ``step``, then sends
  it ``sig``; returns the finished process."""
  killed = run_after(_DIE_AFTER_CHECKPOINT.format(step=step, sig=int(sig)),
                     command)
  if sig == signal.SIGKILL:
    assert killed.returncode == -signal.SIGKILL, killed.stderr
  assert (output_dir / "checkpoints" / str(step)).is_dir()
  assert not (output_dir / "done").exists(), "the run ended before the kill"
  return killed


@pytest.mark.slow
def test_run_killed_and_restarted_ends_bit_for_bit_as_uninterrupted(
    reference, tmp_path, capsys):
  output_dir = tmp_path / "run"
  kill_at_first_checkpoint(_command(output_dir), output_dir, FREQ)
  # What a run killed later leaves: a record newer than any checkpoint, and
  # one cut short. Both are dropped, saying so.
  torn = '{"step": 4, "env0_in'
  with (output_dir / "results.jsonl").open("a") as f:
    f.write(json.dumps({"step": FREQ + 1}) + "\n" + torn)

  resumed = run_here(_flags(output_dir), capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from step" in resumed.stderr
  assert f"Dropped the record of step {FREQ + 1}" in resumed.stderr
  assert f"Dropped a last line cut short ({len(torn)} bytes)" in resumed.stderr
  expected = _params(reference)
  got = _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  def comparable(record):
    record = {k: v for k, v in record.items() if k not in TIMING}
    return {**record, "args": {**record["args"], "output_dir": None}}

  assert ([comparable(r) for r in read_records(output_dir)]
          == [comparable(r) for r in read_records(reference)])
  # Killed and resumed on one machine: trained on that one alone.
  assert records.read_environment(output_dir) == records.read_environment(
      reference)


@pytest.mark.slow
def test_run_stops_at_its_first_plateaued_check_even_when_killed_there(
    reference, tmp_path, capsys):
  # Checks at steps 4 and 8 of at most 10; the uninterrupted run's records
  # say where it first plateaued (its validation moves by one SE or less).
  check_freq = 2 * FREQ
  ends = dict(convergence.run_ends(read_records(reference)))
  stop = next(step for step in range(check_freq, STEPS, check_freq)
              if ends[step].plateaued)
  output_dir = tmp_path / "run"
  flags = [*_flags(output_dir), "--plateau_check_freq", str(check_freq)]
  # Killed once its checkpoint at the stop is saved, before it is done: the
  # resumed run reads its records, stops there again and trains no further.
  kill_at_first_checkpoint(_train_command(flags), output_dir, stop)
  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Stopped at step {stop} of at most {STEPS}" in resumed.stderr
  assert f"after {stop} steps" in resumed.stdout
  assert (output_dir / "done").exists()

  def comparable(record):
    return {k: v for k, v in record.items() if k not in ("args", *TIMING)}

  records = read_records(output_dir)
  assert [comparable(r) for r in records] == [
      comparable(r) for r in read_records(reference) if r["step"] <= stop]
  assert all(r["args"]["plateau_check_freq"] == check_freq for r in records)


def test_stops_at_reads_the_records_at_check_steps_only():
  run = [make_record("RotatedDigits", "ERM", 0, 0, 0, step,
                     in_accs=[0.5] * 6, out_accs=[0.1] + [val] * 5)
         for step, val in ((100, 0.4), (200, 0.9), (300, 0.9), (400, 0.9))]
  for record in run:
    for i in range(6):
      record[f"env{i}_out_examples"] = 60
      record[f"env{i}_in_loss"] = 1.0
  def stops(step, check_freq):
    config = config_lib.Config(steps=1000, checkpoint_freq=100,
                               plateau_check_freq=check_freq)
    return stopping.stops_at(config, run[:step // 100], step)
  # 200: 0.4 -> 0.9 over the window (it reaches back to step 100); 300 and
  # 400: no move.
  assert [stops(s, 100) for s in (100, 200, 300, 400)] == [
      False, False, True, True]
  assert not stops(300, 200) and stops(400, 200)
  assert not stops(400, 0) and not stops(0, 100)


# Prepended to a train command: records how the first training batch is
# laid out on the devices, as placed and as the step's program types it.
_RECORD_BATCH_LAYOUT = """import json, jax
from experiments.training import sharding
place = sharding.Sharder.batch
def place_and_record(self, batch, axis):
  placed = place(self, batch, axis)
  if axis == 1 and not place_and_record.done:
    image = placed["image"]
    with open({path!r}, "w") as f:
      json.dump({{"spec": tuple(image.sharding.spec),
                 "type": str(jax.typeof(image)),
                 "shards": sorted([s.device.id, *s.data.shape]
                                  for s in image.addressable_shards)}}, f)
    place_and_record.done = True
  return placed
place_and_record.done = False
sharding.Sharder.batch = place_and_record
"""


# Two steps, the first checkpoint's: the runs on several devices.
SHORT_FLAGS = _with_steps(FREQ)


@pytest.fixture(name="two_devices", scope="module")
def fixture_two_devices(tmp_path_factory):
  """A run of `SHORT_FLAGS` on two (simulated) devices, in a process of its
  own (a process's device count is set as JAX starts): the finished process,
  its output directory, and the layout of its first training batch."""
  tmp_path = tmp_path_factory.mktemp("two_devices")
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
         "--xla_force_host_platform_device_count=2"}
  layout = tmp_path / "layout.json"
  output_dir = tmp_path / "run"
  result = run_after(
      _RECORD_BATCH_LAYOUT.format(path=str(layout)),
      _train_command([*SHORT_FLAGS, "--devices", "2", "--output_dir",
                      str(output_dir)]), env=env)
  return result, output_dir, layout


@pytest.mark.slow
def test_runs_data_parallel_on_several_devices(two_devices, tmp_path):
  # The same two updates on one device and on two (simulated) devices, which
  # split the batches over a data axis: the runs differ only in the order of
  # floating-point sums. They are compared before chaos grows: over the 10
  # steps of `reference`, training amplifies the rounding differences (ReLU
  # signs flip, Adam's first steps magnify small gradients) by an amount that
  # depends on the CPU, from 1e-7 to 5e-5 in a bias of size 1e-3 (on an AVX2
  # AMD EPYC). After two updates they were at most 3e-8 under
  # --xla_cpu_max_isa SSE4_2, AVX, AVX2 and AVX-512, where the params move by
  # 3.5e-4 (median) and at most 1.2e-3: atol 1e-6 is 30 times the measured
  # difference and a 350th of the median move. The run on one device runs
  # in this process, which has one.
  result, output_dir, _ = two_devices
  assert result.returncode == 0, result.stderr
  assert train.main([*SHORT_FLAGS, "--devices", "1",
                     "--output_dir", str(tmp_path / "1_devices")]) == 0
  expected, got = _params(tmp_path / "1_devices"), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6,
                               err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, hparams", [
    ("ANDMask", {}),
    # At DomainBed's tau = 1 its mask is 0 everywhere: nothing would train.
    ("SANDMask", {"tau": 0.5}),
    ("IGA", {})])
def test_gradient_masks_and_iga_run_data_parallel_on_two_devices(
    tmp_path, algorithm, hparams):
  # Their per-domain gradients are means over each domain's examples, which
  # the data axis splits and sums back: two updates on two (simulated)
  # devices equal those on one up to the order of the sums. Measured on an
  # AVX-512 EPYC and under --xla_cpu_max_isa AVX2: at most 3e-8 (ANDMask,
  # SANDMask) and 1.3e-7 (IGA, whose penalty's second derivatives sum
  # most); atol 1e-6, as for PGrad above, is 7 times IGA's.
  flags = _with_steps(FREQ)
  flags[flags.index("--hparams") + 1] = json.dumps({"batch_size": 6,
                                                    **hparams})
  flags += ["--algorithm", algorithm]
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
         "--xla_force_host_platform_device_count=2"}
  two = subprocess.run(
      _train_command([*flags, "--devices", "2", "--output_dir",
                      str(tmp_path / "2_devices")]),
      cwd=REPO, env=env, capture_output=True, text=True, check=False)
  assert two.returncode == 0, two.stderr
  assert "split over 2 cpu devices on a data axis" in two.stderr
  assert train.main([*flags, "--devices", "1",
                     "--output_dir", str(tmp_path / "1_device")]) == 0
  expected, got = _params(tmp_path / "1_device"), _params(tmp_path / "2_devices")
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6,
                               err_msg=key)


def test_devices_split_every_domains_batch_on_a_data_axis(two_devices):
  result, output_dir, layout = two_devices
  assert result.returncode == 0, result.stderr
  assert (f"batch of {TRAIN_DOMAINS} domains x 6 examples, split over 2 cpu "
          "devices on a data axis, 3 examples of every domain on each."
          in result.stderr)
  placed = json.loads(layout.read_text())
  # Every domain's 6 examples: 3 on each device, the domain axis whole; the
  # step's program is typed with the split (Explicit sharding).
  assert placed["spec"] == [None, "data"]
  assert placed["shards"] == [[0, TRAIN_DOMAINS, 3, 28, 28, 1],
                              [1, TRAIN_DOMAINS, 3, 28, 28, 1]]
  assert placed["type"] == f"float32[{TRAIN_DOMAINS},6@data,28,28,1]"
  # The run is whole: its records check, as on one device.
  assert [r["step"] for r in records.read_run(output_dir).records] == [FREQ]


def test_trajectory_snapshots_every_n_steps_end_at_the_final_params(
    tmp_path):
  flags = _with_steps(6)
  assert train.main([*flags, "--trajectory_freq", "3",
                     "--output_dir", str(tmp_path)]) == 0
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


# Prepended to a train command: the run SIGKILLs itself once its step-0
# params snapshot is on disk, before its first step (and checkpoint).
_DIE_AFTER_FIRST_SNAPSHOT = """\
import os, signal
from experiments.rundir import checkpoints
save = checkpoints.save_trajectory_point
def save_then_die(output_dir, step, params):
  save(output_dir, step, params)
  if step == 0:
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints.save_trajectory_point = save_then_die
"""


@pytest.mark.slow
def test_a_run_killed_after_its_first_snapshot_resumes_bit_for_bit(
    reference, tmp_path, capsys):
  # The case reported: the step-0 snapshot was the run directory's first
  # file, before its config file; killed then, the run's directory was
  # refused by the same command as a run of unknown configuration.
  output_dir = tmp_path / "run"
  flags = [*_flags(output_dir), "--trajectory_freq", "5"]
  killed = run_after(_DIE_AFTER_FIRST_SNAPSHOT, _train_command(flags))
  assert killed.returncode == -signal.SIGKILL, killed.stderr
  assert list(records.trajectory_files(output_dir)) == [0]
  assert not records.checkpoint_steps(output_dir)
  assert (output_dir / records.CONFIG_FILE).exists()
  # As if it had started on another machine: resumed here, it adds this
  # one.
  [entry] = records.read_environment(output_dir)
  elsewhere = {**entry, "processor": "another processor"}
  (output_dir / records.ENVIRONMENT_FILE).write_text(json.dumps([elsewhere]))

  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert records.read_environment(output_dir) == [elsewhere, entry]
  assert list(records.trajectory_files(output_dir)) == [0, 5, STEPS]
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def _files(output_dir):
  """Every file of a run directory, with its bytes."""
  return {p.relative_to(output_dir): p.read_bytes()
          for p in sorted(output_dir.rglob("*")) if p.is_file()}


def test_a_finished_run_prints_its_result_again_and_writes_nothing(
    reference, capsys):
  before = _files(reference)
  assert train.main([*FLAGS, "--output_dir", str(reference)]) == 0
  out, err = capsys.readouterr()
  assert "Already finished." in err
  last = read_records(reference)[-1]
  held_out = ", ".join(f"{name} (env{i}) {last[f'env{i}_in_acc']:.4f}"
                       for i, name in enumerate(last["domains"][:4]))
  assert out == (
      f"Held-out accuracy after {STEPS} steps (the last step's, on the "
      "held-out domains' in splits; no model selection): "
      f"{held_out}. Run directory: {reference}\n")
  assert _files(reference) == before
  # Claimed and trained in a test, the finished run gives its last record
  # and says it is finished; the result is the command's to print.
  assert train.claim_and_train(train.resolve_run(_flags(reference))) == last
  assert capsys.readouterr() == ("", "Already finished.\n")
  assert _files(reference) == before


def test_a_finished_runs_result_is_printed_without_importing_jax(reference):
  # The README's default command run again once finished: its result, read
  # from the records, needs neither JAX nor the training loop (seconds of
  # imports). Python's import log (-X importtime, on stderr) names every
  # module the command imported.
  again = subprocess.run(
      [sys.executable, "-X", "importtime", "-m", "experiments.train",
       *_flags(reference)],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert again.returncode == 0, again.stderr
  assert again.stdout == records.final_line(read_records(reference)[-1],
                                            reference) + "\n"
  assert "Already finished." in again.stderr
  imported = {line.rsplit("|", 1)[-1].strip()
              for line in again.stderr.splitlines()
              if line.startswith("import time:")}
  assert "experiments.config" in imported, again.stderr
  needless = sorted(name for name in imported
                    if name.split(".")[0] in ("jax", "jaxlib")
                    or name.startswith("experiments.training"))
  assert not needless, needless[:10]


def _truncate_mid_line(run):
  data = (run / "results.jsonl").read_bytes()
  (run / "results.jsonl").write_bytes(data[:len(data) // 2])


def _truncate_unfinished(run):
  # Whole lines, of an unfinished run: step 10's checkpoint has no record.
  (run / "done").unlink()
  lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
  (run / "results.jsonl").write_text("".join(lines[:2]))


def _corrupt(run):
  lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
  lines[2] = lines[2].replace('"step"', '"step', 1)
  (run / "results.jsonl").write_text("".join(lines))


def _reorder(run):
  lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
  lines[1], lines[3] = lines[3], lines[1]
  (run / "results.jsonl").write_text("".join(lines))


def _delete_last_checkpoint(run):
  shutil.rmtree(run / "checkpoints" / str(STEPS))


@pytest.mark.parametrize("damage, problem", [
    (_truncate_mid_line, "(a finished run): its last line is cut short"),
    (_truncate_unfinished, f"(an unfinished run): it has no record of step "
     f"{STEPS}, its last checkpoint's (it ends at step {2 * FREQ})"),
    (_corrupt, "(a finished run): line 3 is not JSON"),
    (_reorder, f"(a finished run): line 3 is of step {3 * FREQ}, after step "
     f"{4 * FREQ}"),
    (_delete_last_checkpoint, f"(a finished run): it is done, yet its last "
     f"record (step {STEPS}) has no checkpoint"),
])
def test_damaged_records_are_refused_and_left_as_they_are(
    reference, tmp_path, capsys, damage, problem):
  # The case: a finished run's records cut short were read up to
  # their last whole line, reported as the run's end, and rewritten so.
  run = tmp_path / "run"
  shutil.copytree(reference, run)
  damage(run)
  before = _files(run)
  assert train.main([*FLAGS, "--output_dir", str(run)]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  # One line, the command's, as argparse's usage errors.
  assert err.splitlines() == [
      f"{config_lib.PROG}: error: {run / 'results.jsonl'} {problem}; no run "
      "leaves its records so, even when killed. Train it again from "
      "scratch: the same command with --overwrite."], err
  assert _files(run) == before


# Prepended to a train command: SIGTERM arrives while the run reads its data.
_SIGTERM_WHILE_READING = """\
import os, signal
from experiments.data import datasets
get_dataset = datasets.get_dataset
def get_dataset_and_signal(*args, **kwargs):
  os.kill(os.getpid(), signal.SIGTERM)
  return get_dataset(*args, **kwargs)
datasets.get_dataset = get_dataset_and_signal
"""


def test_sigterm_while_the_data_is_read_stops_with_a_message(tmp_path):
  output_dir = tmp_path / "run"
  stopped = run_after(_SIGTERM_WHILE_READING, _command(output_dir))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  assert "Traceback" not in stopped.stderr
  assert stopped.stderr.endswith(
      "stopped by SIGTERM; before the run started; rerun the same command "
      "to run it.\n"), stopped.stderr
  assert not records.checkpoint_steps(output_dir)


def test_ctrl_c_stops_at_a_checkpoint_that_the_same_command_resumes(tmp_path):
  output_dir = tmp_path / "run"
  stopped = kill_at_first_checkpoint(_command(output_dir), output_dir, FREQ,
                                     sig=signal.SIGINT)
  assert stopped.returncode == 130, stopped.stderr
  assert stopped.stderr.endswith(
      f"stopped by SIGINT; checkpoint at step {FREQ} in {output_dir}; rerun "
      "the same command to resume from it.\n"), stopped.stderr
  assert "Traceback" not in stopped.stderr
  run = records.read_run(output_dir)
  assert run.checkpoint_step == FREQ and run.unsaved == 0
  # At a checkpoint already: its record is the schedule's.
  assert checkpoints.INTERRUPT_KEY not in run.records[-1]


# Prepended to a train command: the run sends itself SIG once its training
# step has run CALLS times (its metrics are summed; the loop has not
# checked for signals yet), so that the signal lands within that step.
_SIGNAL_IN_STEP = """\
import os
from experiments.training import evaluate
add = evaluate.MetricMeter.add
calls = []
def add_and_signal(self, metrics):
  add(self, metrics)
  calls.append(1)
  if len(calls) == {calls}:
    os.kill(os.getpid(), {sig})
evaluate.MetricMeter.add = add_and_signal
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_between_checkpoints_saves_the_step_and_resumes_exactly(
    reference, tmp_path, capsys, sig):
  # Step 3 of checkpoints every 2 steps: the run finishes it, evaluates and
  # checkpoints it, and exits 128 + the signal.
  output_dir, stop = tmp_path / "run", FREQ + 1
  stopped = run_after(_SIGNAL_IN_STEP.format(calls=stop, sig=int(sig)),
                      _command(output_dir))
  assert stopped.returncode == 128 + sig, stopped.stderr
  assert "Traceback" not in stopped.stderr
  assert stopped.stderr.endswith(
      f"stopped by {sig.name}; checkpoint at step {stop} in {output_dir}; "
      "rerun the same command to resume from it.\n"), stopped.stderr
  run = records.read_run(output_dir)
  assert run.checkpoint_step == stop and run.unsaved == 0
  assert [r["step"] for r in run.records] == [FREQ, stop]
  interrupt = run.records[-1]
  assert interrupt[checkpoints.INTERRUPT_KEY] == sig.name
  # A whole record, evaluated, as any reader of the records expects.
  assert 0 <= interrupt["env0_in_acc"] <= 1

  resumed = run_here(_flags(output_dir), capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Resuming from step {stop}." in resumed.stderr
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  # The interrupt's record and checkpoint are gone; the record after it
  # averages the metrics of its whole interval, as uninterrupted.
  assert records.checkpoint_steps(output_dir) == [STEPS - FREQ, STEPS]

  def comparable(record):
    return {k: v for k, v in record.items() if k not in ("args", *TIMING)}

  assert ([comparable(r) for r in read_records(output_dir)]
          == [comparable(r) for r in read_records(reference)])


def test_a_resumed_run_compiles_nothing_that_a_fresh_run_did_not(tmp_path):
  # The case seen: the first resume after a SIGINT compiled its step from
  # scratch (105 s, against 22-32 s for fresh runs of its shape), missing
  # every program that fresh runs had left in the compilation cache; the
  # resumed state, committed to its device as Orbax restores it, lowered to
  # other programs than the fresh, uncommitted one. Each run is a process
  # of its own, so that none finds a program in another's memory.
  cache = tmp_path / "cache"
  flags = [*_with_steps(2 * FREQ), "--compile_cache_dir", str(cache)]

  def entries():
    return {path.name for path in cache.iterdir()}

  fresh = run_after("", _train_command(
      [*flags, "--output_dir", str(tmp_path / "fresh")]))
  assert fresh.returncode == 0, fresh.stderr
  compiled = entries()
  # Signalled in the step after the first checkpoint: the resumed run
  # restores its state and the interrupt's meter, and evaluates.
  output_dir = tmp_path / "run"
  command = _train_command([*flags, "--output_dir", str(output_dir)])
  stopped = run_after(_SIGNAL_IN_STEP.format(calls=FREQ + 1,
                                             sig=int(signal.SIGINT)), command)
  assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr
  resumed = run_after("", command)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Resuming from step {FREQ + 1}." in resumed.stderr
  assert not entries() - compiled


# Defines make_lagging_step, a make_train_step whose steps, from step CALLS
# on, first wait on the device for a product of SIZE x SIZE matrices, ROUNDS
# times (their results unchanged bit for bit). The wait is a program of its
# own, which the step's state goes through: the step's program is the run's,
# which the compilation cache holds (compiling the two as one took a test
# about 6 CPU-seconds).
_LAGGING_STEPS = """\
import jax, jax.numpy as jnp
from experiments.training import steps as train_steps
make_train_step = train_steps.make_train_step
def busy(_):
  matrix = jnp.full(({size}, {size}), 1 / {size}, jnp.float32)
  return jax.lax.fori_loop(0, {rounds}, lambda _, m: jnp.tanh(m @ m),
                           matrix)[0, 0]
@jax.jit
def lag(step):
  # tanh is at most 1: the step is unchanged, but waits for the product.
  over = jax.lax.cond(step >= {calls} - 1, busy,
                      lambda _: jnp.zeros((), jnp.float32), step) > 2
  return jnp.where(over, 0, step)
def make_lagging_step(algorithm, key):
  train_step = make_train_step(algorithm, key)
  def lagging_step(state, batches):
    return train_step(state._replace(step=lag(state.step)), batches)
  lagging_step.lower = train_step.lower  # The run compiles its step.
  return lagging_step
"""


# Prepended to a train command: from step CALLS on, each step lags on the
# device (`_LAGGING_STEPS`), and SIG comes DELAY seconds after the loop has
# dispatched step CALLS. JAX lets the loop run ahead of the device, so
# without a bound the loop has dispatched every step to the next checkpoint
# by then.
_SIGNAL_WHILE_THE_DEVICE_LAGS = _LAGGING_STEPS + """\
import os, threading
from experiments.training import evaluate
train_steps.make_train_step = make_lagging_step
add = evaluate.MetricMeter.add
calls = []
def add_and_signal_later(self, metrics):
  add(self, metrics)
  calls.append(1)
  if len(calls) == {calls}:
    threading.Timer({delay}, os.kill, (os.getpid(), {sig})).start()
evaluate.MetricMeter.add = add_and_signal_later
"""


def test_a_signal_while_the_device_lags_stops_at_once_and_resumes_exactly(
    reference, tmp_path, capsys):
  # The case reported: a SIGTERM while the device was still on the steps
  # after a checkpoint, which the loop had all dispatched, was acknowledged,
  # and the run trained to the end and exited 0. The run now keeps at most
  # the next step in flight: it stops within a step or two of the device.
  freq, stop = 5, 6
  output_dir = tmp_path / "run"
  flags = [*_flags(output_dir), "--checkpoint_freq", str(freq)]
  stopped = run_after(
      _SIGNAL_WHILE_THE_DEVICE_LAGS.format(
          calls=stop, size=400, rounds=300, delay=0.5,
          sig=int(signal.SIGTERM)),
      _train_command(flags))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  assert "Traceback" not in stopped.stderr
  run = records.read_run(output_dir)
  assert stop <= run.checkpoint_step < STEPS, run.checkpoint_step
  assert stopped.stderr.endswith(
      f"stopped by SIGTERM; checkpoint at step {run.checkpoint_step} in "
      f"{output_dir}; rerun the same command to resume from it.\n"
  ), stopped.stderr
  assert [r["step"] for r in run.records] == [freq, run.checkpoint_step]
  # As if from before runs recorded where they trained: the resumed run
  # does not claim the steps trained so far.
  (output_dir / records.ENVIRONMENT_FILE).unlink()

  resumed = run_here(flags, capsys)
  assert resumed.returncode == 0, resumed.stderr
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  assert records.checkpoint_steps(output_dir) == [freq, STEPS]
  assert records.read_environment(output_dir) == [None,
                                                  environment.describe()]


def test_the_bar_counts_only_the_steps_that_have_ended(tmp_path, capsys,
                                                      monkeypatch):
  # The case seen: right after an evaluation, the bar showed tens of
  # thousands of images a second, counting the step just dispatched as done.
  # Each step here first waits on the device for a product of a while, so
  # that the step the loop has just dispatched is still running when the bar
  # is updated: `_LAGGING_STEPS`, defined in this process.
  lagging = {}
  exec(  # pylint: disable=exec-used
      _LAGGING_STEPS.format(calls=0, size=200, rounds=100), lagging)

  interval = []  # The metrics of the steps since the last evaluation.
  shown = []  # (steps counted, steps ended) as the bar was updated.
  add, training_shown, results = (evaluate.MetricMeter.add,
                                  progress.Screen.training,
                                  progress.Screen.results)

  def add_and_keep(self, metrics):
    interval.append(metrics)
    add(self, metrics)

  def show(self, steps, seconds, data_wait):
    ended = sum(jax.tree.leaves(m)[0].is_ready() for m in interval)
    shown.append((steps, ended))
    training_shown(self, steps, seconds, data_wait)

  def evaluated(self, record, test_envs):
    interval.clear()
    results(self, record, test_envs)

  monkeypatch.setattr(train_steps, "make_train_step",
                      lagging["make_lagging_step"])
  monkeypatch.setattr(evaluate.MetricMeter, "add", add_and_keep)
  monkeypatch.setattr(progress.Screen, "training", show)
  monkeypatch.setattr(progress.Screen, "results", evaluated)
  finished = run_here(_flags(tmp_path / "run"), capsys)
  assert finished.returncode == 0, finished.stderr
  assert len(shown) == STEPS
  assert all(steps <= ended for steps, ended in shown), shown
  # Every update but each interval's first shows a rate.
  assert sum(steps > 0 for steps, _ in shown) == STEPS - STEPS // FREQ
  # The loop waited for the device, which ran behind it.
  for record in read_records(tmp_path / "run"):
    assert record["device_wait_time"] > 0


# Prepended to a train command: the run sends itself SIG as it calls
# MODULE.FUNCTION.
_SIGNAL_ON_CALL = """\
import importlib, os
module = importlib.import_module("{module}")
function = module.{function}
def signal_and_call(*args, **kwargs):
  os.kill(os.getpid(), {sig})
  return function(*args, **kwargs)
module.{function} = signal_and_call
"""


@pytest.mark.parametrize("module, function", [
    ("experiments.data.pipeline", "make_train_iterator"),  # Setting up.
    ("experiments.training.steps", "compile_while_reading"),  # Compiling.
])
def test_a_signal_before_the_first_step_stops_there(tmp_path, module,
                                                     function):
  output_dir = tmp_path / "run"
  stopped = run_after(_SIGNAL_ON_CALL.format(
      module=module, function=function, sig=int(signal.SIGTERM)),
                      _command(output_dir))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  assert stopped.stderr.endswith(
      "stopped by SIGTERM; no checkpoint yet; rerun the same command to "
      "start again.\n"), stopped.stderr
  assert "Traceback" not in stopped.stderr
  assert "the first step ended" not in stopped.stderr
  assert not output_dir.exists() or not any(output_dir.iterdir())


def test_flags_that_cannot_run_are_usage_errors_before_any_work(
    tmp_path, capsys):
  a_file = tmp_path / "notes.txt"
  a_file.write_text("not weights, not a directory")
  empty = tmp_path / "empty"
  empty.mkdir()
  for flags, message in [
      # The output directory, before training rather than at its first
      # evaluation.
      (["--output_dir", str(a_file / "run")], f"{a_file} is a file"),
      (["--output_dir", str(a_file)], f"{a_file} is a file"),
      # Datasets that are not there.
      (["--dataset", "PACS", "--data_dir", str(empty)],
       f"PACS not found: {empty / 'PACS'} is not a directory"),
      (["--dataset", "RotatedMNIST", "--data_dir", str(empty)],
       'pip install -e ".[experiments,tfds-prepare]"'),
      # Weights that are not weights.
      (["--pretrained", str(a_file)],
       f"--pretrained: {str(a_file)!r} is not a .npz file"),
      (["--init_params", str(a_file)],
       f"--init_params: {str(a_file)!r} is not a .npz file"),
      # More devices than there are.
      (["--devices", "2"], "--devices 2: only 1 cpu device here. On a CPU, "
       "XLA_FLAGS=--xla_force_host_platform_device_count=2 before the "
       "command makes 2 devices of its cores."),
  ]:
    flags = [*FLAGS, *flags]
    if "--output_dir" not in flags:
      flags += ["--output_dir", str(tmp_path / "runs" / str(len(flags)))]
    assert train.main(flags) == 2, flags
    out, err = capsys.readouterr()
    assert message in err, (flags, err)
    assert out == ""
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes.txt"]


def test_the_compile_cache_is_the_users_unless_moved_or_off(monkeypatch,
                                                            tmp_path):
  monkeypatch.delenv(train.COMPILE_CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert train.compile_cache_path(None) == (
      tmp_path / "xdg" / "pgrad_jax" / "jax_cache")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert train.compile_cache_path(None) == (
      tmp_path / "home" / ".cache" / "pgrad_jax" / "jax_cache")
  monkeypatch.setenv(train.COMPILE_CACHE_ENV, str(tmp_path / "env"))
  assert train.compile_cache_path(None) == tmp_path / "env"
  assert train.compile_cache_path(str(tmp_path / "flag")) == (
      tmp_path / "flag")
  assert train.compile_cache_path("none") is None
  # Where runs execute, not what they compute: not in their identity.
  config = config_lib.parse_args(["--compile_cache_dir", "none"])
  assert config.identity() == config_lib.parse_args([]).identity()
  assert "compile_cache_dir" not in config.record_args()


def test_one_process_at_a_time_trains_a_run(reference, tmp_path, capsys):
  # As if another process trained there: this test holds the lock.
  output_dir = tmp_path / "run"
  output_dir.mkdir()
  flags = [*_flags(output_dir), "--num_workers", "0"]
  with claim.RunDirectoryLock(output_dir) as other:
    other.acquire()
    # A fresh run in a directory that exists (a sweep's) finds out before
    # it builds its model, which it says of once built.
    fresh = run_here(flags, capsys)
    assert fresh.returncode == 2, fresh.stderr
    # One line, the command's: not even the model's.
    assert fresh.stderr.splitlines() == [
        f"{config_lib.PROG}: error: {output_dir}: another process is "
        "training this run now. Wait for it to end, or stop it, then run "
        "the same command to go on from its last checkpoint."]
    assert sorted(p.name for p in output_dir.iterdir()) == [
        records.LOCK_FILE]
  # Released, as when the other process ends: the run trains.
  assert run_here(flags, capsys).returncode == 0
  assert _params(output_dir).keys() == _params(reference).keys()
  shutil.rmtree(output_dir / records.CHECKPOINT_DIR / str(STEPS))
  (output_dir / "done").unlink()
  files = sorted(p.name for p in output_dir.iterdir())
  with claim.RunDirectoryLock(output_dir) as other:
    other.acquire()
    # A run to resume, at once; and --overwrite deletes nothing from under
    # the other process.
    for extra in ([], ["--overwrite"]):
      refused = run_here([*flags, *extra], capsys)
      assert refused.returncode == 2, (extra, refused.stderr)
      assert "another process is training this run now" in refused.stderr
      assert sorted(p.name for p in output_dir.iterdir()) == files
  assert run_here(flags, capsys).returncode == 0
  assert (output_dir / "done").exists()


def test_a_compile_cache_the_user_names_must_be_writable(monkeypatch,
                                                        tmp_path):
  monkeypatch.delenv(train.COMPILE_CACHE_ENV, raising=False)
  # A directory under a file: no one can create it, root included.
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  assert train.checked_compile_cache(str(tmp_path / "cache")) == (
      tmp_path / "cache")
  assert (tmp_path / "cache").is_dir()
  assert train.checked_compile_cache("none") is None
  with pytest.raises(errors.UsageError,
                     match=r"--compile_cache_dir .*a_file/cache: cannot write "
                     r"the compilation cache there \(Not a directory\); pass "
                     "a writable --compile_cache_dir, or --compile_cache_dir "
                     "none"):
    train.checked_compile_cache(str(blocked / "cache"))
  monkeypatch.setenv(train.COMPILE_CACHE_ENV, str(blocked / "env"))
  with pytest.raises(errors.UsageError,
                     match=r"\$JAX_COMPILATION_CACHE_DIR .*a_file/env: cannot"):
    train.checked_compile_cache(None)


def test_a_run_without_a_writable_default_cache_says_so_once(tmp_path):
  # The default cache (no flag, no variable) in a home that cannot hold it,
  # as on a cluster's read-only home: the run trains, without a cache, and
  # says so once, rather than JAX warning of every program it cannot keep.
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  env = {k: v for k, v in os.environ.items()
         if k != train.COMPILE_CACHE_ENV}
  output_dir = tmp_path / "run"
  finished = subprocess.run(
      _command(output_dir), cwd=REPO, capture_output=True, text=True,
      check=False, env={**env, "XDG_CACHE_HOME": str(blocked)})
  assert finished.returncode == 0, finished.stderr
  assert finished.stderr.count(
      f"Warning: cannot write the compilation cache {blocked}") == 1
  assert "compilation cache entry" not in finished.stderr
  assert (output_dir / "done").exists()
  # A cache the user names is refused before the run writes anything.
  refused = subprocess.run(
      [*_command(tmp_path / "refused"), "--compile_cache_dir",
       str(blocked / "cache")], cwd=REPO, capture_output=True, text=True,
      check=False, env=env)
  assert refused.returncode == 2, refused.stderr
  assert "cannot write the compilation cache there" in refused.stderr
  assert "Traceback" not in refused.stderr
  assert not (tmp_path / "refused").exists()


def test_a_file_as_data_dir_is_refused_at_the_command_line(tmp_path):
  a_file = tmp_path / "data.zip"
  a_file.write_text("")
  refused = subprocess.run(
      _train_command(["--dataset", "PACS", "--data_dir", str(a_file),
                      "--output_dir", str(tmp_path / "run")]),
      cwd=REPO, capture_output=True, text=True, check=False)
  assert refused.returncode == 2
  assert refused.stderr.endswith(
      f"error: --data_dir {a_file} is a file; pass the directory that holds "
      "the datasets.\n")
  assert "Traceback" not in refused.stderr


def test_a_diverged_run_says_so(tmp_path, capsys):
  # No float32 model survives this lr: ERM's first Adam step moves every
  # param by about 1e30, and the next activations overflow.
  flags = _with_steps(FREQ)
  flags[flags.index("--hparams") + 1] = '{"batch_size": 6, "lr": 1e30}'
  flags += ["--algorithm", "ERM", "--output_dir", str(tmp_path)]
  finished = run_here(flags, capsys)
  assert finished.returncode == 0  # A result of the protocol, as DomainBed's.
  assert "Held-out accuracy" in finished.stdout
  assert (f"Warning: the model diverged: after {FREQ} steps its loss is not "
          f"finite on {NUM_DOMAINS} of its {NUM_DOMAINS} domains"
          in finished.stderr)
  # And again where the finished run is only reported.
  again = run_here(flags, capsys)
  assert "Already finished." in again.stderr
  assert "Warning: the model diverged" in again.stderr


def test_auto_lr_without_validation_examples_is_a_usage_error(tmp_path,
                                                              capsys):
  # A ten-thousandth of a digits domain is no example: refused as the run
  # resolves.
  output_dir = tmp_path / "run"
  refused = run_here([
      "--algorithm", "ERMPlusPlus", "--test_envs", "0", "--holdout_fraction",
      "0.0001", "--output_dir", str(output_dir), "--hparams",
      '{"auto_lr": true}'], capsys)
  assert refused.returncode == 2
  assert ("--holdout_fraction 0.0001 holds out no example of domains "
          "[1, 2, 3, 4, 5]") in refused.stderr
  assert "Traceback" not in refused.stderr
  assert not output_dir.exists()
