"""pgrad and fish: against the NumPy oracle, their properties, errors,
options, jit, dtypes and Optax wrappers (with Flax and Orbax:
tests/integration/test_flax_and_orbax.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import oracle
import pgrad_jax


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def problem(n=2, b=6, dtype=jnp.float32):
  x = jax.random.normal(jax.random.key(0), (n, b, 3), dtype)
  y = jnp.sin(x.sum(-1)) + jnp.arange(n, dtype=dtype)[:, None]
  params = {"w": jnp.full((3,), 0.1, dtype), "b": jnp.zeros((), dtype)}
  return params, {"x": x, "y": y}


def update(tx, params, batches, state=None, grads=None, **kw):
  """``tx.update`` from ``state`` (default: a fresh one), jitted as a
  training step runs it.

  Op by op, every op of an update compiles on its own, which took most of
  the tests' time; test_update_keeps_the_state_structure_and_matches_jit
  checks eager updates against jitted ones. Two transforms that compute the
  same operations give the same bits when both are compiled (measured under
  --xla_cpu_max_isa SSE4_2, AVX, AVX2 and AVX-512; eager, op by op, rounds
  differently: up to 4e-7 apart in float32).
  """
  state = tx.init(params) if state is None else state
  loss = kw.pop("loss_fn", loss_fn)
  return jax.jit(lambda g, s, p, b: tx.update(g, s, p, loss_fn=loss,
                                              batches=b, **kw))(
                                                  grads, state, params,
                                                  batches)


def flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


# --- against the float64 NumPy oracle -------------------------------------------

N_IN, N_OUT = oracle.N_IN, oracle.N_OUT


def linear_loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def linear_problem(num_domains=3, batch=6, seed=0, dtype=jnp.float64):
  cast = lambda a: jnp.asarray(a, dtype)
  return jax.tree.map(cast, oracle.linear_problem(num_domains, batch, seed))


fixed_schedule = oracle.fixed_schedule


def oracle_rtol(points, k, components):
  """The rtol of a float64 principal gradient against the oracle's.

  ``eigh``'s first-order error in a component of eigenvalue ``lambda`` is
  about ``eps * lambda_max / lambda``: well-conditioned top components agree
  to ~1e-15, but the bottom ones of the second B = 3 update
  (``lambda_max / lambda = 2.5e6``) differ by up to 0.8 times that under
  --xla_cpu_max_isa SSE4_2 (0.15 times under AVX, AVX2 and AVX-512). The
  tolerance is 10 times the bound of the smallest chosen component, and at
  least 1e-9.
  """
  centred = points - points.mean(0)
  lam = np.linalg.eigvalsh(centred @ centred.T)[::-1]
  lam = lam[lam > 1e-9 * lam[0]]  # The oracle's cut-off.
  chosen = lam[:k] if components == "top" else lam[-k:]
  return max(1e-9, 10 * np.finfo(np.float64).eps * lam[0] / chosen.min())


def linear_step(tx):
  """``tx``'s update of `linear_loss`, jitted."""
  return jax.jit(lambda s, p, b: tx.update(None, s, p, loss_fn=linear_loss,
                                           batches=b))


def run(tx, params, batches, steps=1):
  state = tx.init(params)
  step = linear_step(tx)
  for _ in range(steps):
    updates, state = step(state, params, batches)
  return updates, state


@pytest.mark.parametrize("options", oracle.OPTION_CASES, ids=str)
@pytest.mark.parametrize("B", [1, 3])
def test_matches_numpy_oracle(options, B):
  options = dict(options)
  k = options.pop("k", 2)
  # PGradParallel is pgrad's option for the oracle's mean reference.
  parallel = options.pop("reference", "end") == "mean"
  with jax.enable_x64(True):
    params, batches = linear_problem()
    tx = pgrad_jax.pgrad(optax.adam(0.05), k=k, B=B, order="fixed",
                         principal=pgrad_jax.PrincipalOptions(**options),
                         parallel=parallel)
    state = tx.init(params)
    adam = oracle.Adam(0.05, 8)
    theta0 = flat(params)
    step = linear_step(tx)
    # Two outer steps: the inner Adam state must carry over between them.
    for _ in range(2):
      updates, state = step(state, params, batches)
      points, losses = oracle.trajectory(
          theta0, np.asarray(batches["x"]), np.asarray(batches["y"]),
          fixed_schedule(3, B), B, adam, N_IN, N_OUT,
          parallel=parallel)
      expected = oracle.principal_gradient(
          points, k, reference="mean" if parallel else "end", **options)
      np.testing.assert_allclose(
          flat(updates), expected, atol=1e-12,
          rtol=oracle_rtol(points, k, options.get("components", "top")))
      np.testing.assert_allclose(np.asarray(state.loss), losses.mean(),
                                 rtol=1e-6)
      params = optax.apply_updates(params, jax.tree.map(lambda u: 0.1 * u,
                                                        updates))
      theta0 = flat(params)


