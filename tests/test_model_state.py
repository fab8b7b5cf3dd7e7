"""Model state (e.g. BatchNorm running statistics) threaded through a rollout."""

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


def test_jitted_chain_compiles_once_per_state_structure():
  tx = optax.chain(pgrad_jax.pgrad(optax.adam(0.1), k=2, num_domains=3),
                   optax.sgd(0.1))
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
  # init's state holds no model state; the first update's holds one, so the
  # step is traced for each of the two structures, then never again.
  assert len(traces) == 2
  assert int(model_state["count"]) == 9


def test_nonfinite_keeps_the_old_model_state():
  tx = pgrad_jax.pgrad(optax.adam(0.1), k=2)
  params, batches = problem()
  batches["x"] = batches["x"].at[1, 0, 0].set(jnp.nan)
  before = initial_model_state()
  updates, state = tx.update(None, tx.init(params), params,
                             loss_fn=stateful_loss, batches=batches,
                             model_state=before)
  assert int(state.num_skipped) == 1
  np.testing.assert_array_equal(updates["w"], 0.0)
  np.testing.assert_array_equal(state.model_state["mean"], before["mean"])
  assert int(state.model_state["count"]) == 0


def test_new_model_state_must_match():
  tx = pgrad_jax.pgrad(optax.adam(0.1))
  params, batches = problem()
  state, model_state = tx.init(params), initial_model_state()

  def wrong_shape(params, batch, model_state):
    return loss_fn(params, batch), {**model_state, "mean": batch["x"]}

  with pytest.raises(TypeError, match="shapes and dtypes of the model state"):
    tx.update(None, state, params, loss_fn=wrong_shape, batches=batches,
              model_state=model_state)
  with pytest.raises(TypeError, match=r"return \(loss, new_model_state\)"):
    tx.update(None, state, params, loss_fn=lambda p, b, s: loss_fn(p, b),
              batches=batches, model_state=model_state)


def test_model_state_excludes_has_aux():
  tx = pgrad_jax.pgrad(optax.adam(0.1), has_aux=True)
  params, batches = problem()
  with pytest.raises(ValueError, match="has_aux=True cannot be combined"):
    tx.update(None, tx.init(params), params, loss_fn=stateful_loss,
              batches=batches, model_state=initial_model_state())
