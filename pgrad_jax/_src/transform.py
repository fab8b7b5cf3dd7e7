"""``pgrad`` and ``fish``: Optax transforms built on a rollout.

An update of :func:`pgrad` is the paper's six steps in order: roll out
(``rollout.py``), then centre, Gram and ``eigh``, orient, weight and calibrate,
and project back (``principal.py``).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import principal as principal_lib
from pgrad_jax._src import rollout as rollout_lib
from pgrad_jax._src import validation

NonFinite = Literal["skip", "propagate"]


class PGradState(NamedTuple):
  """State of :func:`pgrad`.

  Attributes:
    inner_state: the inner optimizer's state, carried from one outer step to
      the next unless ``reset_inner_state=True``.
    model_state: the model state (e.g. BatchNorm statistics) the rollout's
      last inner step left; read it by name,
      ``optax.tree_utils.tree_get(state, "model_state")``. ``init`` sets it
      to None, or, wrapped by :func:`with_model_state`, to the initial model
      state, which fixes its structure from the start.
    key: the PRNG key of the random domain order.
    eigenvalues: ``(num_domains * B + 1,)`` spectrum of the last trajectory's
      centred Gram matrix, descending.
    ref_norm: ``||theta_0 - theta_end||`` of the last rollout.
    loss: the mean inner loss of the last rollout.
    losses: ``(num_domains * B,)`` inner loss of every step of the last
      rollout, in visiting order.
    num_skipped: how many updates ``nonfinite="skip"`` has skipped.

  ``eigenvalues`` and ``losses`` are None unless ``num_domains`` was given:
  ``init`` sees only the params, and fixes the state's shapes.
  """

  inner_state: optax.OptState
  model_state: Any
  key: jax.Array
  eigenvalues: jax.Array | None
  ref_norm: jax.Array
  loss: jax.Array
  losses: jax.Array | None
  num_skipped: jax.Array


class FishState(NamedTuple):
  """State of :func:`fish`: :class:`PGradState` without ``eigenvalues``."""

  inner_state: optax.OptState
  model_state: Any
  key: jax.Array
  ref_norm: jax.Array
  loss: jax.Array
  losses: jax.Array | None
  num_skipped: jax.Array


def _check_model_state(name: str, model_state: Any, held: Any) -> None:
  """Checks the ``model_state=`` extra against the one the state holds.

  A state without one (None, as ``init`` leaves it) accepts any; a state
  from :func:`with_model_state` needs one like its own, so that the update
  returns a state of the same structure.
  """
  if held is None:
    return
  if model_state is None:
    raise ValueError(
        f"This {name} state holds a model state (from with_model_state), so "
        "every update needs one: tx.update(..., model_state=...), e.g. "
        "optax.tree_utils.tree_get(state, 'model_state').")
  if not rollout_lib.same_shapes(model_state, held):
    raise ValueError(
        f"The model_state given to {name}.update must have the structure, "
        "shapes and dtypes of the one given to with_model_state: expected "
        f"{rollout_lib.tree_shapes(held)}, got "
        f"{rollout_lib.tree_shapes(model_state)}.")


def _is_empty_container(params: Any) -> bool:
  """Whether ``params`` is None or dicts, lists and tuples of nothing else.

  Such params hold no arrays to optimise: a mistake ``init`` names. A pytree
  node of another type without leaves is not one: it stands for the params,
  as the placeholder ``optax.tree.map_params`` passes to ``init`` does.
  """
  if isinstance(params, dict):
    params = list(params.values())
  if isinstance(params, (list, tuple)):
    return all(_is_empty_container(child) for child in params)
  return params is None


def _check_params(name: str, params: optax.Params) -> None:
  """Refuses params that a rollout cannot step: none, or not floating."""
  if _is_empty_container(params):
    raise ValueError(
        f"{name}.init needs the params, a pytree of floating-point arrays; "
        f"got {params!r}.")
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          f"{name} needs floating-point params; leaf "
          f"{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}. "
          "Keep integer state out of the params tree (e.g. nnx.Optimizer's "
          "wrt=nnx.Param).")


def _check_update(
    name: str, state: Any, params: optax.Params | None, model_state: Any,
    batches: Any, B: int, num_domains: int | None
) -> tuple[PGradState | FishState, optax.Params, int]:
  """Refuses an update's arguments that do not fit the transform; returns
  the state and params, known to be the transform's, and how many domains
  the batches hold."""
  if not isinstance(state, (PGradState, FishState)):
    raise TypeError(
        f"{name}.update needs the state that {name}.init returned; got "
        f"{type(state).__name__}.")
  if params is None:
    raise ValueError(
        f"{name}.update needs params: "
        "tx.update(grads, state, params, loss_fn=..., batches=...).")
  _check_model_state(name, model_state, state.model_state)
  n = rollout_lib.check_batches(batches, B)
  if num_domains is not None and n != num_domains:
    raise ValueError(
        f"batches hold {n} domains but {name} was built with "
        f"num_domains={num_domains}; build it with num_domains={n}.")
  return state, params, n


def _skip_nonfinite(losses: jax.Array, update: optax.Updates,
                    new_states: Any, old_states: Any
                    ) -> tuple[optax.Updates, Any, Any, jax.Array]:
  """``nonfinite="skip"``: where a loss, the update or the new model state
  is not finite, a zero update and the old inner and model states.

  Returns:
    The update, the inner state, the model state, and whether it skipped.
  """
  finite = jnp.all(jnp.isfinite(losses))
  for leaf in jax.tree.leaves((update, new_states[1])):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      finite &= jnp.all(jnp.isfinite(leaf))
  update = jax.tree.map(lambda u: jnp.where(finite, u, 0).astype(u.dtype),
                        update)
  inner_state, model_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old), new_states, old_states)
  return update, inner_state, model_state, ~finite


def _rollout_transform(
    name: str,
    inner_opt: optax.GradientTransformation,
    order: rollout_lib.Order,
    options: rollout_lib.RolloutOptions,
    from_rollout: Callable[[rollout_lib.Rollout],
                           principal_lib.PrincipalGradient],
    *,
    reset_inner_state: bool,
    nonfinite: NonFinite,
    num_domains: int | None,
    seed: int,
) -> optax.GradientTransformationExtraArgs:
  """The machinery :func:`pgrad` and :func:`fish` share around a rollout.

  ``from_rollout`` turns the rollout into the update and its diagnostics
  (``eigenvalues`` None for fish). Every option is checked here, once.
  """
  schedule = rollout_lib.make_schedule(options.B, order)
  validation.one_of("nonfinite", nonfinite, NonFinite)
  if num_domains is not None:
    num_domains = validation.positive_int("num_domains", num_domains)
  num_steps = 0 if num_domains is None else num_domains * options.B

  def make_state(eigenvalues, losses, **fields):
    # Absent diagnostics are None, not empty arrays, which checkpointers
    # such as Orbax refuse to save.
    if not num_steps:
      eigenvalues = losses = None
    if not options.store_trajectory:  # No trajectory, no spectrum.
      return FishState(losses=losses, **fields)
    return PGradState(eigenvalues=eigenvalues, losses=losses, **fields)

  # The states are typed at their fields: optax.OptState leaves out None,
  # which absent diagnostics are (and a pytree and a checkpoint hold).
  def init_fn(params: optax.Params) -> Any:
    _check_params(name, params)
    return make_state(
        eigenvalues=jnp.zeros((num_steps + 1,), jnp.float32),
        losses=jnp.zeros((num_steps,), jnp.float32),
        inner_state=inner_opt.init(params),
        model_state=None,
        key=jax.random.PRNGKey(seed),
        ref_norm=jnp.zeros((), jnp.float32),
        loss=jnp.zeros((), jnp.float32),
        num_skipped=jnp.zeros((), jnp.int32))

  def update_fn(
      updates: optax.Updates,
      state: optax.OptState,
      params: optax.Params | None = None,
      *,
      loss_fn: Callable[..., Any] | None = None,
      batches: Any = None,
      model_state: Any = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, Any]:
    del updates, extra_args  # The rollout computes its own gradients.
    checked, params, n = _check_update(name, state, params, model_state,
                                       batches, options.B, num_domains)

    # Step 1: roll out.
    key, order_key = jax.random.split(checked.key)
    domains, chunks = schedule(order_key, n)
    inner_state = inner_opt.init(params) if reset_inner_state else (
        checked.inner_state)
    rolled = rollout_lib.take_steps(
        loss_fn, inner_opt, params, inner_state, batches, domains, chunks,
        options, layout=None, model_state=model_state)
    # Steps 2 to 6 (pgrad), or the end point (fish).
    step = from_rollout(rolled)
    update = jax.tree.map(lambda u, p: u.astype(p.dtype), step.update, params)

    inner_state, new_model_state = rolled.inner_state, rolled.model_state
    skipped = jnp.zeros((), bool)
    if nonfinite == "skip":
      update, inner_state, new_model_state, skipped = _skip_nonfinite(
          rolled.losses, update, (inner_state, new_model_state),
          (checked.inner_state, model_state))

    return update, make_state(
        eigenvalues=(None if step.eigenvalues is None
                     else step.eigenvalues.astype(jnp.float32)),
        losses=rolled.losses,
        inner_state=inner_state,
        model_state=new_model_state,
        key=key,
        ref_norm=step.ref_norm.astype(jnp.float32),
        loss=jnp.mean(rolled.losses),
        num_skipped=checked.num_skipped + skipped.astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pgrad(
    inner_opt: optax.GradientTransformation,
    k: int = 4,
    B: int = 1,
    *,
    order: rollout_lib.Order = "random",
    principal: principal_lib.PrincipalOptions = principal_lib.PrincipalOptions(),
    parallel: bool = False,
    reset_inner_state: bool = False,
    nonfinite: NonFinite = "skip",
    unroll: int | bool | None = None,
    trajectory_dtype: Any = None,
    axis_name: str | None = None,
    num_domains: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """PGrad: step along the principal directions of a rollout trajectory.

  Each update rolls out ``n * B`` steps of ``inner_opt`` over the ``n``
  training domains (:func:`domain_schedule`; a schedule inside ``inner_opt``
  counts them all) and outputs the principal gradient of the trajectory
  (:func:`principal_gradient`) in gradient sign convention. The incoming
  updates are ignored. Chain it with the outer optimizer: the paper uses
  ``optax.sgd(0.1)``.

  Args:
    inner_opt: the Optax transform of the inner steps (the paper: Adam).
    k: how many principal components to use; more than available uses all.
    B: chunks per domain batch (PGrad-B uses 3); must divide the batch size.
    order: ``"random"`` (PGrad) or ``"fixed"`` (PGrad-F): see
      :func:`domain_schedule`.
    principal: a :class:`PrincipalOptions`, how the principal gradient is
      weighted, cut off and computed; its defaults are the paper's.
    parallel: every inner step starts from ``theta_0`` (PGradParallel), the
      inner state still threading through; the reference becomes ``theta_0``
      minus the mean of the rollout's points.
    reset_inner_state: re-initialise the inner optimizer every outer step.
    nonfinite: ``"skip"``: if an inner loss, the update or the new model
      state is not finite, the update is zero, the inner and model states are
      kept and ``num_skipped`` counts it; ``"propagate"``: no check.
    unroll: ``jax.lax.scan`` unroll of the rollout; None lets ``layout.py``
      pick it for the devices and the loss.
    trajectory_dtype: dtype of the stored displacements, e.g. ``jnp.bfloat16``
      to halve their memory; None keeps the params' dtypes.
    axis_name: inside ``shard_map``/``pmap`` with the batch split over this
      axis, average gradients, losses and a floating model state over it.
    num_domains: the number of training domains, checked against
      ``batches``; it sizes the state (see :class:`PGradState`).
    seed: seeds the random domain order.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`PGradState`.
    Its ``update(updates, state, params, *, loss_fn, batches,
    model_state=None)`` takes ``loss_fn``, ``batches`` (leaves
    ``(n_domains, batch, ...)``) and ``model_state`` as :func:`rollout` does.

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
    >>> updates, state = tx.update(None, tx.init(params), params,
    ...                            loss_fn=loss_fn, batches=batches)
    >>> first = jax.tree.map(lambda b: b[0], batches)
    >>> new_params = optax.apply_updates(params, updates)
    >>> bool(loss_fn(new_params, first) < loss_fn(params, first))
    True

  References:
    Wang, Grigsby and Qi, `PGrad: Learning Principal Gradients for Domain
    Generalization <https://openreview.net/forum?id=CgCmwcfgEdH>`_, ICLR 2023.
  """
  k = validation.positive_int("k", k)
  if not isinstance(principal, principal_lib.PrincipalOptions):
    raise TypeError(
        "principal must be a pgrad_jax.PrincipalOptions, e.g. "
        f"principal=pgrad_jax.PrincipalOptions(components='bottom'); got "
        f"{principal!r}.")
  options = rollout_lib.RolloutOptions(
      B=B, parallel=parallel, unroll=unroll, trajectory_dtype=trajectory_dtype,
      axis_name=axis_name)
  reference = "mean" if parallel else "end"

  def principal_step(rolled):
    return principal_lib.principal_gradient(
        rolled.displacements, k, principal, reference=reference)

  return _rollout_transform(
      "pgrad", inner_opt, order, options, principal_step,
      reset_inner_state=reset_inner_state, nonfinite=nonfinite,
      num_domains=num_domains, seed=seed)


def fish(
    inner_opt: optax.GradientTransformation,
    B: int = 1,
    *,
    order: rollout_lib.Order = "random",
    reset_inner_state: bool = False,
    nonfinite: NonFinite = "skip",
    unroll: int | bool | None = None,
    axis_name: str | None = None,
    num_domains: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Fish (Reptile over domains): output ``theta_0 - theta_end`` of a rollout.

  The rollout of :func:`pgrad`, keeping only its end point (one point of
  memory): ``optax.chain(fish(inner_opt), optax.sgd(meta_lr))`` moves the
  params a fraction ``meta_lr`` of the way there, Fish's meta update.

  Args:
    inner_opt: the Optax transform of the inner steps (Fish uses Adam).
    B: chunks per domain batch, as in :func:`pgrad`.
    order: ``"random"`` or ``"fixed"``, as in :func:`pgrad`.
    reset_inner_state: as in :func:`pgrad`.
    nonfinite: as in :func:`pgrad`.
    unroll: as in :func:`pgrad`.
    axis_name: as in :func:`pgrad`.
    num_domains: as in :func:`pgrad`; it sizes the state's ``losses``.
    seed: as in :func:`pgrad`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`FishState`;
    its ``update`` takes the same extras as :func:`pgrad`'s.

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
  options = rollout_lib.RolloutOptions(
      B=B, unroll=unroll, axis_name=axis_name, store_trajectory=False)

  def end_point(rolled):
    update = jax.tree.map(lambda d: -d, rolled.point(-1))
    ref_norm = optax.tree.norm(optax.tree.cast(update, jnp.float32))
    return principal_lib.PrincipalGradient(update, None, ref_norm)

  return _rollout_transform(
      "fish", inner_opt, order, options, end_point,
      reset_inner_state=reset_inner_state, nonfinite=nonfinite,
      num_domains=num_domains, seed=seed)


def with_model_state(
    tx: optax.GradientTransformation, model_state: Any,
) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` puts ``model_state`` in its state from the start.

  ``init`` sees only the params, so a :func:`pgrad` or :func:`fish` state
  holds None as its ``model_state`` until the first update given
  ``model_state=``; its structure then changes, which makes a jitted step
  trace twice and ``flax.nnx.Optimizer`` fail. Wrapped, the state holds the
  initial model state (e.g. ``nnx.state(model, nnx.BatchStat)``) from
  ``init`` on, and every update must be given a model state like it.

  Args:
    tx: ``pgrad`` or ``fish``, alone or in a chain (the field is found by
      name, as ``optax.tree_utils.tree_set`` finds it).
    model_state: the initial model state.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``tx`` with that ``init``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import pgrad_jax
    >>> params = {"w": jnp.zeros(2)}
    >>> tx = pgrad_jax.with_model_state(
    ...     optax.chain(pgrad_jax.fish(optax.sgd(0.1)), optax.sgd(0.5)),
    ...     {"mean": jnp.zeros(2)})
    >>> optax.tree_utils.tree_get(tx.init(params), "model_state")
    {'mean': Array([0., 0.], dtype=float32)}
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    state = tx.init(params)
    try:
      return optax.tree_utils.tree_set(state, model_state=model_state)
    except KeyError:
      raise ValueError(
          "with_model_state needs a transform whose state has a model_state "
          "field: pgrad or fish, alone or in an optax.chain.") from None

  return optax.GradientTransformationExtraArgs(init_fn, tx.update)
