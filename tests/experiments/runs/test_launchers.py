"""The local and multi_gpu launchers, and the checks of every launcher's
flags, through the sweep's command line with test_sweep.py's stand-in
training script."""

import os
import socket

import pytest

from experiments.runs import sweep

from test_sweep import flag, launches, sweep_flags, wait_for_notice
from test_sweep import fixture_held_run_notices, train_command  # pylint: disable=unused-import


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
