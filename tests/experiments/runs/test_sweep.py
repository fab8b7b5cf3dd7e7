"""The sweep's runs, launching and resuming, with a stand-in training script."""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shlex
import signal
import socket
import sys
import textwrap
import threading

import numpy as np
import pytest

from experiments import catalog
from experiments import train
from experiments.runs import records
from experiments.runs import rerun
from experiments.runs import sweep

# The steps that a held run has trained (see FAKE_TRAIN).
HOLD_STEP = 3

# Stands in for experiments.train: records each launch (its flags, the GPUs
# it sees, its process ids, and whether another run held its GPU), fails
# for hparams_seed 3, and otherwise trains --steps steps, resuming from the
# steps a previous launch wrote to "progress". SIGTERM stops it after the
# current step, as a preempted run. The first launch of the run whose output
# directory is FAKE_HOLD waits after step HOLD_STEP until SIGTERM (or
# SIGKILL), so that a test acts on a run mid-training whatever the machine's
# speed, and says so with a datagram to FAKE_NOTIFY (`held_run_notices`).
# SIGTERM is blocked and read from the pending signals: the held run sleeps
# in sigwait, and no signal can slip between a check and the wait. A run on
# a GPU holds a file of that GPU's, created exclusively, while it trains:
# finding it there means two runs shared the GPU.
FAKE_TRAIN = textwrap.dedent("""\
    import argparse, json, os, pathlib, signal, socket, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir")
    parser.add_argument("--hparams_seed", type=int)
    parser.add_argument("--steps", type=int, default=1)
    args, _ = parser.parse_known_args()
    out = pathlib.Path(args.output_dir)
    progress = out / "progress"
    start = int(progress.read_text()) if progress.exists() else 0
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_mark = None if gpu is None else pathlib.Path(GPU_MARKS) / f"gpu-{gpu}"
    gpu_shared = False
    if gpu_mark is not None:
      try:
        os.close(os.open(gpu_mark, os.O_CREAT | os.O_EXCL))
      except FileExistsError:
        gpu_shared, gpu_mark = True, None
    with open(out / "launches", "a") as f:
      f.write(json.dumps({
          "argv": sys.argv[1:], "start": start, "pid": os.getpid(),
          "ppid": os.getppid(), "gpu": gpu,
          "gpu_shared": gpu_shared}) + "\\n")
    def leave(status=None):
      if gpu_mark is not None:
        gpu_mark.unlink()
      sys.exit(status)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if args.hparams_seed == 3:
      leave("failed on purpose")
    hold = os.environ.get("FAKE_HOLD") == str(out) and start == 0
    for step in range(start, args.steps):
      if hold and step == {hold_step}:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notice:
          notice.sendto(b"held", "\\0" + os.environ["FAKE_NOTIFY"])
        held = signal.sigwait({signal.SIGTERM})
      else:
        held = False
      progress.write_text(str(step + 1))
      if held or signal.SIGTERM in signal.sigpending():
        (out / "stopped").write_text(str(step + 1))
        leave(143)
    (out / "results.jsonl").write_text('{"step": 7}\\n')
    (out / "done").write_text("")
    leave()
""").replace("{hold_step}", str(HOLD_STEP))


@pytest.fixture
def train_command(tmp_path):
  script = tmp_path / "fake_train.py"
  marks = tmp_path / "gpu_marks"
  marks.mkdir()
  script.write_text(f"GPU_MARKS = {str(marks)!r}\n{FAKE_TRAIN}")
  return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


@pytest.fixture(name="held_run_notices")
def fixture_held_run_notices(monkeypatch):
  """A socket that the held run (FAKE_HOLD) sends a datagram to once it is
  held, FAKE_NOTIFY naming its abstract address."""
  name = f"pgrad-sweep-test-{os.getpid()}-{os.urandom(8).hex()}"
  with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notices:
    notices.bind("\0" + name)
    monkeypatch.setenv("FAKE_NOTIFY", name)
    yield notices


def wait_for_notice(notices, timeout_s=120):
  """Blocks until the held run sends its datagram, and returns it; the
  timeout only stops a hung test."""
  notices.settimeout(timeout_s)
  try:
    return notices.recv(64)
  except TimeoutError:
    pytest.fail("the held run sent nothing")


def sweep_flags(output_dir, n_hparams=3):
  return ["--datasets", "ColoredDigits", "--algorithms", "ERM", "PGrad",
          "--test_envs", "1", "--n_hparams", str(n_hparams), "--n_trials", "1",
          "--steps", "7", "--output_dir", str(output_dir)]


def launches(run):
  """What each launch of ``run``'s training recorded."""
  path = run.output_dir / "launches"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


