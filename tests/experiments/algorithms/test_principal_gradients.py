"""Tests for experiments/algorithms/principal_gradients.py: PGrad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import models
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS, Flatten
from test_algorithms import algorithm_hparams, make_batches


def _one_pgrad_update(hparams):
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(
      "PGrad-F", network, {**algorithm_hparams("PGrad"), **hparams},
      num_domains=NUM_DOMAINS)
  new_params, _, _, _ = algorithm.update(
      params, stats, algorithm.init(params), make_batches(),
      jax.random.PRNGKey(0))
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(new_params)])


def test_k_all_keeps_every_component_of_the_trajectory():
  every = _one_pgrad_update({"k": "all", "B": 2, "batch_size": BATCH})
  np.testing.assert_allclose(
      every, _one_pgrad_update({"k": NUM_DOMAINS * 2, "B": 2}), rtol=1e-6)
  assert np.abs(every - _one_pgrad_update({"k": 1, "B": 2})).max() > 1e-6


@pytest.mark.parametrize("k", [0, "some", 2.5])
def test_pgrad_rejects_a_bad_k(k):
  with pytest.raises(ValueError, match="k must be"):
    _one_pgrad_update({"k": k})


@pytest.mark.parametrize("num_domains", [2, 4])
def test_outer_lr_per_domain_divides_the_outer_step(num_domains):
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  images = jax.random.normal(jax.random.PRNGKey(5),
                             (num_domains, BATCH, 4, 4, 1))
  batches = {"image": images,
             "label": jnp.arange(num_domains * BATCH).reshape(
                 num_domains, BATCH) % NUM_CLASSES}
  steps = []
  for per_domain in (False, True):
    hparams = {**algorithm_hparams("PGrad"), "outer_lr_per_domain": per_domain}
    algorithm = algorithms.build_algorithm("PGrad", network, hparams,
                                           num_domains=num_domains)
    new_params, *_ = jax.jit(algorithm.update)(
        params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
    steps.append(jax.tree.map(lambda new, old: new - old, new_params, params))
  # gamma = c / n-hat: the same direction, 1 / n-hat as long (up to the
  # float32 rounding of new - old for params of order 1).
  for full, scaled in zip(jax.tree.leaves(steps[0]), jax.tree.leaves(steps[1])):
    assert np.abs(full).max() > 1e-4
    np.testing.assert_allclose(scaled, full / num_domains, rtol=1e-4,
                               atol=1e-7)
