"""Tests for experiments/models/layers.py: BatchNorm against PyTorch's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import models


def _numpy_torch_batch_norm(batches, momentum=0.1, epsilon=1e-5):
  """float64 ``torch.nn.BatchNorm2d`` in train mode, from its documentation.

  Every batch ``(N, H, W, C)`` is normalized with its mean and biased
  variance; then ``running = (1 - momentum) * running + momentum *
  statistic``, the variance's statistic the unbiased batch variance.

  Returns:
    ``(outputs, running mean, running var)``, the statistics from 0 and 1.
  """
  axes = (0, 1, 2)
  running_mean = np.zeros(batches.shape[-1])
  running_var = np.ones(batches.shape[-1])
  outputs = []
  for x in batches:
    outputs.append((x - x.mean(axes)) / np.sqrt(x.var(axes) + epsilon))
    running_mean = (1 - momentum) * running_mean + momentum * x.mean(axes)
    running_var = ((1 - momentum) * running_var
                   + momentum * x.var(axes, ddof=1))
  return outputs, running_mean, running_var


@pytest.mark.parametrize("unbiased", [True, False])
def test_batch_norm_follows_pytorchs_running_statistics_in_float64(unbiased):
  # Six batches of 3 maps of 2x2: m = 12 values per feature, so the
  # unbiased variance is 12 / 11 of the biased one.
  rng = np.random.default_rng(0)
  batches = (rng.normal(size=(6, 3, 2, 2, 4)) * np.array([0.5, 1, 2, 4])
             + np.array([-1, 0, 1, 3]))
  want_outputs, want_mean, want_var = _numpy_torch_batch_norm(batches)
  with jax.enable_x64(True):
    norm = models.BatchNorm(4, momentum=0.9, epsilon=1e-5,
                            unbiased_running_var=unbiased,
                            dtype=jnp.float64, param_dtype=jnp.float64,
                            rngs=nnx.Rngs(0))
    assert norm.mean[...].dtype == norm.var[...].dtype == jnp.float64
    outputs = np.stack([norm(jnp.asarray(x)) for x in batches])
    mean, var = np.asarray(norm.mean[...]), np.asarray(norm.var[...])
    norm.eval()
    eval_outputs = np.asarray(norm(jnp.asarray(batches[0])))
  # Train mode normalizes with the biased variance either way: measured
  # 2e-15 apart on outputs up to 2.
  np.testing.assert_allclose(outputs, want_outputs, rtol=0, atol=1e-13)
  np.testing.assert_allclose(mean, want_mean, rtol=1e-13)
  want_eval = (batches[0] - want_mean) / np.sqrt(want_var + 1e-5)
  if unbiased:
    # Measured 3e-16 relative on the statistics, 2e-15 on the outputs.
    np.testing.assert_allclose(var, want_var, rtol=1e-13)
    np.testing.assert_allclose(eval_outputs, want_eval, rtol=0, atol=1e-13)
  else:  # Flax's running variance: 8% below PyTorch's here.
    assert np.abs(var / want_var - 1).max() > 0.05
    assert np.abs(eval_outputs - want_eval).max() > 0.01


def test_batch_norm_needs_two_values_per_feature_for_its_unbiased_variance():
  norm = models.BatchNorm(3, unbiased_running_var=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="more than one value per feature"):
    norm(jnp.ones((1, 1, 1, 3)))
  norm.eval()  # The running statistics need no batch variance.
  assert norm(jnp.ones((1, 1, 1, 3))).shape == (1, 1, 1, 3)
