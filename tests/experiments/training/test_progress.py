"""Tests for experiments/training/progress.py: what a run shows and says
while it trains."""

import time

from experiments import config as config_lib
from experiments.data import datasets
from experiments.training import progress


def test_a_long_run_on_a_cpu_is_warned_of_with_its_estimate(capsys):
  config = config_lib.parse_args(["--dataset", "PACS", "--model", "resnet18"])
  progress.warn_if_long(progress.ESTIMATE_WARNED_SECONDS, config)
  assert capsys.readouterr().err == ""
  progress.warn_if_long(2.5 * 3600, config)
  assert ("Warning: resnet18 on PACS takes about 2.5 h more on this CPU"
          in capsys.readouterr().err)


def test_start_line_says_how_the_input_is_read():
  # The digits are arrays in memory, read as they are: no worker processes,
  # whatever --num_workers says.
  config = config_lib.parse_args(["--num_workers", "2", "--steps", "5",
                                  "--output_dir", "r"]).resolve()
  digits = datasets.get_dataset("RotatedDigits")
  assert progress.start_line(config, digits, augmented=False) == (
      "5 steps, a checkpoint every 50; 28x28x1 images, augmentation off, "
      "no input workers (arrays in memory); run directory r.")


def test_the_start_line_counts_one_step_in_the_singular():
  config = config_lib.Config(
      dataset="ColoredDigits", algorithm="ERM", steps=1, num_workers=1,
      output_dir="run", test_envs=[0]).resolve()
  line = progress.start_line(config, datasets.get_dataset("ColoredDigits"),
                             augmented=False)
  assert line.startswith("1 step, a checkpoint every ")


def test_the_progress_bar_counts_time_from_the_runs_start(capsys):
  started = time.time() - 94
  with progress.progress_bar(10, 0, started) as bar:
    bar.update()
    elapsed = bar.format_dict["elapsed"]
  capsys.readouterr()
  # The run's 94 s so far, not the bar's few microseconds.
  assert 94 <= elapsed < 94 + 60


def test_the_bar_ends_on_the_last_evaluations_numbers(capsys):
  # The bar's last words and the printed result come from the same record:
  # the speed of the steps before an evaluation, then that evaluation.
  with progress.progress_bar(20, 0, time.time()) as bar:
    screen = progress.Screen(bar, images_per_step=10)
    for step, (loss, acc) in [(10, (0.9, 0.25)), (20, (0.5, 0.75))]:
      screen.training(10, seconds=2.0, data_wait=0.5)
      screen.results({"step": step, "loss": loss, "env0_in_acc": acc},
                     test_envs=[0])
      shown = bar.postfix
  capsys.readouterr()
  assert shown == "images/s=50, data wait 25%, loss=0.5000, held_out=0.7500"