def flag(argv, name):
  return argv[argv.index(name) + 1]


def test_seed_hash_is_deterministic_and_distinct():
  seed = sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert seed == sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert 0 <= seed < 2**31
  assert seed != sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 1)


def test_make_runs_holds_out_every_domain_by_default(tmp_path):
  kwargs = dict(output_dir=tmp_path, datasets=["ColoredDigits"],
                algorithms=["ERM", "PGrad"], n_hparams=2, n_trials=3)
  runs = sweep.make_runs(**kwargs)
  # 3 domains x 2 algorithms x 2 hparam draws x 3 trials.
  assert len(runs) == 36
  assert {tuple(r.args["test_envs"]) for r in runs} == {(0,), (1,), (2,)}
  assert len({r.output_dir for r in runs}) == 36
  assert len({r.args["seed"] for r in runs}) == 36
  assert all(r.output_dir.parent == tmp_path for r in runs)
  # The directories depend on the arguments only.
  assert [r.output_dir for r in sweep.make_runs(**kwargs)] == [
      r.output_dir for r in runs]
  longer = sweep.make_runs(**kwargs, steps=100)
  assert not {r.output_dir for r in longer} & {r.output_dir for r in runs}
  stopping = sweep.make_runs(**kwargs, steps=100, plateau_check_freq=50)
  assert all(r.args["plateau_check_freq"] == 50 for r in stopping)
  assert "plateau_check_freq" not in runs[0].args
  command = stopping[0].command("train")
  assert command[command.index("--plateau_check_freq") + 1] == "50"
  assert not {r.output_dir for r in stopping} & {r.output_dir for r in longer}


def test_command_passes_every_flag():
  run = sweep.Run.create(
      {"dataset": "ColoredDigits", "algorithm": "PGrad", "test_envs": [2],
       "hparams_seed": 1, "trial_seed": 0, "seed": 5, "hparams": '{"lr": 1}',
       "model": "resnet18"},
      "sweep")
  command = run.command("python -m experiments.train", data_dir="data",
                        num_workers=3)
  assert command[:3] == ["python", "-m", "experiments.train"]
  flags = dict(zip(command[3::2], command[4::2]))
  assert flags == {
      "--algorithm": "PGrad", "--data_dir": "data",
      "--dataset": "ColoredDigits",
      "--hparams": '{"lr": 1}', "--hparams_seed": "1", "--model": "resnet18",
      "--num_workers": "3",
      "--output_dir": str(run.output_dir), "--seed": "5", "--test_envs": "2",
      "--trial_seed": "0"}