def test_eigenvalues_match_covariance_spectrum():
  with jax.enable_x64(True):
    params, batches = linear_problem()
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
  params, batches = linear_problem(seed=seed, dtype=jnp.float32)
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
  params, batches = linear_problem(dtype=jnp.float32)
  tx = pgrad_jax.pgrad(
      optax.adam(0.05), k=3, B=2,
      principal=pgrad_jax.PrincipalOptions(calibrate_length=False))
  updates, _ = run(tx, params, batches)
  np.testing.assert_allclose(np.linalg.norm(flat(updates)), 1.0, rtol=1e-4)


def test_single_step_is_the_step_itself():
  with jax.enable_x64(True):
    params, batches = linear_problem(num_domains=1)
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
    params, batches = linear_problem()
    updates, _ = run(pgrad_jax.fish(optax.adam(0.05), B=2, order="fixed"),
                     params, batches)
    points, _ = oracle.trajectory(
        flat(params), np.asarray(batches["x"]), np.asarray(batches["y"]),
        fixed_schedule(3, 2), 2, oracle.Adam(0.05, 8), N_IN, N_OUT)
    np.testing.assert_allclose(flat(updates), points[0] - points[-1],
                               rtol=1e-9)


def test_zero_learning_rate_gives_zero_update():
  params, batches = linear_problem(dtype=jnp.float32)
  tx = pgrad_jax.pgrad(optax.sgd(0.0), k=4, B=3, num_domains=3)
  updates, state = run(tx, params, batches)
  assert np.all(flat(updates) == 0)
  assert np.all(np.isfinite(np.asarray(state.eigenvalues)))
  assert int(state.num_skipped) == 0



# --- bad input ----------------------------------------------------------------


BAD_SHARED_OPTIONS = [
    (dict(B=0), "B must be a positive integer"),
    (dict(B=2.0), "B must be a positive integer"),
    (dict(order="sorted"), "order must be one of"),
    (dict(nonfinite="ignore"), "nonfinite must be one of"),
    (dict(num_domains=0), "num_domains must be a positive integer"),
]


@pytest.mark.parametrize("kw, match", BAD_SHARED_OPTIONS + [
    (dict(k=0), "k must be a positive integer")])
def test_bad_construction(kw, match):
  with pytest.raises(ValueError, match=match):
    pgrad_jax.pgrad(optax.sgd(0.1), **kw)


@pytest.mark.parametrize("kw, match", BAD_SHARED_OPTIONS)
def test_bad_fish_construction(kw, match):
  with pytest.raises(ValueError, match=match):
    pgrad_jax.fish(optax.sgd(0.1), **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(weighting="l3"), "weighting must be one of"),
    (dict(components="middle"), "components must be one of"),
    (dict(rtol=-1e-3), r"rtol must be None or a number in \[0, 1\)"),
    (dict(rtol=1.0), r"rtol must be None or a number in \[0, 1\)"),
    (dict(rtol="1e-3"), r"rtol must be None or a number in \[0, 1\)"),
    (dict(gram_dtype=jnp.int32), "gram_dtype must be a floating-point dtype"),
])
def test_bad_principal_options(kw, match):
  with pytest.raises(ValueError, match=match):
    pgrad_jax.PrincipalOptions(**kw)


def test_principal_must_be_principal_options():
  with pytest.raises(TypeError, match=r"principal=pgrad_jax.PrincipalOptions\("):
    pgrad_jax.pgrad(optax.sgd(0.1), principal={"components": "bottom"})


def test_batch_not_divisible_by_B_names_working_sizes():
  params, batches = problem(b=7)
  with pytest.raises(ValueError, match=r"B=3 does not divide.*7.*6 or 9"):
    update(pgrad_jax.pgrad(optax.sgd(0.1), B=3), params, batches)


