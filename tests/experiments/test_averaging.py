"""Tests for experiments/averaging.py against float64 NumPy references.

The references are written here, separately from the module: SWAD's as
khanrc/swad structures it (``LossValley`` with its two deques of segment
models, ``AveragedModel``, the trainer's loop: khanrc/swad 252190e,
``domainbed/swad.py``, ``domainbed/lib/swa_utils.py``,
``domainbed/trainer.py``), SMA as DomainBed's ``ErmPlusPlusMovingAvg``
computes it (b93c22a, ``domainbed/lib/misc.py`` lines 51-72), EMA as timm's
``ModelEmaV2``, and BatchNorm's recomputed statistics as torch's BatchNorm
updates them with ``momentum=None``.
"""

import collections
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import averaging

SHAPES = {"w": (3, 4), "b": (4,)}


def params_stream(steps, seed=0):
  """Independent float32 draws: every term of an average shows in it."""
  rng = np.random.default_rng(seed)
  return [{name: rng.normal(size=shape).astype(np.float32)
           for name, shape in SHAPES.items()} for _ in range(steps)]


def as_float64(params):
  return {name: np.asarray(value, np.float64) for name, value in params.items()}


def save_and_restore(state, path):
  """The state through an .npz file, as a checkpoint would take it."""
  leaves, treedef = jax.tree_util.tree_flatten(state)
  np.savez(path, *[np.asarray(leaf) for leaf in leaves])
  with np.load(path) as saved:
    restored = [saved[f"arr_{i}"] for i in range(len(leaves))]
  return jax.tree_util.tree_unflatten(treedef, restored)


def assert_bit_exact(a, b):
  leaves_a, treedef_a = jax.tree_util.tree_flatten(a)
  leaves_b, treedef_b = jax.tree_util.tree_flatten(b)
  assert treedef_a == treedef_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


# A float32 running mean of N(0, 1) terms differs from float64 by a few
# float32 roundings of O(1) values: at most 1.4e-7 measured (SWAD, SMA).
# 1e-6 leaves room for other code generation and stays far below what one
# term more or less changes (O(1) / N, N <= 200 here). The EMA's roundings
# compound over its memory of 1 / (1 - decay) = 33 steps: 8.4e-7 measured.
MEAN_ATOL = 1e-6
EMA_ATOL = 5e-6


def assert_close(jax_params, reference, atol=MEAN_ATOL):
  for name in SHAPES:
    np.testing.assert_allclose(np.asarray(jax_params[name], np.float64),
                               reference[name], rtol=0, atol=atol)


# SWAD: a separate float64 reference, structured as khanrc/swad's code.


class RefAveragedModel:
  """swa_utils.AveragedModel: a model (params) and its count of terms."""

  def __init__(self, params):
    self.params = copy.deepcopy(params)
    self.n_averaged = 0
    self.start_step = -1
    self.end_step = -1
    self.end_loss = None

  def update_parameters(self, params, step=None, start_step=None,
                        end_step=None):
    if isinstance(params, RefAveragedModel):
      params = params.params
    for name in self.params:
      if self.n_averaged == 0:
        self.params[name] = params[name].copy()
      else:
        self.params[name] = self.params[name] + (
            params[name] - self.params[name]) / (self.n_averaged + 1)
    self.n_averaged += 1
    if step is not None:
      start_step = step if start_step is None else start_step
      end_step = step if end_step is None else end_step
    if start_step is not None and self.n_averaged == 1:
      self.start_step = start_step
    if end_step is not None:
      self.end_step = end_step


