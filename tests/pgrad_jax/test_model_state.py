"""Model state (e.g. BatchNorm running statistics) threaded through a rollout
(a Flax NNX BatchNorm: tests/integration/test_flax_and_orbax.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
