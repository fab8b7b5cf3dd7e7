"""The model a run trains, and its jitted train and eval steps."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from concurrent import futures
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import algorithms
from experiments import catalog
from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import photo_augmentation as augmentation
from experiments.data import pipeline as input_pipeline
from experiments.data import tasks
from experiments import models
from experiments.training import sharding
from experiments.weights import convert

# DomainBed's ToTensor and Normalize (`datasets.normalize`) of every uint8
# level, by RGB channel: photos cross to the device as uint8 and the step
# looks their values up here (`normalized`), the same float32 values as on
# the host. (XLA divides by a constant as a multiplication by its
# reciprocal, which is a last bit off NumPy's division at some levels.)
_LEVELS = datasets.normalize(
    np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))


class TrainState(NamedTuple):
  """Everything that changes during training, except the data iterator."""

  step: jax.Array
  params: nnx.State
  stats: nnx.State
  algorithm_state: Any


def build_model(
    config: config_lib.Config,
    dataset: datasets.MultiDomainDataset,
    hparams: Mapping[str, Any],
    weights: Path | None = None,
) -> models.Classifier:
  """The configured model, its featurizer loaded from the ``weights`` file
  if any (`config.RunSpec.weights`, fetched and checked already)."""
  model = models.build_model(
      config.model, num_classes=dataset.num_classes,
      input_shape=dataset.input_shape, rngs=nnx.Rngs(config.seed),
      **catalog.ALGORITHMS[config.algorithm].model_options,
      **catalog.MODELS[config.model].hparams_options(hparams))
  if weights is not None:
    convert.load_pretrained(model, weights)
    print(f"Featurizer weights from {weights}.", file=sys.stderr)
  return model


def model_shapes(
    config: config_lib.Config,
    dataset: datasets.MultiDomainDataset,
    hparams: Mapping[str, Any],
) -> tuple[nnx.State, nnx.State]:
  """The shapes and dtypes of the configured model's params and BatchNorm
  statistics, as `jax.ShapeDtypeStruct` leaves: none of its values
  computed."""
  model = nnx.eval_shape(lambda: build_model(config, dataset, hparams))
  _, params, stats = algorithms.Network.split(model)
  return params, stats


def normalized(images: jax.Array) -> jax.Array:
  """uint8 RGB images as `datasets.normalize` makes them, bit for bit, on
  the device; other images as they are."""
  if images.dtype != jnp.uint8:
    return images
  return jnp.asarray(_LEVELS)[images.astype(jnp.int32),
                              jnp.arange(_LEVELS.shape[1])]


def make_train_step(
    algorithm: algorithms.Algorithm, key: jax.Array
) -> Callable[[TrainState, algorithms.Batches],
              tuple[TrainState, algorithms.Metrics]]:
  """The jitted step; step ``t`` draws its randomness from fold_in(key, t).

  uint8 images (augmented photos) are normalised in the step (`normalized`),
  so that a quarter of float32's bytes cross to the device."""

  @jax.jit
  def train_step(state, batches):
    batches = {**batches, "image": normalized(batches["image"])}
    params, stats, algorithm_state, metrics = algorithm.update(
        state.params, state.stats, state.algorithm_state, batches,
        jax.random.fold_in(key, state.step))
    return TrainState(state.step + 1, params, stats, algorithm_state), metrics

  return train_step


def make_eval_step(
    network: algorithms.Network,
    predict: Callable[..., jax.Array] | None = None,
) -> Callable[[nnx.State, nnx.State, jax.Array, jax.Array, jax.Array],
              tuple[jax.Array, jax.Array]]:
  """The jitted ``(params, stats, images, labels, count) -> (predictions,
  loss)``; the batch's first ``count`` examples are real, the rest padding.

  The outputs are the algorithm's ``predict`` (``algorithms.Algorithm``) if
  it has one, else the network's in eval mode. Predictions are classes, or
  values for regression targets (`tasks`).
  """

  @jax.jit
  def eval_step(params, stats, images, labels, count):
    if predict is None:
      outputs, _ = network.logits(params, stats, images, train=False)
    else:
      outputs = predict(params, stats, images, count)
    loss = tasks.example_loss(outputs, {"label": labels})
    return tasks.predictions(outputs, labels), loss

  return eval_step


def make_evaluated(
    algorithm: algorithms.Algorithm
) -> Callable[[TrainState], TrainState]:
  """The state whose network an evaluation runs: the trained one, or the
  network the algorithm evaluates (``algorithms.Algorithm.evaluated``: ERM++'s
  moving average), jitted."""
  if algorithm.evaluated is None:
    return lambda state: state
  network = jax.jit(algorithm.evaluated)

  def evaluated(state):
    params, stats = network(state.params, state.stats, state.algorithm_state)
    return state._replace(params=params, stats=stats)

  return evaluated


def training_example(dataset: datasets.MultiDomainDataset,
                     augment: augmentation.Augmentation | None,
                     train_domains: Sequence[int],
                     splits: Sequence[input_pipeline.Split]
                     ) -> datasets.Element:
  """A training example as batched: its shapes and dtypes are a batch's."""
  domain = train_domains[0]
  index = int(splits[domain][0][0])
  if augment is None:
    return dataset.domains[domain][index]
  return augment.transform(augment.dataset.domains[domain][index],
                           np.random.default_rng(0))


def compile_while_reading(
    train_step: Any, state: TrainState, sharder: sharding.Sharder,
    example: datasets.Element, leading: tuple[int, int],
    read: Callable[[], Any],
) -> tuple[float, Any]:
  """Compiles the jitted ``train_step`` for ``state`` and batches of
  ``example``s in a thread, while this thread reads the first batch, which
  starts the input workers. Calls of ``train_step`` then run the compiled
  program.

  Returns:
    The seconds compiling took (reading from the persistent compilation
    cache, where it holds the program), the seconds ``read()`` took, and
    the batch it returned.
  """

  def compile_step() -> float:
    start = time.time()
    train_step.lower(state, sharder.abstract_batch(example, leading)).compile()
    return time.time() - start

  compile_step = sharder.on_mesh(compile_step)

  with futures.ThreadPoolExecutor(1, thread_name_prefix="compile") as pool:
    compiling = pool.submit(compile_step)
    start = time.time()
    batch = read()
    first_batch_time = time.time() - start
    return compiling.result(), first_batch_time, batch
