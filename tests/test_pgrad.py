"""pgrad and fish against the float64 NumPy oracle, plus their properties."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import pgrad_jax
import oracle
from pgrad_jax._src import interleave

N_IN, N_OUT = 3, 2


def linear_loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def problem(num_domains=3, batch=6, seed=0, dtype=jnp.float64):
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(N_IN, N_OUT)), "b": rng.normal(size=N_OUT)}
  # Each domain has its own target map, so the domains pull apart.
  x = rng.normal(size=(num_domains, batch, N_IN))
  maps = rng.normal(size=(num_domains, N_IN, N_OUT))
  y = np.einsum("nbi,nio->nbo", x, maps) + 0.1 * rng.normal(
      size=(num_domains, batch, N_OUT))
  cast = lambda a: jnp.asarray(a, dtype)
  return jax.tree.map(cast, params), {"x": cast(x), "y": cast(y)}


def flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def fixed_schedule(n, num_chunks):
  return [(d, c) for c in range(num_chunks) for d in range(n)]


def run(tx, params, batches, steps=1):
  state = tx.init(params)
  for _ in range(steps):
    updates, state = tx.update(None, state, params, loss_fn=linear_loss,
                               batches=batches)
  return updates, state


# --- exactness against the NumPy oracle --------------------------------------

OPTIONS = [
    dict(),
    dict(weighting="l1"),
    dict(weighting="raw"),
    dict(calibrate_length=False),
    dict(components="bottom"),
    dict(parallel=True),
    dict(k=100),
]


@pytest.mark.parametrize("block", [2, 3])
def test_interleaved_trajectory_matches_numpy_oracle(monkeypatch, block):
  # On one CPU device pgrad stores leaves whose size the block divides
  # interleaved: block 2 takes both leaves (sizes 6 and 2), block 3 only w.
  monkeypatch.setattr(interleave, "CPU_BLOCK", block)
  with jax.enable_x64(True):
    params, batches = problem()
    domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 3, 3,
                                                "fixed")
    inner = optax.adam(0.05)
    stored = pgrad_jax.rollout(
        linear_loss, inner, params, inner.init(params), batches, domains,
        chunks, num_chunks=3, interleave=interleave.default_block())
    kinds = {k: isinstance(v, pgrad_jax.Interleaved)
             for k, v in stored.displacements.items()}
    assert kinds == {"w": True, "b": block == 2}
    tx = pgrad_jax.pgrad(inner, k=2, B=3, order="fixed")
    updates, _ = jax.jit(lambda s, p: tx.update(
        None, s, p, loss_fn=linear_loss, batches=batches))(
            tx.init(params), params)
    points, _ = oracle.trajectory(
        flat(params), np.asarray(batches["x"]), np.asarray(batches["y"]),
        fixed_schedule(3, 3), 3, oracle.Adam(0.05, 8), N_IN, N_OUT)
    np.testing.assert_allclose(flat(updates),
                               oracle.principal_gradient(points, 2),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_matches_numpy_oracle(options, num_chunks):
  options = dict(options)
  k = options.pop("k", 2)
  parallel = options.get("parallel", False)
  with jax.enable_x64(True):
    params, batches = problem()
    tx = pgrad_jax.pgrad(optax.adam(0.05), k=k, B=num_chunks, order="fixed",
                         **options)
    state = tx.init(params)
    adam = oracle.Adam(0.05, 8)
    theta0 = flat(params)
    # Two outer steps: the inner Adam state must carry over between them.
    for _ in range(2):
      updates, state = tx.update(None, state, params, loss_fn=linear_loss,
                                 batches=batches)
      points, losses = oracle.trajectory(
          theta0, np.asarray(batches["x"]), np.asarray(batches["y"]),
          fixed_schedule(3, num_chunks), num_chunks, adam, N_IN, N_OUT,
          parallel=parallel)
      expected = oracle.principal_gradient(
          points, k, weighting=options.get("weighting", "l2"),
          calibrate_length=options.get("calibrate_length", True),
          components=options.get("components", "top"),
          reference="mean" if parallel else "end")
      np.testing.assert_allclose(flat(updates), expected, rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(np.asarray(state.loss), losses.mean(),
                                 rtol=1e-6)
      params = optax.apply_updates(params, jax.tree.map(lambda u: 0.1 * u,
                                                        updates))
      theta0 = flat(params)


def test_eigenvalues_match_covariance_spectrum():
  with jax.enable_x64(True):
    params, batches = problem()
    tx = pgrad_jax.pgrad(optax.adam(0.05), k=2, B=2, order="fixed",
                         num_domains=3)
    _, state = run(tx, params, batches)
    points, losses = oracle.trajectory(
        flat(params), np.asarray(batches["x"]), np.asarray(batches["y"]),
        fixed_schedule(3, 2), 2, oracle.Adam(0.05, 8), N_IN, N_OUT)
    centred = points - points.mean(0)
    lam = np.sort(np.linalg.eigvalsh(centred.T @ centred))[::-1]
    m = points.shape[0]
    assert state.eigenvalues.shape == (m,)
    # m = 7 > d = 8? no: d = 8 >= m, so the top m-1 agree and the rest is 0.
    np.testing.assert_allclose(state.eigenvalues[: m - 1], lam[: m - 1],
                               rtol=1e-5)
    assert abs(float(state.eigenvalues[-1])) < 1e-6 * float(lam[0])
    np.testing.assert_allclose(state.losses, losses, rtol=1e-5)
    r = points[0] - points[-1]
    np.testing.assert_allclose(state.ref_norm, np.linalg.norm(r), rtol=1e-5)


# --- properties ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_length_and_orientation(seed):
  params, batches = problem(seed=seed, dtype=jnp.float32)
  tx = pgrad_jax.pgrad(optax.adam(0.05), k=3, B=2, seed=seed)
  updates, state = run(tx, params, batches)
  g = flat(updates)
  np.testing.assert_allclose(np.linalg.norm(g), state.ref_norm, rtol=1e-4)
  # r = theta_0 - theta_end, and the update must point along it.
  fish_updates, _ = run(pgrad_jax.fish(optax.adam(0.05), B=2, seed=seed),
                        params, batches)
  r = flat(fish_updates)
  np.testing.assert_allclose(np.linalg.norm(r), state.ref_norm, rtol=1e-5)
  assert g @ r >= 0


def test_unit_length_without_calibration():
  params, batches = problem(dtype=jnp.float32)
  tx = pgrad_jax.pgrad(optax.adam(0.05), k=3, B=2, calibrate_length=False)
  updates, _ = run(tx, params, batches)
  np.testing.assert_allclose(np.linalg.norm(flat(updates)), 1.0, rtol=1e-4)


def test_single_step_is_the_step_itself():
  with jax.enable_x64(True):
    params, batches = problem(num_domains=1)
    updates, _ = run(pgrad_jax.pgrad(optax.adam(0.05), k=4, B=1), params,
                     batches)
    inner = optax.adam(0.05)
    step, _ = inner.update(
        jax.grad(linear_loss)(params, jax.tree.map(lambda x: x[0], batches)),
        inner.init(params), params)
    # theta_0 - theta_1 is minus the inner step.
    np.testing.assert_allclose(flat(updates), -flat(step), rtol=1e-12)


def test_fish_is_start_minus_end():
  with jax.enable_x64(True):
    params, batches = problem()
    updates, _ = run(pgrad_jax.fish(optax.adam(0.05), B=2, order="fixed"),
                     params, batches)
    points, _ = oracle.trajectory(
        flat(params), np.asarray(batches["x"]), np.asarray(batches["y"]),
        fixed_schedule(3, 2), 2, oracle.Adam(0.05, 8), N_IN, N_OUT)
    np.testing.assert_allclose(flat(updates), points[0] - points[-1],
                               rtol=1e-9)


def test_zero_learning_rate_gives_zero_update():
  params, batches = problem(dtype=jnp.float32)
  tx = pgrad_jax.pgrad(optax.sgd(0.0), k=4, B=3, num_domains=3)
  updates, state = run(tx, params, batches)
  assert np.all(flat(updates) == 0)
  assert np.all(np.isfinite(np.asarray(state.eigenvalues)))
  assert int(state.num_skipped) == 0


# --- the domain schedule --------------------------------------------------------


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
