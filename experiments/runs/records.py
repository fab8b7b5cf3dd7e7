"""A run's directory: the files ``python -m experiments.train`` writes there.

A run directory holds::

  config.json           the run's identity: its resolved arguments and
                        hyperparameters (`experiments.config.run_record`),
                        and the file name and SHA-256 of the weights it
                        started from, if any
  dataset.json          the fingerprint of the data it trains on
                        (`experiments.data.datasets.fingerprint`); runs from
                        before fingerprints have none
  environment.json      where it trained (`append_environment`): a list of
                        `experiments.runs.environment.describe` entries,
                        the machine that started it, then one more each time
                        it resumed on another (a first null: it trained
                        before, unrecorded); runs from before this file
                        have none
  results.jsonl         one record per evaluation, a JSON object per line
  checkpoints/<step>/   Orbax checkpoints of the last evaluations
  trajectory/<step>.npy params snapshots, with --trajectory_freq
  final_params.npz      the params and statistics at the end
  done                  written last: the run finished

A *record* is one evaluation::

  {"args": {...the resolved config...}, "hparams": {...},
   "domains": [str],      # the dataset's domain names; domain i is env{i}
   "step": int,           # updates done
   "epoch": float,        # steps * batch_size / smallest training in split
   "loss": float,         # mean training loss since the previous record
   "step_time": float,    # mean seconds per step since the previous record,
                          # compiling excepted
   "data_wait_time": float,  # of which reading the next training batch
   "device_wait_time": float,  # of which waiting for the device to end
                          # steps; the rest is the loop's work on the host
   "init_time": float,    # seconds initialising the model and the
                          # optimizer state (loading weights, if any)
   "compile_time": float,    # seconds compiling the step (a cache hit: less)
   "first_batch_time": float,  # seconds reading the first training batch,
                          # which the step's compiling overlaps
   "time_to_first_step": float,  # from the start of training to the end of
                          # its first step in this process
   "interrupted": str,    # only on a record written at SIGINT or SIGTERM
   "meter": {...},        # with it: the metric sums since the last record,
                          # carried on when the run resumes
   "env{i}_in_acc", "env{i}_out_acc": float,   # every domain i
   "env{i}_in_loss": float,  # loss on a fixed subset of the in split
   ...}                   # the algorithm's other metrics; for PGrad:
                          # "eigenvalues" (mean normalised spectrum,
                          # descending), "ref_norm", "num_skipped"

Its per-domain keys are ``env{i}_{split}_{metric}`` (`env_key`), the
metrics being `experiments.data.tasks.split_metrics`'s: ``acc`` (and
``worst_acc`` on WILDS) of classes, ``mse``, ``r`` and ``worst_r`` of
regression values, and ``examples``, how many examples they are over.

How a run writes, so that a run killed at any moment leaves a state the next
one recognises: once the previous checkpoint is on disk, the run appends the
record of an evaluation (flushed and synced to disk) and then checkpoints
that step; at the end it writes ``done`` whole or not at all. A killed run
therefore leaves at most one record after its last checkpoint, and maybe a
last line cut short; the run that resumes it drops those, says so, and
computes them again. Anything else is damage that no run leaves: `read_run`
refuses it with `DamagedRunError`, and training, sweeps and reports alike
refuse or skip the run, saying why.

A sweep's finished runs can be *packed* into one compressed file beside
them, ``PACK_FILE`` (`pack_runs`), which is how a study is committed: its
thousands of run files become one, without checkpoints or params. Each line
is one run, in name order::

  {"run": str,            # its directory's name
   "config": {...},       # its config.json
   "environment": [...],  # its environment.json, where it has one
   "records": [...],      # its records, as in results.jsonl
   "trajectory": {...}}   # only for a run that saved params snapshots:
                          # what the paper's claims read of them
                          # (`experiments.analysis.claims.ProjectedPath`),
                          # kept in their place

A packed run is finished. Where its directory holds a results file, that
directory is the run (`packed_run`); reports, sweeps and studies otherwise
read the packed run as they read a finished directory.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
DATASET_FILE = "dataset.json"
ENVIRONMENT_FILE = "environment.json"
RESULTS_FILE = "results.jsonl"
CHECKPOINT_DIR = "checkpoints"
TRAJECTORY_DIR = "trajectory"
# The fields of a record that time its training, which no rerun reproduces
# (an older loop's records may lack any of them but the first two).
TIMING_FIELDS = ("step_time", "data_wait_time", "device_wait_time",
                 "init_time", "compile_time", "first_batch_time",
                 "time_to_first_step")
FINAL_PARAMS_FILE = "final_params.npz"
# Held (flock) by the process that trains the run, while it does
# (`config.RunDirectoryLock`); empty.
LOCK_FILE = "training.lock"
DONE_FILE = "done"
# A sweep's packed runs (`pack_runs`), beside their directories.
PACK_FILE = "runs.jsonl.gz"
# The files a run writes besides CONFIG_FILE; a directory holding any of them
# but no CONFIG_FILE holds a run of unknown configuration. (A sweep puts its
# log there first.)
RUN_FILES = (DATASET_FILE, ENVIRONMENT_FILE, RESULTS_FILE, CHECKPOINT_DIR,
             TRAJECTORY_DIR, FINAL_PARAMS_FILE, DONE_FILE)

Record = dict[str, Any]


def counted(count: int, noun: str) -> str:
  """``count`` of ``noun``, in the singular for one.

  >>> counted(1, "step"), counted(2, "file")
  ('1 step', '2 files')
  """
  return f"{count:,} {noun}{'' if count == 1 else 's'}"

_ENV_KEY = re.compile(r"env(\d+)_(in|out)_(\w+)")


def env_key(env: int, split: str, metric: str) -> str:
  """The key of a domain's metric in a record, ``env{env}_{split}_{metric}``.

  >>> env_key(2, "in", "acc")
  'env2_in_acc'
  """
  return f"env{env}_{split}_{metric}"


def parse_env_key(key: str) -> tuple[int, str, str] | None:
  """``(env, split, metric)`` of an `env_key`, or None for another key.

  >>> parse_env_key("env10_out_worst_acc"), parse_env_key("step")
  ((10, 'out', 'worst_acc'), None)
  """
  match = _ENV_KEY.fullmatch(key)
  return None if match is None else (int(match[1]), match[2], match[3])


def held_out_env(record: Record) -> int:
  """The single held-out domain of a record's run."""
  (env,) = record["args"]["test_envs"]
  return env


