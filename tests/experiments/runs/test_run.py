"""A run of a sweep: its seed, its command line and what names its
directory."""

import os

import pytest

from experiments.runs import run as run_lib
from experiments.runs import sweep

from test_sweep import flag, launches, sweep_flags
from test_sweep import train_command  # pylint: disable=unused-import


def test_seed_hash_is_deterministic_and_distinct():
  seed = run_lib.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert seed == run_lib.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert 0 <= seed < 2**31
  assert seed != run_lib.seed_hash("RotatedDigits", "ERM", [0], 0, 1)


def test_command_passes_every_flag():
  run = run_lib.Run.create(
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


def test_a_run_that_averages_is_labelled_by_its_method():
  args = {"dataset": "RotatedDigits", "algorithm": "ERM", "test_envs": [1],
          "hparams_seed": 0, "trial_seed": 2, "seed": 5}
  # A run without averaging reads as it always has.
  assert run_lib.Run.create(args, "sweep").label == (
      "RotatedDigits ERM test_envs=[1] hparams_seed=0 trial_seed=2")
  averaged = run_lib.Run.create({**args, "averaging": "swad"}, "sweep")
  assert averaged.label == (
      "RotatedDigits ERM + SWAD test_envs=[1] hparams_seed=0 trial_seed=2")
  assert str(averaged) == (f"not started  {averaged.output_dir}  "
                           f"{averaged.label}")