def test_leaves_disagree():
  params, batches = problem()
  batches["y"] = batches["y"][:, :4]
  with pytest.raises(ValueError, match=r"disagree.*\['x'\]: \(2, 6\).*\['y'\]: \(2, 4\)"):
    update(pgrad_jax.pgrad(optax.sgd(0.1)), params, batches)


def test_leaf_without_domain_axis():
  params, batches = problem()
  batches["y"] = batches["y"][0]
  with pytest.raises(ValueError, match="leading axes"):
    update(pgrad_jax.pgrad(optax.sgd(0.1)), params, batches)


def test_non_callable_loss():
  params, batches = problem()
  with pytest.raises(TypeError, match="loss_fn must be a callable"):
    update(pgrad_jax.pgrad(optax.sgd(0.1)), params, batches, loss_fn="mse")


def test_missing_extras():
  params, batches = problem()
  tx = pgrad_jax.pgrad(optax.sgd(0.1))
  with pytest.raises(TypeError, match="needs loss_fn"):
    tx.update(None, tx.init(params), params, batches=batches)
  with pytest.raises(ValueError, match="needs batches"):
    tx.update(None, tx.init(params), params, loss_fn=loss_fn)


@pytest.mark.parametrize("make", [pgrad_jax.pgrad, pgrad_jax.fish])
def test_another_transforms_state_is_refused(make):
  params, batches = problem()
  tx = make(optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"needs the state that .*init returned; "
                     "got ScaleByAdamState"):
    tx.update(None, optax.scale_by_adam().init(params), params,
              loss_fn=loss_fn, batches=batches)


def test_non_scalar_loss():
  params, batches = problem()
  per_example = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2
  with pytest.raises(TypeError, match="scalar floating-point loss.*shape=\\(6,\\)"):
    update(pgrad_jax.pgrad(optax.sgd(0.1)), params, batches, loss_fn=per_example)


def test_loss_with_aux_says_how_to_drop_it():
  params, batches = problem()
  with_aux = lambda p, b: (loss_fn(p, b), {"n": 1.0})
  with pytest.raises(TypeError, match=r"loss_fn=lambda p, b: f\(p, b\)\[0\]"):
    update(pgrad_jax.pgrad(optax.sgd(0.1)), params, batches, loss_fn=with_aux)


def test_num_domains_mismatch():
  params, batches = problem(n=2)
  with pytest.raises(ValueError, match="num_domains=2"):
    update(pgrad_jax.pgrad(optax.sgd(0.1), num_domains=3), params, batches)


def test_integer_params_rejected():
  with pytest.raises(TypeError, match="floating-point params"):
    pgrad_jax.pgrad(optax.sgd(0.1)).init({"w": jnp.zeros(2), "step": 0})


# --- non-finite losses --------------------------------------------------------


@pytest.mark.parametrize("make", [pgrad_jax.pgrad, pgrad_jax.fish])
def test_nonfinite_update_is_skipped(make):
  params, batches = problem()
  batches["x"] = batches["x"].at[1, 0, 0].set(jnp.nan)
  tx = make(optax.adam(0.1))
  state = tx.init(params)
  updates, new_state = update(tx, params, batches, state=state)
  assert np.all(flat(updates) == 0)
  assert int(new_state.num_skipped) == 1
  for new, old in zip(jax.tree.leaves(new_state.inner_state),
                      jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(new, old)
  # The PRNG still advances, so the next update draws a new order.
  assert not np.array_equal(new_state.key, state.key)


def test_nonfinite_propagates_when_asked():
  params, batches = problem()
  batches["x"] = batches["x"].at[1, 0, 0].set(jnp.nan)
  updates, _ = update(pgrad_jax.pgrad(optax.adam(0.1), nonfinite="propagate"),
                      params, batches)
  assert not np.all(np.isfinite(flat(updates)))


# --- options --------------------------------------------------------------------


def test_inner_state_carries_over_or_resets():
  params, batches = problem()
  for reset, expected in [(False, 4), (True, 2)]:
    tx = pgrad_jax.pgrad(optax.adam(0.1), reset_inner_state=reset)
    _, state = update(tx, params, batches)
    _, state = update(tx, params, batches, state=state)
    # Two domains, one chunk: two inner Adam steps per outer step.
    assert int(state.inner_state[0].count) == expected


@pytest.mark.parametrize("unroll", [1, 2, True])
def test_unroll_does_not_change_the_result(unroll):
  params, batches = problem()
  ref, _ = update(pgrad_jax.pgrad(optax.adam(0.1), B=3, unroll=True), params,
                  batches)
  out, _ = update(pgrad_jax.pgrad(optax.adam(0.1), B=3, unroll=unroll), params,
                  batches)
  np.testing.assert_allclose(flat(out), flat(ref), rtol=1e-5, atol=1e-7)


def test_bfloat16_trajectory_is_close():
  params, batches = problem(n=3)
  ref, _ = update(pgrad_jax.pgrad(optax.adam(0.05), B=2), params, batches)
  out, _ = update(pgrad_jax.pgrad(optax.adam(0.05), B=2,
                                  trajectory_dtype=jnp.bfloat16), params, batches)
  assert jax.tree.map(lambda u: u.dtype, out) == jax.tree.map(
      lambda p: p.dtype, params)
  ref, out = flat(ref), flat(out)
  cos = ref @ out / np.linalg.norm(ref) / np.linalg.norm(out)
  assert cos > 0.999
  np.testing.assert_allclose(np.linalg.norm(out), np.linalg.norm(ref), rtol=1e-2)


def test_chains_with_other_transforms():
  params, batches = problem()
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   pgrad_jax.pgrad(optax.adam(0.1), B=2),
                   optax.add_decayed_weights(1e-4), optax.sgd(0.1))
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = update(tx, params, batches, grads=grads, unused_extra=1)
  assert np.all(np.isfinite(flat(updates)))