def num_envs(record: Record) -> int:
  """The number of domains a record has accuracies for."""
  parsed = (parse_env_key(key) for key in record)
  return sum(key is not None and key[1:] == ("out", "acc") for key in parsed)


def train_envs(record: Record) -> list[int]:
  """The training domains of a record's run: all but the held-out ones."""
  held_out = record["args"]["test_envs"]
  return [i for i in range(num_envs(record)) if i not in held_out]


def has_training_losses(record: Record) -> bool:
  """Whether a record holds every training domain's loss,
  ``env{i}_in_loss``: this project's runs record it at every evaluation;
  DomainBed's own runs (its ``train.py``) record accuracies alone."""
  return all(env_key(i, "in", "loss") in record for i in train_envs(record))


def held_out_metric(record: Record, env: int) -> float:
  """A held-out domain's headline metric: accuracy, or Pearson's r."""
  return record.get(env_key(env, "in", "acc"),
                    record.get(env_key(env, "in", "r")))


def final_line(record: Record, output_dir: str | Path) -> str:
  """What a run prints at its end: its last record's held-out metric, said
  for what it is, and where the run is."""
  test_envs = record["args"]["test_envs"]
  metric = ("accuracy" if env_key(test_envs[0], "in", "acc") in record
            else "Pearson's r")
  held_out = ", ".join(f"{record['domains'][t]} (env{t}) "
                       f"{held_out_metric(record, t):.4f}" for t in test_envs)
  steps = f"{record['step']} step{'' if record['step'] == 1 else 's'}"
  return (f"Held-out {metric} after {steps} (the last step's, "
          f"on the held-out domains' in splits; no model selection): "
          f"{held_out}. Run directory: {output_dir}")


