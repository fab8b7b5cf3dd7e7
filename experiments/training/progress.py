"""What a run shows while it trains: its progress bar, and what it says
of itself on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
import tqdm

from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline
from experiments.rundir import records

# Steps timed after the first, before a photo run on a CPU estimates its
# time; more than ESTIMATE_WARNED_SECONDS of steps is warned about.
ESTIMATE_STEPS = 2
ESTIMATE_WARNED_SECONDS = 3600

_T = TypeVar("_T")


def say(message: str) -> None:
  """Writes a line on stderr, above the progress bar if there is one."""
  tqdm.tqdm.write(message, file=sys.stderr)


class StepTimer:
  """Times the training steps since the last evaluation, as a record gives
  their times (``step_time``, ``data_wait_time``, ``device_wait_time``).

  Attributes:
    start: when the interval started.
    steps: the steps timed since.
    data_wait: the seconds of them spent waiting for batches.
    device_wait: the seconds spent waiting for the device to end steps: the
      rest of a step, but the data wait, is the loop's own work on the host,
      which a device runs ahead of only while it is shorter.
  """

  def __init__(self):
    self.restart()

  def restart(self) -> None:
    """Starts a new interval."""
    self.start = time.time()
    self.steps = 0
    self.data_wait = 0.0
    self.device_wait = 0.0

  def read(self, read: Callable[[], _T]) -> _T:
    """``read()``, its time counted as waiting for data."""
    start = time.time()
    value = read()
    self.data_wait += time.time() - start
    return value

  def wait_for_device(self, tree: Any) -> None:
    """Waits until the device has computed ``tree``'s arrays, counting the
    wait."""
    start = time.time()
    jax.block_until_ready(tree)
    self.device_wait += time.time() - start

  def seconds(self) -> float:
    """The seconds since the interval started."""
    return time.time() - self.start

  def record(self) -> dict[str, float]:
    """The interval's mean times per step, as a record holds them."""
    return {"step_time": self.seconds() / self.steps,
            "data_wait_time": self.data_wait / self.steps,
            "device_wait_time": self.device_wait / self.steps}


def progress_bar(steps: int, step: int, started: float) -> tqdm.tqdm:
  """The training's progress bar, at ``step`` of ``steps``. Its elapsed
  time counts from ``started``, the run's start, as the times the run
  prints do (the model's build and the step's compilation come before
  the bar)."""
  bar = tqdm.tqdm(total=steps, initial=step, unit="step", dynamic_ncols=True)
  bar.start_t = started
  return bar


def start_line(config: config_lib.Config, dataset: datasets.MultiDomainDataset,
               augmented: bool) -> str:
  """What a run says of itself before it trains: its schedule, its input
  and where it writes."""
  height, width, channels = dataset.input_shape
  reading = (records.counted(config.num_workers, "input worker")
             if input_pipeline.uses_workers(dataset, augmented)
             else "no input workers (arrays in memory)")
  return (f"{records.counted(config.steps, 'step')}, a checkpoint every "
          f"{config.checkpoint_freq}; {height}x{width}x{channels} images, "
          f"augmentation {'on' if augmented else 'off'}, {reading}; run "
          f"directory {config.output_dir}.")


def _hours(seconds: float) -> str:
  return (f"{seconds / 3600:.1f} h" if seconds >= 3600 else
          f"{seconds / 60:.0f} min")


class Screen:
  """The progress bar of a run: its phase (compiling, training, evaluating)
  and, while training, the images per second of the training steps alone
  and the share of their time spent waiting for data."""

  def __init__(self, bar: tqdm.tqdm, images_per_step: int):
    self.bar = bar
    self.images_per_step = images_per_step

  def phase(self, name: str) -> None:
    """Labels the bar with ``name``, at once."""
    self.bar.set_description_str(name, refresh=True)

  def training(self, steps: int, seconds: float, data_wait: float) -> None:
    """Says how fast the ``steps`` ended since the last evaluation went,
    in ``seconds``, ``data_wait`` of which waiting for batches; nothing for
    none."""
    if steps and seconds > 0:
      self._speed = (
          f"images/s={self.images_per_step * steps / seconds:.0f}, data wait "
          f"{100 * data_wait / seconds:.0f}%")
      self.bar.set_postfix_str(self._speed + self._results, refresh=False)

  def results(self, record: records.Record,
              test_envs: Sequence[int]) -> None:
    """Shows a record's training loss and mean held-out metric, at once:
    the bar's last words after the last evaluation must be its numbers,
    which the run then prints."""
    held_out = [records.held_out_metric(record, t) for t in test_envs]
    self._results = (f", loss={record['loss']:.4f}, "
                     f"held_out={np.mean(held_out):.4f}")
    self.bar.set_postfix_str(self._speed + self._results, refresh=True)

  _speed = ""
  _results = ""


def warn_if_long(seconds: float, config: config_lib.Config) -> None:
  """Warns of a run whose remaining steps take ``seconds`` on a CPU, when
  more than ESTIMATE_WARNED_SECONDS."""
  if seconds > ESTIMATE_WARNED_SECONDS:
    say(f"Warning: {config.model} on {config.dataset} takes about "
        f"{_hours(seconds)} more on this CPU (its first {ESTIMATE_STEPS} "
        "steps after compiling, evaluations not counted); a GPU, a smaller "
        "--model or image_size, or fewer --steps take less.")
