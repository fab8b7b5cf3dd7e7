"""Tests for experiments/algorithms/gradient_manipulation.py: Fish, Fishr."""

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import models
import oracle
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS, Flatten
from test_algorithms import algorithm_hparams, make_batches


def _numpy_head_variances(params, images, labels):
  """Per-domain variance of per-example CE gradients of a linear head."""
  features = np.asarray(images, np.float64).reshape(NUM_DOMAINS, BATCH, -1)
  kernel = np.asarray(params["head"]["kernel"][...], np.float64)
  bias = np.asarray(params["head"]["bias"][...], np.float64)
  logits = features @ kernel + bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  residual = probs - np.eye(NUM_CLASSES)[np.asarray(labels)]
  # d CE / d kernel = feature (outer) residual; d CE / d bias = residual.
  grads = np.concatenate([
      (features[..., :, None] * residual[..., None, :]).reshape(
          NUM_DOMAINS, BATCH, -1),
      residual], axis=-1)
  return grads.var(axis=1)


def _numpy_penalty(variances):
  return np.mean((variances - variances.mean(axis=0)) ** 2)


def test_fishr_penalty_matches_numpy_per_example_gradients():
  image_shape = (2, 2, 1)
  model = models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**algorithm_hparams("Fishr"), "lambda": 10.0, "ema": 0.9}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)

  # First step: the moving average starts at zero, so its corrected value
  # is the variance itself.
  batches = make_batches(seed=0, image_shape=image_shape)
  var1 = _numpy_head_variances(params, batches["image"], batches["label"])
  params, stats, state, metrics = update(params, stats, state, batches,
                                         jax.random.PRNGKey(0))
  np.testing.assert_allclose(metrics["penalty"], _numpy_penalty(var1),
                             rtol=1e-4)
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + 10.0 * metrics["penalty"], rtol=1e-5)

  # Second step: (0.9 * 0.1 * var1 + 0.1 * var2) / 0.1.
  batches = make_batches(seed=1, image_shape=image_shape)
  var2 = _numpy_head_variances(params, batches["image"], batches["label"])
  _, _, _, metrics = update(params, stats, state, batches,
                            jax.random.PRNGKey(1))
  np.testing.assert_allclose(
      metrics["penalty"], _numpy_penalty(0.9 * var1 + var2), rtol=1e-4)


def test_fishr_penalty_is_off_before_the_anneal_step():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**algorithm_hparams("Fishr"), "penalty_anneal_iters": 5}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), make_batches(),
      jax.random.PRNGKey(0))
  assert metrics["penalty"] > 0
  np.testing.assert_allclose(metrics["loss"], metrics["nll"])


def _numpy_fish(theta, batch_list, lr, meta_lr, wd, placement):
  """DomainBed's Fish.update, float64, over several outer steps.

  The inner Adam's state carries across outer steps (DomainBed reloads
  ``optimizer_inner_state``); domains are visited in their fixed order.
  ``placement="outer"`` instead decays the meta step:
  ``theta -= meta_lr * ((theta - inner) + wd * theta)``.
  """
  adam = oracle.TorchAdam(lr, wd if placement == "inner" else 0.0, theta)
  for batches in batch_list:
    inner = theta
    for images, labels in zip(batches["image"], batches["label"]):
      _, grads = oracle.linear_head_loss_grad(inner, images,
                                              np.asarray(labels), NUM_CLASSES)
      inner = adam.step(inner, grads)
    outer_wd = wd if placement == "outer" else 0.0
    theta = tuple(t - meta_lr * ((t - i) + outer_wd * t)
                  for t, i in zip(theta, inner))
  return theta


@pytest.mark.parametrize("placement", ["inner", "outer"])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_fish_weight_decay_matches_a_numpy_model_of_domainbed(
    placement, num_steps):
  image_shape = (2, 2, 1)
  model = models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  # A large decay, so the two placements differ by far more than float32
  # rounding.
  hparams = {**algorithm_hparams("Fish"), "weight_decay": 0.1, "lr": 0.05,
             "fish_weight_decay": placement}
  assert hparams["fish_order"] == "fixed" and hparams["meta_lr"] == 0.5
  algorithm = algorithms.build_algorithm("Fish", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  batch_list = [make_batches(seed, image_shape) for seed in range(num_steps)]
  theta = (np.asarray(params["head"]["kernel"][...], np.float64),
           np.asarray(params["head"]["bias"][...], np.float64))
  state = algorithm.init(params)
  for step, batches in enumerate(batch_list):
    params, stats, state, _ = update(params, stats, state, batches,
                                     jax.random.PRNGKey(step))

  expected = _numpy_fish(theta, batch_list, 0.05, 0.5, 0.1, placement)
  other = _numpy_fish(theta, batch_list, 0.05, 0.5, 0.1,
                      {"inner": "outer", "outer": "inner"}[placement])
  for got, want, wrong in zip(
      (params["head"]["kernel"][...], params["head"]["bias"][...]),
      expected, other):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - wrong).max() > 1e-3


@pytest.mark.parametrize("hparams, match", [
    ({"fish_weight_decay": "meta"}, "fish_weight_decay"),
    ({"fish_order": "shuffled"}, "fish_order"),
])
def test_fish_rejects_unknown_options(hparams, match):
  network, _, _ = algorithms.Network.split(
      models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=match):
    algorithms.build_algorithm("Fish", network,
                               {**algorithm_hparams("Fish"), **hparams},
                               num_domains=NUM_DOMAINS)


def test_fish_random_order_visits_the_domains_in_another_order():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  ends = {}
  for order in ("fixed", "random"):
    algorithm = algorithms.build_algorithm(
        "Fish", network, {**algorithm_hparams("Fish"), "fish_order": order},
        num_domains=NUM_DOMAINS, seed=1)
    update = jax.jit(algorithm.update)
    p, s, state = params, stats, algorithm.init(params)
    for step in range(4):
      p, s, state, _ = update(p, s, state, make_batches(step),
                              jax.random.PRNGKey(step))
    ends[order] = np.asarray(p["head"]["kernel"][...])
  assert np.abs(ends["fixed"] - ends["random"]).max() > 1e-6