def divergence_warning(record: Record) -> str | None:
  """What a run's last record says of losses that are not finite, or None
  where they all are.

  A model whose evaluated losses (``env{i}_in_loss``) are NaN or infinite
  has diverged: its params are no longer finite, and its accuracies are
  those of a broken model. A training loss that is not finite while the
  evaluated ones are means steps that were not finite; PGrad skips them
  (``num_skipped``), keeping its params.
  """
  evaluated = [key for key, value in record.items()
               if (parsed := parse_env_key(key)) is not None
               and parsed[1:] == ("in", "loss") and not _finite(value)]
  if evaluated:
    return (f"Warning: the model diverged: after "
            f"{counted(record['step'], 'step')} its "
            f"loss is not finite on {len(evaluated)} of its "
            f"{num_envs(record)} domains, so the numbers above are those of "
            "a model with non-finite params. Try a lower lr (--hparams).")
  if "loss" in record and not _finite(record["loss"]):
    skipped = (f"; {record['num_skipped']} updates were skipped so far, "
               "the params kept" if record.get("num_skipped") else "")
    return (f"Warning: the training loss was not finite in some steps up "
            f"to step {record['step']}{skipped}. Try a lower lr (--hparams).")
  return None


def _finite(value: Any) -> bool:
  """Whether a record's number is finite (JSON writes NaN and Infinity)."""
  return isinstance(value, (int, float)) and math.isfinite(value)


def is_done(run_dir: str | Path) -> bool:
  """Whether the run finished (its ``done`` file exists)."""
  return (Path(run_dir) / DONE_FILE).exists()


def checkpoint_steps(run_dir: str | Path) -> list[int] | None:
  """The steps of the run's finished checkpoints, in order, or None when it
  has no checkpoint directory (e.g. a run copied without them).

  A checkpoint being written has a temporary name until it is complete, so
  only finished ones are listed.
  """
  directory = Path(run_dir) / CHECKPOINT_DIR
  if not directory.is_dir():
    return None
  return sorted(int(p.name) for p in directory.iterdir()
                if p.is_dir() and p.name.isdigit())


def trajectory_file(run_dir: str | Path, step: int) -> Path:
  """Where the params snapshot of ``step`` goes, ``trajectory/<step:07d>.npy``.
  """
  return Path(run_dir) / TRAJECTORY_DIR / f"{step:07d}.npy"


def trajectory_files(run_dir: str | Path) -> dict[int, Path]:
  """The run's params snapshots by step, in step order (none: empty)."""
  files = (Path(run_dir) / TRAJECTORY_DIR).glob("*.npy")
  return dict(sorted((int(p.stem), p) for p in files if p.stem.isdigit()))


class DamagedRunError(ValueError):
  """A run's records contradict themselves or its checkpoints; the message
  names the file and what is wrong, for the caller to add the way out."""


@dataclasses.dataclass(frozen=True)
class RunRecords:
  """A run's records, checked against its checkpoints by `read_run`.

  Attributes:
    path: the results file.
    records: every complete record, in step order.
    checkpoint_step: the last checkpoint's step; None without checkpoints.
    unsaved: how many of ``records`` come after ``checkpoint_step`` (0 or
      1): written by a run killed before checkpointing them. Without a
      checkpoint directory, none.
    torn_bytes: the length of a last line cut short by a run killed while
      writing it (0: none); it is not among ``records``.
    kept_bytes: the length of the file up to the end of the last record a
      resumed run keeps (the checkpoint's).
  """

  path: Path
  records: list[Record]
  checkpoint_step: int | None
  unsaved: int
  torn_bytes: int
  kept_bytes: int

  @property
  def checkpointed(self) -> list[Record]:
    """The records up to the last checkpoint, which a resumed run keeps."""
    return self.records[:len(self.records) - self.unsaved]


def _damaged(path: Path, problem: str, *, done: bool) -> DamagedRunError:
  state = "a finished" if done else "an unfinished"
  return DamagedRunError(f"{path} ({state} run): {problem}; no run leaves "
                         "its records so, even when killed")


# read_run's default: the last checkpoint that the run directory holds.
_ON_DISK = object()


