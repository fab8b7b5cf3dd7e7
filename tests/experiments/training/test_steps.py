"""Tests for experiments/training/steps.py: the step's input and its
compilation beside the first read."""

import threading
import time

import jax
import numpy as np

from experiments.data import datasets
from experiments.training import sharding
from experiments.training import steps as train_steps


def test_the_step_normalises_uint8_photos_as_the_host_does():
  # Every level in every channel, and each channel's levels in the others'.
  levels = np.arange(256, dtype=np.uint8)
  pixels = np.stack([levels, levels[::-1], np.roll(levels, 85)], axis=-1)
  images = pixels.reshape(2, 2, 8, 8, 3)
  got = np.asarray(jax.jit(train_steps.normalized)(images))
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, datasets.normalize(images))
  # torchvision's ToTensor and Normalize, in float64: float32 rounding.
  expected = (images / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
  floats = np.linspace(-1, 1, 12, dtype=np.float32).reshape(1, 1, 2, 2, 3)
  assert train_steps.normalized(floats) is floats


def test_the_step_compiles_while_the_first_batch_is_read():
  # Each side waits for the other to have begun: done one after the other,
  # the compile (or the read) would wait for ever, and the test fail.
  tracing, read = threading.Event(), threading.Event()

  def step(state, batch):
    tracing.set()
    assert read.wait(30), "the read did not end while the step compiled"
    return state + batch["image"].sum()

  read_seconds = []

  def read_first_batch():
    start = time.time()
    assert tracing.wait(30), "the step did not compile while reading"
    read.set()
    read_seconds.append(time.time() - start)
    return "the first batch"

  example = {"image": np.zeros((4, 4, 1), np.float32)}
  compile_time, first_batch_time, batch = train_steps.compile_while_reading(
      jax.jit(step), np.zeros((), np.float32), sharding.Sharder(1), example,
      (2, 3), read_first_batch)
  assert batch == "the first batch"
  # The read's own time is what the record gives.
  assert read_seconds[0] <= first_batch_time
  assert compile_time > 0