class RefLossValley:
  """swad.LossValley on RefAveragedModel segments."""

  def __init__(self, n_converge, n_tolerance, tolerance_ratio):
    self.n_converge = n_converge
    self.n_tolerance = n_tolerance
    self.tolerance_ratio = tolerance_ratio
    self.converge_q = collections.deque(maxlen=n_converge)
    self.smooth_q = collections.deque(maxlen=n_tolerance)
    self.final_model = None
    self.converge_step = None
    self.dead_valley = False
    self.threshold = None

  def smooth_loss(self):
    return min(model.end_loss for model in self.smooth_q)

  def update_and_evaluate(self, segment, val_loss):
    if self.dead_valley:
      return
    frozen = copy.deepcopy(segment)
    frozen.end_loss = val_loss
    self.converge_q.append(frozen)
    self.smooth_q.append(frozen)
    if self.converge_step is None:
      if len(self.converge_q) < self.n_converge:
        return
      losses = [model.end_loss for model in self.converge_q]
      least = min(range(len(losses)), key=lambda i: (losses[i], i))
      if least != 0:
        return
      self.converge_step = self.converge_q[0].end_step
      # AveragedModel of an AveragedModel: its params, no term.
      self.final_model = RefAveragedModel(self.converge_q[0].params)
      self.threshold = (sum(losses) / len(losses)) * (
          1.0 + self.tolerance_ratio)
      if self.n_tolerance < self.n_converge:
        for i in range(self.n_converge - self.n_tolerance):
          model = self.converge_q[1 + i]
          self.final_model.update_parameters(
              model, start_step=model.start_step, end_step=model.end_step)
      elif self.n_tolerance > self.n_converge:
        queue = list(self.smooth_q)[:self.n_tolerance - self.n_converge + 1]
        start = 0
        for i in range(len(queue) - 1, -1, -1):
          if queue[i].end_loss > self.threshold:
            start = i + 1
            break
        for model in queue[start + 1:]:
          self.final_model.update_parameters(
              model, start_step=model.start_step, end_step=model.end_step)
      return
    if self.smooth_q[0].end_step < self.converge_step:
      return
    if self.smooth_loss() > self.threshold:
      self.dead_valley = True
      return
    model = self.smooth_q[0]
    self.final_model.update_parameters(
        model, start_step=model.start_step, end_step=model.end_step)

  def get_final_model(self):
    if self.converge_step is None:
      return self.converge_q[-1]
    if not self.dead_valley:
      self.smooth_q.popleft()
      while self.smooth_q:
        if self.smooth_loss() > self.threshold:
          break
        segment = self.smooth_q.popleft()
        self.final_model.update_parameters(segment, step=segment.end_step)
    return self.final_model


def reference_swad(stream, losses, every, config):
  """swad's trainer loop in float64: per-step segment averaging, an
  evaluation at every step ``s % every == 0``, a stop on a dead valley.

  Returns the valley, the final model, the steps trained and, after each
  evaluation, what the final model holds: (N, first step, last step).
  """
  valley = RefLossValley(*config)
  segment = RefAveragedModel(as_float64(stream[0]))
  losses = iter(losses)
  history = []
  steps = 0
  for step, params in enumerate(stream):
    steps += 1
    segment.update_parameters(as_float64(params), step=step)
    if step % every == 0:
      valley.update_and_evaluate(segment, next(losses))
      final = valley.final_model
      history.append(None if final is None else
                     (final.n_averaged, final.start_step, final.end_step))
      if valley.dead_valley:
        break
      segment = RefAveragedModel(as_float64(params))
  return valley, valley.get_final_model(), steps, history


EVERY = 3


def run_swad(stream, losses, config, save_at=None, tmp_path=None):
  """The module's SWAD on the same loop; ``save_at`` saves and restores its
  state after that step (and that step's evaluation)."""
  swad = averaging.swad(*config)
  update = jax.jit(swad.update)
  state = swad.init(stream[0])
  losses = iter(losses)
  history = []
  steps = 0
  for step, params in enumerate(stream):
    steps += 1
    state = state._replace(averaging=update(params, state.averaging))
    if step % EVERY == 0:
      state = swad.evaluate(state, next(losses))
      valley = state.valley
      history.append(None if valley.converged_at < 0 else
                     (int(valley.averaged), int(valley.first_step),
                      int(valley.last_step)))
      if valley.dead:
        break
    if step == save_at:  # As a new process resumes: new functions too.
      state = save_and_restore(state, tmp_path / "swad.npz")
      swad = averaging.swad(*config)
      update = jax.jit(swad.update)
  return state, swad.final(state), steps, history


