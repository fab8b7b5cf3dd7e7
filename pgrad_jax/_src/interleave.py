"""Trajectory leaves stored with the point axis inside, for XLA:CPU.

A stacked trajectory leaf is ``(s, *shape)``: each point is contiguous, and
the Gram matrix is one product over the long flattened axis. XLA:CPU runs
that product (or a loop of blocks of it) on one thread at a small fraction of
the core's peak. An interleaved leaf cuts each point's flattened ``n``
elements into ``n / c`` blocks of ``c`` and stores ``(n / c, m, c)``: block
``j`` of all ``m`` points sits together, so the Gram matrix is a batched
product of small ``(m, c)`` tiles that stay in cache. The ``m`` points include
``theta_0`` as a zero row, which costs one point of memory and makes the
tiles 16 rows tall for PGrad-B's 5 domains x 3 chunks, a shape matrix kernels
handle better than 15.

Measured on a 2-core CPU (4.2M parameter MLP, 16 points): the Gram matrix of
the two large leaves takes about 40 ms interleaved (the per-leaf products
run concurrently; 15-row tiles take a fifth longer) against 77 ms stacked;
the rollout's writes, strided now, cost about 1 ms per step more. Only for
unsharded leaves: slicing a sharded leaf into blocks would gather it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Elements per block on CPU: a 4 KiB page of float32, so each step's strided
# write stays one page per block.
CPU_BLOCK = 1 << 10


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks"],
                   meta_fields=["shape"])
@dataclasses.dataclass(frozen=True)
class Interleaved:
  """One trajectory leaf stored interleaved.

  Attributes:
    blocks: ``(n / c, m, c)``: ``blocks[j, i]`` holds elements
      ``[j * c, (j + 1) * c)`` of the flattened displacement
      ``theta_i - theta_0``; ``blocks[:, 0]`` is zero.
    shape: the shape of the leaf of one point.
  """

  blocks: jax.Array
  shape: tuple[int, ...]

  @property
  def num_steps(self) -> int:
    """The stored steps ``s = m - 1``."""
    return self.blocks.shape[1] - 1

  def point(self, step: int) -> jax.Array:
    """The displacement stored at ``step`` (negative counts from the end)."""
    return self.blocks[:, 1:][:, step].reshape(self.shape)

  def points(self) -> jax.Array:
    """The stacked displacements ``(s, *shape)``, entry ``i`` being point
    ``i + 1`` (a copy)."""
    steps = jnp.moveaxis(self.blocks[:, 1:], 1, 0)
    return steps.reshape((self.num_steps,) + self.shape)


def is_interleaved(x) -> bool:
  return isinstance(x, Interleaved)


def check_block_size(name: str, value) -> None:
  """Raises unless ``value`` is None or a positive integer."""
  if value is not None and (isinstance(value, bool) or
                            not isinstance(value, int) or value < 1):
    raise ValueError(
        f"{name} must be None or a positive integer, got {value!r}.")


def on_one_cpu_device() -> bool:
  """Whether computations run on XLA:CPU with one device, so no leaf is
  sharded and XLA:CPU's slow paths for stacked products apply."""
  return jax.default_backend() == "cpu" and jax.device_count() == 1


def default_block() -> int | None:
  """The interleaving block for the current devices: CPU_BLOCK on one CPU
  device, else None (GPU and TPU libraries multiply a stacked leaf well, and
  with several devices a leaf may be sharded)."""
  return CPU_BLOCK if on_one_cpu_device() else None


def can_interleave(leaf, block: int, dtype=None) -> bool:
  """Whether a leaf (with trajectory ``dtype``) is stored interleaved.

  Its size must be a multiple of ``block``, and its dtype at least 32 bits
  wide: XLA:CPU widens narrower operands of a product whole anyway.
  """
  size = jnp.size(leaf)
  dtype = jnp.dtype(dtype or jnp.result_type(leaf))
  return size > 0 and size % block == 0 and dtype.itemsize >= 4


def zeros_from(leaf, dtype=None) -> jax.Array:
  """``leaf * 0``: zeros that XLA cannot merge with other leaves' zeros.

  XLA merges equal constant broadcasts, so the trajectories of two leaves of
  one shape would start as one buffer and the loop that writes them in place
  would copy it (measured: an extra trajectory-sized copy per repeated
  shape). A non-finite leaf gives NaN here, as its rollout would anyway.
  """
  return (leaf * 0).astype(dtype or jnp.result_type(leaf))


def zeros(leaf, num_steps: int, block: int, dtype=None) -> Interleaved:
  """An interleaved trajectory of ``num_steps`` steps, all zero."""
  dtype = dtype or jnp.result_type(leaf)
  shape = tuple(jnp.shape(leaf))
  rows = zeros_from(leaf, dtype).reshape(-1, 1, block)
  return Interleaved(
      jnp.broadcast_to(rows, (rows.shape[0], num_steps + 1, block)), shape)


def write(trajectory: Interleaved, step,
          displacement: jax.Array) -> Interleaved:
  """Stores ``displacement`` as step ``step`` (point ``step + 1``)."""
  blocks = trajectory.blocks
  rows = displacement.reshape(blocks.shape[0], blocks.shape[2])
  return Interleaved(
      jax.lax.dynamic_update_index_in_dim(blocks, rows, step + 1, 1),
      trajectory.shape)


def gram(trajectory: Interleaved) -> jax.Array:
  """The ``(s, s)`` Gram matrix of the stored steps, in at least float32."""
  b = trajectory.blocks
  tiles = jax.lax.dot_general(
      b, b, (((2,), (2,)), ((0,), (0,))),
      preferred_element_type=jnp.promote_types(b.dtype, jnp.float32))
  return tiles.sum(axis=0)[1:, 1:]


def weighted_sum(beta: jax.Array, trajectory: Interleaved) -> jax.Array:
  """``sum_i beta_i D_i`` in the leaf's shape and dtype, accumulated in at
  least float32."""
  b = trajectory.blocks
  acc_dtype = jnp.promote_types(b.dtype, jnp.float32)
  beta = beta.astype(acc_dtype)
  # One term per step: XLA:CPU fuses the sum into a single pass over the
  # blocks, where a product or reduction over the middle axis runs slower.
  total = functools.reduce(
      lambda acc, i: acc + beta[i] * b[:, i + 1].astype(acc_dtype),
      range(1, trajectory.num_steps), beta[0] * b[:, 1].astype(acc_dtype))
  return total.reshape(trajectory.shape).astype(b.dtype)
