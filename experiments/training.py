"""The training loop of one run of ``python -m experiments.train``.

`train` runs a resolved `config.Config`: the protocol, results, checkpoints
and run directory are described in `experiments.train`, the command line,
which imports this module (and JAX) only once its flags have parsed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
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
from experiments import catalog
from experiments import config as config_lib
from experiments import convergence
from experiments import datasets
from experiments import input_pipeline
from experiments import models
from experiments import pretrained
from experiments import tasks
from experiments import wilds

RESULTS_FILE = "results.jsonl"
DONE_FILE = "done"
FINAL_PARAMS_FILE = "final_params.npz"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINTS_KEPT = 2
TRAJECTORY_DIR = "trajectory"

Record = dict[str, Any]


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
  """The configured model, with pretrained featurizer weights if given."""
  model_facts = catalog.MODELS[config.model]
  model = models.build_model(
      config.model, num_classes=dataset.num_classes,
      input_shape=dataset.input_shape, rngs=nnx.Rngs(config.seed),
      **model_facts.hparams_options(hparams))
  if config.pretrained:
    pretrained.load_pretrained(model, config.pretrained)
  elif (model_facts.imagenet and not config.init_params
        # WILDS trains PovertyMap's 8-band ResNet-18 from scratch.
        and catalog.DATASETS[config.dataset].wilds != "PovertyMap"):
    print(f"Warning: training {config.model} from scratch; DomainBed starts "
          "from ImageNet weights (--pretrained).", file=sys.stderr)
  return model


def make_train_step(
    algorithm: algorithms.Algorithm, key: jax.Array
) -> Callable[[TrainState, algorithms.Batches],
              tuple[TrainState, algorithms.Metrics]]:
  """The jitted step; step ``t`` draws its randomness from fold_in(key, t)."""

  @jax.jit
  def train_step(state, batches):
    params, stats, algorithm_state, metrics = algorithm.update(
        state.params, state.stats, state.algorithm_state, batches,
        jax.random.fold_in(key, state.step))
    return TrainState(state.step + 1, params, stats, algorithm_state), metrics

  return train_step


def make_eval_step(
    network: algorithms.Network,
) -> Callable[[nnx.State, nnx.State, jax.Array, jax.Array],
              tuple[jax.Array, jax.Array]]:
  """The jitted ``(params, stats, images, labels) -> (predictions, loss)``.

  Predictions are classes, or values for regression targets (`tasks`).
  """

  @jax.jit
  def eval_step(params, stats, images, labels):
    outputs, _ = network.logits(params, stats, images, train=False)
    loss = tasks.example_loss(outputs, {"label": labels})
    return tasks.predictions(outputs, labels), loss

  return eval_step


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
  """Places batches and state on the devices: batches split on a data axis."""

  def __init__(self):
    count = jax.device_count()
    # Auto axes: XLA's partitioner propagates the batch sharding through
    # the step, so no operation needs to know about the mesh.
    self.mesh = None if count == 1 else jax.make_mesh(
        (count,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

  def batch(self, batch: dict[str, np.ndarray], axis: int) -> Any:
    """Splits ``axis`` of every leaf over the devices, if it divides evenly."""
    if self.mesh is None:
      return batch
    size = next(iter(batch.values())).shape[axis]
    spec = P(*[None] * axis, "data") if size % self.mesh.size == 0 else P()
    return jax.device_put(batch, NamedSharding(self.mesh, spec))

  def replicate(self, tree: Any) -> Any:
    """Copies ``tree`` to every device."""
    if self.mesh is None:
      return tree
    return jax.device_put(tree, NamedSharding(self.mesh, P()))


def evaluate(
    eval_step: Callable[..., tuple[jax.Array, jax.Array]],
    state: TrainState,
    dataset: datasets.MultiDomainDataset,
    sets: Sequence[dict[str, np.ndarray]],
    config: config_lib.Config,
    sharder: Sharder,
) -> Record:
  """The metrics of every domain's in and out split, and the in-split loss.

  The metrics are `tasks.split_metrics`'s, as ``env{i}_{split}_{metric}``:
  ``acc`` of classes, ``mse`` and ``r`` of regression values, and the
  worst-group ``worst_acc`` or ``worst_r`` where the examples carry a
  ``"group"`` (WILDS), and ``env{i}_{split}_examples``, the number of
  examples evaluated. Empty splits are skipped.
  """
  results = {}
  # Batches no larger than the largest split, so small datasets are not
  # padded to the flag's size; one size for all splits, so one compilation.
  size = min(config.eval_batch_size,
             max(len(indices) for domain in sets
                 for indices in domain.values()))
  for i, domain in enumerate(sets):
    for name, indices in domain.items():
      if len(indices) == 0:
        continue
      predicted, labels, groups, losses = [], [], [], []
      for batch in input_pipeline.eval_batches(dataset, i, indices,
                                               batch_size=size):
        count = len(batch["label"])
        # One batch shape, so one compilation: pad the last batch.
        padded = {k: np.concatenate([v, np.zeros((size - count,) + v.shape[1:],
                                                 v.dtype)])
                  for k, v in batch.items()}
        padded = sharder.batch(padded, axis=0)
        prediction, loss = eval_step(state.params, state.stats,
                                     padded["image"], padded["label"])
        predicted.append(np.asarray(prediction)[:count])
        labels.append(batch["label"])
        groups.append(batch.get("group"))
        losses.append(np.asarray(loss)[:count])
      metrics = tasks.split_metrics(
          np.concatenate(predicted), np.concatenate(labels),
          None if groups[0] is None else np.concatenate(groups))
      results.update({f"env{i}_{name}_{metric}": value
                      for metric, value in metrics.items()})
      # How many examples the metrics are over, for their standard errors.
      results[f"env{i}_{name}_examples"] = len(indices)
      if name == "in":
        results[f"env{i}_in_loss"] = float(
            np.concatenate(losses)[:config.loss_examples].mean())
  return results


class MetricMeter:
  """Sums an algorithm's metrics on the device between evaluations."""

  def __init__(self):
    self.sums = None
    self.latest = None
    self.count = 0

  def add(self, metrics: algorithms.Metrics) -> None:
    self.sums = metrics if self.sums is None else jax.tree.map(
        jnp.add, self.sums, metrics)
    self.latest = metrics
    self.count += 1

  def result(self) -> Record:
    """Means over the steps added, and the latest value of counters."""
    sums, latest = jax.device_get((self.sums, self.latest))
    return {name: (latest[name] if name in algorithms.COUNTERS
                   else sums[name] / self.count).tolist() for name in sums}


