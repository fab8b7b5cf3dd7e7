"""The record files of a run directory: its results, its configuration,
the fingerprint of its data, where it trained, and its ``done`` marker.

What the files hold and how a run writes them is `experiments.rundir`'s
contract.
"""

from __future__ import annotations

import dataclasses
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
# The averaged params and statistics at the end, beside FINAL_PARAMS_FILE, of
# a run with --averaging.
AVERAGED_PARAMS_FILE = "averaged_params.npz"
# The prefix of the averaged model's metrics in the records of such a run:
# ``averaged_env0_in_acc`` beside ``env0_in_acc``.
AVERAGED_PREFIX = "averaged_"
# Held (flock) by the process that trains the run, while it does
# (`claim.RunDirectoryLock`); empty.
LOCK_FILE = "training.lock"
DONE_FILE = "done"
# The files a run writes besides CONFIG_FILE; a directory holding any of them
# but no CONFIG_FILE holds a run of unknown configuration. (A sweep puts its
# log there first.)
RUN_FILES = (DATASET_FILE, ENVIRONMENT_FILE, RESULTS_FILE, CHECKPOINT_DIR,
             TRAJECTORY_DIR, FINAL_PARAMS_FILE, AVERAGED_PARAMS_FILE,
             DONE_FILE)

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


def averaged_record(record: Record) -> Record | None:
  """A record of a run with ``--averaging`` as its averaged model's: its
  ``env{i}_*`` metrics replaced by the ``averaged_env{i}_*`` ones; None for
  a record without them (SWAD's, but the last; a run without averaging).

  >>> averaged_record({"step": 2, "env0_in_acc": 0.5,
  ...                  "averaged_env0_in_acc": 0.75})
  {'step': 2, 'env0_in_acc': 0.75}
  """
  metrics = {key[len(AVERAGED_PREFIX):]: value
             for key, value in record.items()
             if key.startswith(AVERAGED_PREFIX)
             and parse_env_key(key[len(AVERAGED_PREFIX):]) is not None}
  if not metrics:
    return None
  return {**{key: value for key, value in record.items()
             if parse_env_key(key) is None
             and not key.startswith(AVERAGED_PREFIX)}, **metrics}


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
  for what it is, its averaged weights' beside it where the run averages
  them (``--averaging``), and where the run is."""
  test_envs = record["args"]["test_envs"]
  metric = ("accuracy" if env_key(test_envs[0], "in", "acc") in record
            else "Pearson's r")

  def held_out(of: Record) -> str:
    return ", ".join(f"{of['domains'][t]} (env{t}) "
                     f"{held_out_metric(of, t):.4f}" for t in test_envs)

  steps = f"{record['step']} step{'' if record['step'] == 1 else 's'}"
  averaged = averaged_record(record)
  of_average = "" if averaged is None else (
      f"; its averaged weights' (--averaging "
      f"{record['args']['averaging']}): {held_out(averaged)}")
  return (f"Held-out {metric} after {steps} (the last step's, "
          f"on the held-out domains' in splits; no model selection): "
          f"{held_out(record)}{of_average}. Run directory: {output_dir}")


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


def write_whole(path: Path, data: bytes) -> None:
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
  """Writes the run's config file (`claim.run_record`) whole."""
  write_whole(Path(run_dir) / CONFIG_FILE,
              (json.dumps(run_record, indent=2) + "\n").encode())


def write_fingerprint(run_dir: str | Path,
                      fingerprint: Mapping[str, Any]) -> None:
  """Writes the fingerprint of the run's data whole (`DATASET_FILE`)."""
  write_whole(Path(run_dir) / DATASET_FILE,
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
  write_whole(Path(run_dir) / ENVIRONMENT_FILE,
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
  # The digests are of whole groups: which of their files changed, and how
  # many, is not known, so the count said is the group's.
  if recorded["names"] != current["names"]:
    return (f"{where}: one or more of its {counted(after, 'file')} renamed "
            "or replaced")
  if recorded["sizes"] != current["sizes"]:
    return (f"{where}: one or more of its {counted(after, 'file')} resized "
            f"({recorded['bytes']} -> {current['bytes']} bytes)")
  return (f"{where}: one or more of its {counted(after, 'file')} changed in "
          "place (the same names and sizes)")


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
  write_whole(Path(run_dir) / DONE_FILE, b"")
