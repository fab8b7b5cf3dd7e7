"""Steps 2 to 6 of PGrad: from a trajectory to its principal gradient.

The ``m`` points are stored as displacements ``D_i = theta_i - theta_0``
(``trajectory.py``); ``D_0 = 0`` is not stored. Everything PGrad needs comes
from their ``m x m`` Gram matrix ``K = D D^T`` (``gram`` in the code) and the
centring matrix ``H = I - 11^T / m`` (``centring``): neither the centred
trajectory ``C = H D`` (centring the points or their displacements is the
same) nor the ``d x d`` covariance is formed, so the trajectory is read twice,
for ``K`` and for step 6's weighted sum, and only ``K`` is reduced across
devices. Each step's docstring gives the identity it computes; equation
numbers are the paper's.
"""

import dataclasses
import numbers
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import trajectory as trajectory_lib
from pgrad_jax._src import validation

Weighting = Literal["l2", "l1", "raw"]
Components = Literal["top", "bottom"]
Reference = Literal["end", "mean"]


@dataclasses.dataclass(frozen=True)
class PrincipalOptions:
  """How steps 2 to 6 turn a trajectory into its principal gradient; checked
  when built. The defaults are the paper's.

  Attributes:
    weighting: the weight of component ``z``: ``"l2"``,
      ``lambda_z / ||lambda_{:k}||_2`` (the paper); ``"l1"``, over the L1
      norm; ``"raw"``, ``lambda_z``.
    calibrate_length: scale the update by ``||r||`` (eq. 11); without it and
      with ``"l2"``, the update has unit length.
    components: ``"top"`` (largest eigenvalues) or ``"bottom"`` (smallest
      non-zero, the ablation of the paper's appendix A.7).
    rtol: eigenvalues below ``rtol * lambda_max`` count as zero; None uses
      ``10 * m * eps`` of ``gram_dtype``.
    gram_dtype: dtype of the Gram matrix and ``eigh``; None uses the
      trajectory's, at least float32.
  """

  weighting: Weighting = "l2"
  calibrate_length: bool = True
  components: Components = "top"
  rtol: float | None = None
  gram_dtype: Any = None

  def __post_init__(self):
    validation.one_of("weighting", self.weighting, Weighting)
    validation.one_of("components", self.components, Components)
    if self.rtol is not None and not (
        isinstance(self.rtol, numbers.Real) and 0 <= self.rtol < 1):
      raise ValueError(
          f"rtol must be None or a number in [0, 1), got {self.rtol!r}: "
          "eigenvalues below rtol * lambda_max count as zero.")
    if self.gram_dtype is not None and not jnp.issubdtype(self.gram_dtype,
                                                          jnp.floating):
      raise ValueError(
          f"gram_dtype must be a floating-point dtype or None, got "
          f"{self.gram_dtype!r}.")


class PrincipalGradient(NamedTuple):
  """The principal gradient and what it was built from.

  Attributes:
    update: a pytree like one trajectory point, in gradient sign convention
      (``theta <- theta - lr * update`` descends).
    eigenvalues: ``(m,)``, those of the centred Gram matrix, descending and
      clamped at zero; None where no spectrum was computed (:func:`fish`).
    ref_norm: ``||r||``, the length of the reference ``r``.
  """

  update: optax.Updates
  eigenvalues: jax.Array | None
  ref_norm: jax.Array


def centring_matrix(displacements: Any, gram_dtype=None) -> jax.Array:
  """Step 2: the matrix ``H`` that centres the ``m`` points of the
  trajectory (eq. 6's hat): ``C = H D``.

  Args:
    displacements: the stored trajectory ``D``.
    gram_dtype: as in :class:`PrincipalOptions`.

  Returns:
    ``H = I - 11^T / m``, ``(m, m)``.
  """
  m = trajectory_lib.num_steps(displacements) + 1
  dtype = jnp.promote_types(
      gram_dtype or jnp.result_type(*jax.tree.leaves(displacements)),
      jnp.float32)
  return jnp.eye(m, dtype=dtype) - jnp.ones((), dtype) / m