def test_model_names_runs_and_num_workers_does_not(tmp_path, train_command):
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command]
  plain = sweep.runs_for(sweep.parse_args(flags))
  resnet = sweep.runs_for(sweep.parse_args(flags + ["--model", "resnet18"]))
  assert [r.args["model"] for r in resnet] == ["resnet18"] * 2
  assert not {r.output_dir for r in plain} & {r.output_dir for r in resnet}
  assert sweep.runs_for(sweep.parse_args(
      flags + ["--num_workers", "5"]))[0].output_dir == plain[0].output_dir

  assert sweep.main(flags + ["--model", "resnet18", "--num_workers", "5"]) == 0
  argv = launches(resnet[0])[0]["argv"]
  assert (flag(argv, "--model"), flag(argv, "--num_workers")) == (
      "resnet18", "5")
  # By default the runs at once split this host's cores; the plain runs are
  # another sweep, in another directory.
  flags = sweep_flags(tmp_path / "plain", n_hparams=1) + [
      "--train_command", train_command]
  plain = sweep.runs_for(sweep.parse_args(flags))
  assert sweep.main(flags + ["--jobs", "2"]) == 0
  cores = len(os.sched_getaffinity(0))
  assert flag(launches(plain[0])[0]["argv"], "--num_workers") == str(
      cores // 2)
  with pytest.raises(SystemExit, match="2"):
    sweep.parse_args(flags + ["--model", "nope"])


def test_launch_skips_done_runs_and_resumes_the_others(tmp_path, train_command):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 6
  done, incomplete = runs[0], runs[1]
  done.output_dir.mkdir()
  (done.output_dir / "results.jsonl").write_text('{"step": 7}\n')
  (done.output_dir / "done").write_text("")
  incomplete.output_dir.mkdir()
  assert [r.status for r in runs[:3]] == [
      sweep.Status.DONE, sweep.Status.INCOMPLETE, sweep.Status.NOT_STARTED]

  assert sweep.main(flags + ["--jobs", "2"]) == 0
  assert launches(done) == []
  assert all(len(launches(r)) == 1 for r in runs[1:])
  assert all(r.status is sweep.Status.DONE for r in runs)
  argv = launches(runs[2])[0]["argv"]
  assert flag(argv, "--steps") == "7"
  assert flag(argv, "--output_dir") == str(runs[2].output_dir)

  # A restarted sweep has nothing left to do.
  assert sweep.main(flags) == 0
  assert all(len(launches(r)) == 1 for r in runs[1:])


def test_failed_runs_stay_incomplete_and_can_be_deleted(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=4)
  # hparams_seed 3 fails, for both algorithms.
  assert sweep.main(flags + ["--train_command", train_command]) == 1
  assert "8 runs: 6 done, 2 incomplete, 0 not started" in (
      capsys.readouterr().out)

  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out.splitlines()
  incomplete = [line for line in listing if line.startswith("incomplete")]
  assert len(incomplete) == 2
  assert all("hparams_seed=3" in line for line in incomplete)

  assert sweep.main(["delete_incomplete", "--yes"] + flags) == 0
  assert sweep.main(["list"] + flags) == 0
  assert "8 runs: 6 done, 0 incomplete, 2 not started" in (
      capsys.readouterr().out)


def test_damaged_runs_are_neither_done_nor_launched_and_say_why(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  damaged = runs[0]
  damaged.output_dir.mkdir()
  # Finished, but its records reordered.
  (damaged.output_dir / "results.jsonl").write_text(
      '{"step": 7}\n{"step": 5}\n')
  (damaged.output_dir / "done").write_text("")
  assert damaged.status is sweep.Status.DAMAGED

  assert sweep.main(flags) == 1
  out, err = capsys.readouterr()
  assert launches(damaged) == []
  assert all(len(launches(r)) == 1 for r in runs[1:])
  assert "6 runs: 5 done, 0 incomplete, 0 not started, 1 damaged" in out
  assert (f"Skipped {damaged.output_dir}, its records damaged: "
          f"{damaged.output_dir / 'results.jsonl'} (a finished run): line 2 "
          "is of step 5, after step 7") in err
  assert "delete_incomplete deletes it" in err

  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out
  assert listing.startswith(f"damaged      {damaged.output_dir}")
  assert sweep.main(["delete_incomplete", "--yes"] + flags) == 0
  assert not damaged.output_dir.exists()
  assert sweep.main(flags) == 0
  assert len(launches(damaged)) == 1


def test_fixed_hparams_reach_only_the_algorithms_that_have_them(tmp_path):
  runs = sweep.make_runs(
      output_dir=tmp_path, datasets=["ColoredDigits"],
      algorithms=["ERM", "Fishr"], n_hparams=1, n_trials=1, test_envs=[0],
      hparams='{"cnn_width": 8, "penalty_anneal_iters": 50}')
  by_algorithm = {r.args["algorithm"]: json.loads(r.args["hparams"])
                  for r in runs}
  assert by_algorithm == {
      "ERM": {"cnn_width": 8},
      "Fishr": {"cnn_width": 8, "penalty_anneal_iters": 50}}
  with pytest.raises(ValueError, match="No swept algorithm has.*'nope'"):
    sweep.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                    algorithms=["ERM"], n_hparams=1, n_trials=1,
                    hparams='{"nope": 1}')


@pytest.mark.parametrize("hparams, message", [
    ('{"lr": 1', "--hparams is not valid JSON"),
    ("[1]", "--hparams must be a JSON object"),
    ('{"nope": 1}', "No swept algorithm has the hparams ['nope']"),
])
def test_bad_fixed_hparams_are_usage_errors(tmp_path, capsys, hparams, message):
  assert sweep.main(sweep_flags(tmp_path) + ["--hparams", hparams]) == 2
  assert message in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


def test_sweep_saves_trajectories_of_default_runs_only(tmp_path):
  runs = sweep.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                         algorithms=["ERM", "Fish"], n_hparams=2, n_trials=1,
                         test_envs=[0], trajectory_freq=5)
  saved = {(r.args["algorithm"], r.args["hparams_seed"])
           for r in runs if "trajectory_freq" in r.args}
  assert saved == {("ERM", 0)}


def test_make_runs_counts_domains_in_the_catalog_without_data(tmp_path):
  # Neither dataset's data is here; DomainBed's sweep holds out its 6 and 4
  # ENVIRONMENTS in turn.
  runs = sweep.make_runs(output_dir=tmp_path,
                         datasets=["RotatedMNIST", "TerraIncognita"],
                         algorithms=["ERM"], n_hparams=1, n_trials=1)
  assert [(r.args["dataset"], r.args["test_envs"]) for r in runs] == [
      ("RotatedMNIST", [env]) for env in range(6)] + [
          ("TerraIncognita", [env]) for env in range(4)]


