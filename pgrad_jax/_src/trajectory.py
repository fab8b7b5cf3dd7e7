"""The stored trajectory: displacements from theta_0, in one of three layouts.

A rollout stores each point ``theta_i`` as its displacement
``D_i = theta_i - theta_0``: small numbers, whose Gram matrix is free of the
float32 cancellation the raw points would suffer. ``layout.py`` chooses the
layout: the whole trajectory **contiguous** (:class:`ContiguousTrajectory`),
or leaf by leaf, each leaf **stacked**, ``(s, *leaf_shape)`` for the
``s = m - 1`` steps, keeping the leaf's own axes so that a sharded leaf stays
sharded, or **interleaved** (:class:`InterleavedLeaf`).

The products over the trajectory ask for full float32 precision: left to its
default, XLA:GPU may multiply float32 in TensorFloat-32 (10-bit mantissas),
which put the Gram matrix off by 1.6e-4 of its largest entry on an H200,
against 5.6e-8 at full precision, and so perturbs the principal axes. They
read the trajectory once and are bound by memory, not arithmetic,
so full precision costs no time (docs/design.md).
"""

import dataclasses
import functools
import operator
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pgrad_jax._src import layout as layout_lib


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks"],
                   meta_fields=["shape"])
@dataclasses.dataclass(frozen=True)
class InterleavedLeaf:
  """One trajectory leaf of ``n`` elements, interleaved in blocks of ``c``.

  Block ``j`` of every point sits together, so the Gram matrix is a batched
  product of small ``(m, c)`` tiles that stay in cache (the strided writes
  cost about 1 ms per step more). The ``m`` rows include ``theta_0`` as a
  zero row: one point of memory, for tiles 16 rows tall when ``s = 15``,
  which matrix kernels handle better (15-row tiles took a fifth longer).

  Attributes:
    blocks: ``(n / c, m, c)``: ``blocks[j, i]`` holds elements
      ``[j * c, (j + 1) * c)`` of the flattened ``theta_i - theta_0``;
      ``blocks[:, 0]`` is zero.
    shape: the shape of the leaf of one point.
  """

  blocks: jax.Array
  shape: tuple[int, ...]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks"],
                   meta_fields=["treedef", "shapes"])
@dataclasses.dataclass(frozen=True)
class ContiguousTrajectory:
  """A whole trajectory as one array of ``G`` blocks of ``c`` parameters.

  Each point's leaves are flattened and concatenated in pytree order into
  one vector of ``n`` parameters, zero-padded to ``G * c``; block ``j`` of
  every step sits together. The Gram matrix is then ``G`` products of
  ``(s, c)`` tiles, which a GPU runs in parallel, where one product over all
  ``n`` columns (``G = 1``) leaves most of it idle (docs/design.md).

  Attributes:
    blocks: ``(G, s, c)``: ``blocks[j, i]`` holds elements
      ``[j * c, (j + 1) * c)`` of ``D_{i+1}`` flattened.
    treedef: the params' tree structure.
    shapes: the shape of each leaf of one point, in pytree order.
  """

  blocks: jax.Array
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]

  def flatten(self, point: Any) -> jax.Array:
    """One point as a ``(G, c)`` array in this layout."""
    vector = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(point)])
    num_blocks, _, block = self.blocks.shape
    vector = jnp.pad(vector, (0, num_blocks * block - vector.size))
    return vector.reshape(num_blocks, block).astype(self.blocks.dtype)

  def unflatten(self, blocks: jax.Array) -> Any:
    """A pytree like one point from its ``(G, c)`` blocks."""
    sizes = [math.prod(shape) for shape in self.shapes]
    pieces = jnp.split(blocks.reshape(-1)[:sum(sizes)],
                       list(itertools.accumulate(sizes))[:-1])
    return jax.tree.unflatten(
        self.treedef,
        [piece.reshape(shape) for piece, shape in zip(pieces, self.shapes)])


def _is_interleaved(x: Any) -> bool:
  return isinstance(x, InterleavedLeaf)


