"""Tests for experiments/loss_valley.py: its decisions against khanrc/swad's
``LossValley``, as test_averaging.py's float64 reference has it."""

import numpy as np
import pytest

from experiments import loss_valley
from test_averaging import CONFIGS, LOSSES, reference_swad


def _one_hot(segment, size):
  """Segment ``segment``'s params: an average of them shows its weights."""
  return {"weights": np.eye(size)[segment]}


def _valley_weights(losses, config):
  """The weight of every segment in the final average that the decisions
  make, and the state they leave, on one-step segments."""
  size = len(losses)
  weights, terms = None, 0

  def apply(decisions):
    nonlocal weights, terms
    for decision in decisions:
      segment = np.eye(size)[decision.segment]
      if decision.restart:
        weights, terms = segment, 0
      else:
        weights = segment if terms == 0 else (
            weights + (segment - weights) / (terms + 1))
        terms += 1

  state = loss_valley.valley_init(config)
  for segment, loss in enumerate(losses):
    state, decisions = loss_valley.valley_update(state, config, loss,
                                                 segment, segment)
    apply(decisions)
    if state.dead:
      break
  state, decisions = loss_valley.valley_final(state, config)
  apply(decisions)
  return weights, state


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("losses", LOSSES.values(), ids=LOSSES)
def test_the_decisions_average_swads_segments(losses, config):
  # One step a segment, each step's params a one-hot vector: the final
  # model's params are the weights of the segments it averages.
  stream = [_one_hot(step, len(losses)) for step in range(len(losses))]
  valley, final, _, _ = reference_swad(stream, losses, 1, config)
  weights, state = _valley_weights(losses, loss_valley.ValleyConfig(*config))
  # Running means of at most 24 terms in float64: rounding of 1e-16.
  np.testing.assert_allclose(weights, final.params["weights"], rtol=0,
                             atol=1e-14)
  assert bool(state.dead) == valley.dead_valley
  if valley.converge_step is None:
    assert int(state.converged_at) == -1
  else:
    assert int(state.converged_at) == valley.converge_step
    assert (int(state.averaged), int(state.first_step),
            int(state.last_step)) == (final.n_averaged, final.start_step,
                                      final.end_step)


def test_bad_hparams_and_losses_are_refused():
  with pytest.raises(ValueError, match="at least 1"):
    loss_valley.valley_init(loss_valley.ValleyConfig(n_converge=0))
  with pytest.raises(ValueError, match="tolerance_ratio"):
    loss_valley.valley_init(loss_valley.ValleyConfig(tolerance_ratio=-0.1))
  config = loss_valley.ValleyConfig()
  state = loss_valley.valley_init(config)
  with pytest.raises(ValueError, match="first evaluation"):
    loss_valley.valley_final(state, config)
  with pytest.raises(ValueError, match="must be finite"):
    loss_valley.valley_update(state, config, float("nan"), 0, 0)