def _record_step(line: str) -> int | None:
  try:
    return json.loads(line)["step"]
  except (json.JSONDecodeError, KeyError, TypeError):
    return None  # A line cut short by a killed run.


def restore_results(path: Path, step: int) -> Record | None:
  """Keeps the records up to ``step`` (the restored checkpoint's).

  Later records were written by a run killed before checkpointing them; the
  resumed run writes them again.

  Returns:
    The last record kept, if any.
  """
  if not path.exists():
    return None
  kept = [line for line in path.read_text().splitlines()
          if (s := _record_step(line)) is not None and s <= step]
  path.write_text("".join(line + "\n" for line in kept))
  return json.loads(kept[-1]) if kept else None


def stops_at(config: config_lib.Config, results_path: Path, step: int) -> bool:
  """Whether a run with ``plateau_check_freq`` stops at ``step``: a check
  step at which its records so far have plateaued (`convergence.run_end`).

  It reads the records from the run's results file, so a run killed after
  stopping and resumed stops again at the same step."""
  if not config.plateau_check_freq or not step or (
      step % config.plateau_check_freq):
    return False
  records = [json.loads(line)
             for line in results_path.read_text().splitlines()]
  return convergence.run_end(records).plateaued


def save_params(path: Path, state: TrainState) -> None:
  """Writes params and statistics to ``.npz``, keyed like params/head/bias."""
  tree = {"params": nnx.to_pure_dict(state.params),
          "stats": nnx.to_pure_dict(state.stats)}
  flat = traverse_util.flatten_dict(jax.device_get(tree))
  np.savez(path, **{"/".join(map(str, k)): np.asarray(v)
                    for k, v in flat.items()})


def save_trajectory_point(directory: Path, step: int, params: nnx.State):
  """Writes the params, flattened in leaf order, as ``<step:07d>.npy``.

  The file appears whole or not at all (written aside, then renamed), so a
  killed run leaves no truncated snapshot.
  """
  leaves = jax.tree.leaves(jax.device_get(params))
  flat = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])
  directory.mkdir(parents=True, exist_ok=True)
  partial = directory / f"{step:07d}.partial.npy"
  np.save(partial, flat)
  partial.replace(directory / f"{step:07d}.npy")


