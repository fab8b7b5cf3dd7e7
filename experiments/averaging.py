"""Weight averaging along a run: EMA, SMA (ERM++) and SWAD.

The strongest domain-generalization recipes evaluate an average of the
weights a run passes through rather than its last weights. This module
computes those averages as pure functions of the stream of params, in
optax's style: a factory returns ``init`` and ``update`` functions, and the
state is a pytree of arrays, so it is checkpointed with the run and a resumed
run continues bit for bit. It imports only JAX, the standard library and
`loss_valley` (NumPy); any pytree of floating arrays (Flax params, with
BatchNorm statistics where they should be averaged too) can be averaged.

ERM++ (``experiments.algorithms.erm_plus_plus``) keeps its `sma` in its
state; ``experiments.train --averaging ema|sma|swad`` runs these functions
for every other algorithm (``experiments.training.weight_averaging``), and
any training loop can call them itself (below).

**EMA** (`ema`): ``average = decay * average + (1 - decay) * params`` after
every step, starting from the initial params, with no bias correction: the
weights of the initial and later params already sum to one, so there is no
bias from a start at zero to correct (optax's ``ema(debias=True)`` corrects
one because it starts from zeros). This is the weight EMA users meet in timm,
``ModelEmaV2`` (huggingface/pytorch-image-models 0a044bf,
``timm/utils/model_ema.py``: the average starts as a ``deepcopy`` of the
model and updates as ``decay * e + (1. - decay) * m``).

**SMA** (`sma`): DomainBed's ``ErmPlusPlusMovingAvg``, which ERM++ uses
(facebookresearch/DomainBed b93c22a, ``domainbed/lib/misc.py`` lines 51-72).
It counts updates from 1 (``global_iter``); before update ``start_iter``
(600) the average is the latest params; from update ``start_iter`` on it is
the equal-weight mean of the params after update ``start_iter - 1`` and
after every later update (line 67 weighs the average by ``sma_count``, which
reaches 1 at update ``start_iter``, and the new params by 1).

**SWAD** (`swad`): khanrc/swad's ``LossValley`` (khanrc/swad 252190e,
``domainbed/swad.py`` lines 48-162) over its ``AveragedModel``
(``domainbed/lib/swa_utils.py`` lines 9-80), called as its trainer calls them
(``domainbed/trainer.py`` lines 151-155, 178-180, 242-257, 287-296):

- every step, after the optimizer's update, the *segment* average takes the
  new params (dense averaging, `Swad.update`);
- at every evaluation, `Swad.evaluate` is given the training domains'
  validation loss (swad's ``tr_outloss``) and closes the segment: the
  segment's mean, its first and last step and the loss enter the windows of
  the last ``n_converge`` and ``n_tolerance`` segments, and a new segment
  starts at the next step. swad evaluates at every step ``s`` with
  ``s % checkpoint_freq == 0``, step 0 included, so its first segment is
  step 0 alone; steps after the last evaluation are not averaged;
- *convergence*: with ``n_converge`` segments seen, the valley starts when
  the oldest of the last ``n_converge`` has the least loss (the first such
  on ties, ``np.argmin``). The threshold is their mean loss times
  ``1 + tolerance_ratio``;
- *inside the valley*: once the oldest of the last ``n_tolerance`` segments
  is not older than the one convergence found, each evaluation averages it
  into the final model, unless the least loss of those ``n_tolerance``
  exceeds the threshold: then the valley is dead
  (`loss_valley.ValleyState.dead`), and swad's trainer stops training
  (line 253);
- `Swad.final` is swad's ``get_final_model``: before convergence the last
  segment's mean; in a living valley, the segments still in the tolerance
  window after its oldest, averaged in order while the least loss of those
  left stays within the threshold.

The final model averages *segment means*, one weight per segment, as swad's
does. Its quirks are kept, since they decide which weights are averaged:

- the final average starts from the converging segment but counts it as no
  term (``AveragedModel(untilmin_segment_swa)`` has ``n_averaged == 0``, so
  the next update overwrites it; swad.py line 100, swa_utils.py line 61);
- with ``n_tolerance > n_converge``, at convergence it averages the segments
  of the tolerance window, up to the converging one, that come after the
  last one above the threshold, less the first of them (swad.py lines
  111-123, ``Q[start_idx + 1:]``); when the tolerance window is not yet
  full, that slice reaches past the converging segment;
- a segment can be averaged twice: at convergence and again when it is the
  oldest of the tolerance window (line 131 compares with ``<``); while that
  window is not yet full, its oldest segment is averaged again at every
  evaluation.

The decisions (`loss_valley.valley_update`, `loss_valley.valley_final`)
are host logic on the sequence of losses in float64, in their own module,
separate from the dense averaging here, which is pure JAX. SWAD keeps
``max(n_converge, n_tolerance)`` segment means, the open segment and the
final average: ``max(n_converge, n_tolerance) + 2`` copies of the params (8
at the defaults); EMA and SMA keep one.

Every equal-weight running mean here (SMA, SWAD's segments and final
average, the BatchNorm statistics) is computed as torch's ``AveragedModel``
computes it, ``mean + (x - mean) / (n + 1)``, its first term copied;
DomainBed's SMA writes ``(mean * n + x) / (n + 1)``, which differs only in
rounding.

**BatchNorm**: swad recomputes BatchNorm's running statistics of the final
model before evaluating it, when BatchNorm trains (trainer.py lines 289-293,
500 batches of the training domains, concatenated): swa_utils's
``update_bn`` (lines 98-126) resets them, sets ``momentum = None`` and runs
the model in train mode, so that torch's BatchNorm keeps the cumulative
average of every batch's mean and *unbiased* variance (factor
``1 / num_batches_tracked``). `cumulative_batch_statistics` computes that
average from a function that returns a batch's statistics.

Example, with a train step that returns new params::

  weight_averaging = swad()
  state = weight_averaging.init(params)
  for step in range(steps):
    params = train_step(params, batches)
    state = state._replace(
        averaging=weight_averaging.update(params, state.averaging))
    if step % checkpoint_freq == 0:
      state = weight_averaging.evaluate(state, validation_loss(params))
      if state.valley.dead:
        break
  final = weight_averaging.final(state)  # final.params, final.averaged, ...

EMA and SMA need no evaluation: ``state = update(params, state)`` after
every step, and ``state.average`` is the averaged params.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from experiments import loss_valley

Params = Any  # A pytree of floating arrays.
Stats = Any  # A pytree of floating arrays: BatchNorm statistics.


def _check_floating(params: Params) -> None:
  """Raises if a leaf of ``params`` is not floating: it cannot be averaged."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          f"Only floating arrays can be averaged, but "
          f"{jax.tree_util.keystr(path)} is {jnp.result_type(leaf)}: average "
          "the params (and BatchNorm statistics) without integer counters.")


