"""pgrad_jax with Flax and Orbax: an NNX optimizer, a Linen model, a
BatchNorm's statistics as the model state, and the state checkpointed.

The library needs neither; these tests need the experiments' extra. They use
the library tests' problems (tests/pgrad_jax/test_transform.py and
test_model_state.py), which pick their sizes and check the numbers without
Flax.
"""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import pgrad_jax
import test_model_state as model_state_tests
import test_transform as transform_tests
from test_model_state import MOMENTUM


# --- Flax NNX and Linen -------------------------------------------------------


def test_flax_nnx_optimizer():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(model, nnx.Param)
  optimizer = nnx.Optimizer(
      model, optax.chain(pgrad_jax.pgrad(optax.adam(1e-2), k=2, B=2),
                         optax.sgd(0.1)), wrt=nnx.Param)
  _, batches = transform_tests.problem()

  def model_loss(params, batch):
    pred = nnx.merge(graphdef, params)(batch["x"])[..., 0]
    return jnp.mean((pred - batch["y"]) ** 2)

  @nnx.jit
  def train_step(model, optimizer, batches):
    params = nnx.state(model, nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, params)
    optimizer.update(model, zeros, loss_fn=model_loss, batches=batches)

  first = model_loss(nnx.state(model, nnx.Param),
                     jax.tree.map(lambda x: x[0], batches))
  for _ in range(5):
    train_step(model, optimizer, batches)
  after = model_loss(nnx.state(model, nnx.Param),
                     jax.tree.map(lambda x: x[0], batches))
  assert after < first


def test_flax_linen_model():
  model = linen.Dense(1)
  _, batches = transform_tests.problem()
  params = model.init(jax.random.key(0), batches["x"][0])

  def model_loss(params, batch):
    pred = model.apply(params, batch["x"])[..., 0]
    return jnp.mean((pred - batch["y"]) ** 2)

  tx = optax.chain(pgrad_jax.pgrad(optax.adam(1e-2), B=3), optax.sgd(0.1))
  state = tx.init(params)
  before = model_loss(params, jax.tree.map(lambda x: x[0], batches))
  step = jax.jit(lambda p, s: tx.update(None, s, p, loss_fn=model_loss,
                                        batches=batches))
  for _ in range(5):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  assert model_loss(params, jax.tree.map(lambda x: x[0], batches)) < before


# --- BatchNorm statistics through nnx.Optimizer -------------------------------


class BatchNormNet(nnx.Module):
  """A linear layer, BatchNorm and a linear head."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=MOMENTUM, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.norm(self.hidden(x))))[..., 0]


def bn_setup(inner_lr):
  """A BatchNormNet, its pure loss, and a pgrad chain wrapped to hold the
  model's BatchNorm statistics from ``init`` on."""
  model = BatchNormNet(nnx.Rngs(0))
  graphdef, _, _, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)

  def bn_loss(params, batch, stats):
    model = nnx.merge(graphdef, params, stats, rest)
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, nnx.as_pure(nnx.state(model, nnx.BatchStat))

  tx = pgrad_jax.with_model_state(
      optax.chain(pgrad_jax.pgrad(optax.adam(inner_lr), k=2, B=2,
                                  order="fixed", num_domains=3),
                  optax.sgd(0.1)),
      nnx.as_pure(nnx.state(model, nnx.BatchStat)))
  return model, bn_loss, tx


def nnx_train(model, bn_loss, tx, batches, steps):
  """``steps`` updates through ``nnx.Optimizer``; returns the traces."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  traces = []

  @nnx.jit
  def train_step(model, optimizer, batches):
    traces.append(None)
    optimizer.update(model, None, loss_fn=bn_loss, batches=batches,
                     model_state=nnx.state(model, nnx.BatchStat))
    nnx.update(model, optax.tree_utils.tree_get(optimizer.opt_state,
                                                "model_state"))

  for _ in range(steps):
    train_step(model, optimizer, batches)
  return traces


def test_batchnorm_statistics_through_nnx_optimizer():
  # With a zero inner learning rate every inner step sees the same params,
  # so the running statistics have a float64 replay: BatchNorm's biased
  # variance, 2 updates x 2 rounds x 3 domains, chunk i in round i.
  model, bn_loss, tx = bn_setup(inner_lr=0.0)
  _, batches = model_state_tests.problem()
  hidden = np.asarray(model.hidden(batches["x"]), np.float64)
  traces = nnx_train(model, bn_loss, tx, batches, steps=2)
  assert len(traces) == 1
  mean, var = np.zeros(8), np.ones(8)
  for _ in range(2):
    for chunk in range(2):
      for domain in range(3):
        h = hidden[domain, 3 * chunk:3 * (chunk + 1)]
        mean = MOMENTUM * mean + (1 - MOMENTUM) * h.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * h.var(0)
  # float32 running averages of O(1) values over 12 steps: at most 1.1e-7
  # from the replay under --xla_cpu_max_isa SSE4_2, AVX, AVX2 and AVX-512;
  # 1e-6 is 9 times that.
  np.testing.assert_allclose(model.norm.mean[...], mean, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(model.norm.var[...], var, rtol=1e-6, atol=1e-6)


def test_batchnorm_training_through_nnx_optimizer_matches_functional_api():
  model, bn_loss, tx = bn_setup(inner_lr=1e-2)
  _, batches = model_state_tests.problem()
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
  traces = nnx_train(model, bn_loss, tx, batches, steps=3)
  assert len(traces) == 1

  @jax.jit
  def step(params, state, stats):
    updates, state = tx.update(None, state, params, loss_fn=bn_loss,
                               batches=batches, model_state=stats)
    return (optax.apply_updates(params, updates), state,
            optax.tree_utils.tree_get(state, "model_state"))

  state = tx.init(params)
  for _ in range(3):
    params, state, stats = step(params, state, stats)
  # The same operations compiled in both programs: bit for bit (under
  # --xla_cpu_max_isa SSE4_2, AVX, AVX2 and AVX-512 alike).
  for kind, expected in ((nnx.Param, params), (nnx.BatchStat, stats)):
    got = nnx.as_pure(nnx.state(model, kind))
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(a, b)


# --- Orbax --------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: pgrad_jax.pgrad(optax.adam(0.1), B=2),
    lambda: pgrad_jax.pgrad(optax.adam(0.1), B=2, num_domains=2),
    lambda: pgrad_jax.fish(optax.adam(0.1), num_domains=2),
], ids=["pgrad", "pgrad-num_domains", "fish"])
def test_state_round_trips_through_orbax(make, tmp_path):
  params, batches = transform_tests.problem()
  tx = make()
  _, state = transform_tests.update(tx, params, batches)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "state", state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  # Resuming from the restored state continues exactly.
  after, _ = transform_tests.update(tx, params, batches, state=restored)
  expected, _ = transform_tests.update(tx, params, batches, state=state)
  np.testing.assert_array_equal(transform_tests.flat(after),
                                transform_tests.flat(expected))
