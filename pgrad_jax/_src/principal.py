"""The principal gradient of a trajectory, from its small Gram matrix.

With the trajectory ``theta_0..theta_{m-1}`` stored as displacements
``D_i = theta_i - theta_0`` (``D_0 = 0``), the centred trajectory is
``C = H D`` with ``H = I - 11^T / m``, and every quantity PGrad needs comes
from the ``m x m`` matrix ``K = D D^T``:

* ``G = C C^T = H K H``, whose eigenpairs ``(lambda_z, e_z)`` give the
  principal axes ``v_z = C^T e_z / sqrt(lambda_z)`` (the bijection of eq. 7 of
  the paper; the ``d x d`` covariance is never formed);
* ``<C^T e_z, r> = e_z^T H K rho`` for a reference ``r = D^T rho``, which fixes
  each axis's sign, and ``||r||^2 = rho^T K rho``;
* the principal gradient is ``C^T a = D^T H a`` for a coefficient vector ``a``
  of length ``m``: one weighted sum of the stored displacements.

So the trajectory is read twice, once for ``K`` and once for the weighted sum,
and nothing but ``K`` (``m x m``) is ever reduced across devices.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import interleave as interleave_lib

Weighting = Literal["l2", "l1", "raw"]
Components = Literal["top", "bottom"]
WEIGHTINGS = ("l2", "l1", "raw")
COMPONENTS = ("top", "bottom")


class Principal(NamedTuple):
  """The principal gradient and what it was built from.

  Attributes:
    update: the principal gradient, a pytree like one trajectory point, in
      gradient sign convention (``theta <- theta - lr * update`` descends).
    eigenvalues: ``(m,)``, the eigenvalues of the centred Gram matrix in
      descending order, clamped at zero.
    ref_norm: ``||r||``, the length of the reference ``r``.
  """

  update: optax.Updates
  eigenvalues: jax.Array
  ref_norm: jax.Array


# Elements of one trajectory point per block of a blocked Gram product: the
# block of all points (about 1 MiB for m = 16 in float32) stays in cache.
CPU_GRAM_BLOCK = 1 << 14


def default_gram_block() -> int | None:
  """The ``block_size`` of :func:`gram` suited to the current devices.

  XLA:CPU computes ``D D^T`` by first copying the whole trajectory into a
  transposed layout: twice the trajectory's memory, and (measured on a 4.2M
  parameter MLP with m = 16) three times slower than the product done block by
  block. On one CPU device the Gram is therefore blocked. GPU and TPU
  libraries transpose for free, and with several devices a leaf may be
  sharded, and flattening and slicing it would gather it: there the product
  is left whole.
  """
  return CPU_GRAM_BLOCK if interleave_lib.on_one_cpu_device() else None


def gram(displacements: optax.Params, *,
         block_size: int | None = None) -> jax.Array:
  """``K[i, j] = <D_i, D_j>`` summed leaf by leaf, in at least float32.

  By default each leaf is contracted over its own axes, so no leaf is
  reshaped or concatenated: a leaf sharded over devices stays sharded, and
  only the ``(s, s)`` result is reduced.

  An ``Interleaved`` leaf (see ``pgrad_jax.rollout``'s ``interleave``) is
  contracted as a batch of small tiles.

  Args:
    displacements: a pytree whose leaves have a leading axis of length ``s``,
      or are ``Interleaved`` with ``s`` steps.
    block_size: None, or how many elements of each point to contract at a
      time: a stacked float32 or float64 leaf is then flattened and goes
      through in slices (see :func:`default_gram_block`). Only for unsharded
      leaves.

  Returns:
    The ``(s, s)`` Gram matrix.

  Example:
    >>> import jax.numpy as jnp
    >>> from pgrad_jax import gram
    >>> gram({"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}).tolist()
    [[5.0, 11.0], [11.0, 25.0]]
  """
  interleave_lib.check_block_size("block_size", block_size)

  def product(x):
    axes = tuple(range(1, x.ndim))
    out = jnp.promote_types(x.dtype, jnp.float32)
    # With a leaf sharded over explicit mesh axes, JAX needs to be told where
    # the product goes: replicated, so only (s, s) partial sums are reduced.
    sharding = jax.typeof(x).sharding
    replicated = None
    if any(sharding.spec):
      replicated = jax.sharding.NamedSharding(sharding.mesh,
                                              jax.sharding.PartitionSpec())
    return jax.lax.dot_general(
        x, x, ((axes, axes), ((), ())), preferred_element_type=out,
        out_sharding=replicated)

  def blocked(x):
    # XLA:CPU widens a low-precision operand whole, blocked or not.
    if x.ndim < 2 or x[0].size <= block_size or x.dtype.itemsize < 4:
      return product(x)
    # One contracted axis: XLA:CPU's product over several is slower.
    flat = x.reshape(x.shape[0], -1)
    steps, whole = flat.shape[0], flat.shape[1] // block_size

    def add_block(i, acc):
      return acc + product(
          jax.lax.dynamic_slice_in_dim(flat, i * block_size, block_size, 1))

    acc = jax.lax.fori_loop(
        0, whole, add_block,
        jnp.zeros((steps, steps), jnp.promote_types(x.dtype, jnp.float32)))
    if flat.shape[1] > whole * block_size:
      acc = acc + product(flat[:, whole * block_size:])
    return acc

  stacked_gram = product if block_size is None else blocked

  def leaf_gram(x):
    if interleave_lib.is_interleaved(x):
      return interleave_lib.gram(x)
    return stacked_gram(x)

  return sum(jax.tree.leaves(jax.tree.map(
      leaf_gram, displacements, is_leaf=interleave_lib.is_interleaved)))


def principal_gradient(
    displacements: optax.Params,
    k: int,
    *,
    weighting: Weighting = "l2",
    calibrate_length: bool = True,
    components: Components = "top",
    reference: Literal["end", "mean"] = "end",
    rtol: float | None = None,
    dtype=None,
    gram_block: int | None = None,
) -> Principal:
  """The principal gradient of a trajectory given as displacements.

  The trajectory is ``theta_0`` plus the ``s`` stored points, ``m = s + 1``.

  1. Centre it and eigendecompose ``G = C C^T``, eigenvalues descending.
  2. Orient each axis ``v_z`` so that ``<v_z, r> >= 0``, with the reference
     ``r = theta_0 - theta_end`` (``reference="end"``) or
     ``theta_0 - mean_i theta_i`` over the stored points (``"mean"``).
  3. Return ``||r|| * sum_z w_z v_z`` over the chosen ``k`` components, with
     ``w = lambda / ||lambda||_2`` (``"l2"``), ``lambda / ||lambda||_1``
     (``"l1"``) or ``lambda`` (``"raw"``), normalised over the chosen
     components; without length calibration the ``||r||`` factor is dropped.

  Components whose eigenvalue is below ``rtol * lambda_max`` are numerically
  zero: they contribute nothing and do not count towards ``k`` (a centred
  trajectory of ``m`` points has at most ``m - 1`` of them).

  Args:
    displacements: pytree with leaves ``(s, *leaf_shape)``, entry ``i`` being
      ``theta_{i+1} - theta_0``, or ``Interleaved`` leaves holding the same.
    k: how many components to use; more than available uses them all.
    weighting: ``"l2"``, ``"l1"`` or ``"raw"``.
    calibrate_length: scale by ``||r||`` (paper eq. 10).
    components: ``"top"`` (largest eigenvalues) or ``"bottom"`` (smallest
      non-zero, the ablation of the paper's appendix A.7).
    reference: ``"end"`` or ``"mean"``, see above.
    rtol: relative eigenvalue cut-off; None uses ``10 * m * eps``.
    dtype: dtype of the Gram matrix and ``eigh``; None uses the Gram's dtype
      (at least float32).
    gram_block: ``block_size`` of :func:`gram`.

  Returns:
    A :class:`Principal`.

  Example:
    >>> import jax.numpy as jnp
    >>> from pgrad_jax import principal_gradient
    >>> disp = {"w": jnp.array([[-1.0, 0.0], [-2.0, -0.1]])}
    >>> out = principal_gradient(disp, k=1)
    >>> float(jnp.linalg.norm(out.update["w"]))  # ||r|| = ||theta_0 - theta_end||
    2.002...

  References:
    Wang, Grigsby and Qi, `PGrad: Learning Principal Gradients for Domain
    Generalization <https://openreview.net/forum?id=CgCmwcfgEdH>`_, ICLR 2023.
  """
  kk = gram(displacements, block_size=gram_block)
  if dtype is not None:
    kk = kk.astype(jnp.promote_types(dtype, jnp.float32))
  beta, lam, ref_norm = coefficients(
      kk, k, weighting=weighting, calibrate_length=calibrate_length,
      components=components, reference=reference, rtol=rtol)
  return Principal(weighted_sum(beta, displacements), lam, ref_norm)


def coefficients(
    kk: jax.Array,
    k: int,
    *,
    weighting: Weighting = "l2",
    calibrate_length: bool = True,
    components: Components = "top",
    reference: Literal["end", "mean"] = "end",
    rtol: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Everything :func:`principal_gradient` computes from the Gram matrix.

  Args:
    kk: the ``(s, s)`` Gram matrix of the stored displacements.
    k, weighting, calibrate_length, components, reference, rtol: as in
      :func:`principal_gradient`.

  Returns:
    ``(beta, eigenvalues, ref_norm)``: the principal gradient is
    ``sum_i beta_i D_i`` (see :func:`weighted_sum`); ``eigenvalues`` has
    length ``s + 1``.
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
  if components not in COMPONENTS:
    raise ValueError(
        f"components must be one of {COMPONENTS}, got {components!r}.")
  steps = kk.shape[0]
  m = steps + 1
  # Row/column 0 is theta_0 itself, whose displacement is zero.
  kk = jnp.pad(kk, ((1, 0), (1, 0)))
  centre = jnp.eye(m, dtype=kk.dtype) - 1.0 / m
  if reference == "end":
    rho = -jnp.zeros(m, kk.dtype).at[-1].set(1.0)
  elif reference == "mean":
    rho = -jnp.ones(m, kk.dtype).at[0].set(0.0) / steps
  else:
    raise ValueError(f"reference must be 'end' or 'mean', got {reference!r}.")

  g = centre @ kk @ centre
  g = 0.5 * (g + g.T)
  lam, vecs = jnp.linalg.eigh(g)
  lam, vecs = jnp.maximum(lam[::-1], 0.0), vecs[:, ::-1]
  ref_norm = jnp.sqrt(jnp.maximum(rho @ kk @ rho, 0.0))
  projection = vecs.T @ (centre @ kk @ rho)  # <C^T e_z, r>
  sign = jnp.where(projection >= 0, 1.0, -1.0).astype(kk.dtype)

  cutoff = (rtol if rtol is not None else 10 * m * jnp.finfo(kk.dtype).eps)
  valid = lam > cutoff * lam[0]
  rank = jnp.arange(m)
  if components == "top":
    chosen = valid & (rank < k)
  else:
    chosen = valid & (rank >= jnp.sum(valid) - k)
  lam_k = jnp.where(chosen, lam, 0.0)
  if weighting == "l2":
    norm = jnp.linalg.norm(lam_k)
  elif weighting == "l1":
    norm = jnp.sum(lam_k)
  else:
    norm = jnp.ones((), kk.dtype)
  weights = jnp.where(norm > 0, lam_k / jnp.where(norm > 0, norm, 1.0), 0.0)
  # w_z s_z v_z = (w_z s_z / sqrt(lambda_z)) C^T e_z.
  safe_sqrt = jnp.sqrt(jnp.where(chosen, lam, 1.0))
  coef = vecs @ jnp.where(chosen, weights * sign / safe_sqrt, 0.0)
  if calibrate_length:
    coef = coef * ref_norm
  beta = (centre @ coef)[1:]
  return beta, lam, ref_norm


def weighted_sum(beta: jax.Array, displacements: optax.Params) -> optax.Updates:
  """``sum_i beta_i D_i`` leaf by leaf, accumulated in at least float32."""

  def leaf_sum(d):
    if interleave_lib.is_interleaved(d):
      return interleave_lib.weighted_sum(beta, d)
    acc = jnp.promote_types(d.dtype, jnp.float32)
    return jnp.tensordot(beta.astype(acc), d, axes=1).astype(d.dtype)

  return jax.tree.map(leaf_sum, displacements,
                      is_leaf=interleave_lib.is_interleaved)
