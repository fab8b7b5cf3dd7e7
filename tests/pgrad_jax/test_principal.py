"""Steps 2-6 (and the Gram matrix of either layout) against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import oracle
import pgrad_jax
from pgrad_jax._src import trajectory as trajectory_lib

Layout = pgrad_jax.TrajectoryLayout
# Leaf shapes of one trajectory point: a scalar, a bias, a kernel whose size
# is prime times 5, and a conv kernel.
SHAPES = {"scalar": (), "bias": (7,), "kernel": (13, 5), "conv": (3, 3, 2, 4)}


def stacked(trajectory):
  """Every stored step of either layout, stacked: ``(s, *leaf_shape)``."""
  steps = trajectory_lib.num_steps(trajectory)
  points = [trajectory_lib.point(trajectory, i) for i in range(steps)]
  return jax.tree.map(lambda *p: np.stack(p), *points)


def random_trajectory(steps=5, seed=0):
  rng = np.random.default_rng(seed)
  return {name: rng.standard_normal((steps,) + shape)
          for name, shape in SHAPES.items()}


def numpy_gram(tree):
  flat = np.concatenate([x.reshape(x.shape[0], -1) for x in tree.values()],
                        axis=1)
  return flat @ flat.T


def stored(tree, block, contiguous=False):
  """The stacked trajectory ``tree`` written as a rollout with ``block``
  (and ``contiguous``) would store it."""
  points = jax.tree.map(lambda x: x[0], tree)
  steps = jax.tree.leaves(tree)[0].shape[0]
  out = trajectory_lib.allocate(points, steps, Layout(1, block, contiguous))
  for i in range(steps):
    out = trajectory_lib.write(out, i, jax.tree.map(lambda x: x[i], tree))
  return out


def assert_reads_back_as_numpy(tree, disp, beta):
  """The stored float64 trajectory ``tree`` of ``disp`` gives back its steps,
  and its Gram matrix and ``beta``-weighted sum match NumPy's. Call with
  x64 enabled."""
  unstacked = stacked(tree)
  for name in SHAPES:
    np.testing.assert_array_equal(np.asarray(unstacked[name]), disp[name])
  got = jax.jit(pgrad_jax.gram)(tree)
  summed = jax.jit(trajectory_lib.weighted_sum)(jnp.asarray(beta), tree)
  np.testing.assert_allclose(np.asarray(got), numpy_gram(disp), rtol=1e-12)
  for name, shape in SHAPES.items():
    assert summed[name].shape == shape and summed[name].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(summed[name]),
                               np.tensordot(beta, disp[name], axes=1),
                               rtol=1e-12, atol=1e-14)


def test_gram_matches_numpy():
  disp = random_trajectory()
  with jax.enable_x64(True):
    got = pgrad_jax.gram(jax.tree.map(jnp.asarray, disp))
    assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), numpy_gram(disp), rtol=1e-12)


def test_gram_promotes_bfloat16_to_float32():
  disp = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16),
                      random_trajectory())
  got = jax.jit(pgrad_jax.gram)(disp)
  assert got.dtype == jnp.float32
  ref = numpy_gram(jax.tree.map(lambda x: np.asarray(x, np.float64), disp))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)


@pytest.mark.parametrize("block", [None, 1, 2, 3, 4, 9, 36, 1024])
def test_gram_and_weighted_sum_of_either_layout_match_numpy(block):
  disp = random_trajectory(steps=6, seed=2)
  beta = np.random.default_rng(3).standard_normal(6)
  with jax.enable_x64(True):
    tree = stored(jax.tree.map(jnp.asarray, disp), block)
    kinds = {k: isinstance(v, trajectory_lib.InterleavedLeaf)
             for k, v in tree.items()}
    assert kinds == {k: block is not None and int(np.prod(shape)) % block == 0
                     for k, shape in SHAPES.items()}
    assert_reads_back_as_numpy(tree, disp, beta)


@pytest.mark.parametrize("block", [None, 1, 2, 7, 145, 1024])
def test_contiguous_trajectory_matches_numpy(block):
  disp = random_trajectory(steps=6, seed=4)
  beta = np.random.default_rng(5).standard_normal(6)
  with jax.enable_x64(True):
    tree = stored(jax.tree.map(jnp.asarray, disp), block, contiguous=True)
    # One array of blocks, the leaves in pytree order, zero-padded (145
    # parameters: one block where the block is None or larger).
    assert isinstance(tree, trajectory_lib.ContiguousTrajectory)
    size = min(block or 145, 145)
    num_blocks = -(-145 // size)
    rows = np.concatenate([disp[name].reshape(6, -1)
                           for name in sorted(SHAPES)], axis=1)
    padded = np.pad(rows, ((0, 0), (0, num_blocks * size - 145)))
    np.testing.assert_array_equal(
        np.asarray(tree.blocks),
        padded.reshape(6, num_blocks, size).transpose(1, 0, 2))
    assert_reads_back_as_numpy(tree, disp, beta)


def test_contiguous_needs_one_stored_dtype():
  params = {"w": jnp.zeros((4, 8), jnp.float32),
            "h": jnp.zeros((3,), jnp.bfloat16)}
  layout = Layout(1, None, contiguous=True)
  mixed = trajectory_lib.allocate(params, 3, layout)
  assert mixed["w"].shape == (3, 4, 8) and mixed["h"].dtype == jnp.bfloat16
  narrow = trajectory_lib.allocate(params, 3, layout, jnp.bfloat16)
  assert isinstance(narrow, trajectory_lib.ContiguousTrajectory)
  assert narrow.blocks.shape == (1, 3, 35)
  assert narrow.blocks.dtype == jnp.bfloat16


def test_interleaved_float32_accumulates_and_keeps_dtype():
  disp = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                      random_trajectory())
  tree = stored(disp, 2)
  assert isinstance(tree["conv"], trajectory_lib.InterleavedLeaf)
  got = pgrad_jax.gram(tree)
  summed = trajectory_lib.weighted_sum(jnp.ones(5), tree)
  assert got.dtype == jnp.float32 and summed["conv"].dtype == jnp.float32
  ref = numpy_gram(jax.tree.map(lambda x: np.asarray(x, np.float64), disp))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)


def test_narrow_trajectory_dtype_is_not_interleaved():
  params = {"w": jnp.zeros((4, 8), jnp.float32), "e": jnp.zeros((0,))}
  wide = trajectory_lib.allocate(params, 3, Layout(1, 8))
  narrow = trajectory_lib.allocate(params, 3, Layout(1, 8), jnp.bfloat16)
  other = trajectory_lib.allocate(params, 3, Layout(1, 5))
  assert isinstance(wide["w"], trajectory_lib.InterleavedLeaf)
  assert narrow["w"].shape == other["w"].shape == (3, 4, 8)
  assert wide["e"].shape == (3, 0)


# --- the principal gradient against the oracle, in every layout ---------------

N_IN, N_OUT = oracle.N_IN, oracle.N_OUT

def linear_loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


@pytest.mark.parametrize("layout", [Layout(1, None), Layout(True, None),
                                    Layout(1, 2), Layout(True, 3),
                                    Layout(1, None, True)], ids=str)
def test_principal_gradient_matches_numpy_oracle(layout):
  # Block 2 interleaves both leaves (sizes 6 and 2), block 3 only w.
  schedule = oracle.fixed_schedule(3, 3)
  with jax.enable_x64(True):
    params, batches = jax.tree.map(jnp.asarray, oracle.linear_problem())
    domains, chunks = pgrad_jax.domain_schedule(jax.random.key(0), 3, 3,
                                                "fixed")
    inner = optax.adam(0.05)
    for parallel in (False, True):
      rolled = pgrad_jax.rollout(
          linear_loss, inner, params, inner.init(params), batches, domains,
          chunks, pgrad_jax.RolloutOptions(B=3, parallel=parallel),
          layout=layout)
      points, _ = oracle.trajectory(
          flat(params), np.asarray(batches["x"]), np.asarray(batches["y"]),
          schedule, 3, oracle.Adam(0.05, 8), N_IN, N_OUT, parallel=parallel)
      for options in oracle.OPTION_CASES:
        if (options.get("reference") == "mean") != parallel:
          continue
        options = dict(options)
        k = options.pop("k", 2)
        reference = options.pop("reference", "end")
        result = pgrad_jax.principal_gradient(
            rolled.displacements, k, pgrad_jax.PrincipalOptions(**options),
            reference=reference)
        np.testing.assert_allclose(
            flat(result.update),
            oracle.principal_gradient(points, k, reference=reference,
                                      **options),
            rtol=1e-9, atol=1e-12, err_msg=str(options))
      centred = points - points.mean(0)
      lam = np.sort(np.linalg.eigvalsh(centred @ centred.T))[::-1]
      np.testing.assert_allclose(np.asarray(result.eigenvalues), lam,
                                 rtol=1e-8, atol=1e-12 * lam[0])


def test_gram_dtype_sets_the_eigh_precision():
  disp = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                      random_trajectory())
  with jax.enable_x64(True):
    result = pgrad_jax.principal_gradient(
        disp, 2, pgrad_jax.PrincipalOptions(gram_dtype=jnp.float64))
  assert result.eigenvalues.dtype == jnp.float64
  assert result.update["conv"].dtype == jnp.float32