def check_one_run_per_gpu(runs, gpus):
  """Each run saw one of ``gpus`` alone, every GPU trained, and no two runs
  were on one GPU at once (none found its GPU's file held, FAKE_TRAIN)."""
  used = set()
  for run in runs:
    (launch,) = launches(run)
    assert launch["gpu"] in gpus
    assert flag(launch["argv"], "--num_workers") == str(
        len(os.sched_getaffinity(0)) // len(gpus))
    assert not launch["gpu_shared"], launch
    used.add(launch["gpu"])
  assert used == set(gpus)


def test_multi_gpu_runs_one_run_per_gpu_at_a_time(
    tmp_path, train_command, monkeypatch, capsys):
  flags = sweep_flags(tmp_path, n_hparams=2) + [
      "--train_command", train_command, "--launcher", "multi_gpu"]
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 4
  assert sweep.main(flags + ["--gpus", "0,1"]) == 0
  check_one_run_per_gpu(runs, ["0", "1"])

  capsys.readouterr()
  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out.splitlines()
  for run in runs:
    (line,) = [line for line in listing if str(run.output_dir) in line]
    pid, gpu = launches(run)[0]["pid"], launches(run)[0]["gpu"]
    assert line.startswith("done")
    assert line.endswith(
        f"[multi_gpu on {socket.gethostname()} GPU {gpu} pid {pid}]")


def test_multi_gpu_takes_the_gpus_cuda_visible_devices_lists(
    tmp_path, train_command, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5a,")  # A trailing comma.
  flags = sweep_flags(tmp_path, n_hparams=2) + [
      "--train_command", train_command, "--launcher", "multi_gpu"]
  assert sweep.main(flags) == 0
  check_one_run_per_gpu(sweep.runs_for(sweep.parse_args(flags)),
                        ["3", "GPU-5a"])


def test_multi_gpu_without_gpus_is_a_usage_error(
    tmp_path, train_command, monkeypatch, capsys):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command,
                                   "--launcher", "multi_gpu"]
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  assert sweep.main(flags) == 2
  assert "CUDA_VISIBLE_DEVICES is empty" in capsys.readouterr().err
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  monkeypatch.setenv("PATH", str(tmp_path))  # No nvidia-smi.
  assert sweep.main(flags) == 2
  assert "found no GPU" in capsys.readouterr().err
  assert not any(launches(run) for run in sweep.runs_for(
      sweep.parse_args(flags)))


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus: only with --launcher multi_gpu"),
    (["--slurm_time", "5"], "--slurm_time: only with --launcher slurm"),
    (["--launcher", "multi_gpu", "--jobs", "2"], "--jobs: only with"),
    (["--num_workers", "-1"], "--num_workers must be >= 0"),
    (["--step_ms", "3"], "cost needs --step_ms"),
])
def test_launcher_flags_are_checked(tmp_path, capsys, flags, message):
  with pytest.raises(SystemExit, match="2"):
    sweep.main(sweep_flags(tmp_path) + flags)
  assert message in capsys.readouterr().err


def test_slurm_without_sbatch_is_a_usage_error(
    tmp_path, train_command, monkeypatch, capsys):
  monkeypatch.setenv("PATH", str(tmp_path))  # No sbatch.
  flags = sweep_flags(tmp_path) + ["--train_command", train_command,
                                   "--launcher", "slurm"]
  assert sweep.main(flags) == 2
  assert "--slurm_cluster local" in capsys.readouterr().err
  assert not (tmp_path / sweep.SUBMITIT_DIR).exists()


def slurm_flags(output_dir, train_command, n_hparams):
  """A sweep of ``2 * n_hparams`` runs through submitit's local executor."""
  return sweep_flags(output_dir, n_hparams=n_hparams) + [
      "--train_command", train_command, "--launcher", "slurm",
      "--slurm_cluster", "local", "--slurm_gpus_per_job", "0"]


def test_slurm_sweep_finishes_and_lists_its_jobs(
    tmp_path, train_command, capsys):
  flags = slurm_flags(tmp_path, train_command, n_hparams=2)
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert sweep.main(flags) == 0
  assert all(r.status is sweep.Status.DONE for r in runs)
  assert all(len(launches(r)) == 1 for r in runs)

  capsys.readouterr()
  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out.splitlines()
  job_ids = set()
  for run in runs:
    record = run.launch_record
    (line,) = [line for line in listing if str(run.output_dir) in line]
    assert line.startswith("done")
    assert line.endswith(
        f"[slurm job {record['job_id']} on {socket.gethostname()} pid "
        f"{launches(run)[0]['pid']} log {record['stdout']} "
        f"{record['stderr']}]")
    # The job's own log, submitit's, says it ran.
    assert "Job completed successfully" in open(record["stdout"]).read()
    job_ids.add(record["job_id"])
  assert len(job_ids) == 4
  # Nothing is submitted again.
  assert sweep.main(flags) == 0
  assert all(len(launches(r)) == 1 for r in runs)