def _running_mean(mean: Params, params: Params, count: jax.Array) -> Params:
  """The mean of ``count`` terms, ``mean``, with ``params`` added.

  With ``count == 0`` this is ``params`` itself, copied as torch's
  ``AveragedModel`` copies its first term (swa_utils.py line 62).
  """
  def add(mean_leaf, leaf):
    added = mean_leaf + (leaf - mean_leaf) / (count + 1).astype(leaf.dtype)
    return jnp.where(count == 0, leaf, added)
  return jax.tree.map(add, mean, params)


class EmaState(NamedTuple):
  """The state of `ema`.

  Attributes:
    average: the exponential moving average of the params.
  """
  average: Params


class SmaState(NamedTuple):
  """The state of `sma`.

  Attributes:
    average: the equal-weight mean of the params since update
      ``start_iter - 1``; before update ``start_iter``, the latest params.
    count: how many params ``average`` holds (int32).
    updates: how many updates it has seen (DomainBed's ``global_iter``).
  """
  average: Params
  count: jax.Array
  updates: jax.Array


class ParamsAveraging(NamedTuple):
  """A running average of params, as a pair of pure functions.

  Attributes:
    init: ``init(params) -> state``, from the initial params.
    update: ``update(params, state) -> state``, after every optimizer step;
      jit-friendly.
  """
  init: Callable[[Params], Any]
  update: Callable[[Params, Any], Any]


def ema(decay: float) -> ParamsAveraging:
  """An exponential moving average of the params (see the module docstring).

  Args:
    decay: the weight of the previous average, in [0, 1).

  Returns:
    The `ParamsAveraging`, whose state is an `EmaState`.
  """
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"EMA's decay must be in [0, 1), not {decay}; 0.999 is "
                     "common.")

  def init(params):
    _check_floating(params)
    return EmaState(average=jax.tree.map(jnp.asarray, params))

  def update(params, state):
    average = jax.tree.map(
        lambda a, p: (decay * a + (1.0 - decay) * p).astype(a.dtype),
        state.average, params)
    return EmaState(average=average)

  return ParamsAveraging(init, update)


