"""The training loop of one run of ``python -m experiments.train``.

`train` runs a `config.RunSpec`, every setting of the run resolved and
checked, which it only reads: the protocol and checkpoints are described in
`experiments.train`, the command line, which resolves the spec and imports
this module (and JAX) only then, and the run directory and its records in
`experiments.runs.records`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from flax import nnx
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import algorithms
from experiments.data import photo_augmentation as augmentation
from experiments import catalog
from experiments import config as config_lib
from experiments.runs import convergence
from experiments.runs import environment
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline
from experiments import models
from experiments.runs import records
from experiments.data import tasks
from experiments.weights import convert
from experiments.weights import imagenet

CHECKPOINTS_KEPT = 2
# A user's own threshold for the programs the compilation cache keeps.
COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# DomainBed's ToTensor and Normalize (`datasets.normalize`) of every uint8
# level, by RGB channel: photos cross to the device as uint8 and the step
# looks their values up here (`normalized`), the same float32 values as on
# the host. (XLA divides by a constant as a multiplication by its
# reciprocal, which is a last bit off NumPy's division at some levels.)
_LEVELS = datasets.normalize(
    np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))
# Steps timed after the first, before a photo run on a CPU estimates its
# time; more than ESTIMATE_WARNED_SECONDS of steps is warned about.
ESTIMATE_STEPS = 2
ESTIMATE_WARNED_SECONDS = 3600
# The signals that stop a run at its next step, once it has checkpointed it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A record of an interrupt between checkpoints (`Interrupted`) names the
# signal under this key, and holds the `MetricMeter` state under METER_KEY
# for the resumed run to go on from.
INTERRUPT_KEY = "interrupted"
METER_KEY = "meter"


class TrainState(NamedTuple):
  """Everything that changes during training, except the data iterator."""

  step: jax.Array
  params: nnx.State
  stats: nnx.State
  algorithm_state: Any


def build_model(
    config: config_lib.Config,
    dataset: datasets.MultiDomainDataset,
    hparams: dict[str, Any],
) -> models.Classifier:
  """The configured model, with its pretrained featurizer weights if any.

  ``--pretrained imagenet`` (or ``imagenet_augmix``) downloads the
  published weights first, if they are not cached yet
  (`imagenet.fetch_imagenet`), before the model is built.

  Raises:
    config_lib.UsageError: the weights cannot be downloaded, read, or do not
      fit the model.
  """
  weights = config.pretrained
  if weights in imagenet.PRETRAINED:
    try:
      weights = imagenet.fetch_imagenet(config.model, weights)
    except imagenet.WeightsUnavailableError as e:
      raise config_lib.UsageError(str(e)) from None
  model = models.build_model(
      config.model, num_classes=dataset.num_classes,
      input_shape=dataset.input_shape, rngs=nnx.Rngs(config.seed),
      **catalog.ALGORITHMS[config.algorithm].model_options,
      **catalog.MODELS[config.model].hparams_options(hparams))
  if weights not in (None, "none"):
    try:
      convert.load_pretrained(model, weights)
    except (OSError, ValueError) as e:  # Unreadable or misfit.
      raise config_lib.UsageError(f"--pretrained: {e}") from None
    print(f"Featurizer weights from {weights}.", file=sys.stderr)
  return model


def normalized(images: jax.Array) -> jax.Array:
  """uint8 RGB images as `datasets.normalize` makes them, bit for bit, on
  the device; other images as they are."""
  if images.dtype != jnp.uint8:
    return images
  return jnp.asarray(_LEVELS)[images.astype(jnp.int32),
                              jnp.arange(_LEVELS.shape[1])]


def make_train_step(
    algorithm: algorithms.Algorithm, key: jax.Array
) -> Callable[[TrainState, algorithms.Batches],
              tuple[TrainState, algorithms.Metrics]]:
  """The jitted step; step ``t`` draws its randomness from fold_in(key, t).

  uint8 images (augmented photos) are normalised in the step (`normalized`),
  so that a quarter of float32's bytes cross to the device."""

  @jax.jit
  def train_step(state, batches):
    batches = {**batches, "image": normalized(batches["image"])}
    params, stats, algorithm_state, metrics = algorithm.update(
        state.params, state.stats, state.algorithm_state, batches,
        jax.random.fold_in(key, state.step))
    return TrainState(state.step + 1, params, stats, algorithm_state), metrics

  return train_step


def make_eval_step(
    network: algorithms.Network,
    predict: Callable[..., jax.Array] | None = None,
) -> Callable[[nnx.State, nnx.State, jax.Array, jax.Array, jax.Array],
              tuple[jax.Array, jax.Array]]:
  """The jitted ``(params, stats, images, labels, count) -> (predictions,
  loss)``; the batch's first ``count`` examples are real, the rest padding.

  The outputs are the algorithm's ``predict`` (``algorithms.Algorithm``) if
  it has one, else the network's in eval mode. Predictions are classes, or
  values for regression targets (`tasks`).
  """

  @jax.jit
  def eval_step(params, stats, images, labels, count):
    if predict is None:
      outputs, _ = network.logits(params, stats, images, train=False)
    else:
      outputs = predict(params, stats, images, count)
    loss = tasks.example_loss(outputs, {"label": labels})
    return tasks.predictions(outputs, labels), loss

  return eval_step