def read_run(run_dir: str | Path,
             checkpoint_step: int | None | object = _ON_DISK
             ) -> RunRecords:
  """Reads a run's records and checks them against its checkpoints.

  The records must be JSON objects, one per line, with integer steps that
  strictly increase. The last checkpoint's step must have its record, and
  at most one record may follow it; a finished run must end on its last
  checkpoint (where it has any) and on a whole line.

  Args:
    run_dir: the run's directory. No results file: no records.
    checkpoint_step: the step of the checkpoint that a resumed run restores
      (None: none). By default, the last one on disk (`checkpoint_steps`);
      a run without a checkpoint directory is checked on its records alone.

  Returns:
    The records.

  Raises:
    DamagedRunError: the records fail the check; it says how.
  """
  run_dir = Path(run_dir)
  path = run_dir / RESULTS_FILE
  done = is_done(run_dir)
  if checkpoint_step is _ON_DISK:
    steps = checkpoint_steps(run_dir)
    known = steps is not None
    checkpoint_step = steps[-1] if steps else None
  else:
    known = True
  data = path.read_bytes() if path.exists() else b""
  whole, _, torn = data.rpartition(b"\n")
  if torn and done:
    raise _damaged(path, "its last line is cut short", done=done)
  records, ends = [], []  # ends: each line's end offset, for truncation.
  for number, line in enumerate(whole.split(b"\n") if whole else [], 1):
    try:
      record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise _damaged(path, f"line {number} is not JSON", done=done) from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
      raise _damaged(path, f"line {number} has no step (a positive integer)",
                     done=done)
    if records and step <= records[-1]["step"]:
      raise _damaged(path, f"line {number} is of step {step}, after step "
                     f"{records[-1]['step']}", done=done)
    records.append(record)
    ends.append((ends[-1] if ends else 0) + len(line) + 1)
  if done and not records:
    raise _damaged(path, "it is done, yet holds no record", done=done)
  steps = [r["step"] for r in records]
  unsaved = 0
  if known:
    after = [s for s in steps if checkpoint_step is None or s > checkpoint_step]
    unsaved = len(after)
    if checkpoint_step is not None and checkpoint_step not in steps:
      last = f"step {steps[-1]}" if steps else "no record"
      raise _damaged(path, f"it has no record of step {checkpoint_step}, its "
                     f"last checkpoint's (it ends at {last})", done=done)
    if unsaved > 1:
      where = ("its last checkpoint (step "
               f"{checkpoint_step})" if checkpoint_step is not None else
               "it has no checkpoint")
      raise _damaged(path, f"{unsaved} records (steps {after[0]} to "
                     f"{after[-1]}) come after {where}; a run checkpoints "
                     "every record before writing the next", done=done)
    if done and unsaved:
      raise _damaged(path, f"it is done, yet its last record (step "
                     f"{steps[-1]}) has no checkpoint", done=done)
  kept = len(records) - unsaved
  return RunRecords(path=path, records=records,
                    checkpoint_step=checkpoint_step if known else None,
                    unsaved=unsaved, torn_bytes=len(torn),
                    kept_bytes=ends[kept - 1] if kept else 0)


def append_record(run_dir: str | Path, record: Record) -> None:
  """Appends ``record`` to the results file and syncs it to disk."""
  with (Path(run_dir) / RESULTS_FILE).open("a") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def keep_checkpointed(run: RunRecords) -> list[str]:
  """Cuts the results file after its last checkpoint's record, for a resumed
  run to write the rest again.

  Only what a killed run leaves goes (`RunRecords.unsaved` records and a
  torn last line); the bytes kept are not rewritten.

  Returns:
    What was dropped, one sentence each, for the log.
  """
  dropped = []
  if run.unsaved:
    dropped.append(
        f"Dropped the record of step {run.records[-1]['step']} from "
        f"{run.path}: the run was killed before checkpointing it; it is "
        "computed again.")
  if run.torn_bytes:
    dropped.append(f"Dropped a last line cut short ({run.torn_bytes} bytes) "
                   f"from {run.path}: the run was killed while writing it.")
  if dropped:
    with run.path.open("r+b") as f:
      f.truncate(run.kept_bytes)
      os.fsync(f.fileno())
  return dropped


