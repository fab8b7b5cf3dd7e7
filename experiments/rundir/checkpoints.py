"""The files of a run's params, and its Orbax checkpoints.

What they are and when a run writes them is `experiments.rundir`'s
contract.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from flax import traverse_util

from experiments.rundir import records
from experiments.weights import convert

CHECKPOINTS_KEPT = 2
# A record of an interrupt between checkpoints names the signal under this
# key, and holds the training metrics' sums under METER_KEY for the resumed
# run to go on from.
INTERRUPT_KEY = "interrupted"
METER_KEY = "meter"


def save_params(path: Path, params: nnx.State, stats: nnx.State) -> None:
  """Writes params and statistics to ``.npz``, keyed like params/head/bias."""
  tree = {"params": nnx.to_pure_dict(params),
          "stats": nnx.to_pure_dict(stats)}
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


def check_params_fit(path: str | Path, params: nnx.State, stats: nnx.State
                     ) -> dict[tuple[str, ...], np.ndarray]:
  """Reads another run's `save_params` file for a model of these ``params``
  and ``stats`` (arrays, or their shapes: `jax.ShapeDtypeStruct`s), and
  checks that it fits them.

  Returns:
    Its arrays, by the model's flattened keys.

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
  return {k: loaded[name] for name, k in keys.items()}


def load_params(
    path: str | Path, params: nnx.State, stats: nnx.State
) -> tuple[nnx.State, nnx.State]:
  """Params and statistics from another run's `save_params` file, which
  must fit them (`check_params_fit`, whose errors it raises)."""
  values = traverse_util.unflatten_dict(
      {k: jnp.asarray(value)
       for k, value in check_params_fit(path, params, stats).items()})
  # Empty statistics (frozen or no BatchNorm) leave no keys behind.
  nnx.replace_by_pure_dict(params, values.get("params", {}))
  nnx.replace_by_pure_dict(stats, values.get("stats", {}))
  return params, stats


def checkpoint_manager(output_dir: Path) -> ocp.CheckpointManager:
  """The manager of the run's Orbax checkpoints, which keeps the last
  CHECKPOINTS_KEPT."""
  return ocp.CheckpointManager(
      (output_dir / records.CHECKPOINT_DIR).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=CHECKPOINTS_KEPT))


def forget_interrupt_checkpoint(
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

  Raises:
    records.DamagedRunError: the records left fail `records.read_run`'s
      check.
  """
  manager.close()
  directory = output_dir / records.CHECKPOINT_DIR
  deleted = directory / f"interrupt-{step}.deleted"
  (directory / str(step)).rename(deleted)
  shutil.rmtree(deleted)
  manager = checkpoint_manager(output_dir)
  run = records.read_run(output_dir, checkpoint_step=manager.latest_step())
  records.keep_checkpointed(run)
  return manager, run.checkpointed
