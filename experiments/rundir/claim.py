"""Claims a run directory for one run: its identity, its lock, the refusal
of another run's directory, and what a run goes on from (`claim_run`).

What a run directory holds, and why a run claims it before any work, is
`experiments.rundir`'s contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from experiments.errors import UsageError
from experiments.rundir import records


def write_in(directory: Path) -> None:
  """Writes a file in ``directory`` and deletes it: a real write, which
  access checks miss (root, read-only mounts).

  Raises:
    OSError: the directory does not take a new file.
  """
  with tempfile.TemporaryFile(dir=directory):
    pass


def _differences(
    ours: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = ""
) -> list[str]:
  """The keys whose values differ, as ``key: ours here, theirs there``."""
  return [f"{prefix}{key}: {ours.get(key)!r} here, {theirs.get(key)!r} there"
          for key in sorted(ours.keys() | theirs.keys())
          if ours.get(key) != theirs.get(key)]


def run_record(identity: Mapping[str, Any], hparams: Mapping[str, Any],
               weights: Mapping[str, str] | None = None) -> dict[str, Any]:
  """What ``config.json`` holds: the ``identity`` of the run
  (``experiments.config.Config.identity``) and its ``hparams``, as JSON
  values, and the ``weights`` it starts from
  (``experiments.config.RunSpec.weights``), if any."""
  record = {"args": dict(identity), "hparams": dict(hparams)}
  if weights is not None:
    record["weights"] = dict(weights)
  return json.loads(json.dumps(record))


def _check_writable(output_dir: Path) -> None:
  """Refuses an output directory that the run could not write, before any
  work: the directory, or else its nearest existing parent, must be a
  directory that takes a new file."""
  existing = next(p for p in (output_dir, *output_dir.parents) if p.exists())
  if not existing.is_dir():
    raise UsageError(f"--output_dir {output_dir}: {existing} is a file; pass "
                     "a directory.")
  try:
    write_in(existing)
  except OSError as e:
    raise UsageError(f"--output_dir {output_dir}: cannot write in {existing} "
                     f"({e.strerror}); pass a writable --output_dir.") from None


class RunDirectoryBusyError(Exception):
  """Another process holds a run directory's lock: it trains the run now.
  The message says what to do; it is the user's to act on, as a usage
  error's."""


