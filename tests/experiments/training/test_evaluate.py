"""Tests for experiments/training/evaluate.py: every domain's metrics."""

import numpy as np

from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import pipeline
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


def test_validation_loss_weighs_each_batch_of_64_as_domainbed_does():
  # Per-example losses are the images' values: 150 and 70 examples in the
  # training domains' out splits, batches of 64, 64, 22 and 64, 6. The last
  # short batch weighs as much as a full one, so the mean is not the
  # examples' mean.
  rng = np.random.default_rng(0)
  values = [rng.exponential(size=200).astype(np.float32) for _ in range(3)]
  dataset = datasets.MultiDomainDataset(
      name="Losses", domain_names=("a", "b", "c"),
      domains=tuple(datasets.ArraySource(v[:, None, None, None],
                                         np.zeros(200, np.int64))
                    for v in values),
      num_classes=2, input_shape=(1, 1, 1))
  out_sizes = {0: 150, 1: 10, 2: 70}
  splits = [(np.arange(200 - n), np.arange(200 - n, 200))
            for n in out_sizes.values()]
  shapes = []

  def eval_step(params, stats, images, labels, count):
    shapes.append(images.shape[0])
    return labels, np.asarray(images)[:, 0, 0, 0]

  config = config_lib.Config(test_envs=(1,), num_workers=0, seed=3)
  step = 7
  state = train_steps.TrainState(step, None, None, None)
  got = evaluate.validation_loss(eval_step, state, dataset, splits, (0, 2),
                                 config, sharding.Sharder())
  want = []
  for domain in (0, 2):
    # A fresh order at every step, as DomainBed's RandomSampler.
    order = pipeline.validation_order(splits[domain][1], seed=3, step=step,
                                      domain=domain)
    assert sorted(order) == list(splits[domain][1])
    assert not np.array_equal(order, pipeline.validation_order(
        splits[domain][1], seed=3, step=step + 1, domain=domain))
    out = values[domain][order].astype(np.float64)
    batch_means = [out[start:start + 64].mean()
                   for start in range(0, len(out), 64)]
    want.append(sum(batch_means) / len(batch_means))
  assert set(shapes) == {64}
  # Both float64 means of the same float32 values, summed in another
  # order: a few float64 ulps apart at most.
  np.testing.assert_allclose(got, np.mean(want), rtol=1e-14, atol=0)
  examples_mean = np.mean(np.concatenate(
      [values[0][50:], values[2][130:]]).astype(np.float64))
  assert abs(got - examples_mean) > 1e-3