def make_evaluated(
    algorithm: algorithms.Algorithm
) -> Callable[[TrainState], TrainState]:
  """The state whose network an evaluation runs: the trained one, or the
  network the algorithm evaluates (``algorithms.Algorithm.evaluated``: ERM++'s
  moving average), jitted."""
  if algorithm.evaluated is None:
    return lambda state: state
  network = jax.jit(algorithm.evaluated)

  def evaluated(state):
    params, stats = network(state.params, state.stats, state.algorithm_state)
    return state._replace(params=params, stats=stats)

  return evaluated


def eval_sets(
    splits: Sequence[input_pipeline.Split], config: config_lib.Config
) -> list[dict[str, np.ndarray]]:
  """Per domain, the in and out indices evaluated, in a fixed random order.

  A random order makes any prefix a random subset: ``eval_examples`` keeps a
  prefix of each split, and ``env{i}_in_loss`` averages a prefix.
  """
  sets = []
  for i, split in enumerate(splits):
    domain = {}
    for j, (name, indices) in enumerate(zip(("in", "out"), split)):
      rng = np.random.default_rng([config.trial_seed, i, j])
      domain[name] = rng.permutation(indices)[:config.eval_examples]
    sets.append(domain)
  return sets


class Sharder:
  """Places batches and state on the devices: batches split on a data axis.

  With ``devices`` > 1, every domain's batch is split over an Explicit
  ``data`` mesh axis (docs/scaling.md): the step's program carries the
  split in its types, so PGrad's rollout keeps each chunk split over the
  devices (an Auto axis would gather it). Params and state are replicated.
  `config.Config.check_batch_split` has checked that the batch divides.
  """

  def __init__(self, devices: int = 1):
    available = jax.device_count()
    if devices > available:
      # A CPU host has one device unless XLA is told to make several.
      hint = ("" if jax.default_backend() != "cpu" else
              " On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count="
              f"{devices} before the command makes {devices} devices of its "
              "cores.")
      raise config_lib.UsageError(
          f"--devices {devices}: only {available} {jax.default_backend()} "
          f"device{'s' if available > 1 else ''} here.{hint}")
    self.mesh = None if devices == 1 else jax.make_mesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:devices])

  @property
  def num_devices(self) -> int:
    return 1 if self.mesh is None else self.mesh.size

  def layout(self, shape: Sequence[int]) -> str:
    """How a training batch of ``shape`` (domains, examples) is laid out."""
    domains, examples = shape
    where = (f"on 1 {jax.default_backend()} device" if self.mesh is None else
             f"split over {self.mesh.size} {jax.default_backend()} devices on "
             f"a data axis, {examples // self.mesh.size} examples of every "
             "domain on each")
    return f"batch of {domains} domains x {examples} examples, {where}"

  def _batch_sharding(self, axis: int) -> NamedSharding | None:
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, P(*[None] * axis, "data"))

  def batch(self, batch: dict[str, np.ndarray], axis: int) -> Any:
    """Puts a batch on the devices, ``axis`` of every leaf split over them
    (it must divide). The copy is asynchronous on an accelerator: it
    overlaps a step already running. On one CPU device the batch stays as
    it is: the step's call copies it, in less time than a put (measured on
    the digits: 0.5 against 2 ms a step)."""
    sharding = self._batch_sharding(axis)
    if sharding is not None:
      return jax.device_put(batch, sharding)
    return batch if jax.default_backend() == "cpu" else jax.device_put(batch)

  def abstract_batch(self, example: datasets.Element,
                     leading: tuple[int, ...]) -> Any:
    """The shapes, dtypes and layout of `batch`'s result for batches of
    ``example``-like examples stacked on ``leading`` axes, split on the
    last of them; for compiling a step before its first batch."""
    sharding = self._batch_sharding(len(leading) - 1)
    return {key: jax.ShapeDtypeStruct(leading + np.shape(value),
                                      jnp.asarray(value).dtype,
                                      sharding=sharding)
            for key, value in example.items()}

  def replicate(self, tree: Any) -> Any:
    """Copies ``tree`` to every device, committed to them (on one device
    too, where nothing is copied).

    Committed, so that a fresh run compiles the programs that a resumed one
    does, and the compilation cache holds them for both: Orbax restores a
    checkpoint's arrays committed, and jit lowers a committed argument with
    its sharding, an uncommitted one without.
    """
    return jax.device_put(
        tree, jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if self.mesh is None else NamedSharding(self.mesh, P()))

  def on_mesh(self, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` called with the mesh set, as explicit sharding traces it."""
    if self.mesh is None:
      return step

    def on_mesh_step(*args):
      with jax.sharding.set_mesh(self.mesh):
        return step(*args)

    return on_mesh_step


def evaluate(
    eval_step: Callable[..., tuple[jax.Array, jax.Array]],
    state: TrainState,
    dataset: datasets.MultiDomainDataset,
    sets: Sequence[dict[str, np.ndarray]],
    config: config_lib.Config,
    sharder: Sharder,
    augment: augmentation.Augmentation | None = None,
) -> records.Record:
  """The metrics of every domain's in and out split, and the in-split loss.

  The metrics are `tasks.split_metrics`'s, as `records.env_key`s:
  ``acc`` of classes, ``mse`` and ``r`` of regression values, and the
  worst-group ``worst_acc`` or ``worst_r`` where the examples carry a
  ``"group"`` (WILDS), and ``env{i}_{split}_examples``, the number of
  examples evaluated. Empty splits are skipped. With an ``augment`` that
  asks for it, the training domains' examples go through its transform, as
  DomainBed evaluates them.
  """
  results = {}
  step = int(state.step)
  # Batches no larger than the largest split, so small datasets are not
  # padded to the flag's size; one size for all splits, so one compilation.
  size = min(config.eval_batch_size,
             max(len(indices) for domain in sets
                 for indices in domain.values()))
  # Split over the devices as a training batch is, in equal shares.
  size = -(-size // sharder.num_devices) * sharder.num_devices
  for i, domain in enumerate(sets):
    augmented = (augment is not None and augment.in_evaluation
                 and i not in config.test_envs)
    for name, indices in domain.items():
      if len(indices) == 0:
        continue
      predicted, labels, groups, losses = [], [], [], []
      for batch in input_pipeline.eval_batches(
          augment.dataset if augmented else dataset, i, indices,
          batch_size=size, num_workers=config.num_workers,
          transform=augment.transform if augmented else None,
          seed=config.seed, step=step):
        count = len(batch["label"])
        if batch["image"].dtype == np.uint8:
          # Augmented photos: normalised here, so that one program (of
          # float32 images, as the test domains') evaluates every domain.
          batch = {**batch, "image": datasets.normalize(batch["image"])}
        # One batch shape, so one compilation: pad the last batch.
        padded = {k: np.concatenate([v, np.zeros((size - count,) + v.shape[1:],
                                                 v.dtype)])
                  for k, v in batch.items()}
        padded = sharder.batch(padded, axis=0)
        prediction, loss = eval_step(state.params, state.stats,
                                     padded["image"], padded["label"], count)
        predicted.append(np.asarray(prediction)[:count])
        labels.append(batch["label"])
        groups.append(batch.get("group"))
        losses.append(np.asarray(loss)[:count])
      metrics = tasks.split_metrics(
          np.concatenate(predicted), np.concatenate(labels),
          None if groups[0] is None else np.concatenate(groups))
      results.update({records.env_key(i, name, metric): value
                      for metric, value in metrics.items()})
      # How many examples the metrics are over, for their standard errors.
      results[records.env_key(i, name, "examples")] = len(indices)
      if name == "in":
        results[records.env_key(i, "in", "loss")] = float(
            np.concatenate(losses)[:config.loss_examples].mean())
  return results


# One dispatch per step for the metric sums, rather than one per metric.
_add = jax.jit(functools.partial(jax.tree.map, jnp.add))


class MetricMeter:
  """Sums an algorithm's metrics on the device between evaluations."""

  def __init__(self):
    self.sums = None
    self.latest = None
    self.count = 0

  def state(self) -> dict[str, Any]:
    """The sums, latest values and count as JSON values, exactly: each
    value's dtype and its elements (float32 and int32 are exact as Python
    numbers)."""
    sums, latest = jax.device_get((self.sums, self.latest))
    return {"count": self.count, **{
        name: {key: [str(np.asarray(value).dtype), np.asarray(value).tolist()]
               for key, value in tree.items()}
        for name, tree in (("sums", sums), ("latest", latest))}}

  @classmethod
  def from_state(cls, state: dict[str, Any],
                 place: Callable[[Any], Any]) -> MetricMeter:
    """The meter that a `state` describes, its NumPy arrays put on the
    devices by ``place`` (`Sharder.replicate`), as the step's metrics are.
    (Not by ``jnp.asarray``, which compiles a program per dtype and shape,
    which a fresh run never compiles.)"""
    meter = cls()
    meter.count = state["count"]
    meter.sums, meter.latest = (
        place({key: np.asarray(value, dtype)
               for key, (dtype, value) in state[name].items()})
        for name in ("sums", "latest"))
    return meter

  def add(self, metrics: algorithms.Metrics) -> None:
    self.sums = metrics if self.sums is None else _add(self.sums, metrics)
    self.latest = metrics
    self.count += 1

  def result(self) -> records.Record:
    """Means over the steps added, and the latest value of counters."""
    sums, latest = jax.device_get((self.sums, self.latest))
    return {name: (latest[name] if name in algorithms.COUNTERS
                   else sums[name] / self.count).tolist() for name in sums}


def stops_at(config: config_lib.Config, run_records: Sequence[records.Record],
             step: int) -> bool:
  """Whether a run with ``plateau_check_freq`` stops at ``step``: a check
  step at which its records so far have plateaued (`convergence.run_end`).

  A resumed run reads its records so far from its results file, so a run
  killed after stopping and resumed stops again at the same step."""
  if not config.plateau_check_freq or not step or (
      step % config.plateau_check_freq):
    return False
  return convergence.run_end(run_records).plateaued


def save_params(path: Path, state: TrainState) -> None:
  """Writes params and statistics to ``.npz``, keyed like params/head/bias."""
  tree = {"params": nnx.to_pure_dict(state.params),
          "stats": nnx.to_pure_dict(state.stats)}
  flat = traverse_util.flatten_dict(jax.device_get(tree))
  np.savez(path, **{"/".join(map(str, k)): np.asarray(v)
                    for k, v in flat.items()})


def save_trajectory_point(output_dir: Path, step: int, params: nnx.State):
  """Writes the params, flattened in leaf order, as `records.trajectory_file`.

  The file appears whole or not at all (written aside, then renamed), so a
  killed run leaves no truncated snapshot.
  """
  leaves = jax.tree.leaves(jax.device_get(params))
  flat = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])
  path = records.trajectory_file(output_dir, step)
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_suffix(".partial.npy")
  np.save(partial, flat)
  partial.replace(path)


def load_params(
    path: str | Path, params: nnx.State, stats: nnx.State
) -> tuple[nnx.State, nnx.State]:
  """Params and statistics from another run's `save_params` file.

  Raises:
    FileNotFoundError: there is no such file.
    ValueError: it is not a ``.npz`` file, or its keys or shapes differ from
      the model's.
  """
  loaded = convert.read_npz(path)
  tree = {"params": nnx.to_pure_dict(params), "stats": nnx.to_pure_dict(stats)}
  flat = traverse_util.flatten_dict(tree)
  keys = {"/".join(map(str, k)): k for k in flat}
  wrong = sorted(set(keys) ^ set(loaded)) + sorted(
      k for k in set(keys) & set(loaded)
      if loaded[k].shape != flat[keys[k]].shape)
  if wrong:
    raise ValueError(f"{path} does not fit the model: --model and --dataset "
                     "must match the run that wrote it. Differing keys or "
                     f"shapes: {wrong[:5]}.")
  values = traverse_util.unflatten_dict(
      {k: jnp.asarray(loaded[name]) for name, k in keys.items()})
  # Empty statistics (frozen or no BatchNorm) leave no keys behind.
  nnx.replace_by_pure_dict(params, values.get("params", {}))
  nnx.replace_by_pure_dict(stats, values.get("stats", {}))
  return params, stats


def _start_run_directory(
    config: config_lib.Config, hparams: dict[str, Any],
    fingerprint: dict[str, Any], weights: Mapping[str, str] | None,
    lock: config_lib.RunDirectoryLock
) -> None:
  """Creates the run directory and takes its ``lock``, then records the
  configuration it belongs to with the ``weights`` it starts from
  (`config.RunSpec.weights`), the fingerprint of its data
  (`datasets.fingerprint`) and the machine it trains on
  (`environment.describe`).

  Raises:
    config_lib.UsageError: another process has started the directory and
      trains there (`config.RunDirectoryLock`); nothing was written.
  """
  output_dir = Path(config.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  lock.acquire()
  records.write_config(output_dir,
                       config_lib.run_record(config, hparams, weights))
  records.write_fingerprint(output_dir, fingerprint)
  records.append_environment(output_dir, environment.describe(config.devices))


def _started_run_directory(
    manager: ocp.CheckpointManager | None, spec: config_lib.RunSpec,
    hparams: dict[str, Any], lock: config_lib.RunDirectoryLock
) -> ocp.CheckpointManager:
  """The run's checkpoint manager, ``manager``; a fresh run, which has none
  yet, first starts its run directory (`_start_run_directory`).

  A fresh run calls it before the first file it writes in its directory,
  whichever that is: the step-0 params snapshot (``--trajectory_freq``) or
  the first evaluation's record. The config file is then there before any
  other, so that a run killed at any moment leaves a directory that the
  same command resumes rather than refuses (`config.claim_run_directory`).
  """
  if manager is None:
    _start_run_directory(spec.config, hparams, spec.fingerprint,
                         spec.weights, lock)
    manager = _checkpoint_manager(Path(spec.config.output_dir))
  return manager


def _checkpoint_manager(output_dir: Path) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      (output_dir / records.CHECKPOINT_DIR).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=CHECKPOINTS_KEPT))


class Interrupted(KeyboardInterrupt):
  """A run stopped by a signal of `STOP_SIGNALS`, after the checkpoint of
  its last step.

  Attributes:
    signum: the signal's number.
  """

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class _StopRequests:
  """Catches `STOP_SIGNALS` while a run trains, for it to stop at a step.

  The first signal sets ``signum`` (the loop checkpoints the step it is in,
  if not checkpointed yet, then stops); a second raises `Interrupted` at
  once, which loses the steps since the last checkpoint. Only the main
  thread receives signals: in another, nothing is caught.
  """

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self) -> _StopRequests:
    if threading.current_thread() is threading.main_thread():
      # A signal the run was started ignoring (nohup, a launcher's own
      # signal) stays ignored.
      self._previous = {s: signal.signal(s, self._handle)
                        for s in STOP_SIGNALS
                        if signal.getsignal(s) != signal.SIG_IGN}
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.signum is not None:
      raise Interrupted(signum)
    self.signum = signum
    print(f"\n{signal.Signals(signum).name}: stopping once the step in "
          "progress, if any, is checkpointed (again to stop at once, from "
          "the last checkpoint).", file=sys.stderr)


def _forget_interrupt_checkpoint(
    manager: ocp.CheckpointManager, output_dir: Path, step: int
) -> tuple[ocp.CheckpointManager, list[records.Record]]:
  """Deletes the checkpoint of an interrupt at ``step`` (restored already)
  and then its record, so that the run's records are those of a run never
  interrupted.

  The checkpoint goes first, renamed out of the checkpoint steps before it is
  deleted: a run killed meanwhile leaves an unsaved record after the
  previous checkpoint, which the next run drops (`records.read_run`).

  Returns:
    The run's checkpoint manager, afresh, and its records kept.
  """
  manager.close()
  directory = output_dir / records.CHECKPOINT_DIR
  deleted = directory / f"interrupt-{step}.deleted"
  (directory / str(step)).rename(deleted)
  shutil.rmtree(deleted)
  manager = _checkpoint_manager(output_dir)
  run = config_lib.read_checked_run(output_dir,
                                    checkpoint_step=manager.latest_step())
  records.keep_checkpointed(run)
  return manager, run.checkpointed


@contextlib.contextmanager
def _checkpoint_kept_on_interrupt(
    manager: Callable[[], ocp.CheckpointManager | None]):
  """On Ctrl-C, waits for the checkpoint being written (of ``manager()``,
  the run's manager once it has one) before stopping, so that a rerun
  resumes from it."""
  try:
    yield
  except KeyboardInterrupt:
    if manager() is not None:
      manager().wait_until_finished()
    raise


def progress_bar(steps: int, step: int, started: float) -> tqdm.tqdm:
  """The training's progress bar, at ``step`` of ``steps``. Its elapsed
  time counts from ``started``, the run's start, as the times the run
  prints do (the model's build and the step's compilation come before
  the bar)."""
  bar = tqdm.tqdm(total=steps, initial=step, unit="step", dynamic_ncols=True)
  bar.start_t = started
  return bar


def start_line(config: config_lib.Config, dataset: datasets.MultiDomainDataset,
               augmented: bool) -> str:
  """What a run says of itself before it trains: its schedule, its input
  and where it writes."""
  height, width, channels = dataset.input_shape
  reading = (records.counted(config.num_workers, "input worker")
             if input_pipeline.uses_workers(dataset, augmented)
             else "no input workers (arrays in memory)")
  return (f"{records.counted(config.steps, 'step')}, a checkpoint every "
          f"{config.checkpoint_freq}; {height}x{width}x{channels} images, "
          f"augmentation {'on' if augmented else 'off'}, {reading}; run "
          f"directory {config.output_dir}.")


def _hours(seconds: float) -> str:
  return (f"{seconds / 3600:.1f} h" if seconds >= 3600 else
          f"{seconds / 60:.0f} min")


class _Screen:
  """The progress bar of a run: its phase (compiling, training, evaluating)
  and, while training, the images per second of the training steps alone
  and the share of their time spent waiting for data."""

  def __init__(self, bar: tqdm.tqdm, images_per_step: int):
    self.bar = bar
    self.images_per_step = images_per_step

  def phase(self, name: str) -> None:
    """Labels the bar with ``name``, at once."""
    self.bar.set_description_str(name, refresh=True)

  def training(self, steps: int, seconds: float, data_wait: float) -> None:
    """Says how fast the ``steps`` ended since the last evaluation went,
    in ``seconds``, ``data_wait`` of which waiting for batches; nothing for
    none."""
    if steps and seconds > 0:
      self.bar.set_postfix_str(
          f"images/s={self.images_per_step * steps / seconds:.0f}, data wait "
          f"{100 * data_wait / seconds:.0f}%" + self._results, refresh=False)

  def results(self, record: records.Record,
              test_envs: Sequence[int]) -> None:
    """Shows a record's training loss and mean held-out metric."""
    held_out = [records.held_out_metric(record, t) for t in test_envs]
    self._results = (f", loss={record['loss']:.4f}, "
                     f"held_out={np.mean(held_out):.4f}")

  _results = ""


def _warn_if_long(seconds: float, config: config_lib.Config) -> None:
  """Warns of a run whose remaining steps take ``seconds`` on a CPU, when
  more than ESTIMATE_WARNED_SECONDS."""
  if seconds > ESTIMATE_WARNED_SECONDS:
    tqdm.tqdm.write(
        f"Warning: {config.model} on {config.dataset} takes about "
        f"{_hours(seconds)} more on this CPU (its first {ESTIMATE_STEPS} "
        "steps after compiling, evaluations not counted); a GPU, a smaller "
        "--model or image_size, or fewer --steps take less.", file=sys.stderr)


def use_compile_cache(path: Path | None) -> None:
  """Keeps compiled programs in ``path`` (JAX's persistent compilation
  cache), for later runs of the same shape to load; None: none kept.

  Every program is kept, however quick it was to compile, unless
  ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise: JAX's
  default keeps only those of a second or more, but the model's eager
  initialisation compiles one small program per initializer and shape
  (0.3-0.7 s each on a CPU), which together can outlast the step's compile.
  """
  jax.config.update("jax_enable_compilation_cache", path is not None)
  if path is not None:
    jax.config.update("jax_compilation_cache_dir", str(path))
    if COMPILE_TIME_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _example(dataset: datasets.MultiDomainDataset,
             augment: augmentation.Augmentation | None,
             train_domains: Sequence[int],
             splits: Sequence[input_pipeline.Split]) -> datasets.Element:
  """A training example as batched: its shapes and dtypes are a batch's."""
  domain = train_domains[0]
  index = int(splits[domain][0][0])
  if augment is None:
    return dataset.domains[domain][index]
  return augment.transform(augment.dataset.domains[domain][index],
                           np.random.default_rng(0))


def _compile_while_reading(
    train_step: Any, state: TrainState, sharder: Sharder,
    example: datasets.Element, leading: tuple[int, int],
    read: Callable[[], Any],
) -> tuple[float, Any]:
  """Compiles the jitted ``train_step`` for ``state`` and batches of
  ``example``s in a thread, while this thread reads the first batch, which
  starts the input workers. Calls of ``train_step`` then run the compiled
  program.

  Returns:
    The seconds compiling took (reading from the persistent compilation
    cache, where it holds the program), the seconds ``read()`` took, and
    the batch it returned.
  """

  def compile_step() -> float:
    start = time.time()
    train_step.lower(state, sharder.abstract_batch(example, leading)).compile()
    return time.time() - start

  compile_step = sharder.on_mesh(compile_step)

  with futures.ThreadPoolExecutor(1, thread_name_prefix="compile") as pool:
    compiling = pool.submit(compile_step)
    start = time.time()
    batch = read()
    first_batch_time = time.time() - start
    return compiling.result(), first_batch_time, batch


def _seconds_waiting(tree: Any) -> float:
  """Waits until the device has computed ``tree``'s arrays; returns the
  seconds waited."""
  start = time.time()
  jax.block_until_ready(tree)
  return time.time() - start


def train(spec: config_lib.RunSpec) -> records.Record:
  """Trains (or resumes) one run and returns its last results record.

  A finished run (`records.is_done`) is not trained again: its result is
  printed, as the train command prints it (`config.report_finished_run`,
  which the command calls before importing this module), and its last
  record returned.

  Args:
    spec: the run, resolved and checked (``experiments.train.resolve_run``).

  Returns:
    The record of the final evaluation.

  Raises:
    config_lib.UsageError: the run cannot run here: its devices are not
      there, or its records are damaged (`records.read_run`), or its
      weights cannot be read or do not fit, or the data have problems, or
      the compilation cache it names cannot be written
      (`config.checked_compile_cache`), or another process trains the run
      (`config.RunDirectoryLock`); nothing was written.
    KeyboardInterrupt: on Ctrl-C, once the checkpoint being written is
      complete; `Interrupted` on a signal of `STOP_SIGNALS`, from its
      arrival on, once the step in progress (if any) is checkpointed.
  """
  started = time.time()
  # From the start: a signal before the first step stops the run there.
  with _StopRequests() as stop, config_lib.RunDirectoryLock(
      spec.config.output_dir) as lock:
    return _train(spec, stop, started, lock)


def _train(spec: config_lib.RunSpec, stop: _StopRequests,
           started: float, lock: config_lib.RunDirectoryLock
           ) -> records.Record:
  """`train`'s work, stopped as ``stop`` asks; ``started`` is its start
  time. It holds the run directory's ``lock`` from its start where the
  directory exists, else from when it starts it (`_start_run_directory`)."""
  config = spec.protocol
  hparams = dict(spec.hparams)
  output_dir = Path(config.output_dir)
  if spec.resume:
    record = config_lib.report_finished_run(output_dir)
    if record is not None:
      return record
  if spec.resume or output_dir.is_dir():
    # Before the model is built and compiled, so that a second process on
    # the directory (a sweep's, which creates it) stops at once.
    lock.acquire()
  use_compile_cache(config_lib.checked_compile_cache(config.compile_cache_dir))
  # A fresh run creates its directory when it first writes there
  # (`_started_run_directory`), so a run that fails before leaves nothing.
  manager = _checkpoint_manager(output_dir) if spec.resume else None
  start = manager.latest_step() if spec.resume else None
  run = (config_lib.read_checked_run(output_dir, checkpoint_step=start)
         if spec.resume else None)
  sharder = Sharder(config.devices)
  dataset = spec.dataset
  if "image_size" in hparams:
    dataset = datasets.resized(dataset, hparams["image_size"])
  train_domains = list(spec.train_domains)
  splits = input_pipeline.split_domains(
      dataset, holdout_fraction=config.holdout_fraction,
      seed=config.trial_seed)

  initialising = time.time()
  network, params, stats = algorithms.Network.split(
      build_model(config, dataset, hparams))
  if config.init_params:
    try:
      params, stats = load_params(config.init_params, params, stats)
    except (OSError, ValueError) as e:  # Missing, unreadable or misfit.
      raise config_lib.UsageError(f"--init_params: {e}") from None
  # Every step trains on all training domains, or on domains_per_step of them.
  domains_per_step = hparams.get("domains_per_step")
  algorithm = algorithms.build_algorithm(
      config.algorithm, network, hparams,
      num_domains=domains_per_step or len(train_domains), seed=config.seed)
  print(f"{config.algorithm} on {config.dataset}, held out "
        f"{config.test_envs}: " + sharder.layout(
            (domains_per_step or len(train_domains), hparams["batch_size"]))
        + ".", file=sys.stderr)
  state = sharder.replicate(TrainState(
      jnp.zeros((), jnp.int32), params, stats, algorithm.init(params)))
  # Timed to when its values are computed. The model initialises eagerly,
  # compiling one program per initializer and shape (or loading it from the
  # cache): on a cold cache that can take longer than the step's compile.
  jax.block_until_ready(state)
  init_time = time.time() - initialising
  augment = augmentation.training_augmentation(dataset, hparams)
  print(start_line(config, dataset, augment is not None), file=sys.stderr)
  on_cpu_photos = (jax.default_backend() == "cpu"
                   and datasets.is_photo_dataset(dataset))
  train_iter = input_pipeline.make_train_iterator(
      dataset if augment is None else augment.dataset, train_domains, splits,
      batch_size=hparams["batch_size"], seed=config.seed,
      num_workers=config.num_workers, domains_per_step=domains_per_step,
      transform=None if augment is None else augment.transform)
  images_per_step = hparams["batch_size"] * (
      domains_per_step or len(train_domains))

  if start is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    # Restores the iterator in place and returns the train state.
    state = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=grain.checkpoint.CheckpointRestore(train_iter))).state
    print(f"Resuming from step {start}.", file=sys.stderr)
  written = []  # The run's records so far.
  meter = MetricMeter()
  if run is not None:
    # What a killed run left after the checkpoint goes; it is computed again.
    for message in records.keep_checkpointed(run):
      print(message, file=sys.stderr)
    written = run.checkpointed
    if written and INTERRUPT_KEY in written[-1]:
      # Its metrics so far go on into the next record, as uninterrupted.
      meter = MetricMeter.from_state(written[-1][METER_KEY],
                                     sharder.replicate)
      manager, written = _forget_interrupt_checkpoint(manager, output_dir,
                                                      start)
  record = written[-1] if written else None

  # Stream 1 of the seed; the model's initialisation uses nnx.Rngs(seed).
  step_program = make_train_step(
      algorithm, jax.random.fold_in(jax.random.PRNGKey(config.seed), 1))
  train_step = sharder.on_mesh(step_program)
  eval_step = sharder.on_mesh(make_eval_step(network, algorithm.predict))
  evaluated = sharder.on_mesh(make_evaluated(algorithm))
  sets = eval_sets(splits, config)
  sizes = [len(splits[d][0]) for d in train_domains]
  # DomainBed's epoch is a pass over the smallest training domain, WILDS's
  # (train.wilds_protocol) over the whole training split.
  steps_per_epoch = (
      sum(sizes) / images_per_step
      if catalog.DATASETS[config.dataset].wilds is not None
      else min(sizes) / hparams["batch_size"])
  step = int(state.step)
  if config.trajectory_freq and step == 0:
    # A fresh run's first file: the later snapshots follow it.
    manager = _started_run_directory(manager, spec, hparams, lock)
    save_trajectory_point(output_dir, 0, state.params)
  with progress_bar(config.steps, step, started) as bar, (
      _checkpoint_kept_on_interrupt(lambda: manager)):
    screen = _Screen(bar, images_per_step)
    batch = None  # The next step's, on the device.
    # Whether the state holds steps that no checkpoint has (after one
    # resumed from an interrupt's, deleted, it does): a signal stops the run
    # at once only where that loses none.
    unsaved = run is not None and start != manager.latest_step()
    if (step < config.steps and not stops_at(config, written, step)
        and (stop.signum is None or unsaved)):
      if run is not None:
        # A resumed run trains on here: this machine joins the record of
        # where it trained, unless it was the last there. (A fresh run
        # records it as it starts its directory.) Checkpoints without an
        # entry are of a run from before runs recorded theirs.
        records.append_environment(
            output_dir, environment.describe(config.devices),
            unrecorded_before=start is not None)
      screen.phase("compiling")
      compile_time, first_batch_time, batch = _compile_while_reading(
          step_program, state, sharder, _example(dataset, augment, train_domains,
                                               splits),
          (domains_per_step or len(train_domains), hparams["batch_size"]),
          lambda: sharder.batch(next(train_iter), 1))
    steps_run = 0  # By this process.
    in_flight = None  # The metrics of the step dispatched before this one.
    interval_start = time.time()
    timed = 0  # Training steps timed since interval_start.
    data_wait = 0.0  # Seconds spent waiting for batches since interval_start.
    # Seconds spent waiting for the device to end steps since interval_start:
    # the rest of a step, but the data wait, is the loop's own work on the
    # host, which a device runs ahead of only while it is shorter.
    device_wait = 0.0
    while step < config.steps and not stops_at(config, written, step):
      if stop.signum is not None and not unsaved:
        break
      if batch is None:  # The first step after a checkpoint.
        wait_start = time.time()
        batch = sharder.batch(next(train_iter), 1)
        data_wait += time.time() - wait_start
      state, metrics = train_step(state, batch)
      # Nothing holds a batch once its step has it: a worker's batch is in
      # shared memory, freed when the last reference goes.
      batch = None
      meter.add(metrics)
      # At most this step runs ahead of the loop: left to itself, JAX
      # dispatches all the steps to the next checkpoint before the device
      # has run them, and a signal meanwhile stopped the run only there
      # (or let it finish), that many steps later.
      device_wait += _seconds_waiting(in_flight)
      in_flight = metrics
      unsaved = True
      step += 1
      timed += 1
      steps_run += 1
      if steps_run == 1:
        device_wait += _seconds_waiting(state)
        time_to_first_step = time.time() - started
        screen.phase("training")
        tqdm.tqdm.write(
            f"Initialised the model in {init_time:.1f} s; compiled the step "
            f"in {compile_time:.1f} s while reading the first batch in "
            f"{first_batch_time:.1f} s; the first step ended "
            f"{time_to_first_step:.1f} s after the run started.",
            file=sys.stderr)
        estimate_start = time.time()
      elif steps_run == 1 + ESTIMATE_STEPS and on_cpu_photos:
        device_wait += _seconds_waiting(state)
        _warn_if_long((config.steps - step) * (time.time() - estimate_start)
                      / ESTIMATE_STEPS, config)
      # The steps known to have ended: the loop has just waited for the one
      # before this, not for this one, which may have only been dispatched.
      screen.training(timed - 1, time.time() - interval_start, data_wait)
      bar.update()
      if config.trajectory_freq and step % config.trajectory_freq == 0:
        save_trajectory_point(output_dir, step, state.params)
      scheduled = not step % config.checkpoint_freq or step == config.steps
      if not scheduled and stop.signum is None:
        # The next step's batch goes to the device while this step runs.
        # (At a checkpoint none is read ahead: the iterator's state saved
        # is that of the batches trained on.)
        wait_start = time.time()
        batch = sharder.batch(next(train_iter), 1)
        data_wait += time.time() - wait_start
        continue
      device_wait += _seconds_waiting(state)
      step_time = (time.time() - interval_start) / timed
      manager = _started_run_directory(manager, spec, hparams, lock)
      screen.phase("evaluating")
      record = {
          "args": config.record_args(), "hparams": hparams,
          "domains": list(dataset.domain_names), "step": step,
          "epoch": step / steps_per_epoch,
          **meter.result(), "step_time": step_time,
          "data_wait_time": data_wait / timed,
          "device_wait_time": device_wait / timed,
          "init_time": init_time, "compile_time": compile_time,
          "first_batch_time": first_batch_time,
          "time_to_first_step": time_to_first_step,
          **evaluate(eval_step, evaluated(state), dataset, sets, config,
                     sharder, augment)}
      if not scheduled:
        # An interrupt's record, between the --checkpoint_freq steps: the
        # run that resumes from it carries its meter on and drops it.
        record.update({INTERRUPT_KEY: signal.Signals(stop.signum).name,
                       METER_KEY: meter.state()})
      # The previous checkpoint is complete before the next record, so a
      # killed run leaves at most one record after its last checkpoint.
      manager.wait_until_finished()
      records.append_record(output_dir, record)
      written.append(record)
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(train_iter)))
      unsaved = False
      screen.results(record, config.test_envs)
      screen.phase("training")
      meter = MetricMeter()
      interval_start, timed, data_wait, device_wait = time.time(), 0, 0.0, 0.0
  train_iter.close()  # Stops its workers, freeing the batches read ahead.
  if manager is not None:  # None: a fresh run stopped before writing.
    manager.wait_until_finished()
    manager.close()
  if stop.signum is not None and step < config.steps and not stops_at(
      config, written, step):
    raise Interrupted(stop.signum)
  save_params(output_dir / records.FINAL_PARAMS_FILE, state)
  # Done only on records that check, whatever touched them meanwhile.
  config_lib.read_checked_run(output_dir)
  records.mark_done(output_dir)
  if step < config.steps:
    print(f"Stopped at step {step} of at most {config.steps}: plateaued "
          "(--plateau_check_freq).", file=sys.stderr)
  config_lib.print_result(record, output_dir)
  return record
