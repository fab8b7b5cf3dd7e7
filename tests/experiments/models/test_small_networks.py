"""Tests for experiments/models/small_networks.py: DomainBed's MLP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import models


def test_mlp_is_domainbeds():
  mlp = models.MLP(6, 3, width=5, depth=3, rngs=nnx.Rngs(0))
  weights = [(np.asarray(layer.kernel[...], np.float64),
              np.asarray(layer.bias[...], np.float64)) for layer in mlp.layers]
  assert [w.shape for w, _ in weights] == [(6, 5), (5, 5), (5, 3)]
  for (kernel, bias), fan_in in zip(weights, (6, 5, 5)):
    # PyTorch's U(-1/sqrt(fan_in), 1/sqrt(fan_in)), weights and biases.
    for w in (kernel, bias):
      assert np.abs(w).max() <= fan_in**-0.5 and np.abs(w).max() > 0
  x = np.random.default_rng(0).normal(size=(4, 6))
  h = x
  for i, (kernel, bias) in enumerate(weights):
    h = h @ kernel + bias
    h = np.maximum(h, 0) if i < 2 else h
  np.testing.assert_allclose(mlp(jnp.asarray(x, jnp.float32)), h,
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="depth is at least 2"):
    models.MLP(6, 3, width=5, depth=1, rngs=nnx.Rngs(0))


def test_mlp_dropout_draws_a_mask_per_layer_from_the_key():
  # Every hidden layer as wide as the last: a mask shared by the layers
  # would drop the same units in both.
  mlp = models.MLP(5, 5, width=5, depth=3, dropout=0.5, rngs=nnx.Rngs(0))
  for layer in mlp.layers:
    layer.kernel[...] = jnp.eye(5)
    layer.bias[...] = jnp.zeros(5)
  x = jnp.ones((1, 5))
  key = jax.random.key(0)
  masks = [jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, (1, 5))
           for i in range(2)]
  assert not np.array_equal(*masks)
  # Identity layers: the output is the input through both masks, scaled.
  np.testing.assert_array_equal(mlp(x, rngs=key), 4.0 * masks[0] * masks[1])
  mlp.eval()
  np.testing.assert_array_equal(mlp(x), x)