def sma(start_iter: int = 600) -> ParamsAveraging:
  """DomainBed's simple moving average for ERM++ (see the module docstring).

  Args:
    start_iter: DomainBed's ``sma_start_iter``: from this update on
      (counting from 1), the average holds the params after update
      ``start_iter - 1`` and every later one.

  Returns:
    The `ParamsAveraging`, whose state is an `SmaState`.
  """
  if start_iter < 1:
    raise ValueError(f"SMA's start_iter counts updates from 1, so it must be "
                     f"at least 1, not {start_iter}.")

  def init(params):
    _check_floating(params)
    # DomainBed's average starts as a copy of the network: one term.
    return SmaState(average=jax.tree.map(jnp.asarray, params),
                    count=jnp.ones((), jnp.int32),
                    updates=jnp.zeros((), jnp.int32))

  def update(params, state):
    updates = state.updates + 1
    # Before start_iter, the average restarts from the latest params.
    count = jnp.where(updates < start_iter, 0, state.count)
    return SmaState(average=_running_mean(state.average, params, count),
                    count=count + 1, updates=updates)

  return ParamsAveraging(init, update)


# SWAD: the dense averaging, pure JAX.


class SwadArrays(NamedTuple):
  """SWAD's arrays.

  Attributes:
    steps: how many steps (updates) it has seen (int32).
    segment: the mean of the open segment's params.
    segment_steps: how many steps the open segment holds (int32).
    window: the latest closed segments' means, each leaf stacked on a
      leading axis of ``loss_valley.ValleyConfig.window`` slots.
    final: the final average.
  """
  steps: jax.Array
  segment: Params
  segment_steps: jax.Array
  window: Params
  final: Params


class SwadState(NamedTuple):
  """SWAD's state: its arrays and its valley's decisions.

  Attributes:
    averaging: the arrays, updated every step by `Swad.update`.
    valley: the decisions' state, in NumPy (float64 losses), which must not
      pass through ``jax.jit``.
  """
  averaging: SwadArrays
  valley: loss_valley.ValleyState


class SwadFinal(NamedTuple):
  """SWAD's final model.

  Attributes:
    params: the averaged params (their BatchNorm statistics are to be
      recomputed, `cumulative_batch_statistics`, where BatchNorm trains).
    averaged: how many segment means they average (swad's ``N``; 0 where
      they are one segment's mean, counted as no term).
    first_step, last_step: the steps swad reports they span.
  """
  params: Params
  averaged: int
  first_step: int
  last_step: int


class Swad(NamedTuple):
  """SWAD as functions (see the module docstring for how to call them).

  Attributes:
    init: ``init(params) -> SwadState``.
    update: ``update(params, averaging) -> averaging`` on
      ``SwadState.averaging``, after every optimizer step: pure JAX, to be
      jitted (with the train step, say).
    evaluate: ``evaluate(state, validation_loss) -> state``, at every
      evaluation, after that step's update: closes the segment and takes
      the valley's decisions.
    final: ``final(state) -> SwadFinal``, swad's ``get_final_model``.
  """
  init: Callable[[Params], SwadState]
  update: Callable[[Params, SwadArrays], SwadArrays]
  evaluate: Callable[[SwadState, float], SwadState]
  final: Callable[[SwadState], SwadFinal]


def _update_segment(params: Params, averaging: SwadArrays) -> SwadArrays:
  """Adds the params after a step to the open segment's mean."""
  return averaging._replace(
      steps=averaging.steps + 1,
      segment=_running_mean(averaging.segment, params,
                            averaging.segment_steps),
      segment_steps=averaging.segment_steps + 1)


@jax.jit
def _close_segment(averaging: SwadArrays, slot: jax.Array) -> SwadArrays:
  window = jax.tree.map(lambda w, s: w.at[slot].set(s), averaging.window,
                        averaging.segment)
  return averaging._replace(window=window,
                            segment_steps=jnp.zeros((), jnp.int32))


@jax.jit
def _average_in(final: Params, window: Params, slot: jax.Array,
                count: jax.Array) -> Params:
  """Adds the segment in ``slot`` to the final average of ``count`` terms."""
  return _running_mean(final, jax.tree.map(lambda w: w[slot], window), count)