def run_in_thread(function, *args):
  """Starts ``function(*args)``; returns the thread and what it returns."""
  result = []
  thread = threading.Thread(target=lambda: result.append(function(*args)))
  thread.start()
  return thread, result


def start_held_slurm_sweep(tmp_path, train_command, monkeypatch, notices,
                           steps):
  """A 2-run slurm sweep of ``steps`` fake steps launched in a thread, once
  its first run is held after `HOLD_STEP` steps; its flags, runs, thread and
  result."""
  flags = slurm_flags(tmp_path, train_command, n_hparams=1) + [
      "--steps", str(steps)]
  runs = sweep.runs_for(sweep.parse_args(flags))
  monkeypatch.setenv("FAKE_HOLD", str(runs[0].output_dir))
  thread, result = run_in_thread(sweep.main, flags)
  assert wait_for_notice(notices) == b"held"
  assert int((runs[0].output_dir / "progress").read_text()) == HOLD_STEP
  return flags, runs, thread, result


@pytest.mark.slow
def test_slurm_preempted_job_is_requeued_and_resumes(
    tmp_path, train_command, monkeypatch, held_run_notices):
  _, runs, thread, result = start_held_slurm_sweep(
      tmp_path, train_command, monkeypatch, held_run_notices, steps=30)
  # SLURM's warning of preemption, to the job's process (the training's
  # parent); SLURM then requeues the job, as the local executor does.
  os.kill(launches(runs[0])[0]["ppid"], signal.SIGUSR2)
  thread.join(timeout=120)
  assert result == [0]
  first, second = launches(runs[0])
  # The signal came while it was held: it stopped after the next step.
  stopped_at = int((runs[0].output_dir / "stopped").read_text())
  assert stopped_at == HOLD_STEP + 1
  assert second["start"] == stopped_at
  assert first["ppid"] != second["ppid"]  # Another job process.
  assert all(r.status is sweep.Status.DONE for r in runs)
  assert len(launches(runs[1])) == 1


@pytest.mark.slow
def test_slurm_killed_job_resumes_when_submitted_again(
    tmp_path, train_command, monkeypatch, held_run_notices, capsys):
  flags, runs, thread, result = start_held_slurm_sweep(
      tmp_path, train_command, monkeypatch, held_run_notices, steps=20)
  os.kill(launches(runs[0])[0]["pid"], signal.SIGKILL)
  thread.join(timeout=120)
  assert result == [1]
  assert f"Failed (see {runs[0].log_file})" in capsys.readouterr().out
  assert runs[0].status is sweep.Status.INCOMPLETE
  killed_at = int((runs[0].output_dir / "progress").read_text())

  assert sweep.main(flags) == 0
  first, second = launches(runs[0])
  assert second["start"] == killed_at == HOLD_STEP
  assert all(r.status is sweep.Status.DONE for r in runs)
  assert len(launches(runs[1])) == 1


def test_a_run_training_on_this_host_is_not_launched_again(
    tmp_path, train_command, monkeypatch, held_run_notices, capsys):
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command, "--steps", "30"]
  runs = sweep.runs_for(sweep.parse_args(flags))
  monkeypatch.setenv("FAKE_HOLD", str(runs[0].output_dir))
  process = runs[0].start(train_command)
  runs[0].record_launch(launcher="local", host=socket.gethostname(),
                        pid=process.pid)
  try:
    assert wait_for_notice(held_run_notices) == b"held"
    assert sweep.main(flags + ["--steps", "30"]) == 0
    assert (f"Skipped {runs[0].output_dir}: its training process "
            f"{process.pid} runs on this host") in capsys.readouterr().err
    assert len(launches(runs[0])) == 1
  finally:
    process.kill()
    process.wait()
  assert not runs[0].training_here()