def _recorded_like(evaluations, seed):
  """A validation loss that falls, flattens and slowly rises, with noise."""
  rng = np.random.default_rng(seed)
  k = np.arange(evaluations)
  return list(1.8 * np.exp(-k / 3.0) + 0.3 + 0.004 * k ** 1.5
              + rng.normal(scale=0.02, size=evaluations))


LOSSES = {
    "recorded_like": _recorded_like(24, seed=1),
    "recorded_like_dies": list(np.r_[_recorded_like(10, seed=2),
                                     np.linspace(1.5, 3.0, 12)]),
    "never_converging": [1.0 / (k + 1) for k in range(14)],
    "converging_at_once": [0.5, 0.6, 0.7, 0.55, 0.52, 0.6, 0.58, 0.61,
                           0.57, 0.6],
    "valley_that_dies": [1.0, 0.5, 0.6, 0.7, 0.6, 0.55, 0.9, 0.95, 1.0,
                         1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
    # A loss above the threshold in the tolerance window before the valley.
    "spike_before_valley": [0.9, 3.0, 0.8, 0.5, 0.6, 0.7, 0.62, 0.58, 0.6,
                            0.64, 0.66, 0.7],
    "ties": [0.5, 0.5, 0.5, 0.5, 0.4, 0.4, 0.5, 0.5],
    "converges_at_the_last": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.45,
                              0.5],
    "one_evaluation": [0.7],
}

