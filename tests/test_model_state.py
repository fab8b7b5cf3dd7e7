"""Model state (e.g. BatchNorm running statistics) threaded through a rollout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pgrad_jax

MOMENTUM = 0.9


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def stateful_loss(params, batch, model_state):
  """``loss_fn`` plus a BatchNorm-like running mean of the inputs it sees."""
  mean = MOMENTUM * model_state["mean"] + (1 - MOMENTUM) * batch["x"].mean(0)
  return loss_fn(params, batch), {"mean": mean,
                                  "count": model_state["count"] + 1}


def problem(n=3, b=6):
  x = jax.random.normal(jax.random.key(0), (n, b, 4))
  y = x @ jnp.array([1.0, -1.0, 0.5, 2.0]) + jnp.arange(n)[:, None]
  return {"w": jnp.zeros(4)}, {"x": x, "y": y}


def initial_model_state():
  return {"mean": jnp.zeros(4), "count": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("make", [
    lambda: pgrad_jax.pgrad(optax.adam(0.1), k=2, B=2, order="fixed"),
    lambda: pgrad_jax.fish(optax.adam(0.1), B=2, order="fixed"),
])
def test_state_follows_the_rollout_steps(make):
  tx = make()
  params, batches = problem()
  state, model_state = tx.init(params), initial_model_state()
  for _ in range(2):
    updates, state = tx.update(None, state, params, loss_fn=stateful_loss,
                               batches=batches, model_state=model_state)
    model_state = state.model_state
  # Independent float64 replay: fixed order, round i visits every domain on
  # chunk i; two outer updates.
  x = np.asarray(batches["x"], np.float64)
  mean = np.zeros(4)
  for _ in range(2):
    for chunk in range(2):
      for domain in range(3):
        mean = MOMENTUM * mean + (1 - MOMENTUM) * x[
            domain, 3 * chunk:3 * (chunk + 1)].mean(0)
  np.testing.assert_allclose(model_state["mean"], mean, rtol=1e-5)
  assert int(model_state["count"]) == 12


def test_stateful_loss_gives_the_stateless_update():
  tx = pgrad_jax.pgrad(optax.adam(0.1), k=2, B=2)
  params, batches = problem()
  stateless, _ = tx.update(None, tx.init(params), params, loss_fn=loss_fn,
                           batches=batches)
  stateful, _ = tx.update(None, tx.init(params), params,
                          loss_fn=stateful_loss, batches=batches,
                          model_state=initial_model_state())
  np.testing.assert_array_equal(stateful["w"], stateless["w"])


@pytest.mark.parametrize("wrapped", [False, True])
def test_jitted_chain_traces_once_with_model_state(wrapped):
  tx = optax.chain(pgrad_jax.pgrad(optax.adam(0.1), k=2, num_domains=3),
                   optax.sgd(0.1))
  if wrapped:
    tx = pgrad_jax.with_model_state(tx, initial_model_state())
  params, batches = problem()
  traces = []

  @jax.jit
  def train_step(params, state, model_state):
    traces.append(None)
    updates, state = tx.update(None, state, params, loss_fn=stateful_loss,
                               batches=batches, model_state=model_state)
    # Read by name, through the chain.
    model_state = optax.tree_utils.tree_get(state, "model_state")
    return optax.apply_updates(params, updates), state, model_state

  state, model_state = tx.init(params), initial_model_state()
  for _ in range(3):
    params, state, model_state = train_step(params, state, model_state)
  # Unwrapped, init's state holds None where the first update's holds the
  # model state, so the step is traced for each of the two structures;
  # wrapped, init's state already holds one.
  assert len(traces) == (1 if wrapped else 2)
  assert int(model_state["count"]) == 9


def test_with_model_state_needs_a_model_state_like_its_own():
  params, batches = problem()
  tx = pgrad_jax.with_model_state(pgrad_jax.fish(optax.adam(0.1)),
                                  initial_model_state())
  state = tx.init(params)
  with pytest.raises(ValueError, match="every update needs one"):
    tx.update(None, state, params, loss_fn=stateful_loss, batches=batches)
  wider = {"mean": jnp.zeros(5), "count": jnp.zeros((), jnp.int32)}
  with pytest.raises(ValueError, match=r"expected .*\(4,\).*got .*\(5,\)"):
    tx.update(None, state, params, loss_fn=stateful_loss, batches=batches,
              model_state=wider)


def test_with_model_state_needs_a_rollout_transform():
  tx = pgrad_jax.with_model_state(optax.adam(0.1), initial_model_state())
  with pytest.raises(ValueError, match="needs a transform whose state has a "
                     "model_state field"):
    tx.init({"w": jnp.zeros(4)})


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
  _, batches = problem()
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
  _, batches = problem()
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
