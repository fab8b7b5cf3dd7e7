"""The sweep's command line: launching, resuming, deleting, costing and
asking, with a stand-in training script."""

import dataclasses
import hashlib
import json
import math
import os
import shlex
import socket
import sys
import textwrap

import pytest

from experiments import catalog
from experiments.runs import grid
from experiments.runs import run as run_lib
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
      run_lib.Status.DONE, run_lib.Status.INCOMPLETE,
      run_lib.Status.NOT_STARTED]

  assert sweep.main(flags + ["--jobs", "2"]) == 0
  assert launches(done) == []
  assert all(len(launches(r)) == 1 for r in runs[1:])
  assert all(r.status is run_lib.Status.DONE for r in runs)
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
  assert damaged.status is run_lib.Status.DAMAGED

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
           "--train_command", train_command,
           "--data_dir", str(tmp_path / "data")]
  # Missing data are said first: they, not a download, are what to fix.
  assert sweep.main(["launch", *flags]) == 2
  error = capsys.readouterr().err
  assert f"PACS not found: {tmp_path / 'data' / 'PACS'}" in error
  assert "resnet50" not in error
  (tmp_path / "data" / "PACS").mkdir(parents=True)  # The stand-in reads none.
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
  assert sweep.fetch_weights(grid.make_runs(
      output_dir=tmp_path / "digits", datasets=["ColoredDigits"],
      algorithms=["ERM"], n_hparams=1, n_trials=1)) == []


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
  assert (tmp_path / grid.GRID_FILE).exists() == launched


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


@pytest.mark.parametrize("flag", ["--n_hparams", "--n_trials"])
def test_a_grid_of_no_runs_is_refused(tmp_path, flag, capsys):
  # Saved, a grid of no runs would refuse the grid meant.
  with pytest.raises(SystemExit, match="2"):
    sweep.parse_args(["launch", "--output_dir", str(tmp_path), flag, "0"])
  assert f"{flag} must be at least 1" in capsys.readouterr().err
  assert not (tmp_path / grid.GRID_FILE).exists()


def test_delete_incomplete_without_a_terminal_needs_the_flag(
    tmp_path, train_command, capsys, monkeypatch):
  flags = sweep_flags(tmp_path, n_hparams=4)
  assert sweep.main(flags + ["--train_command", train_command]) == 1
  capsys.readouterr()
  monkeypatch.setattr(sys, "stdin", open(os.devnull))  # Not a terminal.
  assert sweep.main(["delete_incomplete"] + flags) == 2
  assert capsys.readouterr().err.startswith(
      "python -m experiments.runs.sweep: error: delete_incomplete asks "
      "before deleting; pass --skip_confirmation")
  assert sweep.main(["list"] + flags) == 0
  assert "2 incomplete" in capsys.readouterr().out
  # With the flag it deletes, and then there is nothing to ask about.
  assert sweep.main(["delete_incomplete", "--yes"] + flags) == 0
  capsys.readouterr()
  assert sweep.main(["delete_incomplete"] + flags) == 0
  assert "Nothing to delete." in capsys.readouterr().out


def test_a_usage_error_found_after_parsing_names_the_command(tmp_path, capsys):
  # A sweep directory with no saved grid, listed without the grid's flags.
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 2
  assert capsys.readouterr().err.startswith(
      "python -m experiments.runs.sweep: error: ")


def test_a_sweep_with_averaging_passes_it_to_every_run_and_lists_its_method(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=4) + ["--averaging", "swad"]
  # hparams_seed 3 fails, for both algorithms.
  assert sweep.main(flags + ["--train_command", train_command]) == 1
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 8
  assert all(run.args["averaging"] == "swad" for run in runs)
  assert all(flag(launch["argv"], "--averaging") == "swad"
             for run in runs for launch in launches(run))
  capsys.readouterr()
  alone = ["--output_dir", str(tmp_path)]
  assert sweep.main(["list", *alone]) == 0
  listing = capsys.readouterr().out.splitlines()
  assert [line.split(f"{run.output_dir}  ")[1].split("  [")[0]
          for run, line in zip(runs, listing)] == [
      f"ColoredDigits {algorithm} + SWAD test_envs=[1] hparams_seed={seed} "
      "trial_seed=0" for algorithm in ("ERM", "PGrad") for seed in range(4)]
  assert listing[-1].startswith("8 runs: 6 done, 2 incomplete, 0 not started")
  assert sweep.main(["cost", *alone, "--step_ms", "1000",
                     "--gpu_counts", "1"]) == 0
  assert capsys.readouterr().out.startswith(
      "8 runs, 56 training steps at 1000 ms a step")
  assert sweep.main(["delete_incomplete", "--yes", *alone]) == 0
  assert "Deleted 2 incomplete or damaged runs." in capsys.readouterr().out
  assert [run.status is run_lib.Status.NOT_STARTED for run in runs] == [
      False, False, False, True] * 2