# --- jit and dtypes -------------------------------------------------------------


@pytest.mark.parametrize("num_domains", [None, 2])
def test_jit_compiles_once(num_domains):
  params, batches = problem()
  traces = []

  def counted_loss(p, b):
    traces.append(1)
    return loss_fn(p, b)

  tx = optax.chain(pgrad_jax.pgrad(optax.adam(0.1), k=2, B=2,
                                   num_domains=num_domains), optax.sgd(0.1))

  @jax.jit
  def train_step(params, state, batches):
    updates, state = tx.update(None, state, params, loss_fn=counted_loss,
                               batches=batches)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  losses = []
  for _ in range(4):
    params, state = train_step(params, state, batches)
    losses.append(float(loss_fn(params, jax.tree.map(lambda x: x[0], batches))))
  assert train_step._cache_size() == 1
  first = len(traces)
  params, state = train_step(params, state, batches)
  assert len(traces) == first  # no retrace
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_dtypes(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    params, batches = problem(dtype=dtype)
    tx = pgrad_jax.pgrad(optax.adam(0.05), B=2, num_domains=2)
    updates, state = jax.jit(
        lambda p, s: tx.update(None, s, p, loss_fn=loss_fn, batches=batches)
    )(params, tx.init(params))
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    assert np.all(np.isfinite(flat(updates)))
    # Gram and eigh run in at least float32 (float64 for float64 params).
    assert state.eigenvalues.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(flat(updates)),
                               float(state.ref_norm),
                               rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4)


# --- degenerate input and integral options (checked when traced) -------------


@pytest.mark.parametrize("shape, match", [
    ((3, 0, 3), "empty batch per domain"),
    ((0, 6, 3), "zero domains"),
])
def test_degenerate_batches_are_rejected_when_traced(shape, match):
  params, _ = problem()
  batches = {"x": jnp.zeros(shape), "y": jnp.zeros(shape[:2])}
  tx = pgrad_jax.pgrad(optax.sgd(0.1))
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda s, p: tx.update(None, s, p, loss_fn=loss_fn,
                                   batches=batches)).lower(tx.init(params),
                                                           params)


@pytest.mark.parametrize("make", [pgrad_jax.pgrad, pgrad_jax.fish])
@pytest.mark.parametrize("params", [None, {}])
def test_init_needs_params(make, params):
  with pytest.raises(ValueError, match="init needs the params"):
    make(optax.sgd(0.1)).init(params)


def test_numpy_integers_are_accepted():
  params, batches = problem()
  ref, _ = update(pgrad_jax.pgrad(optax.adam(0.1), k=2, B=3, order="fixed",
                                  num_domains=2), params, batches)
  out, _ = update(pgrad_jax.pgrad(optax.adam(0.1), k=np.int64(2),
                                  B=np.int32(3), order="fixed",
                                  num_domains=np.int64(2)), params, batches)
  np.testing.assert_array_equal(flat(out), flat(ref))


