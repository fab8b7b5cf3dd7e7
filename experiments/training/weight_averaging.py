"""``--averaging`` in the training loop: `experiments.averaging`'s functions
called along a run, their state checkpointed beside the train state, and
the averaged model evaluated and recorded beside the trained one.

The averages are of ``{"params": ..., "stats": ...}``: the params and the
BatchNorm statistics, as DomainBed's ``ErmPlusPlusMovingAvg`` averages its
network's ``state_dict``. EMA and SMA are updated after every step and
evaluated at every evaluation. SWAD is updated after every step; at every
scheduled evaluation its valley takes the training domains' validation loss
of the trained model, as swad's trainer gives it ``tr_outloss``
(khanrc/swad 252190e, ``domainbed/trainer.py`` line 250;
``domainbed/evaluator.py`` lines 98-116: the mean over the training
domains of each out split's mean cross-entropy), and the run stops where
the valley dies (trainer.py lines 253-255). SWAD's final model (swad's
``get_final_model``) is evaluated in the run's last record only, as swad's
trainer evaluates it after training (lines 287-296), its BatchNorm
statistics recomputed first where BatchNorm trains (`bn_trains`).

Two differences from swad's trainer, both of the loop here: it evaluates
every ``checkpoint_freq`` steps from step ``checkpoint_freq`` (after that
many updates), where swad's evaluates after update 1, ``checkpoint_freq``
+ 1, ..., so a segment here is the ``checkpoint_freq`` updates up to an
evaluation; and the validation loss is over each out split's examples
evaluated (``--eval_examples``), all of them by default.

What a run records is `experiments.rundir`'s contract: the keys are named
here (`AVERAGED`, `SWAD_LOSS`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from experiments import algorithms
from experiments import averaging
from experiments import config as config_lib
from experiments.rundir import records
from experiments.training import progress
from experiments.training import sharding
from experiments.training import steps

# The record keys of SWAD, at every scheduled evaluation: the training
# domains' validation loss its valley took, and whether the valley has died
# (the run stops there).
SWAD_LOSS = "swad_loss"
SWAD_DEAD = "swad_dead"
# The record keys of SWAD's final model, in the last record, beside its
# metrics: how many segment means it averages (swad's ``n_averaged``), and
# the first and last step of the params it spans (swad's ``start_step`` and
# ``end_step`` plus one: the params after that many updates, as a record's
# ``step`` counts).
AVERAGED_SEGMENTS = "averaged_segments"
AVERAGED_FIRST_STEP = "averaged_first_step"
AVERAGED_LAST_STEP = "averaged_last_step"
# swad's ``update_bn``: the batches of the training domains that recompute
# the final model's BatchNorm statistics (trainer.py line 291).
BATCHNORM_BATCHES = 500


def averaged_keys(metrics: records.Record) -> records.Record:
  """``metrics`` of the averaged model, under `records.AVERAGED_PREFIX`."""
  return {records.AVERAGED_PREFIX + key: value
          for key, value in metrics.items()}


def _params_step(update: int) -> int | None:
  """The step of the params after swad's 0-based ``update``; None for
  swad's -1 (none set)."""
  return None if update < 0 else update + 1


def bn_trains(hparams: dict[str, Any], stats: Any) -> bool:
  """Whether the model's BatchNorm statistics train: it has BatchNorm, in
  ``bn_mode`` ``"train"``. Frozen (the ResNets' default) or absent (the
  digits' CNN), there are none to recompute."""
  return hparams.get("bn_mode") == "train" and bool(jax.tree.leaves(stats))


def batch_statistics(network: algorithms.Network, params: Any, stats: Any,
                     batch: Any) -> Any:
  """Every BatchNorm's statistics of a training batch in train mode (its
  mean and unbiased variance), for `averaging.cumulative_batch_statistics`:
  the domains' examples concatenated, as swad's ``update_bn`` runs them."""
  model = network.bind(params, stats, train=True)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      # The running statistics become the batch's own.
      module.momentum = 0.0
  images = steps.normalized(batch["image"])
  # In train mode, as update_bn runs it, dropout included: a fixed key.
  model(images.reshape(-1, *images.shape[2:]), rngs=jax.random.PRNGKey(0))
  return nnx.state(model, nnx.BatchStat)