def test_cost_counts_every_runs_steps(tmp_path, capsys):
  flags = ["cost", "--datasets", "PACS", "DomainNet", "--algorithms", "ERM",
           "--n_hparams", "2", "--n_trials", "1", "--output_dir",
           str(tmp_path), "--step_ms", "100", "--gpu_counts", "1", "3"]
  assert sweep.main(flags) == 0
  # The catalog's steps: PACS's 4 held-out domains x 2 draws, DomainNet's 6.
  steps = {d: catalog.DATASETS[d].steps for d in ("PACS", "DomainNet")}
  hours = {d: s * 0.1 / 3600 for d, s in steps.items()}
  total = 8 * hours["PACS"] + 12 * hours["DomainNet"]
  # On 3 GPUs, longest first: 4 DomainNet runs each, then PACS's 8 runs
  # over the three, 3 + 3 + 2.
  three = 4 * hours["DomainNet"] + 3 * hours["PACS"]
  out = capsys.readouterr().out
  assert out == (
      f"20 runs, {8 * steps['PACS'] + 12 * steps['DomainNet']:,} training "
      f"steps at 100 ms a step: {total:.1f} GPU-hours (training steps "
      f"only).\n  on 1 GPU: {total:.1f} h\n  on 3 GPUs: {three:.1f} h\n")
  assert math.isclose(three, total / 3, rel_tol=0.1)
  assert sweep.main(flags + ["--datasets", "FMoW"]) == 2
  assert "FMoW trains for epochs" in capsys.readouterr().err


# Small evaluations, for the real training runs.
TRAIN_FLAGS = "--eval_examples 16 --eval_batch_size 16 --loss_examples 8"


# experiments.train, whose run in FAKE_HOLD sends a datagram to FAKE_NOTIFY
# as it takes its NOTIFY_STEP-th step (`training.MetricMeter.add` sums each
# step's metrics), so that a test acts on it mid-training.
TRAIN_NOTIFYING = textwrap.dedent("""\
    import os, socket, sys
    from experiments import train, training
    NOTIFY_STEP = {notify_step}
    add, steps = training.MetricMeter.add, []
    def add_and_notify(self, metrics):
      add(self, metrics)
      steps.append(1)
      output_dir = sys.argv[sys.argv.index("--output_dir") + 1]
      if len(steps) == NOTIFY_STEP and output_dir == os.environ["FAKE_HOLD"]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notice:
          try:
            notice.sendto(b"step", "\\0" + os.environ["FAKE_NOTIFY"])
          except OSError:  # A resumed run's: the test listens no more.
            pass
    training.MetricMeter.add = add_and_notify
    sys.exit(train.main())
""")