def _map(stacked_fn, interleaved_fn, trajectory, *rest):
  """Maps each leaf of ``trajectory`` through the function for its layout."""
  return jax.tree.map(
      lambda leaf, *r: (interleaved_fn if _is_interleaved(leaf)
                        else stacked_fn)(leaf, *r),
      trajectory, *rest, is_leaf=_is_interleaved)


def _accumulation_dtype(dtype) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


# See the module docstring.
_FULL_PRECISION = jax.lax.Precision.HIGHEST


def allocate(params: Any, num_steps: int, layout: layout_lib.TrajectoryLayout,
             dtype=None) -> Any:
  """A buffer of ``num_steps`` zero displacements like ``params``, which the
  rollout then fills in place, one step at a time (:func:`write`).

  Args:
    params: ``theta_0``.
    num_steps: ``s``, the points after ``theta_0``.
    layout: contiguous, or which leaves are interleaved.
    dtype: the stored dtype; None keeps each leaf's.

  Returns:
    A :class:`ContiguousTrajectory`, or a pytree like ``params`` of stacked
    arrays and ``InterleavedLeaf``.
  """
  leaves, treedef = jax.tree.flatten(params)
  stored_dtypes = {jnp.dtype(dtype or jnp.result_type(x)) for x in leaves}
  block = layout.interleave_block
  if layout.contiguous and len(stored_dtypes) == 1:
    size = sum(jnp.size(x) for x in leaves)
    block = min(block or size, size) or 1
    return ContiguousTrajectory(
        jnp.zeros((-(-size // block), num_steps, block), stored_dtypes.pop()),
        treedef, tuple(tuple(jnp.shape(x)) for x in leaves))

  def leaf_zeros(leaf):
    # ``leaf * 0`` rather than ``jnp.zeros``: XLA merges equal constant
    # broadcasts, so two same-shaped leaves would share one buffer and the
    # loop writing them in place would copy it (an extra trajectory-sized copy
    # per repeated shape, measured). A non-finite leaf gives NaN here, as its
    # rollout would anyway.
    zeros = (leaf * 0).astype(dtype or jnp.result_type(leaf))
    # XLA:CPU widens an operand narrower than 32 bits whole before a product,
    # so interleaving a narrow leaf would not save its copy.
    if (block is not None and zeros.size and zeros.size % block == 0
        and zeros.dtype.itemsize >= 4):
      rows = zeros.reshape(-1, 1, block)
      return InterleavedLeaf(
          jnp.broadcast_to(rows, (rows.shape[0], num_steps + 1, block)),
          tuple(jnp.shape(leaf)))
    # Broadcasting a zero point keeps the params' sharding on its axes.
    return jnp.broadcast_to(zeros, (num_steps,) + zeros.shape)

  return jax.tree.map(leaf_zeros, params)


def write(trajectory: Any, step, displacement: Any) -> Any:
  """Stores ``displacement`` (a pytree like the params) as step ``step``."""
  if isinstance(trajectory, ContiguousTrajectory):
    return dataclasses.replace(trajectory, blocks=(
        jax.lax.dynamic_update_index_in_dim(
            trajectory.blocks, trajectory.flatten(displacement), step, 1)))

  def write_stacked(buffer, x):
    return jax.lax.dynamic_update_index_in_dim(buffer, x.astype(buffer.dtype),
                                               step, 0)

  def write_interleaved(leaf, x):
    blocks = leaf.blocks
    rows = x.reshape(blocks.shape[0], blocks.shape[2]).astype(blocks.dtype)
    return InterleavedLeaf(
        jax.lax.dynamic_update_index_in_dim(blocks, rows, step + 1, 1),
        leaf.shape)

  return _map(write_stacked, write_interleaved, trajectory, displacement)


def point(trajectory: Any, step: int) -> Any:
  """The displacement stored at ``step`` (negative counts from the end)."""
  if isinstance(trajectory, ContiguousTrajectory):
    return trajectory.unflatten(trajectory.blocks[:, step])
  return _map(
      lambda x: x[step],
      lambda leaf: leaf.blocks[:, 1:][:, step].reshape(leaf.shape),
      trajectory)


def num_steps(trajectory: Any) -> int:
  """``s``, the points stored after ``theta_0``."""
  if isinstance(trajectory, ContiguousTrajectory):
    return trajectory.blocks.shape[1]
  leaf = jax.tree.leaves(trajectory, is_leaf=_is_interleaved)[0]
  return leaf.blocks.shape[1] - 1 if _is_interleaved(leaf) else leaf.shape[0]


def gram(trajectory: Any) -> jax.Array:
  """The Gram matrix ``K[i, j] = <D_i, D_j>`` of the stored steps (without
  theta_0's zero row and column), in any layout.

  Accumulated in at least float32, at full precision. A contiguous
  trajectory or an interleaved leaf is a batch of tiles; a stacked leaf is
  contracted over its own axes, never reshaped.

  Args:
    trajectory: displacements as :func:`allocate` lays them out, or any
      pytree whose leaves have a leading axis of length ``s``.

  Returns:
    The ``(s, s)`` Gram matrix.

  Example:
    >>> import jax.numpy as jnp
    >>> from pgrad_jax import gram
    >>> gram({"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}).tolist()
    [[5.0, 11.0], [11.0, 25.0]]
  """
  if isinstance(trajectory, ContiguousTrajectory):
    b = trajectory.blocks
    return jax.lax.dot_general(
        b, b, (((2,), (2,)), ((0,), (0,))), precision=_FULL_PRECISION,
        preferred_element_type=_accumulation_dtype(b.dtype)).sum(axis=0)

  def stacked_gram(x):
    axes = tuple(range(1, x.ndim))
    # With a leaf sharded over explicit mesh axes, JAX needs to be told where
    # the product goes: replicated, so only (s, s) partial sums are reduced.
    sharding = jax.typeof(x).sharding
    replicated = None
    if any(sharding.spec):
      replicated = jax.sharding.NamedSharding(sharding.mesh,
                                              jax.sharding.PartitionSpec())
    return jax.lax.dot_general(
        x, x, ((axes, axes), ((), ())),
        precision=_FULL_PRECISION,
        preferred_element_type=_accumulation_dtype(x.dtype),
        out_sharding=replicated)

  def interleaved_gram(leaf):
    b = leaf.blocks
    tiles = jax.lax.dot_general(
        b, b, (((2,), (2,)), ((0,), (0,))), precision=_FULL_PRECISION,
        preferred_element_type=_accumulation_dtype(b.dtype))
    return tiles.sum(axis=0)[1:, 1:]

  return functools.reduce(operator.add, jax.tree.leaves(
      _map(stacked_gram, interleaved_gram, trajectory)))


def weighted_sum(beta: jax.Array, trajectory: Any) -> Any:
  """``sum_i beta_i D_i`` leaf by leaf, in each point's shape and dtype,
  accumulated in at least float32, at full precision."""
  def scaled_sum(blocks, step_axis):
    """``sum_i beta_i * blocks[..., i, ...]``, one term per step: a single
    elementwise pass over the blocks, where a product over the step axis
    runs slower (XLA:CPU; on a GPU, a matrix-vector product read the
    trajectory at about a twentieth of the memory bandwidth)."""
    acc = _accumulation_dtype(blocks.dtype)
    weights = beta.astype(acc)
    return functools.reduce(
        operator.add,
        (weights[i] * jnp.take(blocks, i, axis=step_axis).astype(acc)
         for i in range(len(beta))))

  if isinstance(trajectory, ContiguousTrajectory):
    b = trajectory.blocks
    return trajectory.unflatten(scaled_sum(b, 1).astype(b.dtype))

  def stacked_sum(x):
    acc = _accumulation_dtype(x.dtype)
    return jnp.tensordot(beta.astype(acc), x, axes=1,
                         precision=_FULL_PRECISION).astype(x.dtype)

  def interleaved_sum(leaf):
    b = leaf.blocks[:, 1:]  # Row 0 is theta_0's zero.
    return scaled_sum(b, 1).reshape(leaf.shape).astype(b.dtype)

  return _map(stacked_sum, interleaved_sum, trajectory)
