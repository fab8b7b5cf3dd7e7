"""Sequential inner-optimizer steps over the training domains.

A rollout starts at ``theta_0`` and takes one inner-optimizer step per
(domain, chunk) of a schedule. It returns the trajectory as displacements
``theta_i - theta_0``: they are small, so storing them instead of the points
keeps the later Gram matrix free of float32 cancellation.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pgrad_jax._src import interleave as interleave_lib

LossFn = Callable[..., Any]


class Rollout(NamedTuple):
  """What a rollout produced.

  Attributes:
    displacements: a pytree like the params whose leaves have a new leading
      axis of length ``num_steps``: entry ``i`` is ``theta_{i+1} - theta_0``.
      With ``interleave``, a leaf may instead be an ``Interleaved``, whose
      ``points()`` gives that stacked array.
    inner_state: the inner optimizer state after the last step.
    losses: float32 ``(num_steps,)``, the loss at each step's starting point.
    model_state: the model state after the last step's forward pass (e.g.
      BatchNorm running statistics); None for a stateless loss.
  """

  displacements: optax.Params
  inner_state: optax.OptState
  losses: jax.Array
  model_state: Any = None


def has_convolution(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr holds a convolution, at any nesting depth."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "conv_general_dilated":
      return True
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns") and has_convolution(sub):
          return True
  return False


def default_unroll(loss_jaxpr: Any) -> int | bool:
  """The scan unroll that avoids the slow path of the current backend.

  On GPU and TPU the scan stays rolled (an unrolled one compiles slowly). On
  XLA:CPU a loop whose body holds a convolution runs dozens of times slower
  than the same steps unrolled (measured: DomainBed's MNIST CNN, 39 s
  rolled against 1.5 s unrolled per rollout), so a convolutional loss is
  fully unrolled; any other loss stays rolled, which on CPU is as fast and
  lets the trajectory be written in place.

  Args:
    loss_jaxpr: the loss traced on one chunk, e.g.
      ``jax.make_jaxpr(loss_fn)(params, batch)``.

  Returns:
    ``True`` (fully unrolled) or ``1`` (rolled).
  """
  if jax.default_backend() != "cpu":
    return 1
  return True if has_convolution(loss_jaxpr) else 1


def batch_shape(batches: Any, num_chunks: int) -> tuple[int, int]:
  """Checks ``batches`` and returns ``(num_domains, per_domain_batch)``.

  Raises:
    ValueError: if there are no leaves, if a leaf has fewer than two axes, if
      the leading two axes disagree between leaves, or if ``num_chunks`` does
      not divide the per-domain batch.
  """
  leaves = jax.tree_util.tree_leaves_with_path(batches)
  if not leaves:
    raise ValueError("batches has no array leaves; pass the per-domain batches "
                     "stacked on a leading axis: (n_domains, batch, ...).")
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
  if per_domain % num_chunks:
    lower = per_domain - per_domain % num_chunks
    options = [s for s in (lower, lower + num_chunks) if s > 0]
    raise ValueError(
        f"B={num_chunks} does not divide the per-domain batch size "
        f"{per_domain}. Use a per-domain batch that is a multiple of B (e.g. "
        f"{' or '.join(map(str, options))}), or a B that divides {per_domain}.")
  return num_domains, per_domain


def split_chunks(x: jax.Array, num_chunks: int, per_chunk: int) -> jax.Array:
  """Reshapes ``(n, b, ...)`` to ``(n, num_chunks, per_chunk, ...)``.

  Under a mesh with explicit axes, a per-domain batch axis sharded over devices
  hands its mesh axes to the within-chunk axis: every chunk is then spread
  over the same devices and each inner step runs data-parallel, at the price
  of one reshuffle of the batch per update. (Kept on the chunk axis instead,
  each chunk would live on a fraction of the devices, and JAX rejects the
  reshape as ambiguous.)
  """
  x = jnp.asarray(x)  # A NumPy batch could not be indexed by the scan.
  shape = (x.shape[0], num_chunks, per_chunk) + x.shape[2:]
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


def check_loss_fn(
    loss_fn: Any, params: optax.Params, batch: Any, has_aux: bool,
    model_state: Any = None,
) -> Any:
  """Checks at trace time that ``loss_fn`` gives a scalar (and a model state).

  With ``model_state`` (not None), ``loss_fn(params, batch, model_state)``
  must return ``(loss, new_model_state)`` with ``new_model_state`` shaped like
  ``model_state``; otherwise ``loss_fn(params, batch)`` returns the loss, or
  ``(loss, aux)`` with ``has_aux``.

  Returns:
    The loss traced to a closed jaxpr.
  """
  if not callable(loss_fn):
    raise TypeError(
        "loss_fn must be a callable loss_fn(params, batch) -> scalar loss, got "
        f"{type(loss_fn).__name__}. Pass it as a keyword: "
        "tx.update(grads, state, params, loss_fn=loss_fn, batches=batches).")
  if model_state is not None:
    if has_aux:
      raise ValueError(
          "has_aux=True cannot be combined with a model state: with a model "
          "state, loss_fn(params, batch, model_state) returns "
          "(loss, new_model_state). Build the transform with has_aux=False.")
    jaxpr, out = jax.make_jaxpr(loss_fn, return_shape=True)(
        params, batch, model_state)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          "With a model state, loss_fn(params, batch, model_state) must return "
          f"(loss, new_model_state); got {out}.")
    out, new_state = out
    expected = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)),
                            model_state)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), new_state)
    if (jax.tree.structure(expected) != jax.tree.structure(got)
        or expected != got):
      raise TypeError(
          "loss_fn's new model state must have the structure, shapes and "
          f"dtypes of the model state it was given: expected {expected}, got "
          f"{got}.")
  else:
    jaxpr, out = jax.make_jaxpr(loss_fn, return_shape=True)(params, batch)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError("With has_aux=True, loss_fn must return (loss, aux); "
                        f"got {out}.")
      out = out[0]
    elif isinstance(out, tuple):
      raise TypeError("loss_fn returned a tuple; if it returns (loss, aux), "
                      "build the transform with has_aux=True.")
  if getattr(out, "shape", None) != () or not jnp.issubdtype(
      out.dtype, jnp.floating):
    raise TypeError(
        "loss_fn must return a scalar floating-point loss, got "
        f"shape={getattr(out, 'shape', None)} dtype={getattr(out, 'dtype', None)}"
        ". Reduce it, e.g. with .mean(), over the batch.")
  return jaxpr


def rollout(
    loss_fn: LossFn,
    inner_opt: optax.GradientTransformation,
    params: optax.Params,
    inner_state: optax.OptState,
    batches: Any,
    domains: jax.Array,
    chunks: jax.Array,
    *,
    num_chunks: int,
    parallel: bool = False,
    has_aux: bool = False,
    unroll: int | bool | None = None,
    trajectory_dtype: Any = None,
    axis_name: str | None = None,
    model_state: Any = None,
    interleave: int | None = None,
    store_trajectory: bool = True,
) -> Rollout:
  """Takes one inner-optimizer step per scheduled (domain, chunk).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``).
    inner_opt: the Optax transform used for the inner steps.
    params: ``theta_0``.
    inner_state: the inner optimizer state to start from.
    batches: a pytree of leaves shaped ``(n_domains, per_domain_batch, ...)``.
    domains: int ``(num_steps,)``, the domain of each step.
    chunks: int ``(num_steps,)``, the chunk of each step.
    num_chunks: ``B``; chunk ``i`` holds examples
      ``[i * b / B, (i + 1) * b / B)`` of a domain's batch ``b``.
    parallel: if True, every step starts from ``theta_0`` instead of the
      previous point (the PGradParallel ablation); the inner state still
      threads through the steps.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is dropped.
    unroll: passed to ``jax.lax.scan``; None uses :func:`default_unroll`.
      A scan that is not fully unrolled writes each point into a
      preallocated trajectory in place; a fully unrolled one stacks them.
    trajectory_dtype: dtype of the stored displacements; None keeps each
      leaf's dtype.
    axis_name: a mapped axis (``shard_map``/``pmap``) over which the data is
      split: gradients and losses are averaged over it.
    model_state: state that the loss's forward pass updates and that is not
      trained by gradient (e.g. BatchNorm running statistics). When given,
      ``loss_fn(params, batch, model_state)`` returns
      ``(loss, new_model_state)`` and each step starts from the state the
      previous step left, so the state follows the rollout; with
      ``axis_name`` it is averaged over the mapped axis.
    interleave: None, or a block size ``c``: a rolled scan then stores each
      float32/float64 leaf whose size ``c`` divides as an ``Interleaved``
      (point axis inside, ``theta_0`` included as a zero row), whose Gram
      matrix XLA:CPU computes about twice as fast. Only for unsharded
      params; a fully unrolled scan stacks every leaf.
    store_trajectory: if False, only the end point is kept: the
      ``displacements`` leaves have a leading axis of length 1 holding
      ``theta_end - theta_0`` (all Fish needs, in the memory of one point).

  Returns:
    A :class:`Rollout`.
  """
  interleave_lib.check_block_size("interleave", interleave)
  num_domains, per_domain = batch_shape(batches, num_chunks)
  chunked = jax.tree.map(
      lambda x: split_chunks(x, num_chunks, per_domain // num_chunks), batches)
  first_chunk = jax.tree.map(lambda x: x[0, 0], chunked)
  loss_jaxpr = check_loss_fn(loss_fn, params, first_chunk, has_aux,
                             model_state)
  stateful = model_state is not None
  if unroll is None:
    unroll = default_unroll(loss_jaxpr)
  num_steps = domains.shape[0]
  # Measured on XLA:CPU: in a rolled loop, stacked scan outputs take two more
  # param-sized buffers than a carried trajectory updated in place; fully
  # unrolled, the carried trajectory is the one that gets copied.
  in_place = store_trajectory and unroll is not True and unroll < num_steps
  stacked = store_trajectory and not in_place
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux or stateful)

  def displacement(theta):
    return jax.tree.map(
        lambda t, t0: (t - t0).astype(trajectory_dtype or t.dtype), theta,
        params)

  def step(carry, schedule):
    theta, state, model, trajectory = carry
    index, domain, chunk = schedule
    batch = jax.tree.map(lambda x: x[domain, chunk], chunked)
    start = params if parallel else theta
    varying = start if axis_name is None else vary_over(start, axis_name)
    loss, grads = grad_fn(varying, batch, *([model] if stateful else []))
    if stateful:
      loss, model = loss
    elif has_aux:
      loss = loss[0]
    if axis_name is not None:
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
      # Integer state (e.g. a step counter) is the same on every device.
      model = jax.tree.map(
          lambda x: jax.lax.pmean(x, axis_name)
          if jnp.issubdtype(x.dtype, jnp.inexact) else x, model)
    updates, state = inner_opt.update(grads, state, start)
    theta = optax.apply_updates(start, updates)
    loss = loss.astype(jnp.float32)
    if stacked:
      return (theta, state, model, trajectory), (displacement(theta), loss)
    if not in_place:
      return (theta, state, model, trajectory), loss
    trajectory = jax.tree.map(
        lambda buf, x: interleave_lib.write(buf, index, x)
        if interleave_lib.is_interleaved(buf)
        else jax.lax.dynamic_update_index_in_dim(buf, x, index, 0),
        trajectory, displacement(theta), is_leaf=interleave_lib.is_interleaved)
    return (theta, state, model, trajectory), loss

  def zeros(p):
    if interleave is not None and interleave_lib.can_interleave(
        p, interleave, trajectory_dtype):
      return interleave_lib.zeros(p, num_steps, interleave, trajectory_dtype)
    # Broadcasting a zero point keeps the params' sharding on its axes.
    return jnp.broadcast_to(interleave_lib.zeros_from(p, trajectory_dtype),
                            (num_steps,) + jnp.shape(p))

  trajectory = jax.tree.map(zeros, params) if in_place else None
  (theta, inner_state, model_state, trajectory), out = jax.lax.scan(
      step, (params, inner_state, model_state, trajectory),
      (jnp.arange(num_steps), domains, chunks), unroll=unroll)
  if stacked:
    trajectory, losses = out
  else:
    losses = out
  if not store_trajectory:
    trajectory = jax.tree.map(lambda d: d[None], displacement(theta))
  return Rollout(trajectory, inner_state, losses, model_state)
