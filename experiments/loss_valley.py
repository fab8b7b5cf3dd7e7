"""SWAD's loss valley: when its averaging starts and stops, and which
segments its final model averages (khanrc/swad's ``LossValley``).

Host logic on the sequence of the training domains' validation losses, in
float64 NumPy, apart from the dense averaging of the params that
``experiments.averaging.swad`` does in JAX: each function returns the new
`ValleyState` and the decisions (`Decision`) that the averaging applies.
``experiments.averaging``'s docstring describes the decisions, swad's
quirks included, with the lines of khanrc/swad 252190e's
``domainbed/swad.py`` that the comments below cite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class ValleyConfig(NamedTuple):
  """``LossValley``'s hparams (khanrc/swad's ``config.yaml`` defaults).

  Attributes:
    n_converge: the convergence window, in segments.
    n_tolerance: the window whose least loss decides when the valley ends.
    tolerance_ratio: the threshold is the converging window's mean loss
      times ``1 + tolerance_ratio``.
  """
  n_converge: int = 3
  n_tolerance: int = 6
  tolerance_ratio: float = 0.3

  @property
  def window(self) -> int:
    """How many of the latest segments the decisions can reach."""
    return max(self.n_converge, self.n_tolerance)


class ValleyState(NamedTuple):
  """What ``LossValley`` knows, as NumPy arrays (a pytree: checkpoint it).

  Segments are numbered from 0 in the order they close; segment ``k`` is
  kept in slot ``k % ValleyConfig.window`` of the arrays below and of
  `SwadArrays.window`.

  Attributes:
    segments: how many segments have closed.
    losses: each kept segment's validation loss (float64).
    first_steps, last_steps: each kept segment's first and last step.
    converged_at: the segment where the valley starts, -1 before.
    threshold: the loss above which the valley dies, NaN before.
    dead: whether the valley has died (then nothing changes any more).
    averaged: how many segments the final average holds (swad's
      ``n_averaged``).
    first_step, last_step: the steps the final average spans, as swad
      reports them (-1 where it has set none).
  """
  segments: np.ndarray
  losses: np.ndarray
  first_steps: np.ndarray
  last_steps: np.ndarray
  converged_at: np.ndarray
  threshold: np.ndarray
  dead: np.ndarray
  averaged: np.ndarray
  first_step: np.ndarray
  last_step: np.ndarray


class Decision(NamedTuple):
  """One decision of the valley on the final average.

  Attributes:
    segment: the segment it takes.
    restart: True to make the final average that segment's mean counted as
      no term (swad's ``AveragedModel(segment)``); False to add it as a term.
  """
  segment: int
  restart: bool


def valley_init(config: ValleyConfig) -> ValleyState:
  """The state before any segment closes."""
  if config.n_converge < 1 or config.n_tolerance < 1:
    raise ValueError(
        f"SWAD's n_converge and n_tolerance count segments: both must be at "
        f"least 1, not {config.n_converge} and {config.n_tolerance}.")
  if not (np.isfinite(config.tolerance_ratio)
          and config.tolerance_ratio >= 0):
    raise ValueError(f"SWAD's tolerance_ratio must be finite and at least 0, "
                     f"not {config.tolerance_ratio}; swad's default is 0.3.")
  window = config.window
  return ValleyState(
      segments=np.int64(0), losses=np.full(window, np.nan),
      first_steps=np.full(window, -1, np.int64),
      last_steps=np.full(window, -1, np.int64),
      converged_at=np.int64(-1), threshold=np.float64(np.nan),
      dead=np.bool_(False), averaged=np.int64(0), first_step=np.int64(-1),
      last_step=np.int64(-1))


def _kept(state: ValleyState, size: int) -> list[int]:
  """The latest ``size`` segments, oldest first (one of swad's deques)."""
  end = int(state.segments)
  return list(range(max(0, end - size), end))


def _least_loss(state: ValleyState, config: ValleyConfig,
                segments: Sequence[int]) -> float:
  """The least validation loss of ``segments`` (swad's smooth loss)."""
  return min(state.losses[k % config.window] for k in segments)


def _decide(state: ValleyState, config: ValleyConfig, segment: int,
            restart: bool = False, step: int | None = None
            ) -> tuple[ValleyState, Decision]:
  """Averages ``segment`` into the final model, recording swad's steps.

  ``step`` records that one step as the first and last, as swad's
  ``get_final_model`` does (``update_parameters(step=end_step)``); otherwise
  the segment's own first and last steps are recorded.
  """
  if restart:  # AveragedModel.__init__: no term, steps -1 (lines 12-13).
    state = state._replace(averaged=np.int64(0), first_step=np.int64(-1),
                           last_step=np.int64(-1))
    return state, Decision(segment, restart=True)
  slot = segment % config.window
  first = int(state.first_steps[slot]) if step is None else step
  last = int(state.last_steps[slot]) if step is None else step
  averaged = int(state.averaged) + 1
  # update_parameters sets the first step with the first term only.
  first_step = first if averaged == 1 else int(state.first_step)
  state = state._replace(averaged=np.int64(averaged),
                         first_step=np.int64(first_step),
                         last_step=np.int64(last))
  return state, Decision(segment, restart=False)


def valley_update(state: ValleyState, config: ValleyConfig, loss: float,
                  first_step: int, last_step: int
                  ) -> tuple[ValleyState, list[Decision]]:
  """``LossValley.update_and_evaluate`` on one closed segment.

  Args:
    state: the valley's state.
    config: its hparams.
    loss: the training domains' validation loss at the segment's end.
    first_step, last_step: the segment's first and last step.

  Returns:
    The new state, and the decisions on the final average, in order.
  """
  if not np.isfinite(loss):
    raise ValueError(f"SWAD's validation loss must be finite, not {loss}: "
                     "the run diverged, or the validation split is empty.")
  if state.dead:  # swad.py line 84.
    return state, []
  window = config.window
  slot = int(state.segments) % window
  losses, firsts, lasts = (state.losses.copy(), state.first_steps.copy(),
                           state.last_steps.copy())
  losses[slot], firsts[slot], lasts[slot] = loss, first_step, last_step
  state = state._replace(segments=state.segments + 1, losses=losses,
                         first_steps=firsts, last_steps=lasts)
  converge = _kept(state, config.n_converge)
  smooth = _kept(state, config.n_tolerance)
  decisions = []

  if state.converged_at < 0:
    if len(converge) < config.n_converge:  # Lines 92-94.
      return state, decisions
    converge_losses = [losses[k % window] for k in converge]
    if int(np.argmin(converge_losses)) != 0:  # Lines 96-98.
      return state, decisions
    state = state._replace(
        converged_at=np.int64(converge[0]),
        threshold=np.float64(np.mean(converge_losses)
                             * (1.0 + config.tolerance_ratio)))
    state, decision = _decide(state, config, converge[0], restart=True)
    decisions.append(decision)
    if config.n_tolerance < config.n_converge:  # Lines 105-110.
      added = converge[1:1 + config.n_converge - config.n_tolerance]
    elif config.n_tolerance > config.n_converge:  # Lines 111-123.
      before = smooth[:config.n_tolerance - config.n_converge + 1]
      start = 0
      for i in reversed(range(len(before))):
        if losses[before[i] % window] > state.threshold:
          start = i + 1
          break
      added = before[start + 1:]
    else:
      added = []
    for segment in added:
      state, decision = _decide(state, config, segment)
      decisions.append(decision)
    return state, decisions

  if smooth[0] < state.converged_at:  # Lines 131-132.
    return state, decisions
  if _least_loss(state, config, smooth) > state.threshold:  # Lines 135-139.
    return state._replace(dead=np.bool_(True)), decisions
  state, decision = _decide(state, config, smooth[0])  # Lines 141-144.
  return state, [decision]


def valley_final(state: ValleyState, config: ValleyConfig
                 ) -> tuple[ValleyState, list[Decision]]:
  """``LossValley.get_final_model``: the decisions that finish the average.

  Before convergence the final model is the last segment's mean: one
  restart decision, which adds no term.

  Args:
    state: the valley's state after the last evaluation.
    config: its hparams.

  Returns:
    The state the final average is in, and the decisions, in order.

  Raises:
    ValueError: where no segment has closed.
  """
  if int(state.segments) == 0:
    raise ValueError("SWAD has no final model before its first evaluation: "
                     "call evaluate() at least once.")
  if state.converged_at < 0:  # Lines 147-151.
    last = int(state.segments) - 1
    slot = last % config.window
    final = state._replace(averaged=np.int64(0),
                           first_step=state.first_steps[slot],
                           last_step=state.last_steps[slot])
    return final, [Decision(last, restart=True)]
  decisions = []
  if not state.dead:  # Lines 153-160.
    smooth = _kept(state, config.n_tolerance)[1:]
    while smooth and _least_loss(state, config, smooth) <= state.threshold:
      segment = smooth.pop(0)
      step = int(state.last_steps[segment % config.window])
      state, decision = _decide(state, config, segment, step=step)
      decisions.append(decision)
  return state, decisions
