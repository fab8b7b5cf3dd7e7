"""The Gram matrix, whole and blocked, and the per-backend defaults."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pgrad_jax
from pgrad_jax._src import interleave
from pgrad_jax._src import principal
from pgrad_jax._src import rollout as rollout_lib

# Leaf shapes of one trajectory point: a scalar, a bias, a kernel whose first
# axis is prime (so blocks leave a tail), and a conv kernel.
SHAPES = {"scalar": (), "bias": (7,), "kernel": (13, 5), "conv": (3, 3, 2, 4)}


def trajectory(steps=5, seed=0):
  rng = np.random.default_rng(seed)
  return {name: rng.standard_normal((steps,) + shape)
          for name, shape in SHAPES.items()}


def numpy_gram(tree):
  flat = np.concatenate([x.reshape(x.shape[0], -1) for x in tree.values()],
                        axis=1)
  return flat @ flat.T


@pytest.mark.parametrize("block_size", [None, 1, 4, 10, 24, 10_000])
def test_gram_matches_numpy(block_size):
  disp = trajectory()
  with jax.enable_x64(True):
    got = pgrad_jax.gram(jax.tree.map(jnp.asarray, disp),
                         block_size=block_size)
    assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), numpy_gram(disp), rtol=1e-12)


def test_blocked_gram_jits_and_promotes_to_float32():
  disp = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), trajectory())
  got = jax.jit(lambda d: pgrad_jax.gram(d, block_size=6))(disp)
  assert got.dtype == jnp.float32
  ref = numpy_gram(jax.tree.map(lambda x: np.asarray(x, np.float64), disp))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_gram_rejects_bad_block_size(block_size):
  with pytest.raises(ValueError, match="block_size must be None or a positive"):
    pgrad_jax.gram(jax.tree.map(jnp.asarray, trajectory()),
                   block_size=block_size)


def test_principal_gradient_is_the_same_blocked():
  with jax.enable_x64(True):
    disp = jax.tree.map(jnp.asarray, trajectory(steps=6, seed=1))
    whole = pgrad_jax.principal_gradient(disp, k=3)
    blocked = pgrad_jax.principal_gradient(disp, k=3, gram_block=4)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(blocked)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10,
                               atol=1e-12)


def test_default_gram_block_on_one_cpu_device():
  # The test process sees the default single CPU device.
  assert jax.default_backend() == "cpu" and jax.device_count() == 1
  assert principal.default_gram_block() == principal.CPU_GRAM_BLOCK


# --- the default unroll -------------------------------------------------------


def dense_loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2)


def conv_loss(params, batch):
  y = jax.lax.conv_general_dilated(batch["x"], params["w"], (1, 1), "SAME")
  return jnp.mean(y ** 2)


CONV_ARGS = ({"w": jnp.ones((2, 1, 3, 3))}, {"x": jnp.ones((4, 1, 8, 8))})
DENSE_ARGS = ({"w": jnp.ones((3, 2))}, {"x": jnp.ones((4, 3))})


def test_has_convolution_sees_nested_convolutions():
  nested = jax.checkpoint(lambda p, b: jax.jit(conv_loss)(p, b) + 1.0)
  branch = lambda p, b: jax.lax.cond(b["x"].sum() > 0, conv_loss,
                                     lambda p, b: 0.0, p, b)
  for fn in (conv_loss, nested, branch):
    assert rollout_lib.has_convolution(jax.make_jaxpr(fn)(*CONV_ARGS))
  assert not rollout_lib.has_convolution(
      jax.make_jaxpr(dense_loss)(*DENSE_ARGS))


def test_default_unroll_on_cpu():
  # XLA:CPU: convolutions fully unrolled, everything else rolled.
  assert rollout_lib.default_unroll(
      jax.make_jaxpr(conv_loss)(*CONV_ARGS)) is True
  assert rollout_lib.default_unroll(
      jax.make_jaxpr(dense_loss)(*DENSE_ARGS)) == 1


# --- the trajectory written in place ------------------------------------------


@pytest.mark.parametrize("unroll, interleave_block",
                         [(1, None), (2, None), (True, None), (1, 2), (2, 3),
                          (True, 2)])
def test_rollout_trajectory_is_the_same_in_place_or_stacked(
    unroll, interleave_block):
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
                          batches, domains, chunks, num_chunks=2,
                          unroll=unroll, interleave=interleave_block)
  stored = out.displacements["w"]
  # Only a rolled scan interleaves; a fully unrolled one stacks.
  assert isinstance(stored, pgrad_jax.Interleaved) == (
      interleave_block is not None and unroll is not True)
  if isinstance(stored, pgrad_jax.Interleaved):
    assert stored.blocks.shape == (6 // interleave_block, 5, interleave_block)
    np.testing.assert_array_equal(np.asarray(stored.blocks[:, 0]), 0.0)
    for step in (0, 2, -1):
      np.testing.assert_array_equal(np.asarray(stored.point(step)),
                                    np.asarray(stored.points()[step]))
    stored = stored.points()
  np.testing.assert_allclose(np.asarray(stored), np.stack(expected),
                             rtol=1e-5, atol=1e-7)


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
        inner.init(params), batches, domains, chunks, num_chunks=2,
        unroll=unroll, parallel=parallel, store_trajectory=store)

  full, end = run(True), run(False)
  for name in params:
    assert end.displacements[name].shape == (1,) + params[name].shape
    np.testing.assert_array_equal(np.asarray(end.displacements[name][0]),
                                  np.asarray(full.displacements[name][-1]))
  np.testing.assert_array_equal(np.asarray(end.losses),
                                np.asarray(full.losses))
  for a, b in zip(jax.tree.leaves(end.inner_state),
                  jax.tree.leaves(full.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fish_stores_no_trajectory():
  # Fish needs the end point only: its compiled step holds far less than
  # PGrad's, which keeps all m points (here m = 16, 2048 x 512 params).
  params = {"w": jnp.zeros((2048, 512))}
  batches = {"x": jnp.ones((5, 6, 2048))}

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


# --- interleaved trajectories -------------------------------------------------


def interleaved(tree, block):
  """The stacked float trajectory ``tree`` stored as the rollout would."""
  def store(x):
    point = x[0]
    if not interleave.can_interleave(point, block):
      return x
    out = interleave.zeros(point, x.shape[0], block)
    for i in range(x.shape[0]):
      out = interleave.write(out, i, x[i])
    return out
  return jax.tree.map(store, tree)


@pytest.mark.parametrize("block", [1, 2, 3, 4, 9, 36, 1024])
def test_interleaved_gram_and_weighted_sum_match_numpy(block):
  disp = trajectory(steps=6, seed=2)
  beta = np.random.default_rng(3).standard_normal(6)
  with jax.enable_x64(True):
    tree = interleaved(jax.tree.map(jnp.asarray, disp), block)
    kinds = {k: isinstance(v, pgrad_jax.Interleaved) for k, v in tree.items()}
    assert kinds == {k: int(np.prod(shape)) % block == 0
                     for k, shape in SHAPES.items()}
    for name in SHAPES:
      stored = tree[name].points() if kinds[name] else tree[name]
      np.testing.assert_array_equal(np.asarray(stored), disp[name])
    got = jax.jit(pgrad_jax.gram)(tree)
    summed = jax.jit(principal.weighted_sum)(jnp.asarray(beta), tree)
  np.testing.assert_allclose(np.asarray(got), numpy_gram(disp), rtol=1e-12)
  for name, shape in SHAPES.items():
    assert summed[name].shape == shape and summed[name].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(summed[name]),
                               np.tensordot(beta, disp[name], axes=1),
                               rtol=1e-12, atol=1e-14)


def test_interleaved_float32_accumulates_and_keeps_dtype():
  disp = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trajectory())
  tree = interleaved(disp, 2)
  assert isinstance(tree["conv"], pgrad_jax.Interleaved)
  got = pgrad_jax.gram(tree)
  summed = principal.weighted_sum(jnp.ones(5), tree)
  assert got.dtype == jnp.float32 and summed["conv"].dtype == jnp.float32
  ref = numpy_gram(jax.tree.map(lambda x: np.asarray(x, np.float64), disp))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)


def test_narrow_trajectory_dtype_is_not_interleaved():
  leaf = jnp.zeros((4, 8), jnp.float32)
  assert interleave.can_interleave(leaf, 8)
  assert not interleave.can_interleave(leaf, 8, jnp.bfloat16)
  assert not interleave.can_interleave(leaf, 5)
  assert not interleave.can_interleave(jnp.zeros((0,)), 8)


@pytest.mark.parametrize("block", [0, -1, 1.5, True])
def test_rollout_rejects_bad_interleave(block):
  params = {"w": jnp.zeros((3, 2))}
  batches = {"x": jnp.zeros((2, 4, 3))}
  domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 2, 2, "fixed")
  with pytest.raises(ValueError, match="interleave must be None or a positive"):
    pgrad_jax.rollout(dense_loss, optax.sgd(0.1), params, (), batches,
                      domains, chunks, num_chunks=2, interleave=block)


def test_default_interleave_block_on_one_cpu_device():
  assert interleave.default_block() == interleave.CPU_BLOCK


@pytest.mark.parametrize("interleave_block", [None, 1024])
def test_same_shaped_leaves_get_their_own_trajectory_buffers(interleave_block):
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
                            chunks, num_chunks=2, unroll=1,
                            interleave=interleave_block)
    assert all(isinstance(d, pgrad_jax.Interleaved) == bool(interleave_block)
               for d in out.displacements.values())
    return pgrad_jax.principal_gradient(out.displacements, 2).update

  hlo = jax.jit(update).lower(params).compile().as_text()
  shape = "6,64,64" if interleave_block is None else "4,7,1024"
  entry = hlo[hlo.index("ENTRY"):]
  copies = [line for line in entry.splitlines()
            if f"f32[{shape}]" in line and " copy(" in line]
  assert not copies
  assert entry.count(f"= f32[{shape}]") >= 3
