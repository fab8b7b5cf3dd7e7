"""The domain schedule, directly and as the transform visits it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pgrad_jax


def id_loss(params, batch):
  # The loss reveals which examples the step saw, whatever the params.
  return jnp.mean(batch["id"]) + 0.0 * jnp.sum(params["w"])


def id_batches(n, b):
  ids = np.arange(n * b, dtype=np.float32).reshape(n, b)
  return {"id": jnp.asarray(ids)}


def visited(order, n=4, num_chunks=3, b=6, seed=0):
  tx = pgrad_jax.pgrad(optax.sgd(0.1), B=num_chunks, order=order,
                       num_domains=n, seed=seed)
  params = {"w": jnp.ones(2)}
  _, state = tx.update(None, tx.init(params), params, loss_fn=id_loss,
                       batches=id_batches(n, b))
  c = b // num_chunks
  # Mean id of domain d's chunk i is d*b + i*c + (c-1)/2.
  means = np.asarray(state.losses) - (c - 1) / 2
  return [(int(v // b), int(v % b) // c) for v in np.round(means)]


def test_fixed_order_schedule():
  assert visited("fixed") == [(d, i) for i in range(3) for d in range(4)]


def test_random_order_is_a_permutation_per_round():
  steps = visited("random")
  for i in range(3):
    round_i = steps[4 * i: 4 * (i + 1)]
    assert sorted(d for d, _ in round_i) == list(range(4))
    assert all(c == i for _, c in round_i)


def test_seed_controls_the_order():
  assert visited("random", seed=1) == visited("random", seed=1)
  orders = {tuple(visited("random", seed=s)) for s in range(4)}
  assert len(orders) > 1


def test_order_changes_between_updates():
  tx = pgrad_jax.pgrad(optax.sgd(0.1), B=1, num_domains=5)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  seen = set()
  for _ in range(4):
    _, state = tx.update(None, state, params, loss_fn=id_loss,
                         batches=id_batches(5, 2))
    seen.add(tuple(np.asarray(state.losses).tolist()))
  assert len(seen) > 1


def test_domain_schedule_function():
  domains, chunks = pgrad_jax.domain_schedule(jax.random.PRNGKey(0), 3, 2,
                                              "fixed")
  assert domains.tolist() == [0, 1, 2, 0, 1, 2]
  assert chunks.tolist() == [0, 0, 0, 1, 1, 1]


def test_domain_schedule_rejects_an_unknown_order():
  with pytest.raises(ValueError, match="order must be one of"):
    pgrad_jax.domain_schedule(jax.random.PRNGKey(0), 3, 2, "sorted")