class RunDirectoryLock:
  """Keeps two processes from training one run directory at once (a sweep
  launched again while its jobs still run, one command run twice), which
  would interleave their checkpoints and records.

  `acquire` takes an exclusive ``flock`` on the directory's
  `records.LOCK_FILE`; the kernel (or the network file system's lock
  service) ends it with the process, however the process ends, so a killed
  or preempted run leaves no stale lock. As a context manager, the lock, if
  taken, is released on exit.
  """

  def __init__(self, output_dir: str | Path):
    self.output_dir = Path(output_dir)
    self._file = None

  def acquire(self) -> None:
    """Takes the lock, unless held already; the directory must exist.

    Raises:
      RunDirectoryBusyError: another process holds it. A file system
        without locks gets a warning instead, and no lock.
    """
    if self._file is not None:
      return
    file = open(self.output_dir / records.LOCK_FILE, "a")
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      file.close()
      raise RunDirectoryBusyError(
          f"{self.output_dir}: another process is training this run now. "
          "Wait for it to end, or stop it, then run the same command to go "
          "on from its last checkpoint.") from None
    except OSError as e:  # No locks on this file system.
      file.close()
      print(f"Warning: cannot lock {self.output_dir} ({e.strerror or e}): "
            "another process training this run at the same time would not "
            "be stopped.", file=sys.stderr)
      return
    self._file = file

  def release(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> RunDirectoryLock:
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


@dataclasses.dataclass(frozen=True)
class ClaimedRun:
  """A run directory claimed by `claim_run`: what its run goes on from.

  Attributes:
    lock: the directory's lock, held where the directory exists; a fresh
      run takes it as it creates the directory (`start_run_directory`).
    run: the records of the run to resume, checked against its last
      checkpoint (`records.read_run`), or of the finished run; None for a
      fresh run.
    finished: whether the run is finished (`records.is_done`): its result
      is ``run.records[-1]``, and nothing is left to train.
  """

  lock: RunDirectoryLock
  run: records.RunRecords | None
  finished: bool


@contextlib.contextmanager
def claim_run(output_dir: str | Path, *,
              resume: bool) -> Iterator[ClaimedRun]:
  """Claims ``output_dir`` for the run resolved to go there
  (`claim_run_directory`), as a context manager: takes its lock where the
  directory exists, and reads and checks the records of a run to resume,
  so that a second process, or damaged records, stop the run before its
  model is built. The lock, if taken, is released on exit.

  It imports no JAX, so that the command prints a finished run's result
  without the seconds of importing the training loop.

  Args:
    output_dir: the run directory.
    resume: whether it holds the run to resume (`claim_run_directory`).

  Yields:
    The claimed run; a finished run's lock is not taken, as it writes
    nothing.

  Raises:
    RunDirectoryBusyError: another process trains the run there.
    records.DamagedRunError: the records of the run to resume, or of the
      finished run, fail `records.read_run`'s check.
  """
  output_dir = Path(output_dir)
  with RunDirectoryLock(output_dir) as lock:
    if resume and records.is_done(output_dir):
      yield ClaimedRun(lock, records.read_run(output_dir), finished=True)
      return
    # Before the model is built, so that a second process stops at once;
    # on a directory with no run in it yet (a sweep's, which creates it)
    # too.
    if output_dir.is_dir():
      lock.acquire()
    run = None
    if resume:
      steps = records.checkpoint_steps(output_dir)
      run = records.read_run(output_dir,
                             checkpoint_step=steps[-1] if steps else None)
    yield ClaimedRun(lock, run, finished=False)


def print_result(record: records.Record, output_dir: str | Path) -> None:
  """Prints a run's result, its last ``record``: the final line on stdout,
  then on stderr a warning where its losses are not finite
  (`records.divergence_warning`)."""
  print(records.final_line(record, output_dir))
  if (warning := records.divergence_warning(record)) is not None:
    print(warning, file=sys.stderr)


def claim_run_directory(output_dir: str | Path, identity: Mapping[str, Any],
                        hparams: Mapping[str, Any], *,
                        overwrite: bool) -> bool:
  """Whether to resume the run in ``output_dir``; refuses another's.

  With ``overwrite``, deletes the run's files there (`records.RUN_FILES` and
  its config file; other files stay); nothing is deleted otherwise. Creates
  nothing: the run creates the directory when it first writes to it.

  Args:
    output_dir: the run directory.
    identity: the run's identity (``experiments.config.Config.identity``).
    hparams: its hyperparameters.
    overwrite: whether to delete the run there and start over.

  Returns:
    True when the directory holds a run of the same identity, False when
    there is nothing to resume (no directory, none of a run's files, or
    ``overwrite``).

  Raises:
    UsageError: the directory cannot be written, or holds a run of another
      configuration, or run files without a config file, and ``overwrite``
      is off.
    RunDirectoryBusyError: with ``overwrite``, another process trains the
      run there; nothing was deleted.
  """
  output_dir = Path(output_dir)
  _check_writable(output_dir)
  if overwrite:
    if (output_dir / records.LOCK_FILE).exists():
      # Not from under a process that trains there.
      with RunDirectoryLock(output_dir) as lock:
        lock.acquire()
    for name in (records.CONFIG_FILE, *records.RUN_FILES):
      path = output_dir / name
      if path.is_dir():
        shutil.rmtree(path)
      elif path.exists():
        path.unlink()
      else:
        continue
      print(f"Deleted {path} (--overwrite).", file=sys.stderr)
    return False
  config_path = output_dir / records.CONFIG_FILE
  ways_out = ("Pass another --output_dir (or none: each configuration has "
              "its own default), or --overwrite to delete that run and start "
              "over.")
  if config_path.exists():
    try:
      stored = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
      raise UsageError(f"{config_path} is not JSON ({e}): a damaged run of "
                       f"unknown configuration. {ways_out}") from None
    ours = run_record(identity, hparams)
    differences = (_differences(ours["args"], stored.get("args", {})) +
                   _differences(ours["hparams"], stored.get("hparams", {}),
                                "hparams."))
    if not differences:
      return True
    raise UsageError(
        f"{output_dir} holds a run of another configuration; differing "
        f"keys:\n  " + "\n  ".join(differences) + f"\n{ways_out}")
  found = [name for name in records.RUN_FILES if (output_dir / name).exists()]
  if found:
    raise UsageError(f"{output_dir} holds {', '.join(found)} but no "
                     f"{records.CONFIG_FILE}: a run of unknown configuration. "
                     f"{ways_out}")
  return False


def start_run_directory(
    output_dir: str | Path, run_record: Mapping[str, Any],
    fingerprint: Mapping[str, Any], environment: Mapping[str, Any],
    lock: RunDirectoryLock
) -> None:
  """Creates the run directory and takes its ``lock``, then records the
  ``run_record`` of the configuration it belongs to (`run_record`), the
  ``fingerprint`` of its data (``datasets.fingerprint``) and the
  ``environment`` it trains in (``experiments.runs.environment.describe``).

  Raises:
    RunDirectoryBusyError: another process has started the directory and
      trains there (`RunDirectoryLock`); nothing was written.
  """
  output_dir = Path(output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  lock.acquire()
  records.write_config(output_dir, run_record)
  records.write_fingerprint(output_dir, fingerprint)
  records.append_environment(output_dir, environment)