CONFIGS = {
    "defaults": (3, 6, 0.3),
    "tolerance_below_converge": (4, 2, 0.3),
    "tolerance_equal": (3, 3, 0.3),
    "tolerance_one": (2, 1, 0.1),
    "tolerance_far_above": (2, 7, 0.5),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("losses", LOSSES.values(), ids=LOSSES)
def test_swad_matches_the_reference(losses, config):
  # Two steps after the last evaluation, which swad never averages.
  stream = params_stream((len(losses) - 1) * EVERY + 3, seed=len(losses))
  valley, ref_final, ref_steps, ref_history = reference_swad(
      stream, losses, EVERY, config)
  state, final, steps, history = run_swad(stream, losses, config)

  assert steps == ref_steps
  assert bool(state.valley.dead) == valley.dead_valley
  if valley.converge_step is None:
    assert state.valley.converged_at == -1
  else:
    # Segment k closes at step k * EVERY.
    assert state.valley.converged_at * EVERY == valley.converge_step
    assert state.valley.threshold == pytest.approx(valley.threshold,
                                                   rel=1e-15)
  assert history == ref_history
  assert final.averaged == (ref_final.n_averaged
                            if valley.converge_step is not None else 0)
  assert (final.first_step, final.last_step) == (ref_final.start_step,
                                                 ref_final.end_step)
  assert_close(final.params, ref_final.params)


def test_the_sequences_cover_every_path():
  """The sequences reach what they are named for (defaults)."""
  outcomes = {}
  for name, losses in LOSSES.items():
    stream = params_stream((len(losses) - 1) * EVERY + 1)
    valley, _, _, _ = reference_swad(stream, losses, EVERY, (3, 6, 0.3))
    outcomes[name] = (valley.converge_step, valley.dead_valley)
  assert outcomes["never_converging"] == (None, False)
  assert outcomes["converging_at_once"] == (0, False)
  assert outcomes["valley_that_dies"][1]
  assert outcomes["recorded_like_dies"][1]
  assert outcomes["recorded_like"][0] is not None
  assert not outcomes["recorded_like"][1]
  assert outcomes["converges_at_the_last"] == (6 * EVERY, False)


def test_swad_resumes_bit_exactly(tmp_path):
  losses = LOSSES["recorded_like"]
  stream = params_stream((len(losses) - 1) * EVERY + 1)
  config = CONFIGS["defaults"]
  whole, final, _, _ = run_swad(stream, losses, config)
  # Saved mid-segment, in the valley: convergence shows when the segment
  # n_converge - 1 after the converging one closes.
  saved = 16
  resumed, resumed_final, _, _ = run_swad(stream, losses, config,
                                          save_at=saved * EVERY + 1,
                                          tmp_path=tmp_path)
  assert 0 <= whole.valley.converged_at + config[0] - 1 < saved
  assert_bit_exact(resumed, whole)
  assert_bit_exact(resumed_final, final)


def test_swad_does_nothing_once_the_valley_is_dead():
  losses = LOSSES["valley_that_dies"]
  stream = params_stream((len(losses) - 1) * EVERY + 1)
  state, _, steps, _ = run_swad(stream, losses, CONFIGS["defaults"])
  assert state.valley.dead and steps < len(stream)
  swad = averaging.swad()
  state = state._replace(
      averaging=swad.update(stream[steps], state.averaging))
  assert_bit_exact(swad.evaluate(state, 0.01), state)


def test_swad_refuses_what_it_cannot_average():
  swad = averaging.swad()
  state = swad.init(params_stream(1)[0])
  with pytest.raises(ValueError, match="call update"):
    swad.evaluate(state, 0.5)
  with pytest.raises(ValueError, match="first evaluation"):
    swad.final(state)
  state = state._replace(
      averaging=swad.update(params_stream(1)[0], state.averaging))
  with pytest.raises(ValueError, match="must be finite"):
    swad.evaluate(state, float("nan"))
  with pytest.raises(ValueError, match="at least 1"):
    averaging.swad(n_converge=0)
  with pytest.raises(ValueError, match="tolerance_ratio"):
    averaging.swad(tolerance_ratio=-0.1)
  with pytest.raises(TypeError, match=r"\['count'\] is int32"):
    swad.init({"w": np.zeros(2, np.float32), "count": np.zeros((), np.int32)})


# SMA and EMA.


def reference_sma(stream, start_iter=600):
  """DomainBed's ErmPlusPlusMovingAvg.update_sma in float64: after each
  update, the average it holds."""
  sma = as_float64(stream[0])
  global_iter = sma_count = 0
  history = []
  for params in stream[1:]:
    params = as_float64(params)
    global_iter += 1
    if global_iter >= start_iter:
      sma_count += 1
      sma = {name: (sma[name] * sma_count + params[name]) / (1.0 + sma_count)
             for name in sma}
    else:
      sma = {name: params[name].copy() for name in sma}
    history.append(sma)
  return history


def reference_ema(stream, decay):
  ema = as_float64(stream[0])
  history = []
  for params in stream[1:]:
    ema = {name: decay * ema[name] + (1.0 - decay) * as_float64(params)[name]
           for name in ema}
    history.append(ema)
  return history


def run_average(make_transform, stream, save_at=None, tmp_path=None):
  """The averages after every update; ``save_at`` saves and restores the
  state after that update, into a new transform, as a new process would."""
  transform = make_transform()
  update = jax.jit(transform.update)
  state = transform.init(stream[0])
  history = []
  for i, params in enumerate(stream[1:], start=1):
    state = update(params, state)
    history.append(state)
    if i == save_at:
      state = save_and_restore(state, tmp_path / "average.npz")
      update = jax.jit(make_transform().update)
  return history


SMA_STEPS = 760  # 160 updates averaged after DomainBed's start at 600.


@pytest.fixture(scope="module", name="sma_run")
def fixture_sma_run():
  stream = params_stream(SMA_STEPS + 1)
  return stream, run_average(averaging.sma, stream)


def test_sma_matches_domainbed(sma_run):
  stream, history = sma_run
  reference = reference_sma(stream)
  for state, expected in zip(history, reference):
    assert_close(state.average, expected)
  # Restated: from update 600 on, the mean since the params of update 599.
  assert_close(history[-1].average, {
      name: np.mean([as_float64(p)[name] for p in stream[599:]], axis=0)
      for name in SHAPES})
  assert int(history[-1].count) == SMA_STEPS - 598


def test_sma_resumes_bit_exactly(sma_run, tmp_path):
  stream, history = sma_run
  resumed = run_average(averaging.sma, stream, save_at=650,
                        tmp_path=tmp_path)
  assert_bit_exact(resumed, history)


@pytest.mark.parametrize("start_iter", [1, 5])
def test_sma_from_an_early_start(start_iter):
  stream = params_stream(40)
  history = run_average(lambda: averaging.sma(start_iter), stream)
  for state, expected in zip(history, reference_sma(stream, start_iter)):
    assert_close(state.average, expected)


def test_ema_matches_the_reference_and_resumes_bit_exactly(tmp_path):
  stream = params_stream(301)
  transform = functools.partial(averaging.ema, 0.97)
  history = run_average(transform, stream)
  for state, expected in zip(history, reference_ema(stream, 0.97)):
    assert_close(state.average, expected, atol=EMA_ATOL)
  assert_bit_exact(
      run_average(transform, stream, save_at=150, tmp_path=tmp_path),
      history)


def test_an_nnx_models_params_average_into_the_model():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  transform = averaging.ema(0.9)
  state = jax.jit(transform.update)(jax.tree.map(lambda p: p + 1.0, params),
                                    transform.init(params))
  averaged = nnx.merge(nnx.graphdef(model), state.average)
  # 0.9 * kernel + 0.1 * (kernel + 1).
  np.testing.assert_allclose(averaged.kernel[...], model.kernel[...] + 0.1,
                             rtol=0, atol=MEAN_ATOL)


def test_bad_hparams_are_refused():
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    averaging.ema(1.0)
  with pytest.raises(ValueError, match="at least 1"):
    averaging.sma(0)
  with pytest.raises(TypeError, match="integer counters"):
    averaging.ema(0.9).init({"steps": np.zeros((), np.int64)})


# BatchNorm statistics.

EPS = 1e-5


def _forward_statistics(xp, params, x):
  """A two-layer network with BatchNorm in train mode, in NumPy or JAX:
  the output, and each BatchNorm's batch mean and unbiased variance."""
  statistics = {}
  h = x
  for layer in ("bn1", "bn2"):
    h = h @ params[layer]["kernel"]
    mean = h.mean(axis=0)
    biased = ((h - mean) ** 2).mean(axis=0)
    n = h.shape[0]
    statistics[layer] = {"mean": mean, "var": biased * n / (n - 1)}
    h = (h - mean) / xp.sqrt(biased + EPS) * params[layer]["scale"]
    h = xp.maximum(h, 0.0)
  return statistics


def reference_update_bn(params, batches):
  """torch's BatchNorm over the batches with momentum None, after
  swa_utils.update_bn's reset: its running statistics in float64."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  running = {layer: {"mean": np.zeros(params[layer]["kernel"].shape[1]),
                     "var": np.ones(params[layer]["kernel"].shape[1])}
             for layer in ("bn1", "bn2")}
  num_batches_tracked = 0
  for x in batches:
    num_batches_tracked += 1
    factor = 1.0 / num_batches_tracked
    batch = _forward_statistics(np, params, np.asarray(x, np.float64))
    for layer, stats in batch.items():
      for key in ("mean", "var"):
        running[layer][key] = ((1.0 - factor) * running[layer][key]
                               + factor * stats[key])
  return running


def test_batch_statistics_match_torchs_cumulative_average():
  rng = np.random.default_rng(0)
  params = {
      "bn1": {"kernel": rng.normal(size=(5, 4)).astype(np.float32),
              "scale": rng.uniform(0.5, 2, 4).astype(np.float32)},
      "bn2": {"kernel": rng.normal(size=(4, 3)).astype(np.float32),
              "scale": rng.uniform(0.5, 2, 3).astype(np.float32)}}
  batches = [(rng.normal(size=(8, 5)) * (1 + i % 3) + i % 2).astype(
      np.float32) for i in range(30)]
  recomputed = averaging.cumulative_batch_statistics(
      lambda x: _forward_statistics(jnp, params, x), batches)
  expected = reference_update_bn(params, batches)
  # The float32 forward pass rounds too: 1.7e-7 relative error measured on
  # variances up to 29, 1.7e-8 absolute on a mean of 0.003 (cancellation).
  for layer in expected:
    for key in ("mean", "var"):
      np.testing.assert_allclose(np.asarray(recomputed[layer][key]),
                                 expected[layer][key], rtol=2e-6,
                                 atol=MEAN_ATOL)
  with pytest.raises(ValueError, match="at least one batch"):
    averaging.cumulative_batch_statistics(lambda x: x, [])
