"""Tests for benchmarks/accelerator.sh: its commands, without running them."""

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "accelerator.sh"
# The device time one GPU check may take, start included.
GPU_CHECK_LIMIT_S = 8 * 60


def _run(tmp_path, *names, **env):
  environment = {**os.environ, **env,
                 # The script's python3 is this test's.
                 "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
  return subprocess.run(["bash", str(SCRIPT), str(tmp_path), *names],
                        cwd=REPO, env=environment, capture_output=True,
                        text=True, check=False)


def _commands(stdout):
  """(limit, module, argv) of every command a dry run prints."""
  commands = []
  for line in stdout.splitlines():
    if line.startswith("timeout "):
      words = shlex.split(line)
      assert words[2:4] == ["python3", "-m"], line
      commands.append((int(words[1]), words[4], words[5:]))
  return commands


@pytest.mark.parametrize("smoke", ["", "1"])
def test_every_command_of_the_gpu_check_parses(tmp_path, smoke):
  ran = _run(tmp_path, "gpu_check", "gpu_check_resnet18_loop",
             BENCH_DRY_RUN="1", BENCH_SMOKE=smoke)
  assert ran.returncode == 0, ran.stderr
  commands = _commands(ran.stdout)
  assert [module for _, module, _ in commands] == [
      "benchmarks.step_time", "benchmarks.profile_update",
      "benchmarks.end_to_end", "benchmarks.vmap_trials",
      "benchmarks.vmap_trials", "benchmarks.end_to_end"]
  for _, module, argv in commands:
    args = importlib.import_module(module).parse_args(argv)
    assert Path(args.out).parent == tmp_path
    assert re.fullmatch(r"[a-z_]+_cpu_\w+\.json", Path(args.out).name)
    if module == "benchmarks.end_to_end" and not smoke:
      # At least 200 steady steps, the first interval (start-up) aside.
      assert args.steps - args.checkpoint_freq >= 200
      assert args.image_size == 224 and args.num_workers == os.cpu_count()
  # The first five are the GPU check: under its limit together.
  assert sum(limit for limit, _, _ in commands[:5]) < GPU_CHECK_LIMIT_S
  vmapped = [importlib.import_module(m).parse_args(argv)
             for _, m, argv in commands if m == "benchmarks.vmap_trials"]
  assert [(a.model, a.trials) for a in vmapped] == (
      [("mnist_cnn", [1, 2]), ("resnet18", [1, 2])] if smoke else
      [("mnist_cnn", [1, 3, 8]), ("resnet18", [1, 3, 8])])


def test_mistakes_exit_2_and_name_the_fix(tmp_path):
  unknown = _run(tmp_path, "gpu_chek", BENCH_DRY_RUN="1")
  assert unknown.returncode == 2
  assert "no benchmark named gpu_chek" in unknown.stderr
  assert "gpu_check" in unknown.stderr
  into_results = subprocess.run(
      ["bash", str(SCRIPT), "benchmarks/results", "gpu_check"], cwd=REPO,
      env={**os.environ, "BENCH_SMOKE": "1"}, capture_output=True, text=True,
      check=False)
  assert into_results.returncode == 2
  assert "another output_dir" in into_results.stderr
