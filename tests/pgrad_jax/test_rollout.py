"""The rollout: its domain schedule, its steps, its trajectory in either
layout, its options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pgrad_jax
from pgrad_jax._src import trajectory as trajectory_lib

Layout = pgrad_jax.TrajectoryLayout


def stacked(trajectory):
  """Every stored step of either layout, stacked: ``(s, *leaf_shape)``."""
  steps = trajectory_lib.num_steps(trajectory)
  points = [trajectory_lib.point(trajectory, i) for i in range(steps)]
  return jax.tree.map(lambda *p: np.stack(p), *points)


def dense_loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2)


@pytest.mark.parametrize("layout", [
    Layout(1, None), Layout(2, None), Layout(True, None), Layout(1, 2),
    Layout(2, 3), Layout(True, 2), Layout(1, None, True),
    Layout(True, 2, True)], ids=str)
def test_trajectory_matches_plain_python_steps(layout):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)}
  batches = {"x": jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)}
  domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 2, 2,
                                              "fixed")
  inner = optax.sgd(0.1)
  # Plain Python steps: the reference trajectory.
  theta, expected = params, []
  for d, c in zip(np.asarray(domains), np.asarray(chunks)):
    chunk = {"x": batches["x"][d, 2 * c:2 * c + 2]}
    theta = jax.tree.map(lambda t, g: t - 0.1 * g, theta,
                         jax.grad(dense_loss)(theta, chunk))
    expected.append(np.asarray(theta["w"] - params["w"]))
  out = pgrad_jax.rollout(dense_loss, inner, params, inner.init(params),
                          batches, domains, chunks,
                          pgrad_jax.RolloutOptions(B=2),
                          layout=layout)
  block = layout.interleave_block
  if layout.contiguous:  # 6 parameters in blocks of 2, or in one.
    assert out.displacements.blocks.shape == ((3, 4, 2) if block else
                                              (1, 4, 6))
    block = None
  stored = stacked(out.displacements)["w"] if layout.contiguous else (
      out.displacements["w"])
  assert isinstance(stored, trajectory_lib.InterleavedLeaf) == (
      block is not None)
  if block is not None:
    assert stored.blocks.shape == (6 // block, 5, block)
    np.testing.assert_array_equal(np.asarray(stored.blocks[:, 0]), 0.0)
  for step in (0, 2, -1):
    np.testing.assert_array_equal(np.asarray(out.point(step)["w"]),
                                  np.asarray(stacked(
                                      out.displacements)["w"][step]))
  np.testing.assert_allclose(
      np.asarray(stacked(out.displacements)["w"]),
      np.stack(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("unroll", [1, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_rollout_without_trajectory_keeps_the_end(unroll, parallel):
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
            "b": jnp.zeros((2,), jnp.float32)}
  batches = {"x": jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)}
  domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 2, 2,
                                              "fixed")
  inner = optax.adam(0.1)

  def run(store):
    return pgrad_jax.rollout(
        lambda p, b: dense_loss(p, b) + jnp.sum(p["b"] ** 2), inner, params,
        inner.init(params), batches, domains, chunks,
        pgrad_jax.RolloutOptions(B=2, unroll=unroll,
                                 parallel=parallel, store_trajectory=store))

  full, end = run(True), run(False)
  for name in params:
    assert end.displacements[name].shape == (1,) + params[name].shape
    np.testing.assert_array_equal(np.asarray(end.point(-1)[name]),
                                  np.asarray(full.point(-1)[name]))
  np.testing.assert_array_equal(np.asarray(end.losses),
                                np.asarray(full.losses))
  for a, b in zip(jax.tree.leaves(end.inner_state),
                  jax.tree.leaves(full.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layout", [Layout(1, None), Layout(1, 1024),
                                    Layout(True, 1024),
                                    Layout(1, None, True)], ids=str)
def test_same_shaped_leaves_get_their_own_trajectory_buffers(layout):
  # XLA merges equal zero broadcasts; the loop writing two trajectories in
  # place would then copy the merged buffer. No trajectory-shaped copy here.
  params = {name: jnp.ones((64, 64)) for name in "abc"}
  batches = {"x": jnp.ones((3, 6, 64))}

  def loss(p, batch):
    return jnp.mean((batch["x"] @ p["a"] @ p["b"] @ p["c"]) ** 2)

  def update(p):
    domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 3, 2,
                                                "fixed")
    inner = optax.sgd(0.1)
    out = pgrad_jax.rollout(loss, inner, p, inner.init(p), batches, domains,
                            chunks, pgrad_jax.RolloutOptions(B=2),
                            layout=layout)
    return pgrad_jax.principal_gradient(out.displacements, 2).update

  hlo = jax.jit(update).lower(params).compile().as_text()
  shape = ("1,6,12288" if layout.contiguous else
           "6,64,64" if layout.interleave_block is None else "4,7,1024")
  entry = hlo[hlo.index("ENTRY"):]
  copies = [line for line in entry.splitlines()
            if f"f32[{shape}]" in line and " copy(" in line]
  assert not copies
  assert entry.count(f"f32[{shape}]") >= 3


@pytest.mark.parametrize("kw, match", [
    (dict(B=0), "B must be a positive integer"),
    (dict(B=2.0), "B must be a positive integer"),
    (dict(unroll=0), "unroll must be a positive integer"),
])
def test_options_reject_bad_values(kw, match):
  with pytest.raises(ValueError, match=match):
    pgrad_jax.RolloutOptions(**kw)


def test_options_take_integral_values():
  assert pgrad_jax.RolloutOptions(B=np.int64(3)).B == 3
  assert type(pgrad_jax.RolloutOptions(B=np.int64(3)).B) is int


# --- the domain schedule, directly and as the transform visits it ----------


def id_loss(params, batch):
  # The loss reveals which examples the step saw, whatever the params.
  return jnp.mean(batch["id"]) + 0.0 * jnp.sum(params["w"])


def id_batches(n, b):
  ids = np.arange(n * b, dtype=np.float32).reshape(n, b)
  return {"id": jnp.asarray(ids)}


def visited(order, n=4, B=3, b=6, seed=0):
  tx = pgrad_jax.pgrad(optax.sgd(0.1), B=B, order=order,
                       num_domains=n, seed=seed)
  params = {"w": jnp.ones(2)}
  _, state = tx.update(None, tx.init(params), params, loss_fn=id_loss,
                       batches=id_batches(n, b))
  c = b // B
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