@pytest.mark.slow
def test_slurm_sweep_of_real_training_resumes_a_preempted_run_exactly(
    tmp_path, monkeypatch, held_run_notices):
  # Preempted after its checkpoint at step 20, as it takes step 25 (the
  # steps after it are fast, their evaluations not).
  script = tmp_path / "train_notifying.py"
  script.write_text(TRAIN_NOTIFYING.format(notify_step=25))
  # The script imports experiments, which runs from the checkout: Python
  # puts the script's folder on the path, not the working directory.
  checkout = str(pathlib.Path(__file__).resolve().parents[3])
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      filter(None, [checkout, os.environ.get("PYTHONPATH")])))
  # The sweep passes the rest of each run's flags.
  train_command = (f"{shlex.quote(sys.executable)} "
                   f"{shlex.quote(str(script))} {TRAIN_FLAGS}")
  flags = slurm_flags(tmp_path / "sweep", train_command, n_hparams=1) + [
      "--algorithms", "ERM", "--n_trials", "2", "--steps", "60",
      "--checkpoint_freq", "20", "--hparams", '{"batch_size": 6}']
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 2
  monkeypatch.setenv("FAKE_HOLD", str(runs[0].output_dir))
  thread, result = run_in_thread(sweep.main, flags)
  assert wait_for_notice(held_run_notices, timeout_s=300) == b"step"
  # The job's process is the training process's parent.
  training = runs[0].launch_record["pid"]
  job = int(open(f"/proc/{training}/stat").read().rsplit(")", 1)[1].split()[1])
  os.kill(job, signal.SIGUSR2)
  thread.join(timeout=600)
  assert result == [0]
  # Stopped by the job's checkpoint, requeued, and resumed.
  assert "Requeued job" in open(runs[0].launch_record["stdout"]).read()
  assert "Resuming from step" in runs[0].log_file.read_text()

  # Trained straight through in this process, with the sweep's flags: a
  # subprocess would import JAX, Flax and Orbax once more.
  reference = tmp_path / "reference"
  command = runs[0].command(TRAIN_FLAGS)
  command[command.index("--output_dir") + 1] = str(reference)
  assert train.main(command) == 0
  straight, resumed = (reference, runs[0].output_dir)
  assert rerun.first_difference(records.read_run(straight).records,
                                records.read_run(resumed).records) is None
  with np.load(straight / records.FINAL_PARAMS_FILE) as expected, np.load(
      resumed / records.FINAL_PARAMS_FILE) as got:
    assert expected.files == got.files
    for key in expected.files:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def test_a_run_whose_slurm_job_is_queued_is_not_submitted_again(
    tmp_path, train_command, monkeypatch, capsys):
  # Stands in for SLURM's sacct (what submitit asks, with --parsable2): job
  # 4242's array task 0 is pending, task 1 has failed.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sacct").write_text(
      "#!/bin/sh\necho 'JobID|State|NodeList'\n"
      "echo '4242_0|PENDING|None assigned'\necho '4242_1|FAILED|node3'\n")
  (bin_dir / "sacct").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  flags = sweep_flags(tmp_path / "sweep", n_hparams=1) + [
      "--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  for task, run in enumerate(runs):
    run.record_launch(launcher="slurm", cluster="slurm",
                      folder=str(tmp_path / "submitit" / "%j"),
                      job_id=f"4242_{task}", stdout="out", stderr="err")
  assert sweep.slurm_states(runs) == {"4242_0": "PENDING",
                                      "4242_1": "FAILED"}

  assert sweep.main(flags) == 0
  assert (f"Skipped {runs[0].output_dir}: its SLURM job 4242_0 is PENDING"
          in capsys.readouterr().err)
  assert launches(runs[0]) == []
  assert len(launches(runs[1])) == 1


def test_photo_sweep_fetches_imagenet_weights_once_before_any_run(
    tmp_path, train_command, monkeypatch, capsys):
  # Nothing listens on the weights' URL: the sweep stops before any run
  # starts, with the download's message, instead of failing every run.
  # pylint: disable-next=import-outside-toplevel
  from experiments.weights import imagenet
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  monkeypatch.setenv(imagenet.URL_VARIABLE, f"http://127.0.0.1:{port}/m")
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
  flags = ["--datasets", "PACS", "--algorithms", "ERM", "--test_envs", "0",
           "--n_hparams", "1", "--n_trials", "2", "--steps", "1",
           "--output_dir", str(tmp_path / "sweep"),
           "--train_command", train_command]
  assert sweep.main(["launch", *flags]) == 2
  error = capsys.readouterr().err
  assert "resnet50-0676ba61.pth" in error and "--pretrained none" in error
  assert not (tmp_path / "sweep").exists()
  # Once the file is cached the runs train, and nothing is downloaded again.
  cached = tmp_path / "cache" / "resnet50-0676ba61.pth"
  assert not list(cached.parent.glob("*"))  # The failed download left none.
  # A file placed there is checked against its name's hash: one that does
  # not check stops the sweep; one of a name of its own hash is used.
  cached.write_bytes(b"cached")
  assert sweep.main(["launch", *flags]) == 2
  assert "experiments.weights fetch resnet50" in capsys.readouterr().err
  cached = cached.rename(cached.with_name(
      f"resnet50-{hashlib.sha256(b'cached').hexdigest()[:8]}.pth"))
  monkeypatch.setitem(catalog.MODELS, "resnet50", dataclasses.replace(
      catalog.MODELS["resnet50"], imagenet_weights=cached.name))
  assert sweep.main(["launch", *flags]) == 0
  assert cached.read_bytes() == b"cached"
  runs = sweep.runs_for(sweep.parse_args(["list", *flags]))
  assert [len(launches(run)) for run in runs] == [1, 1]
  # A digits sweep fetches nothing.
  assert sweep.fetch_weights(sweep.make_runs(
      output_dir=tmp_path / "digits", datasets=["ColoredDigits"],
      algorithms=["ERM"], n_hparams=1, n_trials=1)) == []


def test_launch_saves_its_grid_and_the_directory_alone_names_the_sweep(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  assert sweep.main(flags) == 0
  assert json.loads((tmp_path / sweep.GRID_FILE).read_text()) == {
      **sweep.GRID_DEFAULTS, "datasets": ["ColoredDigits"],
      "algorithms": ["ERM", "PGrad"], "test_envs": [1], "n_hparams": 3,
      "n_trials": 1, "steps": 7}
  runs = sweep.runs_for(sweep.parse_args(flags))
  capsys.readouterr()
  alone = ["--output_dir", str(tmp_path)]
  assert sweep.main(["list", *alone]) == 0
  out = capsys.readouterr().out
  assert "6 runs: 6 done, 0 incomplete, 0 not started" in out
  assert all(str(run.output_dir) in out for run in runs)
  # Launched again from the directory alone, it has nothing to do.
  assert sweep.main(["launch", *alone, "--train_command", train_command]) == 0
  assert all(len(launches(run)) == 1 for run in runs)
  # The algorithms in another order are the same grid.
  assert sweep.main(["list", *alone, "--algorithms", "PGrad", "ERM"]) == 0


def test_a_directory_without_a_grid_is_not_listed_as_the_default_sweep(
    tmp_path, capsys):
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 2
  error = capsys.readouterr().err
  assert sweep.GRID_FILE in error and "--datasets" in error
  assert "10800" not in error


@pytest.mark.parametrize("command", ["list", "launch", "delete_incomplete"])
def test_flags_that_contradict_the_saved_grid_exit_2_naming_them(
    tmp_path, train_command, capsys, command):
  sweep_dir = tmp_path / "sweep"
  flags = sweep_flags(sweep_dir) + ["--train_command", train_command]
  assert sweep.main(flags) == 0
  capsys.readouterr()
  assert sweep.main([command, "--output_dir", str(sweep_dir), "--n_trials",
                     "2", "--steps", "8", "--train_command", train_command,
                     "--yes"]) == 2
  error = capsys.readouterr().err
  assert "--n_trials 2 (the grid has --n_trials 1)" in error
  assert "--steps 8 (the grid has --steps 7)" in error
  assert "--extend_grid" in error
  assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == sorted(
      r.output_dir.name for r in sweep.runs_for(sweep.parse_args(flags)))


def test_extend_grid_adds_runs_and_saves_the_larger_grid(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command]
  assert sweep.main(flags) == 0
  alone = ["--output_dir", str(tmp_path), "--train_command", train_command]
  assert sweep.main(["launch", *alone, "--n_hparams", "3",
                     "--extend_grid"]) == 0
  assert json.loads((tmp_path / sweep.GRID_FILE).read_text())[
      "n_hparams"] == 3
  capsys.readouterr()
  assert sweep.main(["list", *alone]) == 0
  assert "6 runs: 6 done" in capsys.readouterr().out
  # Fewer draws, or other steps, would leave runs of the grid out.
  for shrink in (["--n_hparams", "2"], ["--steps", "8"]):
    assert sweep.main(["launch", *alone, *shrink, "--extend_grid"]) == 2
    assert "would leave out" in capsys.readouterr().err
  assert json.loads((tmp_path / sweep.GRID_FILE).read_text())[
      "n_hparams"] == 3


@pytest.fixture(name="terminal_input")
def fixture_terminal_input(monkeypatch):
  """Makes a pseudo-terminal this process's stdin; yields a function that
  types a line into it."""
  leader, follower = os.openpty()
  with os.fdopen(follower, "r") as stdin:
    monkeypatch.setattr(sys, "stdin", stdin)
    yield lambda line: os.write(leader, line.encode() + b"\n")
  os.close(leader)


@pytest.mark.parametrize("answer, launched", [("n", False), ("y", True)])
def test_launch_on_a_terminal_asks_first(
    tmp_path, train_command, capsys, terminal_input, answer, launched):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  terminal_input(answer)
  assert sweep.main(flags) == (0 if launched else 1)
  assert "Launch 6 runs of 6? (y/n)" in capsys.readouterr().out
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert all(bool(launches(run)) == launched for run in runs)
  # Nothing declined is saved either.
  assert (tmp_path / sweep.GRID_FILE).exists() == launched


def test_skip_confirmation_launches_on_a_terminal_without_asking(
    tmp_path, train_command, capsys, terminal_input):
  del terminal_input  # Nothing is typed: a question would wait forever.
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  assert sweep.main(flags + ["--skip_confirmation"]) == 0
  assert "(y/n)" not in capsys.readouterr().out


def test_usage_names_the_command_to_run(capsys):
  with pytest.raises(SystemExit, match="2"):
    sweep.parse_args(["list", "--output_dir", "x", "--n_trials", "many"])
  assert capsys.readouterr().err.startswith(
      "usage: python -m experiments.runs.sweep ")


def test_slurm_local_on_a_host_without_gpus_names_none(
    tmp_path, train_command, capsys):
  # --slurm_gpus_per_job left at its default, 1.
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command, "--launcher", "slurm",
      "--slurm_cluster", "local"]
  assert sweep.main(flags) == 0
  submitted = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("Submitted")]
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert sorted(submitted) == sorted(
      f"Submitted SLURM job {run.launch_record['job_id']}: {run.output_dir}  "
      f"{run.label}" for run in runs)
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 0
  listing = capsys.readouterr().out
  gpus = sweep.nvidia_gpu_count()
  assert ("GPU 0" in listing) == (gpus > 0)
  assert all(launches(run)[0]["gpu"] == ("0" if gpus else "")
             for run in runs)