def gram_and_eigh(
    gram: jax.Array, centring: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Step 3: eigendecompose ``G = C C^T = H K H`` (eqs. 5-7): its eigenpairs
  ``(lambda_z, e_z)`` give the axes ``v_z = C^T e_z / sqrt(lambda_z)``.

  Args:
    gram: ``(m - 1, m - 1)``, ``K`` of the stored steps
      (``pgrad_jax.gram``), without theta_0's zero row and column.
    centring: ``H``.

  Returns:
    ``(eigenvalues, eigenvectors, gram)``: ``(m,)``, descending and clamped
    at zero; the ``(m, m)`` ``e_z`` as columns; ``K``, ``(m, m)``, in
    ``H``'s dtype.
  """
  # Row and column 0 of K belong to theta_0, whose displacement is zero.
  gram = jnp.pad(gram.astype(centring.dtype), ((1, 0), (1, 0)))
  g = centring @ gram @ centring
  eigenvalues, eigenvectors = jnp.linalg.eigh(0.5 * (g + g.T))
  return jnp.maximum(eigenvalues[::-1], 0.0), eigenvectors[:, ::-1], gram


def orient(
    eigenvectors: jax.Array, gram: jax.Array, centring: jax.Array,
    reference: Reference,
) -> tuple[jax.Array, jax.Array]:
  """Step 4: flip each axis to point along the reference ``r`` (eq. 8).

  With ``r = D^T rho``, ``<C^T e_z, r> = e_z^T H K rho`` and
  ``||r||^2 = rho^T K rho``.

  Args:
    eigenvectors: ``(m, m)``, the ``e_z`` as columns.
    gram, centring: ``K = D D^T`` and ``H``.
    reference: ``"end"``: ``r = theta_0 - theta_end`` (the paper);
      ``"mean"``: ``r = theta_0 - mean_{i>0} theta_i`` (PGradParallel).

  Returns:
    ``(signs, ref_norm)``: ``s_z = +-1`` with ``<s_z v_z, r> >= 0``; ``||r||``.
  """
  m = gram.shape[0]
  if reference == "end":
    rho = -jnp.zeros(m, gram.dtype).at[-1].set(1.0)
  else:
    rho = -jnp.ones(m, gram.dtype).at[0].set(0.0) / (m - 1)
  ref_norm = jnp.sqrt(jnp.maximum(rho @ gram @ rho, 0.0))
  projection = eigenvectors.T @ (centring @ gram @ rho)
  return jnp.where(projection >= 0, 1.0, -1.0).astype(gram.dtype), ref_norm


def weight_and_calibrate(
    eigenvalues: jax.Array, signs: jax.Array, ref_norm: jax.Array, k: int,
    options: PrincipalOptions,
) -> jax.Array:
  """Step 5: weight the chosen axes by eigenvalue, scale by ``||r||``.

  The weight of axis ``z`` is ``lambda_z / ||lambda_{:k}||_2`` (eqs. 9 and
  12, or ``options.weighting``'s), times its sign and, with
  ``options.calibrate_length``, times ``||r||`` (eq. 11). Eigenvalues below
  ``options.rtol * lambda_max`` are numerically zero: they get no weight and
  do not count towards ``k`` (a centred trajectory of ``m`` points has at
  most ``m - 1`` non-zero ones).

  Returns:
    ``(m,)`` weights ``w_z``, zero for the axes not chosen.
  """
  m = eigenvalues.shape[0]
  dtype = eigenvalues.dtype
  rtol = options.rtol
  cutoff = rtol if rtol is not None else 10 * m * jnp.finfo(dtype).eps
  valid = eigenvalues > cutoff * eigenvalues[0]
  rank = jnp.arange(m)
  if options.components == "top":
    chosen = valid & (rank < k)
  else:
    chosen = valid & (rank >= jnp.sum(valid) - k)
  lam = jnp.where(chosen, eigenvalues, 0.0)
  norm = {"l2": jnp.linalg.norm, "l1": jnp.sum,
          "raw": lambda x: jnp.ones((), dtype)}[options.weighting](lam)
  weights = jnp.where(norm > 0, lam / jnp.where(norm > 0, norm, 1.0), 0.0)
  return weights * signs * (ref_norm if options.calibrate_length else 1.0)


def project_back(
    weights: jax.Array, eigenvalues: jax.Array, eigenvectors: jax.Array,
    centring: jax.Array, displacements: Any,
) -> optax.Updates:
  """Step 6: ``sum_z w_z v_z = C^T E (w / sqrt(lambda)) = D^T beta`` with
  ``beta = H E (w / sqrt(lambda))`` (eq. 7): one weighted sum of the stored
  displacements, in each leaf's shape and dtype."""
  chosen = weights != 0
  scaled = jnp.where(chosen, weights / jnp.sqrt(
      jnp.where(chosen, eigenvalues, 1.0)), 0.0)
  beta = centring @ (eigenvectors @ scaled)
  # beta[0] multiplies D_0 = 0.
  return trajectory_lib.weighted_sum(beta[1:], displacements)


def principal_gradient(
    displacements: Any,
    k: int,
    options: PrincipalOptions = PrincipalOptions(),
    *,
    reference: Reference = "end",
) -> PrincipalGradient:
  """The principal gradient of a trajectory given as displacements.

  Steps 2 to 6 of PGrad on the ``m = s + 1`` points ``theta_0`` and the
  ``s`` stored ones: :func:`centring_matrix`, :func:`gram_and_eigh`,
  :func:`orient`, :func:`weight_and_calibrate` and :func:`project_back`,
  giving ``||r|| * sum_{z<k} lambda_z / ||lambda_{:k}||_2 * s_z v_z``
  (eq. 12) with the default options.

  Args:
    displacements: the trajectory, e.g. a rollout's ``displacements``, or any
      pytree with leaves ``(s, *leaf_shape)``, entry ``i`` being
      ``theta_{i+1} - theta_0``.
    k: how many components to use; more than available uses them all.
    options: a :class:`PrincipalOptions`.
    reference: ``"end"`` or ``"mean"``, see :func:`orient`.

  Returns:
    A :class:`PrincipalGradient`.

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
  centring = centring_matrix(displacements, options.gram_dtype)
  eigenvalues, eigenvectors, gram = gram_and_eigh(
      trajectory_lib.gram(displacements), centring)
  signs, ref_norm = orient(eigenvectors, gram, centring, reference)
  weights = weight_and_calibrate(eigenvalues, signs, ref_norm, k, options)
  update = project_back(weights, eigenvalues, eigenvectors, centring,
                        displacements)
  return PrincipalGradient(update, eigenvalues, ref_norm)