def test_inject_hyperparams_with_static_k_and_B():
  params, batches = problem()
  tx = optax.inject_hyperparams(pgrad_jax.pgrad, static_args=("k", "B"))(
      inner_opt=optax.adam(0.1), k=2, B=3, order="fixed")
  out, _ = update(tx, params, batches)
  ref, _ = update(
      pgrad_jax.pgrad(optax.adam(0.1), k=2, B=3, order="fixed"), params,
      batches)
  np.testing.assert_array_equal(flat(out), flat(ref))


def test_inject_hyperparams_without_static_args_says_how():
  # k and B fix shapes: traced, they raise an error naming the fix.
  params, batches = problem()
  tx = optax.inject_hyperparams(pgrad_jax.pgrad)(
      inner_opt=optax.adam(0.1), k=2, B=3)
  step = jax.jit(lambda s, p: tx.update(None, s, p, loss_fn=loss_fn,
                                        batches=batches))
  with pytest.raises(TypeError, match=r"static_args=\('k', 'B'\)"):
    step(tx.init(params), params)


# --- Optax conventions and wrappers --------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: pgrad_jax.pgrad(optax.adam(0.1), B=2, num_domains=2),
    lambda: pgrad_jax.fish(optax.adam(0.1), B=2, num_domains=2),
], ids=["pgrad", "fish"])
def test_update_keeps_the_state_structure_and_matches_jit(make):
  params, batches = problem()
  tx = make()
  state = tx.init(params)
  eager, new_state = tx.update(None, state, params, loss_fn=loss_fn,
                               batches=batches)
  jitted, jit_state = jax.jit(lambda s, p: tx.update(
      None, s, p, loss_fn=loss_fn, batches=batches))(state, params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert jax.tree.map(jnp.shape, new_state) == jax.tree.map(jnp.shape, state)
  np.testing.assert_allclose(flat(eager), flat(jitted), rtol=1e-5, atol=1e-7)


def test_fish_state_has_no_spectrum():
  params, _ = problem()
  state = pgrad_jax.fish(optax.adam(0.1), num_domains=2).init(params)
  assert isinstance(state, pgrad_jax.FishState)
  assert "eigenvalues" not in state._fields


def test_fish_stores_no_trajectory():
  # Fish needs the end point only: its compiled step holds far less than
  # PGrad's, which keeps all m points (here m = 16, 2048 x 512 params).
  params = {"w": jnp.zeros((2048, 512))}
  batches = {"x": jnp.ones((5, 6, 2048))}
  dense_loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)

  def temp_bytes(tx):
    step = jax.jit(lambda s, p: tx.update(None, s, p, loss_fn=dense_loss,
                                          batches=batches))
    compiled = step.lower(tx.init(params), params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  point = 2048 * 512 * 4
  fish = temp_bytes(pgrad_jax.fish(optax.adam(0.1), B=3))
  pgrad = temp_bytes(pgrad_jax.pgrad(optax.adam(0.1), B=3))
  assert pgrad >= 15 * point
  assert fish <= 3 * point


def test_multisteps_keeps_only_the_last_calls_rollout():
  # pgrad ignores the incoming gradients, so MultiSteps has nothing to
  # accumulate: every call rolls out, and only the k-th call's rollout, on
  # its own batches and from the state of the last emitted step, is used.
  params, batches = problem()
  _, other = problem(b=6)
  other = jax.tree.map(lambda x: x[::-1], other)
  inner = lambda: pgrad_jax.pgrad(optax.adam(0.1), B=2)
  tx = optax.MultiSteps(inner(), every_k_schedule=2)
  zeros = jax.tree.map(jnp.zeros_like, params)
  first, state = update(tx, params, other, grads=zeros)
  second, state = update(tx, params, batches, state, grads=zeros)
  alone, _ = update(inner(), params, batches)
  assert np.all(flat(first) == 0)
  np.testing.assert_array_equal(flat(second), flat(alone))


def test_apply_if_finite_checks_only_the_incoming_gradients():
  # apply_if_finite looks at the updates pgrad is given, which pgrad ignores;
  # a non-finite rollout is caught by pgrad's own nonfinite="skip".
  params, batches = problem()
  batches["x"] = batches["x"].at[1, 0, 0].set(jnp.nan)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for nonfinite, finite_output in (("propagate", False), ("skip", True)):
    tx = optax.apply_if_finite(
        pgrad_jax.pgrad(optax.adam(0.1), nonfinite=nonfinite), 3)
    out, state = update(tx, params, batches, grads=zeros)
    assert bool(np.all(np.isfinite(flat(out)))) == finite_output
    assert int(state.total_notfinite) == 0


def test_inner_schedule_counts_inner_steps():
  # An inner schedule advances once per inner step: n * B per outer update.
  params, batches = problem()
  schedule = optax.linear_schedule(1e-2, 0.0, 10)
  tx = pgrad_jax.pgrad(optax.adam(schedule), B=3)
  state = tx.init(params)
  ref_norms = []
  for outer in range(1, 4):
    _, state = update(tx, params, batches, state=state)
    schedule_state = state.inner_state[1]
    assert int(schedule_state.count) == outer * 2 * 3
    ref_norms.append(float(state.ref_norm))
  # 12 inner steps in, the 10-step schedule has reached 0: the third rollout
  # does not move.
  assert ref_norms[2] < 1e-6 * ref_norms[0]



def mean_tracking_loss(params, batch, model_state):
  """``loss_fn`` with a model state: a running mean of the inputs."""
  mean = 0.9 * model_state["mean"] + 0.1 * batch["x"].mean((0, 1))
  return loss_fn(params, batch), {"mean": mean}


def paths(tree, keep=lambda leaf: True):
  return sorted(jax.tree_util.keystr(path)
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if keep(leaf))


# Each chain, the extras of its update, and the paths of its state's
# params-shaped leaves: the inner optimizer's moments, and the outer one's.
MAP_PARAMS_CHAINS = {
    "pgrad": (
        lambda: optax.chain(
            pgrad_jax.pgrad(optax.adam(0.1), B=2, num_domains=2),
            optax.sgd(0.1)),
        {},
        [f"[0].inner_state[0].{moment}['{name}']"
         for moment in ("mu", "nu") for name in ("b", "w")]),
    "fish, model state, momentum": (
        lambda: pgrad_jax.with_model_state(
            optax.chain(pgrad_jax.fish(optax.sgd(0.1, momentum=0.9)),
                        optax.sgd(0.1, momentum=0.5)),
            {"mean": jnp.zeros(3)}),
        {"loss_fn": mean_tracking_loss, "model_state": {"mean": jnp.ones(3)}},
        [f"{prefix}.trace['{name}']"
         for prefix in ("[0].inner_state[0]", "[1][0]") for name in ("b", "w")]),
}


@pytest.mark.parametrize("make, extras, params_paths",
                         MAP_PARAMS_CHAINS.values(),
                         ids=MAP_PARAMS_CHAINS.keys())
def test_map_params_maps_the_params_shaped_leaves(make, extras, params_paths):
  # optax.tree.map_params calls init on a placeholder for the params to find
  # which leaves of a state are params-shaped; each of optax's contributed
  # optimizers is held to a no-op map_params of its state
  # (optax/contrib/_common_test.py, "Test that tree_map_params works").
  params, batches = problem()
  tx = make()
  _, state = update(tx, params, batches, **extras)

  same = optax.tree.map_params(tx, lambda v: v, state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(same),
                                    jax.tree.leaves(state)))

  # Exactly the params-shaped leaves are mapped; the rest (step counts, the
  # key, the diagnostics, the model state) are kept.
  marked = optax.tree.map_params(tx, lambda v: "params", state,
                                 transform_non_params=lambda v: "other")
  assert paths(marked, lambda leaf: leaf == "params") == sorted(params_paths)
  assert paths(marked, lambda leaf: leaf == "other") == sorted(
      set(paths(state)) - set(params_paths))

  # A mapped state still updates: zeroed moments restart the momentum.
  zeroed = optax.tree.map_params(tx, jnp.zeros_like, state)
  updates, _ = update(tx, params, batches, state=zeroed, **extras)
  assert np.all(np.isfinite(flat(updates))) and np.any(flat(updates) != 0)


@pytest.mark.parametrize("make", [pgrad_jax.pgrad, pgrad_jax.fish])
def test_init_without_arrays_is_refused(make):
  # optax's placeholder for the params has no leaves, like these, which init
  # still refuses.
  for empty in ({"w": {}}, [(), []]):
    with pytest.raises(ValueError, match="init needs the params"):
      make(optax.adam(0.1)).init(empty)
