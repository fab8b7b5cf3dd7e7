"""``pgrad`` and ``fish``: Optax transforms built on a rollout."""

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import interleave as interleave_lib
from pgrad_jax._src import principal as principal_lib
from pgrad_jax._src import rollout as rollout_lib
from pgrad_jax._src import schedule as schedule_lib

NonFinite = Literal["skip", "propagate"]
NONFINITE = ("skip", "propagate")


class PGradState(NamedTuple):
  """State of :func:`pgrad` and :func:`fish`.

  Attributes:
    inner_state: the inner optimizer's state; it carries over from one outer
      step to the next unless ``reset_inner_state=True``.
    model_state: None, or model state that the loss's forward pass updates
      and gradients do not train, such as BatchNorm running statistics. Set
      it once after ``init`` (``optax.tree_utils.tree_set(state,
      model_state=batch_stats)``); then ``loss_fn(params, batch, model_state)``
      returns ``(loss, new_model_state)``, the state follows the rollout's
      inner steps, and each update leaves the state of the rollout's last
      step here (``optax.tree_utils.tree_get(state, "model_state")``).
    key: the PRNG key that draws the random domain order.
    eigenvalues: ``(m,)`` spectrum of the last trajectory's centred Gram
      matrix, descending, with ``m = num_domains * B + 1``; None unless
      ``num_domains`` was given (the state's shapes are fixed at ``init``,
      which sees only the params), and always None for :func:`fish`.
    ref_norm: ``||theta_0 - theta_end||`` of the last rollout.
    loss: the mean inner loss of the last rollout.
    losses: ``(num_domains * B,)`` inner loss of every step of the last
      rollout, in visiting order; None unless ``num_domains`` was given.
    num_skipped: how many updates ``nonfinite="skip"`` has skipped.
  """

  inner_state: optax.OptState
  model_state: Any
  key: jax.Array
  eigenvalues: jax.Array | None
  ref_norm: jax.Array
  loss: jax.Array
  losses: jax.Array | None
  num_skipped: jax.Array


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def _rollout_transform(
    inner_opt: optax.GradientTransformation,
    B: int,
    *,
    reduce,
    spectrum: bool,
    order: schedule_lib.Order,
    parallel: bool,
    reset_inner_state: bool,
    has_aux: bool,
    nonfinite: NonFinite,
    unroll: int | bool | None,
    trajectory_dtype: Any,
    axis_name: str | None,
    num_domains: int | None,
    seed: int,
    name: str,
    store_trajectory: bool,
) -> optax.GradientTransformationExtraArgs:
  """Shared machinery: ``reduce(rollout) -> (update, eigenvalues, ref_norm)``.

  With ``store_trajectory`` the rollout keeps every point, interleaved where
  the devices favour it (``interleave.default_block``); without, only the
  end point.
  """
  _check_positive("B", B)
  if num_domains is not None:
    _check_positive("num_domains", num_domains)
  _check_choice("order", order, schedule_lib.ORDERS)
  _check_choice("nonfinite", nonfinite, NONFINITE)
  steps = 0 if num_domains is None else num_domains * B
  m = 0 if num_domains is None or not spectrum else steps + 1

  def init_fn(params):
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        raise TypeError(
            f"{name} needs floating-point params; leaf "
            f"{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}. "
            "Keep integer state out of the params tree (e.g. nnx.Optimizer's "
            "wrt=nnx.Param).")
    return PGradState(
        inner_state=inner_opt.init(params),
        model_state=None,
        key=jax.random.PRNGKey(seed),
        # Absent diagnostics are None, not empty arrays, which checkpointers
        # such as Orbax refuse to save.
        eigenvalues=jnp.zeros((m,), jnp.float32) if m else None,
        ref_norm=jnp.zeros((), jnp.float32),
        loss=jnp.zeros((), jnp.float32),
        losses=jnp.zeros((steps,), jnp.float32) if steps else None,
        num_skipped=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, *, loss_fn=None, batches=None,
                **extra_args):
    del updates, extra_args  # The rollout computes its own gradients.
    if params is None:
      raise ValueError(f"{name}.update needs params: "
                       "tx.update(grads, state, params, loss_fn=..., batches=...).")
    if batches is None:
      raise ValueError(
          f"{name}.update needs batches=...: a pytree whose leaves stack one "
          "batch per training domain, shaped (n_domains, batch, ...).")
    if loss_fn is None:
      raise TypeError(f"{name}.update needs loss_fn=...: a callable "
                      "loss_fn(params, batch) -> scalar loss.")
    n, _ = rollout_lib.batch_shape(batches, B)
    if num_domains is not None and n != num_domains:
      raise ValueError(
          f"batches hold {n} domains but {name} was built with "
          f"num_domains={num_domains}; build it with num_domains={n}.")

    key, order_key = jax.random.split(state.key)
    domains, chunks = schedule_lib.domain_schedule(order_key, n, B, order)
    inner_state = inner_opt.init(params) if reset_inner_state else (
        state.inner_state)
    out = rollout_lib.rollout(
        loss_fn, inner_opt, params, inner_state, batches, domains, chunks,
        num_chunks=B, parallel=parallel, has_aux=has_aux,
        unroll=unroll,
        trajectory_dtype=trajectory_dtype, axis_name=axis_name,
        model_state=state.model_state,
        interleave=interleave_lib.default_block(),
        store_trajectory=store_trajectory)
    step, eigenvalues, ref_norm = reduce(out)
    step = jax.tree.map(lambda u, p: u.astype(p.dtype), step, params)

    inner_state, model_state = out.inner_state, out.model_state
    skipped = jnp.zeros((), bool)
    if nonfinite == "skip":
      finite = jnp.all(jnp.isfinite(out.losses))
      for leaf in jax.tree.leaves((step, model_state)):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
          finite &= jnp.all(jnp.isfinite(leaf))
      skipped = ~finite
      step = jax.tree.map(lambda u: jnp.where(finite, u, 0).astype(u.dtype), step)
      inner_state, model_state = jax.tree.map(
          lambda new, old: jnp.where(finite, new, old),
          (inner_state, model_state), (state.inner_state, state.model_state))

    new_state = PGradState(
        inner_state=inner_state,
        model_state=model_state,
        key=key,
        eigenvalues=eigenvalues.astype(jnp.float32) if m else None,
        ref_norm=ref_norm.astype(jnp.float32),
        loss=jnp.mean(out.losses),
        losses=out.losses if steps else None,
        num_skipped=state.num_skipped + skipped.astype(jnp.int32))
    return step, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pgrad(
    inner_opt: optax.GradientTransformation,
    k: int = 4,
    B: int = 1,
    *,
    order: schedule_lib.Order = "random",
    weighting: principal_lib.Weighting = "l2",
    calibrate_length: bool = True,
    components: principal_lib.Components = "top",
    parallel: bool = False,
    reset_inner_state: bool = False,
    has_aux: bool = False,
    nonfinite: NonFinite = "skip",
    unroll: int | bool | None = None,
    trajectory_dtype: Any = None,
    gram_dtype: Any = None,
    rtol: float | None = None,
    axis_name: str | None = None,
    num_domains: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """PGrad: step along the principal directions of a rollout trajectory.

  Each update rolls out ``n * B`` inner-optimizer steps over the training
  domains (each domain's batch split into ``B`` chunks, round ``i`` visiting
  every domain once on chunk ``i``), centres the ``m = n * B + 1`` points,
  eigendecomposes their ``m x m`` Gram matrix, orients each principal axis
  along ``r = theta_0 - theta_end`` and outputs
  ``||r|| * sum_{z<k} lambda_z / ||lambda_{:k}||_2 * v_z`` in gradient sign
  convention. Chain it with the outer optimizer: the paper uses
  ``optax.sgd(0.1)``.

  The incoming updates are ignored: the rollout computes its own gradients
  from the keyword-only extras ``loss_fn`` and ``batches``.

  Args:
    inner_opt: the Optax transform of the inner steps (the paper: Adam).
    k: number of principal components; more than available uses them all.
    B: chunks per domain batch (PGrad-B uses 3); must divide the batch size.
    order: ``"random"`` (PGrad: a fresh domain permutation each round) or
      ``"fixed"`` (PGrad-F: domains ``0..n-1``).
    weighting: ``"l2"`` (``lambda / ||lambda||_2``, paper default), ``"l1"``
      (``lambda / ||lambda||_1``) or ``"raw"`` (``lambda``).
    calibrate_length: multiply by ``||r||`` (paper eq. 10); else unit length
      with ``"l2"`` weighting.
    components: ``"top"`` or ``"bottom"`` k components (appendix A.7 ablation).
    parallel: every inner step starts from ``theta_0`` (PGradParallel); the
      reference becomes ``theta_0`` minus the mean of the rollout's points.
    reset_inner_state: re-initialise the inner optimizer every outer step
      instead of carrying its state over.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is ignored.
    nonfinite: ``"skip"``: if any inner loss, the update or the new model
      state is not finite, the update is zero, the inner and model states are
      kept and ``num_skipped`` counts it, so NaN never reaches the params;
      ``"propagate"``: no check.
    unroll: ``jax.lax.scan`` unroll of the rollout; None picks per backend:
      rolled, except on CPU for a loss with convolutions, which XLA:CPU runs
      far faster unrolled (see ``pgrad_jax.rollout``).
    trajectory_dtype: dtype of the stored trajectory (displacements from
      ``theta_0``); e.g. ``jnp.bfloat16`` halves its memory. None keeps the
      params' dtypes.
    gram_dtype: dtype of the Gram matrix and ``eigh`` (at least float32).
    rtol: relative cut-off under which an eigenvalue counts as zero.
    axis_name: inside ``shard_map``/``pmap`` with the batch split over this
      axis, average gradients and losses over it.
    num_domains: the number of training domains; sizes the per-step
      diagnostics in the state (``eigenvalues``, ``losses``), which are empty
      without it, and is checked against ``batches``.
    seed: seeds the random domain order.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`PGradState`. Its ``update(updates, state, params, *, loss_fn,
    batches, **extra_args)`` takes ``loss_fn(params, batch) -> scalar`` (or,
    with a model state in the state, ``loss_fn(params, batch, model_state) ->
    (loss, new_model_state)``) and ``batches``, a pytree with leaves shaped
    ``(n_domains, batch, ...)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import pgrad_jax
    >>> params = {"w": jnp.zeros(3)}
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 3))  # 2 domains x 6
    >>> batches = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
    >>> def loss_fn(p, batch):
    ...   return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
    >>> tx = optax.chain(pgrad_jax.pgrad(optax.adam(1e-2), k=2, B=3),
    ...                  optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(None, state, params, loss_fn=loss_fn,
    ...                            batches=batches)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(loss_fn(params, {"x": x[0], "y": batches["y"][0]}) <
    ...      loss_fn({"w": jnp.zeros(3)}, {"x": x[0], "y": batches["y"][0]}))
    True

  References:
    Wang, Grigsby and Qi, `PGrad: Learning Principal Gradients for Domain
    Generalization <https://openreview.net/forum?id=CgCmwcfgEdH>`_, ICLR 2023.
  """
  _check_positive("k", k)
  _check_choice("weighting", weighting, principal_lib.WEIGHTINGS)
  _check_choice("components", components, principal_lib.COMPONENTS)

  def reduce(out):
    result = principal_lib.principal_gradient(
        out.displacements, k, weighting=weighting,
        calibrate_length=calibrate_length, components=components,
        reference="mean" if parallel else "end", rtol=rtol, dtype=gram_dtype,
        gram_block=principal_lib.default_gram_block())
    return result.update, result.eigenvalues, result.ref_norm

  return _rollout_transform(
      inner_opt, B, reduce=reduce, spectrum=True, order=order,
      parallel=parallel, reset_inner_state=reset_inner_state, has_aux=has_aux,
      nonfinite=nonfinite, unroll=unroll, trajectory_dtype=trajectory_dtype,
      axis_name=axis_name, num_domains=num_domains, seed=seed, name="pgrad",
      store_trajectory=True)


def fish(
    inner_opt: optax.GradientTransformation,
    B: int = 1,
    *,
    order: schedule_lib.Order = "random",
    reset_inner_state: bool = False,
    has_aux: bool = False,
    nonfinite: NonFinite = "skip",
    unroll: int | bool | None = None,
    axis_name: str | None = None,
    num_domains: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Fish (Reptile over domains): output ``theta_0 - theta_end`` of a rollout.

  The same sequential rollout as :func:`pgrad`, without the principal
  components: ``optax.chain(fish(inner_opt), optax.sgd(meta_lr))`` moves the
  params a fraction ``meta_lr`` of the way to the rollout's end point, which
  is Fish's meta update.

  Args:
    inner_opt: the Optax transform of the inner steps (Fish uses Adam).
    B: chunks per domain batch, as in :func:`pgrad`.
    order: ``"random"`` or ``"fixed"`` domain order.
    reset_inner_state: re-initialise the inner optimizer every outer step.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    nonfinite: ``"skip"`` or ``"propagate"``, as in :func:`pgrad`.
    unroll: ``jax.lax.scan`` unroll; None picks per backend and loss, as in
      :func:`pgrad`.
    axis_name: mapped axis to average gradients over, as in :func:`pgrad`.
    num_domains: sizes the per-step ``losses`` diagnostic.
    seed: seeds the random domain order.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`PGradState`
    (its ``eigenvalues`` are None).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import pgrad_jax
    >>> params = {"w": jnp.zeros(2)}
    >>> batches = {"x": jnp.ones((3, 4, 2)), "y": jnp.ones((3, 4))}
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> tx = optax.chain(pgrad_jax.fish(optax.sgd(0.1)), optax.sgd(0.5))
    >>> updates, _ = tx.update(None, tx.init(params), params, loss_fn=loss_fn,
    ...                        batches=batches)
    >>> updates["w"].shape
    (2,)

  References:
    Shi et al., `Gradient Matching for Domain Generalization
    <https://arxiv.org/abs/2104.09937>`_, ICLR 2022.
  """

  def reduce(out):
    end = jax.tree.map(lambda d: -d[-1], out.displacements)
    ref_norm = jnp.sqrt(sum(jnp.sum(jnp.square(e.astype(jnp.float32)))
                            for e in jax.tree.leaves(end)))
    return end, None, ref_norm

  return _rollout_transform(
      inner_opt, B, reduce=reduce, spectrum=False, order=order, parallel=False,
      reset_inner_state=reset_inner_state, has_aux=has_aux, nonfinite=nonfinite,
      unroll=unroll, trajectory_dtype=None, axis_name=axis_name,
      num_domains=num_domains, seed=seed, name="fish", store_trajectory=False)
