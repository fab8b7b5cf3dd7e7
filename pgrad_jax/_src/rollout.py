"""Step 1 of PGrad: sequential inner-optimizer steps over the training domains.

A rollout starts at ``theta_0`` and takes one inner-optimizer step per
(domain, chunk) of a schedule (:func:`domain_schedule`, eq. 4), storing the
points it reaches (``trajectory.py``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import layout as layout_lib
from pgrad_jax._src import trajectory as trajectory_lib
from pgrad_jax._src import validation

Order = Literal["random", "fixed"]


def make_schedule(
    B: int, order: Order
) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
  """Checks ``order`` once; returns ``schedule(key, num_domains)``, the
  :func:`domain_schedule` of ``B`` chunks in this order."""
  validation.one_of("order", order, Order)

  def schedule(key, num_domains):
    if order == "fixed":
      perms = jnp.tile(jnp.arange(num_domains, dtype=jnp.int32), (B, 1))
    else:
      keys = jax.random.split(key, B)
      perms = jax.vmap(lambda k: jax.random.permutation(k, num_domains))(keys)
    chunks = jnp.repeat(jnp.arange(B, dtype=jnp.int32), num_domains)
    return perms.reshape(-1).astype(jnp.int32), chunks

  return schedule


def domain_schedule(
    key: jax.Array, num_domains: int, B: int, order: Order
) -> tuple[jax.Array, jax.Array]:
  """Returns the (domain, chunk) visited at every inner step of a rollout.

  Round ``i`` (``0 <= i < B``) visits every domain once, on chunk ``i`` of
  that domain's batch (the trajectory sampling of eq. 4).

  Args:
    key: a PRNG key; unused for ``order="fixed"``.
    num_domains: ``n``, the number of training domains.
    B: the number of chunks each domain's batch is split into.
    order: ``"fixed"`` (PGrad-F): every round visits domains ``0..n-1``;
      ``"random"`` (PGrad): a fresh random permutation each round.

  Returns:
    ``(domains, chunks)``: two int32 arrays of length ``n * B``; step ``s``
    takes an inner step on chunk ``chunks[s]`` of domain ``domains[s]``.

  Example:
    >>> import jax
    >>> from pgrad_jax import domain_schedule
    >>> domains, chunks = domain_schedule(jax.random.key(0), 3, 2, "fixed")
    >>> domains.tolist(), chunks.tolist()
    ([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
  """
  return make_schedule(B, order)(key, num_domains)


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
  """How a rollout steps and what it keeps; checked when built.

  Attributes:
    B: the number of chunks of each domain's batch ``b``; chunk ``i`` holds
      examples ``[i * b / B, (i + 1) * b / B)``.
    parallel, unroll, trajectory_dtype, axis_name: as the arguments of
      :func:`pgrad` that build them.
    store_trajectory: if False, only the end point is kept (all Fish needs).
  """

  B: int = 1
  parallel: bool = False
  unroll: int | bool | None = None
  trajectory_dtype: Any = None
  axis_name: str | None = None
  store_trajectory: bool = True

  def __post_init__(self):
    object.__setattr__(self, "B", validation.positive_int("B", self.B))
    if self.unroll is not None and self.unroll is not True:
      validation.positive_int("unroll", self.unroll)


class Rollout(NamedTuple):
  """What a rollout produced.

  Attributes:
    displacements: ``theta_{i+1} - theta_0`` for every step ``i``, like the
      params, laid out as ``trajectory.py`` describes; with
      ``store_trajectory=False``, the end point alone, as one step.
    inner_state: the inner optimizer state after the last step.
    losses: float32 ``(num_steps,)``, the loss at each step's starting point.
    model_state: what the last step's forward pass left; None if stateless.
  """

  displacements: Any
  inner_state: optax.OptState
  losses: jax.Array
  model_state: Any = None

  def point(self, step: int) -> optax.Params:
    """``theta_{step+1} - theta_0`` like the params (``-1``: the end point)."""
    return trajectory_lib.point(self.displacements, step)


def check_batches(batches: Any, B: int) -> int:
  """Checks ``batches`` and returns the number of domains.

  Raises:
    ValueError: naming the fix, unless every leaf has the same leading axes
      ``(n_domains, per_domain_batch)``, both non-zero, ``B`` dividing the
      second.
  """
  leaves = jax.tree_util.tree_leaves_with_path(batches)
  if not leaves:
    raise ValueError(
        "A rollout needs batches=...: a pytree whose leaves stack one batch "
        "per training domain, shaped (n_domains, batch, ...); got "
        f"{batches!r}.")
  shapes = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if len(shape) < 2:
      raise ValueError(
          f"batches leaf {jax.tree_util.keystr(path)} has shape {shape}; every "
          "leaf needs leading axes (n_domains, per_domain_batch, ...). Stack "
          "one batch per domain, e.g. jnp.stack(per_domain_batches).")
    shapes[jax.tree_util.keystr(path)] = tuple(shape[:2])
  if len(set(shapes.values())) > 1:
    listing = ", ".join(f"{p or 'batches'}: {s}" for p, s in shapes.items())
    raise ValueError(
        "batches leaves disagree on their leading (n_domains, per_domain_batch)"
        f" axes: {listing}. Every leaf must hold the same domains and examples.")
  num_domains, per_domain = next(iter(shapes.values()))
  if num_domains == 0:
    raise ValueError(
        f"batches hold zero domains (leading axes {(0, per_domain)}); stack "
        "one batch per training domain: (n_domains, batch, ...), n_domains >= 1.")
  if per_domain == 0:
    raise ValueError(
        f"batches hold an empty batch per domain (leading axes "
        f"{(num_domains, 0)}); every domain needs at least B={B} "
        "examples.")
  if per_domain % B:
    lower = per_domain - per_domain % B
    options = [s for s in (lower, lower + B) if s > 0]
    raise ValueError(
        f"B={B} does not divide the per-domain batch size "
        f"{per_domain}. Use a per-domain batch that is a multiple of B (e.g. "
        f"{' or '.join(map(str, options))}), or a B that divides {per_domain}.")
  return num_domains


def split_chunks(x: jax.Array, B: int) -> jax.Array:
  """Reshapes ``(n, b, ...)`` to ``(n, B, b / B, ...)``.

  Under a mesh with explicit axes, a per-domain batch axis sharded over devices
  hands its mesh axes to the within-chunk axis, so every chunk is spread over
  all of them and each inner step runs data-parallel, for one reshuffle of
  the batch per update (on the chunk axis, each chunk would live on a
  fraction of the devices, and JAX rejects that reshape as ambiguous).
  """
  x = jnp.asarray(x)  # A NumPy batch could not be indexed by the scan.
  shape = (x.shape[0], B, x.shape[1] // B) + x.shape[2:]
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if spec[1] is None:
    return x.reshape(shape)
  out_sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(spec[0], None, *spec[1:]))
  return jax.lax.reshape(x, shape, out_sharding=out_sharding)


def vary_over(tree: Any, axis_name: Any) -> Any:
  """Marks ``tree`` as varying over the mapped axis (or axes) ``axis_name``.

  Inside ``shard_map`` (with its default ``check_vma=True``) the gradient
  with respect to replicated params comes back already summed over the axis;
  with respect to a varying copy it is each device's own gradient, which
  ``pmean`` then averages, as it does with ``check_vma=False`` or ``pmap``.
  """
  return jax.tree.map(lambda x: jax.lax.pcast(x, axis_name, to="varying"),
                      tree)


def callable_loss_fn(loss_fn: Any) -> Callable[..., Any]:
  """``loss_fn``, checked to be callable: an update given none gets None."""
  if not callable(loss_fn):
    raise TypeError(
        "loss_fn must be a callable loss_fn(params, batch) -> scalar loss, got "
        f"{type(loss_fn).__name__}. An update needs loss_fn as a keyword: "
        "tx.update(grads, state, params, loss_fn=loss_fn, batches=batches).")
  return loss_fn


def check_loss_fn(
    loss_fn: Callable[..., Any], params: optax.Params, batch: Any,
    model_state: Any = None,
) -> Any:
  """Checks at trace time that ``loss_fn`` returns what :func:`rollout` says.

  Returns:
    The loss traced to a closed jaxpr.
  """
  stateful = model_state is not None
  jaxpr, out = jax.make_jaxpr(loss_fn, return_shape=True)(
      params, batch, *([model_state] if stateful else []))
  if stateful:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          "With a model state, loss_fn(params, batch, model_state) must return "
          f"(loss, new_model_state); got {out}.")
    out, new_state = out
    if not same_shapes(model_state, new_state):
      raise TypeError(
          "loss_fn's new model state must have the structure, shapes and "
          "dtypes of the model state it was given: expected "
          f"{tree_shapes(model_state)}, got {tree_shapes(new_state)}.")
  elif isinstance(out, tuple):
    raise TypeError(
        "loss_fn returned a tuple; it must return the loss alone: drop an "
        "auxiliary output, e.g. loss_fn=lambda p, b: f(p, b)[0]. A loss that "
        "updates a model state takes it as its third argument with the "
        "model_state= extra and returns (loss, new_model_state).")
  if getattr(out, "shape", None) != () or not jnp.issubdtype(
      out.dtype, jnp.floating):
    raise TypeError(
        "loss_fn must return a scalar floating-point loss, got "
        f"shape={getattr(out, 'shape', None)} dtype={getattr(out, 'dtype', None)}"
        ". Reduce it, e.g. with .mean(), over the batch.")
  return jaxpr


def same_shapes(a: Any, b: Any) -> bool:
  """Whether two pytrees have the same structure, leaf shapes and dtypes, so
  that one can stand in for the other in a traced program."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def tree_shapes(tree: Any) -> Any:
  """``tree`` with each leaf replaced by its ``(shape, dtype)``, to show."""
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def rollout(
    loss_fn: Callable[..., Any],
    inner_opt: optax.GradientTransformation,
    params: optax.Params,
    inner_state: optax.OptState,
    batches: Any,
    domains: jax.Array,
    chunks: jax.Array,
    options: RolloutOptions = RolloutOptions(),
    *,
    layout: layout_lib.TrajectoryLayout | None = None,
    model_state: Any = None,
) -> Rollout:
  """Takes one inner-optimizer step per scheduled (domain, chunk).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, or with a ``model_state``,
      ``loss_fn(params, batch, model_state) -> (loss, new_model_state)``.
    inner_opt: the Optax transform of the inner steps.
    params: ``theta_0``.
    inner_state: the inner optimizer state to start from.
    batches: a pytree of leaves shaped ``(n_domains, per_domain_batch, ...)``.
    domains, chunks: int ``(num_steps,)``, the domain and chunk of each step
      (:func:`domain_schedule`).
    options: a :class:`RolloutOptions`.
    layout: the scan unroll and trajectory layout; None asks
      ``layout.default_layout`` for the current devices and this loss.
    model_state: state that the loss's forward pass updates and gradients do
      not train (e.g. BatchNorm running statistics); each step starts from
      the state the previous step left.

  Returns:
    A :class:`Rollout`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import pgrad_jax
    >>> params = {"w": jnp.zeros(2)}
    >>> batches = {"x": jnp.ones((2, 4, 2)), "y": jnp.ones((2, 4))}
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> inner = optax.sgd(0.1)
    >>> domains, chunks = pgrad_jax.domain_schedule(
    ...     jax.random.key(0), 2, 2, "fixed")
    >>> rolled = pgrad_jax.rollout(
    ...     loss_fn, inner, params, inner.init(params), batches, domains,
    ...     chunks, pgrad_jax.RolloutOptions(B=2))
    >>> rolled.losses.shape, rolled.point(-1)["w"].shape
    ((4,), (2,))
    >>> float(rolled.losses[0])  # Zero params: the mean of (0 - 1)^2.
    1.0

  Raises:
    ValueError, TypeError: when traced, naming the fix, for batches that
      :func:`check_batches` refuses or a ``loss_fn`` that does not return
      what is described above.
  """
  check_batches(batches, options.B)
  return take_steps(loss_fn, inner_opt, params, inner_state, batches, domains,
                    chunks, options, layout=layout, model_state=model_state)


def take_steps(
    loss_fn: Callable[..., Any] | None,
    inner_opt: optax.GradientTransformation,
    params: optax.Params,
    inner_state: optax.OptState,
    batches: Any,
    domains: jax.Array,
    chunks: jax.Array,
    options: RolloutOptions,
    *,
    layout: layout_lib.TrajectoryLayout | None,
    model_state: Any,
) -> Rollout:
  """:func:`rollout` on batches that :func:`check_batches` has accepted, as
  ``pgrad`` and ``fish`` call it, having checked them once."""
  loss_fn = callable_loss_fn(loss_fn)
  chunked = jax.tree.map(lambda x: split_chunks(x, options.B), batches)
  first_chunk = jax.tree.map(lambda x: x[0, 0], chunked)
  loss_jaxpr = check_loss_fn(loss_fn, params, first_chunk, model_state)
  if layout is None:
    layout = layout_lib.default_layout(loss_jaxpr, options.unroll)
  stateful = model_state is not None
  axis_name = options.axis_name
  grad_fn = jax.value_and_grad(loss_fn, has_aux=stateful)

  def displacement(theta):
    return jax.tree.map(lambda t, t0: t - t0, theta, params)

  def step(carry, schedule):
    theta, state, model, trajectory = carry
    index, domain, chunk = schedule
    batch = jax.tree.map(lambda x: x[domain, chunk], chunked)
    start = params if options.parallel else theta
    varying = start if axis_name is None else vary_over(start, axis_name)
    loss, grads = grad_fn(varying, batch, *([model] if stateful else []))
    if stateful:
      loss, model = loss
    if axis_name is not None:
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
      # Integer state (e.g. a step counter) is the same on every device.
      model = jax.tree.map(
          lambda x: jax.lax.pmean(x, axis_name)
          if jnp.issubdtype(x.dtype, jnp.inexact) else x, model)
    updates, state = inner_opt.update(grads, state, start)
    theta = optax.apply_updates(start, updates)
    if trajectory is not None:
      trajectory = trajectory_lib.write(trajectory, index, displacement(theta))
    return (theta, state, model, trajectory), loss.astype(jnp.float32)

  num_steps = domains.shape[0]
  trajectory = None
  if options.store_trajectory:
    trajectory = trajectory_lib.allocate(params, num_steps, layout,
                                         options.trajectory_dtype)
  (theta, inner_state, model_state, trajectory), losses = jax.lax.scan(
      step, (params, inner_state, model_state, trajectory),
      (jnp.arange(num_steps), domains, chunks), unroll=layout.unroll)
  if trajectory is None:
    trajectory = jax.tree.map(
        lambda d: d[None].astype(options.trajectory_dtype or d.dtype),
        displacement(theta))
  return Rollout(trajectory, inner_state, losses, model_state)