def held_out_metric(record: Record, env: int) -> float:
  """A held-out domain's headline metric: accuracy, or Pearson's r."""
  return record.get(f"env{env}_in_acc", record.get(f"env{env}_in_r"))


def _held_out_summary(
    record: Record, dataset: datasets.MultiDomainDataset,
    test_envs: Sequence[int]
) -> str:
  return ", ".join(f"{dataset.domain_names[t]} (env{t}) "
                   f"{held_out_metric(record, t):.4f}" for t in test_envs)


def load_params(
    path: str | Path, params: nnx.State, stats: nnx.State
) -> tuple[nnx.State, nnx.State]:
  """Params and statistics from another run's `save_params` file.

  Raises:
    ValueError: the file's keys or shapes differ from the model's.
  """
  with np.load(path) as saved:
    loaded = dict(saved)
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


def wilds_protocol(
    config: config_lib.Config, dataset: datasets.MultiDomainDataset,
    hparams: dict[str, Any]
) -> config_lib.Config:
  """WILDS's protocol for a `wilds.WildsDataset`; other datasets unchanged.

  Its evaluation splits are the test domains, its training domains are not
  split (WILDS has its own in-distribution splits), and without ``--steps``
  the run lasts the dataset's epochs (PovertyMap 200, FMoW 10) of its
  training split, at ``batch_size * domains_per_step`` examples per step.
  """
  if not isinstance(dataset, wilds.WildsDataset):
    return config
  steps = config.steps
  if steps is None:
    train_examples = sum(len(dataset.domains[d])
                         for d in range(dataset.num_train_domains))
    per_step = hparams["batch_size"] * hparams["domains_per_step"]
    steps = max(1, -(-dataset.epochs * train_examples // per_step))
  return dataclasses.replace(config, test_envs=list(dataset.test_envs),
                             holdout_fraction=0.0, steps=steps)


def _start_run_directory(
    config: config_lib.Config, hparams: dict[str, Any]
) -> None:
  """Creates the run directory and records the configuration it belongs to."""
  output_dir = Path(config.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  (output_dir / config_lib.CONFIG_FILE).write_text(
      json.dumps(config_lib.run_record(config, hparams), indent=2) + "\n")


def _checkpoint_manager(output_dir: Path) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      (output_dir / CHECKPOINT_DIR).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=CHECKPOINTS_KEPT))


def train(config: config_lib.Config) -> Record:
  """Trains (or resumes) one run and returns its last results record.

  Args:
    config: the run's configuration.

  Returns:
    The record of the final evaluation.

  Raises:
    config_lib.UsageError: the configuration cannot run, or ``output_dir``
      holds a run of another configuration; nothing was written.
  """
  hparams = config.hyperparameters()
  resume = config_lib.claim_run_directory(config, hparams)
  dataset = datasets.get_dataset(config.dataset, data_dir=config.data_dir,
                                 seed=config.trial_seed)
  if "image_size" in hparams:
    dataset = datasets.resized(dataset, hparams["image_size"])
  # The run directory records the configuration as requested: the protocol's
  # changes follow from it.
  requested = config
  config = wilds_protocol(config, dataset, hparams)
  num_domains = len(dataset.domains)
  if not set(config.test_envs) <= set(range(num_domains)):
    raise config_lib.UsageError(
        f"--test_envs {config.test_envs} out of range for {config.dataset}'s "
        f"{num_domains} domains (0 to {num_domains - 1}).")
  train_domains = [d for d in range(num_domains) if d not in config.test_envs]
  if not train_domains:
    raise config_lib.UsageError(
        "Every domain is a test domain; none is left to train on.")
  if config.plateau_check_freq and tasks.is_regression(
      np.asarray(dataset.domains[0][0]["label"])):
    raise config_lib.UsageError(
        f"--plateau_check_freq: {config.dataset} is a regression, and the "
        "convergence criterion is on validation accuracy; train a fixed "
        "--steps instead.")
  splits = input_pipeline.split_domains(
      dataset, holdout_fraction=config.holdout_fraction,
      seed=config.trial_seed)

  network, params, stats = algorithms.Network.split(
      build_model(config, dataset, hparams))
  if config.init_params:
    params, stats = load_params(config.init_params, params, stats)
  # Every step trains on all training domains, or on domains_per_step of them.
  domains_per_step = hparams.get("domains_per_step")
  algorithm = algorithms.build_algorithm(
      config.algorithm, network, hparams,
      num_domains=domains_per_step or len(train_domains), seed=config.seed)
  sharder = Sharder()
  count = jax.device_count()
  print(f"{config.algorithm} on {config.dataset}, held out "
        f"{config.test_envs}: {count} {jax.default_backend()} "
        f"device{'s' if count > 1 else ''}.", file=sys.stderr)
  state = sharder.replicate(TrainState(
      jnp.zeros((), jnp.int32), params, stats, algorithm.init(params)))
  train_iter = input_pipeline.make_train_iterator(
      dataset, train_domains, splits, batch_size=hparams["batch_size"],
      seed=config.seed, domains_per_step=domains_per_step)

  output_dir = Path(config.output_dir)
  results_path = output_dir / RESULTS_FILE
  # A fresh run creates its directory at its first evaluation, so a run that
  # fails before then leaves nothing behind.
  manager = _checkpoint_manager(output_dir) if resume else None
  start = manager.latest_step() if resume else None
  if start is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    # Restores the iterator in place and returns the train state.
    state = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=grain.checkpoint.CheckpointRestore(train_iter))).state
    print(f"Resuming from step {start}.", file=sys.stderr)
  record = restore_results(results_path, start or 0)

  # Stream 1 of the seed; the model's initialisation uses nnx.Rngs(seed).
  train_step = make_train_step(
      algorithm, jax.random.fold_in(jax.random.PRNGKey(config.seed), 1))
  eval_step = make_eval_step(network)
  sets = eval_sets(splits, config)
  steps_per_epoch = min(len(splits[d][0]) for d in train_domains) / (
      hparams["batch_size"])
  if isinstance(dataset, wilds.WildsDataset):
    # WILDS's epoch: one pass over the whole training split.
    steps_per_epoch = sum(len(splits[d][0]) for d in train_domains) / (
        hparams["batch_size"] * domains_per_step)
  meter = MetricMeter()
  step = int(state.step)
  trajectory_dir = output_dir / TRAJECTORY_DIR
  if config.trajectory_freq and step == 0:
    save_trajectory_point(trajectory_dir, 0, state.params)
  with tqdm.tqdm(total=config.steps, initial=step, unit="step",
                 dynamic_ncols=True) as bar:
    interval_start = time.time()
    while step < config.steps and not stops_at(config, results_path, step):
      state, metrics = train_step(state, sharder.batch(next(train_iter), 1))
      meter.add(metrics)
      step += 1
      bar.update()
      if config.trajectory_freq and step % config.trajectory_freq == 0:
        save_trajectory_point(trajectory_dir, step, state.params)
      if step % config.checkpoint_freq and step != config.steps:
        continue
      jax.block_until_ready(state)
      step_time = (time.time() - interval_start) / meter.count
      if manager is None:
        _start_run_directory(requested, hparams)
        manager = _checkpoint_manager(output_dir)
      record = {
          "args": dataclasses.asdict(config), "hparams": hparams,
          "domains": list(dataset.domain_names), "step": step, "epoch": step / steps_per_epoch,
          **meter.result(), "step_time": step_time,
          **evaluate(eval_step, state, dataset, sets, config, sharder)}
      with results_path.open("a") as f:
        f.write(json.dumps(record) + "\n")
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(train_iter)))
      held_out = [held_out_metric(record, t) for t in config.test_envs]
      bar.set_postfix(loss=f"{record['loss']:.4f}",
                      held_out=f"{np.mean(held_out):.4f}")
      meter = MetricMeter()
      interval_start = time.time()
  manager.wait_until_finished()
  manager.close()
  save_params(output_dir / FINAL_PARAMS_FILE, state)
  (output_dir / DONE_FILE).touch()
  if step < config.steps:
    print(f"Stopped at step {step} of at most {config.steps}: plateaued "
          "(--plateau_check_freq).", file=sys.stderr)
  metric = ("accuracy" if f"env{config.test_envs[0]}_in_acc" in record
            else "Pearson's r")
  print(f"Held-out {metric} after {step} steps: "
        f"{_held_out_summary(record, dataset, config.test_envs)}")
  return record