def _write_whole(path: Path, data: bytes) -> None:
  """Writes ``path`` whole or not at all: aside, synced, then renamed."""
  partial = path.with_name(f"{path.name}.partial")
  with partial.open("wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  partial.replace(path)
  directory = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(directory)
  finally:
    os.close(directory)


def write_config(run_dir: str | Path, run_record: Mapping[str, Any]) -> None:
  """Writes the run's config file (`experiments.config.run_record`) whole."""
  _write_whole(Path(run_dir) / CONFIG_FILE,
               (json.dumps(run_record, indent=2) + "\n").encode())


def write_fingerprint(run_dir: str | Path,
                      fingerprint: Mapping[str, Any]) -> None:
  """Writes the fingerprint of the run's data whole (`DATASET_FILE`)."""
  _write_whole(Path(run_dir) / DATASET_FILE,
               (json.dumps(fingerprint, indent=1) + "\n").encode())


def read_environment(run_dir: str | Path) -> list[Any] | None:
  """The run's environment entries (`ENVIRONMENT_FILE`), oldest first; None
  for a run without the file."""
  path = Path(run_dir) / ENVIRONMENT_FILE
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None


def append_environment(run_dir: str | Path, entry: Mapping[str, Any], *,
                       unrecorded_before: bool = False) -> bool:
  """Adds ``entry`` (`experiments.runs.environment.describe`) to the run's
  `ENVIRONMENT_FILE` unless it equals the last entry there, and writes the
  file whole.

  A run resumed on the machine it last trained on therefore adds nothing,
  and one resumed elsewhere adds that machine.

  Args:
    run_dir: the run's directory.
    entry: the environment of the process about to train the run.
    unrecorded_before: whether the run trained before in processes that
      recorded no entry (it is from before runs recorded them). A file
      begun now then starts with a null entry for them, so that the new
      entry does not claim the steps trained before.

  Returns:
    Whether the file changed.
  """
  entries = read_environment(run_dir)
  if entries is None:
    entries = [None] if unrecorded_before else []
  # Compared as read back from JSON, where tuples are lists.
  entry = json.loads(json.dumps(entry))
  if entries and entries[-1] == entry:
    return False
  _write_whole(Path(run_dir) / ENVIRONMENT_FILE,
               (json.dumps([*entries, entry], indent=1) + "\n").encode())
  return True


class DatasetChangedError(ValueError):
  """A run meets other data than it recorded; the message says what
  changed, for the caller to add the way out."""


# How many changes a DatasetChangedError names.
_CHANGES_NAMED = 8


def _group_change(where: str, recorded: Mapping[str, Any],
                  current: Mapping[str, Any]) -> str:
  """How a group of files (``{"files", "bytes", "names", "sizes"}``, and
  ``"contents"``) changed."""
  before, after = recorded["files"], current["files"]
  if before != after:
    verb = "added" if after > before else "removed"
    return (f"{where}: {counted(abs(after - before), 'file')} {verb} "
            f"({before} -> {after})")
  if recorded["names"] != current["names"]:
    return f"{where}: files renamed or replaced ({after} files)"
  if recorded["sizes"] != current["sizes"]:
    return (f"{where}: files resized ({recorded['bytes']} -> "
            f"{current['bytes']} bytes)")
  return (f"{where}: files changed in place ({after} files, the same names "
          "and sizes)")


def fingerprint_changes(recorded: Mapping[str, Any],
                        current: Mapping[str, Any],
                        where: str = "") -> list[str]:
  """What differs between two fingerprints, one phrase each, by path
  (``domain/class``); a group of files is described by its counts.

  A group is compared on what both record: a run recorded before groups
  held their files' ``"contents"`` is checked on names and sizes.
  """
  if {"files", "names"} <= recorded.keys() and recorded.keys() <= (
      current.keys()):
    current = {key: current[key] for key in recorded}
    return [] if recorded == current else [
        _group_change(where, recorded, current)]
  changes = []
  for key in sorted(recorded.keys() | current.keys()):
    path = key if where in ("", "domains") else f"{where}/{key}"
    named = f"domain {key}" if where == "domains" else path
    if key not in current:
      changes.append(f"{named}: gone")
    elif key not in recorded:
      changes.append(f"{named}: new")
    elif isinstance(recorded[key], Mapping) and isinstance(
        current[key], Mapping):
      changes += fingerprint_changes(recorded[key], current[key], path)
    elif recorded[key] != current[key]:
      changes.append(f"{path}: {recorded[key]} -> {current[key]}")
  return changes


def check_fingerprint(run_dir: str | Path,
                      fingerprint: Mapping[str, Any]) -> None:
  """Refuses data other than those the run recorded (`DATASET_FILE`).

  A run without the file is accepted: it is from before runs recorded it,
  or was killed between writing its config file and this one.

  Raises:
    DatasetChangedError: the run recorded another fingerprint; the message
      names what changed.
  """
  path = Path(run_dir) / DATASET_FILE
  if not path.exists():
    return
  changes = fingerprint_changes(json.loads(path.read_text()),
                                json.loads(json.dumps(fingerprint)))
  if changes:
    more = len(changes) - _CHANGES_NAMED
    raise DatasetChangedError(
        f"{run_dir} was trained on other data than it is given now "
        f"({path} records them): " + "; ".join(changes[:_CHANGES_NAMED])
        + (f"; and {more} more" if more > 0 else ""))


def mark_done(run_dir: str | Path) -> None:
  """Writes ``done``, whole, once the run has finished."""
  _write_whole(Path(run_dir) / DONE_FILE, b"")


@dataclasses.dataclass(frozen=True)
class SweepRecords:
  """The runs found under a directory, by `load_runs`.

  Attributes:
    runs: every run with records, directory or packed, to its records, in
      path order.
    skipped: every run directory whose records are damaged, to why.
    trajectories: every packed run's ``trajectory`` (`PackedRun`), by its
      path.
  """

  runs: dict[Path, list[Record]]
  skipped: dict[Path, str]
  trajectories: dict[Path, dict[str, Any]]

  @property
  def records(self) -> list[Record]:
    """Every run's records, run after run."""
    return [record for records in self.runs.values() for record in records]


def load_runs(input_dir: str | Path) -> SweepRecords:
  """Reads and checks (`read_run`) every run below a directory, at any depth,
  and every packed run (`read_pack`).

  A run is a directory holding a results file, or a run of a ``PACK_FILE``
  whose directory holds none (`packed_run`). An unfinished run's records
  are read as far as they go; a run without any is left out.

  Args:
    input_dir: the directory, typically a sweep's output directory.

  Returns:
    The runs and the damaged runs skipped.
  """
  runs, skipped, trajectories = {}, {}, {}
  for path in sorted(Path(input_dir).rglob(RESULTS_FILE)):
    try:
      found = read_run(path.parent).records
    except DamagedRunError as e:
      skipped[path.parent] = str(e)
      continue
    if found:
      runs[path.parent] = found
  for pack in sorted(Path(input_dir).rglob(PACK_FILE)):
    for name, packed in read_pack(pack.parent).items():
      run_dir = pack.parent / name
      if not (run_dir / RESULTS_FILE).exists():
        runs[run_dir] = packed.records
        if packed.trajectory is not None:
          trajectories[run_dir] = packed.trajectory
  return SweepRecords(dict(sorted(runs.items())), skipped, trajectories)


@dataclasses.dataclass(frozen=True)
class PackedRun:
  """A finished run as its sweep's ``PACK_FILE`` holds it.

  Attributes:
    config: its config.json.
    records: its records.
    trajectory: what the claims read of its params snapshots
      (`experiments.analysis.claims.ProjectedPath`); None where it saved
      none.
    environment: its `ENVIRONMENT_FILE`'s entries; None for a run from
      before runs recorded them.
  """

  config: dict[str, Any]
  records: list[Record]
  trajectory: dict[str, Any] | None = None
  environment: list[Any] | None = None


def finished_run_dirs(sweep_dir: str | Path) -> list[Path]:
  """The directories right under ``sweep_dir`` of finished runs
  (`is_done`), in name order."""
  sweep_dir = Path(sweep_dir)
  if not sweep_dir.is_dir():
    return []
  return sorted(path for path in sweep_dir.iterdir() if is_done(path))


@functools.lru_cache(maxsize=4)
def _read_pack_file(path: Path, stamp: tuple[int, int]
                    ) -> dict[str, PackedRun]:
  """The runs of a ``PACK_FILE``; cached while its ``stamp`` (modification
  time and size) holds, since a sweep's every run looks itself up."""
  del stamp  # The cache's key only.
  packed = {}
  with gzip.open(path, "rt", encoding="utf-8") as lines:
    for line in lines:
      run = json.loads(line)
      packed[run["run"]] = PackedRun(run["config"], run["records"],
                                     run.get("trajectory"),
                                     run.get("environment"))
  return packed


def read_pack(sweep_dir: str | Path) -> dict[str, PackedRun]:
  """The runs packed in ``sweep_dir`` (`pack_runs`), by directory name; none
  without a ``PACK_FILE``. The result is shared: do not change it."""
  path = Path(sweep_dir) / PACK_FILE
  try:
    stat = path.stat()
  except FileNotFoundError:
    return {}
  return _read_pack_file(path.resolve(), (stat.st_mtime_ns, stat.st_size))


def packed_run(run_dir: str | Path) -> PackedRun | None:
  """The run as its sweep's pack holds it, where its directory holds no
  results file (a directory that does is the run); otherwise None."""
  run_dir = Path(run_dir)
  if (run_dir / RESULTS_FILE).exists():
    return None
  return read_pack(run_dir.parent).get(run_dir.name)


def finished_records(run_dir: str | Path) -> list[Record] | None:
  """The records of a finished run, packed (`packed_run`) or in its
  directory (`is_done`, checked by `read_run`); None for a run not
  finished."""
  packed = packed_run(run_dir)
  if packed is not None:
    return packed.records
  return read_run(run_dir).records if is_done(run_dir) else None


def run_environment(run_dir: str | Path) -> list[Any] | None:
  """Where the run trained (`ENVIRONMENT_FILE`'s entries), packed
  (`packed_run`) or in its directory; None for a run without them."""
  packed = packed_run(run_dir)
  if packed is not None:
    return packed.environment
  return read_environment(run_dir)


def pack_runs(sweep_dir: str | Path,
              trajectories: Mapping[str, Mapping[str, Any]]
              ) -> tuple[list[str], dict[Path, str]]:
  """Writes the finished runs of ``sweep_dir`` to its ``PACK_FILE``, whole.

  The runs are those already packed and every finished run directory
  right under ``sweep_dir`` (`finished_run_dirs`), a directory replacing a
  packed run of its name; each with its config, its records and, where it
  has one, its `ENVIRONMENT_FILE`. The file is the same, byte for byte, for
  the same runs: lines in name order, gzip without a time stamp or file
  name.

  Args:
    sweep_dir: the sweep's directory.
    trajectories: by run name, what the claims read of a run directory's
      params snapshots (`experiments.analysis.claims.ProjectedPath`); a
      packed run that no directory replaces keeps its own.

  Returns:
    The names of the runs packed, and the finished run directories left
    out, to why: their records are damaged or they have no config.json.
  """
  sweep_dir = Path(sweep_dir)
  runs = {name: {"config": packed.config, "records": packed.records,
                 "trajectory": packed.trajectory,
                 "environment": packed.environment}
          for name, packed in read_pack(sweep_dir).items()}
  skipped = {}
  for run_dir in finished_run_dirs(sweep_dir):
    config = run_dir / CONFIG_FILE
    if not config.exists():
      skipped[run_dir] = f"it has no {CONFIG_FILE}"
      continue
    try:
      found = read_run(run_dir).records
    except DamagedRunError as e:
      skipped[run_dir] = str(e)
      continue
    runs[run_dir.name] = {"config": json.loads(config.read_text()),
                          "records": found,
                          "trajectory": trajectories.get(run_dir.name),
                          "environment": read_environment(run_dir)}
  lines = []
  for name, run in sorted(runs.items()):
    line = {"run": name, "config": run["config"]}
    # Only where the run has one: a run without keeps the line it had
    # before runs recorded where they trained, byte for byte.
    if run["environment"] is not None:
      line["environment"] = run["environment"]
    line["records"] = run["records"]
    if run["trajectory"] is not None:
      line["trajectory"] = run["trajectory"]
    lines.append(json.dumps(line) + "\n")
  # GzipFile's header is the same on every Python (gzip.compress's names
  # the operating system on some).
  compressed = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", compresslevel=9,
                     fileobj=compressed, mtime=0) as f:
    f.write("".join(lines).encode())
  _write_whole(sweep_dir / PACK_FILE, compressed.getvalue())
  return sorted(runs), skipped