class Averaging:
  """A run's weight averaging and its state, which the loop updates after
  every step (`update`), records at every evaluation (`record`) and
  checkpoints (`checkpoint_item`).

  Attributes:
    kind: ``--averaging``: ema, sma or swad.
    bn_trains: whether the model's BatchNorm trains (`bn_trains`): SWAD's
      final model then has its statistics recomputed.
    state: the averaging's arrays (`averaging.EmaState`, `SmaState` or
      `SwadArrays`), on the devices.
    valley: SWAD's `loss_valley.ValleyState` (NumPy); None for the others.
    final: the averaged params and statistics of the run's last record,
      once it is written (`record`); None before.
  """

  def __init__(self, config: config_lib.Config, hparams: dict[str, Any],
               network: algorithms.Network, state: steps.TrainState,
               sharder: sharding.Sharder):
    self.kind = config.averaging
    self.bn_trains = bn_trains(hparams, state.stats)
    self._network = network
    tree = {"params": state.params, "stats": state.stats}
    if self.kind == "swad":
      self._swad = averaging.swad(config.swad_n_converge,
                                  config.swad_n_tolerance,
                                  config.swad_tolerance_ratio)
      initial = self._swad.init(tree)
      update, arrays, self.valley = (self._swad.update, initial.averaging,
                                     initial.valley)
    else:
      functions = (averaging.ema(config.ema_decay) if self.kind == "ema"
                   else averaging.sma(config.sma_start_iter))
      update, arrays, self.valley = functions.update, functions.init(tree), None
    self.state = sharder.replicate(arrays)
    self._update = jax.jit(lambda train_state, arrays: update(
        {"params": train_state.params, "stats": train_state.stats}, arrays))
    self.final = None

  def update(self, state: steps.TrainState) -> None:
    """Averages the params after a step in; dispatched, not waited for."""
    self.state = self._update(state, self.state)

  def checkpoint_item(self) -> dict[str, Any]:
    """The state as Orbax saves it, beside the train state."""
    item = {"arrays": self.state}
    if self.valley is not None:
      item["valley"] = jax.tree.map(np.asarray, self.valley)
    return item

  def abstract_item(self) -> dict[str, Any]:
    """What Orbax restores `checkpoint_item` into: the arrays on the
    devices, the valley in NumPy."""
    return jax.tree.map(
        lambda x: x if isinstance(x, np.ndarray)
        else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        self.checkpoint_item())

  def restore(self, item: dict[str, Any]) -> None:
    """Goes on from a restored `checkpoint_item`."""
    self.state = item["arrays"]
    self.valley = item.get("valley")

  def stopped(self) -> bool:
    """Whether SWAD's valley has died: the run stops."""
    return self.valley is not None and bool(self.valley.dead)

  def record(
      self, state: steps.TrainState, live: records.Record,
      train_domains: Sequence[int], scheduled: bool,
      last: Callable[[], bool],
      evaluate: Callable[[steps.TrainState], records.Record],
      training_batches: Callable[[], Iterator[Any]],
  ) -> records.Record:
    """The record's averaging keys at an evaluation of ``state``.

    EMA and SMA: the averaged model's metrics (`averaged_keys`). SWAD, at a
    scheduled evaluation: its valley takes the validation loss
    (`SWAD_LOSS`, from ``live``'s ``env{i}_out_loss``), and where the
    valley dies or the evaluation is the run's last, the final model is
    evaluated. The final averaged params are kept in `final`.

    Args:
      state: the train state evaluated.
      live: its record's metrics, of the trained model.
      train_domains: the training domains.
      scheduled: a ``checkpoint_freq`` step or the last, not an interrupt's.
      last: ``last()``: whether the run ends at this evaluation, the valley
        aside (called once the valley has decided).
      evaluate: the metrics of a state, as ``live``'s.
      training_batches: an iterator of training batches, for the BatchNorm
        statistics.
    """
    entries = {}
    if self.kind == "swad":
      if not scheduled:
        return entries
      loss = float(np.mean([live[records.env_key(i, "out", "loss")]
                            for i in train_domains]))
      swad_state = self._swad.evaluate(
          averaging.SwadState(self.state, self.valley), loss)
      self.state, self.valley = swad_state
      entries.update({SWAD_LOSS: loss, SWAD_DEAD: self.stopped()})
      if not (self.stopped() or last()):
        return entries
      final = self._swad.final(swad_state)
      averaged = final.params
      if self.bn_trains:
        progress.say(f"Recomputing the BatchNorm statistics of SWAD's model "
                     f"over {BATCHNORM_BATCHES} training batches, as swad's "
                     "update_bn does.")
        batches = training_batches()
        averaged = {**averaged, "stats": averaging.cumulative_batch_statistics(
            lambda batch: batch_statistics(self._network, averaged["params"],
                                           averaged["stats"], batch),
            (next(batches) for _ in range(BATCHNORM_BATCHES)))}
      entries.update({
          AVERAGED_SEGMENTS: final.averaged,
          AVERAGED_FIRST_STEP: _params_step(final.first_step),
          AVERAGED_LAST_STEP: _params_step(final.last_step)})
    else:
      averaged = self.state.average
    entries.update(averaged_keys(evaluate(
        state._replace(params=averaged["params"], stats=averaged["stats"]))))
    if self.kind == "swad" or last():
      self.final = averaged
    return entries


def build(config: config_lib.Config, hparams: dict[str, Any],
          network: algorithms.Network, state: steps.TrainState,
          sharder: sharding.Sharder) -> Averaging | None:
  """The run's `Averaging`, from its initial state; None without."""
  if config.averaging == "none":
    return None
  return Averaging(config, hparams, network, state, sharder)
