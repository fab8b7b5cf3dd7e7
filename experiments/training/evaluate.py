"""Evaluation of every domain's splits, and the training metrics summed
between evaluations."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import algorithms
from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import photo_augmentation as augmentation
from experiments.data import pipeline as input_pipeline
from experiments.data import tasks
from experiments.rundir import records
from experiments.training import sharding
from experiments.training import steps


def eval_sets(
    splits: Sequence[input_pipeline.Split], config: config_lib.Config
) -> list[dict[str, np.ndarray]]:
  """Per domain, the in and out indices evaluated, in a fixed random order.

  A random order makes any prefix a random subset: ``eval_examples`` keeps a
  prefix of each split, and ``env{i}_in_loss`` averages a prefix.
  """
  sets = []
  for i, split in enumerate(splits):
    domain = {}
    for j, (name, indices) in enumerate(zip(("in", "out"), split)):
      rng = np.random.default_rng([config.trial_seed, i, j])
      domain[name] = rng.permutation(indices)[:config.eval_examples]
    sets.append(domain)
  return sets


def evaluate(
    eval_step: Callable[..., tuple[jax.Array, jax.Array]],
    state: steps.TrainState,
    dataset: datasets.MultiDomainDataset,
    sets: Sequence[dict[str, np.ndarray]],
    config: config_lib.Config,
    sharder: sharding.Sharder,
    augment: augmentation.Augmentation | None = None,
    out_loss: bool = False,
) -> records.Record:
  """The metrics of every domain's in and out split, and the in-split loss.

  The metrics are `tasks.split_metrics`'s, as `records.env_key`s:
  ``acc`` of classes, ``mse`` and ``r`` of regression values, and the
  worst-group ``worst_acc`` or ``worst_r`` where the examples carry a
  ``"group"`` (WILDS), and ``env{i}_{split}_examples``, the number of
  examples evaluated. Empty splits are skipped. With an ``augment`` that
  asks for it, the training domains' examples go through its transform, as
  DomainBed evaluates them. With ``out_loss``, also every out split's mean
  loss over all its examples evaluated, ``env{i}_out_loss``, in float64
  (swad's ``tr_outloss`` averages the training domains').
  """
  results = {}
  # Batches no larger than the largest split, so small datasets are not
  # padded to the flag's size; one size for all splits, so one compilation.
  size = min(config.eval_batch_size,
             max(len(indices) for domain in sets
                 for indices in domain.values()))
  # Split over the devices as a training batch is, in equal shares.
  size = -(-size // sharder.num_devices) * sharder.num_devices
  for i, domain in enumerate(sets):
    for name, indices in domain.items():
      if len(indices) == 0:
        continue
      predicted, labels, groups, losses = _split_outputs(
          eval_step, state, dataset, i, indices, size, config, sharder,
          augment)
      metrics = tasks.split_metrics(
          np.concatenate(predicted), np.concatenate(labels),
          None if groups[0] is None else np.concatenate(groups))
      results.update({records.env_key(i, name, metric): value
                      for metric, value in metrics.items()})
      # How many examples the metrics are over, for their standard errors.
      results[records.env_key(i, name, "examples")] = len(indices)
      if name == "in":
        results[records.env_key(i, "in", "loss")] = float(
            np.concatenate(losses)[:config.loss_examples].mean())
      elif out_loss:
        results[records.env_key(i, "out", "loss")] = float(
            np.concatenate(losses).mean(dtype=np.float64))
  return results


# ERM++'s validation batches: DomainBed's ``eval_loaders_iid`` load 64
# examples at a time (``scripts/train_autolr.py`` lines 170-174).
VALIDATION_BATCH_SIZE = 64


def batch_mean_loss(domains: Sequence[Sequence[np.ndarray]]) -> float:
  """The loss of ERM++'s ``set_lr`` (DomainBed's ``algorithms.py`` lines
  213-221) from per-example losses, batch by batch, domain by domain.

  Per domain, the mean over its batches of each batch's mean loss (a short
  last batch weighs as much as a full one), then the mean over the domains;
  in float64 (DomainBed sums float32 batch means).
  """
  return float(np.mean([
      np.mean([np.mean(batch, dtype=np.float64) for batch in batches])
      for batches in domains]))


def validation_loss(
    eval_step: Callable[..., tuple[jax.Array, jax.Array]],
    state: steps.TrainState,
    dataset: datasets.MultiDomainDataset,
    splits: Sequence[input_pipeline.Split],
    train_domains: Sequence[int],
    config: config_lib.Config,
    sharder: sharding.Sharder,
    augment: augmentation.Augmentation | None = None,
) -> float:
  """The training domains' validation loss as ERM++'s ``set_lr`` takes it.

  Each training domain's whole out split, in a fresh random order
  (`input_pipeline.validation_order`), in batches of
  `VALIDATION_BATCH_SIZE` (``eval_loaders_iid``, ``scripts/train_autolr.py``
  lines 170-174), through ``eval_step``, averaged by `batch_mean_loss`.
  ``--eval_examples`` does not shorten it: DomainBed's loaders are whole.

  Raises:
    ValueError: a training domain's out split is empty.
  """
  padded_size = (-(-VALIDATION_BATCH_SIZE // sharder.num_devices)
                 * sharder.num_devices)
  domains = []
  for domain in train_domains:
    indices = input_pipeline.validation_order(
        splits[domain][1], seed=config.seed, step=int(state.step),
        domain=domain)
    if len(indices) == 0:
      raise ValueError(f"Domain {domain}'s out split is empty: ERM++'s "
                       "auto_lr needs a validation loss.")
    domains.append(_split_outputs(
        eval_step, state, dataset, domain, indices, VALIDATION_BATCH_SIZE,
        config, sharder, augment, padded_size)[3])
  return batch_mean_loss(domains)


def _split_outputs(
    eval_step: Callable[..., tuple[jax.Array, jax.Array]],
    state: steps.TrainState,
    dataset: datasets.MultiDomainDataset,
    domain: int,
    indices: np.ndarray,
    size: int,
    config: config_lib.Config,
    sharder: sharding.Sharder,
    augment: augmentation.Augmentation | None,
    padded_size: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray | None],
           list[np.ndarray]]:
  """The predictions, labels, groups (None without) and per-example losses
  of ``domain``'s examples at ``indices``, in that order, batch by batch of
  ``size`` (the last one short), as `evaluate` describes. Each batch is
  padded to ``padded_size`` examples (by default ``size``), a multiple of
  the devices."""
  padded_size = padded_size or size
  augmented = (augment is not None and augment.in_evaluation
               and domain not in config.test_envs)
  predicted, labels, groups, losses = [], [], [], []
  for batch in input_pipeline.eval_batches(
      augment.dataset if augmented else dataset, domain, indices,
      batch_size=size, num_workers=config.num_workers,
      transform=augment.transform if augmented else None,
      seed=config.seed, step=int(state.step)):
    count = len(batch["label"])
    if batch["image"].dtype == np.uint8:
      # Augmented photos: normalised here, so that one program (of
      # float32 images, as the test domains') evaluates every domain.
      batch = {**batch, "image": datasets.normalize(batch["image"])}
    # One batch shape, so one compilation: pad the last batch.
    padded = {k: np.concatenate([v, np.zeros((padded_size - count,)
                                             + v.shape[1:], v.dtype)])
              for k, v in batch.items()}
    padded = sharder.batch(padded, axis=0)
    prediction, loss = eval_step(state.params, state.stats,
                                 padded["image"], padded["label"], count)
    predicted.append(np.asarray(prediction)[:count])
    labels.append(batch["label"])
    groups.append(batch.get("group"))
    losses.append(np.asarray(loss)[:count])
  return predicted, labels, groups, losses


# One dispatch per step for the metric sums, rather than one per metric.
_add = jax.jit(functools.partial(jax.tree.map, jnp.add))


class MetricMeter:
  """Sums an algorithm's metrics on the device between evaluations."""

  def __init__(self):
    self.sums = None
    self.latest = None
    self.count = 0

  def state(self) -> dict[str, Any]:
    """The sums, latest values and count as JSON values, exactly: each
    value's dtype and its elements (float32 and int32 are exact as Python
    numbers)."""
    sums, latest = jax.device_get((self.sums, self.latest))
    return {"count": self.count, **{
        name: {key: [str(np.asarray(value).dtype), np.asarray(value).tolist()]
               for key, value in tree.items()}
        for name, tree in (("sums", sums), ("latest", latest))}}

  @classmethod
  def from_state(cls, state: dict[str, Any],
                 place: Callable[[Any], Any]) -> MetricMeter:
    """The meter that a `state` describes, its NumPy arrays put on the
    devices by ``place`` (`sharding.Sharder.replicate`), as the step's
    metrics are. (Not by ``jnp.asarray``, which compiles a program per dtype
    and shape, which a fresh run never compiles.)"""
    meter = cls()
    meter.count = state["count"]
    meter.sums, meter.latest = (
        place({key: np.asarray(value, dtype)
               for key, (dtype, value) in state[name].items()})
        for name in ("sums", "latest"))
    return meter

  def add(self, metrics: algorithms.Metrics) -> None:
    self.sums = metrics if self.sums is None else _add(self.sums, metrics)
    self.latest = metrics
    self.count += 1

  def result(self) -> records.Record:
    """Means over the steps added, and the latest value of counters."""
    sums, latest = jax.device_get((self.sums, self.latest))
    return {name: (latest[name] if name in algorithms.COUNTERS
                   else sums[name] / self.count).tolist() for name in sums}
