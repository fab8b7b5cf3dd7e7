"""Tests for experiments/training/evaluate.py: every domain's metrics."""

import numpy as np

from experiments import config as config_lib
from experiments.data import datasets
from experiments.training import evaluate
from experiments.training import sharding
from experiments.training import steps as train_steps


def test_evaluation_batches_are_no_larger_than_the_splits():
  images = np.arange(12, dtype=np.float32)[:, None, None, None] * np.ones(
      (1, 2, 2, 1), np.float32)
  dataset = datasets.MultiDomainDataset(
      name="Twelve", domain_names=("a", "b"),
      domains=(datasets.ArraySource(images, np.arange(12) % 2),
               datasets.ArraySource(images[:5], np.arange(5) % 2)),
      num_classes=2, input_shape=(2, 2, 1))
  sets = [{"in": np.arange(9), "out": np.arange(9, 12)},
          {"in": np.arange(3), "out": np.arange(3, 5)}]
  shapes = []

  def eval_step(params, stats, images, labels, count):
    shapes.append(images.shape[0])
    value = images[:, 0, 0, 0]
    # Correct exactly when the image's value is even.
    return np.where(value % 2 == 0, labels, 1 - labels), value

  state = train_steps.TrainState(0, None, None, None)
  config = config_lib.Config(loss_examples=4, num_workers=0)
  results = evaluate.evaluate(eval_step, state, dataset, sets, config,
                              sharding.Sharder())
  assert set(shapes) == {9}  # The largest split, not the flag's 256.
  assert results["env0_in_acc"] == 5 / 9  # 0, 2, 4, 6, 8 of 0..8.
  assert results["env0_out_acc"] == 1 / 3  # 10 of 9, 10, 11.
  assert results["env1_out_acc"] == 1 / 2  # 4 of 3, 4.
  assert [results[f"env{i}_{name}_examples"] for i in (0, 1)
          for name in ("in", "out")] == [9, 3, 3, 2]
  assert results["env0_in_loss"] == np.mean([0.0, 1.0, 2.0, 3.0])