def _apply(averaging: SwadArrays, config: loss_valley.ValleyConfig,
           averaged: int, decisions: Iterable[loss_valley.Decision]
           ) -> Params:
  """The final average after ``decisions``, from ``averaged`` terms."""
  final = averaging.final
  for decision in decisions:
    slot = jnp.int32(decision.segment % config.window)
    if decision.restart:
      final = jax.tree.map(lambda w: w[slot], averaging.window)
      averaged = 0
    else:
      final = _average_in(final, averaging.window, slot, jnp.int32(averaged))
      averaged += 1
  return final


def swad(n_converge: int = 3, n_tolerance: int = 6,
         tolerance_ratio: float = 0.3) -> Swad:
  """khanrc/swad's ``LossValley`` SWAD (see the module docstring).

  Args:
    n_converge: the convergence window, in evaluations.
    n_tolerance: the window whose least validation loss decides when the
      valley ends, in evaluations.
    tolerance_ratio: the valley ends when that least loss exceeds the
      converging window's mean loss times ``1 + tolerance_ratio``.

  Returns:
    The `Swad` functions.
  """
  config = loss_valley.ValleyConfig(n_converge, n_tolerance, tolerance_ratio)
  valley = loss_valley.valley_init(config)  # Checks the hparams now.

  def init(params):
    _check_floating(params)
    params = jax.tree.map(jnp.asarray, params)
    window = jax.tree.map(
        lambda p: jnp.zeros((config.window, *p.shape), p.dtype), params)
    averaging = SwadArrays(
        steps=jnp.zeros((), jnp.int32), segment=params,
        segment_steps=jnp.zeros((), jnp.int32), window=window, final=params)
    return SwadState(averaging, valley)

  def evaluate(state, validation_loss):
    if state.valley.dead:
      return state
    averaging = state.averaging
    segment_steps = int(averaging.segment_steps)
    if segment_steps == 0:
      raise ValueError("SWAD's evaluate() closes the steps averaged since the "
                       "last evaluation, and there are none: call update() "
                       "after every step, before that step's evaluate().")
    last_step = int(averaging.steps) - 1
    slot = jnp.int32(int(state.valley.segments) % config.window)
    averaging = _close_segment(averaging, slot)
    averaged = int(state.valley.averaged)
    valley, decisions = loss_valley.valley_update(
        state.valley, config, float(validation_loss),
        last_step - segment_steps + 1, last_step)
    final = _apply(averaging, config, averaged, decisions)
    return SwadState(averaging._replace(final=final), valley)

  def final(state):
    valley, decisions = loss_valley.valley_final(state.valley, config)
    params = _apply(state.averaging, config, int(state.valley.averaged),
                    decisions)
    return SwadFinal(params, int(valley.averaged), int(valley.first_step),
                     int(valley.last_step))

  return Swad(init, _update_segment, evaluate, final)


def cumulative_batch_statistics(
    batch_statistics: Callable[[Any], Stats], batches: Iterable[Any]
) -> Stats:
  """BatchNorm's running statistics as swad's ``update_bn`` recomputes them.

  ``update_bn`` (khanrc/swad 252190e, ``domainbed/lib/swa_utils.py`` lines
  98-126) resets every BatchNorm's statistics, sets its ``momentum`` to
  None and runs the model in train mode over the batches. With no
  momentum, torch's BatchNorm updates its running mean and variance with
  the factor ``1 / num_batches_tracked``: after ``n`` batches they are the
  plain averages of the ``n`` batches' means and *unbiased* variances. The
  reset values (zeros, ones) weigh nothing, the first batch's factor being 1.

  Args:
    batch_statistics: ``batch_statistics(batch) -> stats``, the statistics
      every BatchNorm computes on the batch in train mode (its mean, and
      its unbiased variance as torch averages it), as a pytree shaped like
      the running statistics. In train mode BatchNorm normalizes with the
      batch's own statistics, so they depend on the params and the batch
      alone. It is jitted here.
    batches: the batches (swad's: 500 of the training domains' batches,
      concatenated).

  Returns:
    The running statistics, averaged over the batches.

  Raises:
    ValueError: where ``batches`` is empty.
  """
  @jax.jit
  def accumulate(average, batch, count):
    return _running_mean(average, batch_statistics(batch), count)

  average, count = None, 0
  for batch in batches:
    if average is None:  # Any start will do: the first batch weighs 1.
      average = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             jax.eval_shape(batch_statistics, batch))
    average = accumulate(average, batch, jnp.int32(count))
    count += 1
  if average is None:
    raise ValueError("Recomputing BatchNorm's statistics needs at least one "
                     "batch, and none came.")
  return average
