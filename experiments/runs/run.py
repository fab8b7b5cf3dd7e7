"""A run of a sweep or study: its training arguments, its directory and
where it stands.

A run's directory under the sweep's is the MD5 of its arguments
(`experiments.config.args_hash`), and its seed derives from a hash of its
identity (`seed_hash`), as in DomainBed. `Run.status` reads the directory
each time it is asked, so it follows training as it goes; `Run.start` trains
the run in a subprocess, which is all that a launcher
(`experiments.runs.launchers`) needs of it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import averaging_flags
from experiments import config as config_lib
from experiments.rundir import pack
from experiments.rundir import records

DEFAULT_TRAIN_COMMAND = f"{shlex.quote(sys.executable)} -m experiments.train"
# Where a run's stdout and stderr go, inside its directory.
LOG_FILE = "train.log"
# Where a run trains or trained (`Run.record_launch`), inside its directory.
LAUNCH_FILE = "launch.json"


def seed_hash(*args: Any) -> int:
  """DomainBed's seed derivation: an MD5 of ``str(args)``, modulo 2**31."""
  digest = hashlib.md5(str(args).encode("utf-8")).hexdigest()
  return int(digest, 16) % (2**31)


class Status(enum.Enum):
  """Where a run stands, judged from its directory."""

  DONE = "done"
  INCOMPLETE = "incomplete"
  NOT_STARTED = "not started"
  DAMAGED = "damaged"


@dataclasses.dataclass(frozen=True)
class Run:
  """One training job of a sweep.

  Attributes:
    args: the training arguments that determine the run's results; they name
      its directory.
    output_dir: the run's directory.
  """

  args: Mapping[str, Any]
  output_dir: Path

  @classmethod
  def create(cls, args: Mapping[str, Any], sweep_dir: str | Path) -> Run:
    """A run whose directory under ``sweep_dir`` is the MD5 of its args."""
    return cls(dict(args), Path(sweep_dir) / config_lib.args_hash(args))

  @property
  def status(self) -> Status:
    """Read from the directory now, so it follows the run's progress; a
    packed run whose directory holds no records is done
    (`pack.packed_run`)."""
    if pack.packed_run(self.output_dir) is not None:
      return Status.DONE
    if not self.output_dir.exists():
      return Status.NOT_STARTED
    if self.damage is not None:
      return Status.DAMAGED
    return Status.DONE if records.is_done(self.output_dir) else (
        Status.INCOMPLETE)

  @property
  def damage(self) -> str | None:
    """What is wrong with the run's records (`records.read_run`), if
    anything."""
    try:
      records.read_run(self.output_dir)
    except records.DamagedRunError as e:
      return str(e)
    return None

  def command(
      self, train_command: str, data_dir: str | None = None,
      num_workers: int | None = None,
  ) -> list[str]:
    """The command line that trains this run.

    Args:
      train_command: the program and leading arguments, e.g.
        ``"python -m experiments.train"``.
      data_dir: passed on as ``--data_dir`` unless ``None``.
      num_workers: passed on as ``--num_workers`` unless ``None``; like
        ``data_dir`` it is not part of the run's identity.

    Returns:
      The command as an argument list.
    """
    flags = {**self.args, "output_dir": str(self.output_dir)}
    if data_dir is not None:
      flags["data_dir"] = data_dir
    if num_workers is not None:
      flags["num_workers"] = num_workers
    command = shlex.split(train_command)
    for name, value in sorted(flags.items()):
      values = value if isinstance(value, list) else [value]
      command += [f"--{name}", *map(str, values)]
    return command

  @property
  def log_file(self) -> Path:
    """Where training writes the run's stdout and stderr."""
    return self.output_dir / LOG_FILE

  def start(
      self, train_command: str = DEFAULT_TRAIN_COMMAND,
      data_dir: str | None = None, num_workers: int | None = None, *,
      environment: Mapping[str, str] | None = None,
      ignored_signal: signal.Signals | None = None,
  ) -> subprocess.Popen:
    """Starts training the run in a subprocess, logging to its directory.

    Args:
      train_command: the training program (`command`).
      data_dir: passed on as ``--data_dir`` unless ``None``.
      num_workers: passed on as ``--num_workers`` unless ``None``.
      environment: variables set for the training process, over this
        process's.
      ignored_signal: a signal the training process ignores (an ignored
        signal stays ignored across ``exec``), so that a signal meant for
        the launcher does not kill it.

    Returns:
      The training process.
    """
    self.output_dir.mkdir(parents=True, exist_ok=True)
    # Runs that differ only in seeds or held-out domain compile the same
    # programs: a persistent compilation cache shared by the sweep compiles
    # each once.
    env = {"JAX_COMPILATION_CACHE_DIR":
               str(self.output_dir.parent / ".jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           **os.environ, **(environment or {})}
    ignore = None if ignored_signal is None else (
        lambda: signal.signal(ignored_signal, signal.SIG_IGN))
    # Appends, so the logs of a resumed run follow those of its earlier tries.
    with open(self.log_file, "a") as log:
      return subprocess.Popen(
          self.command(train_command, data_dir, num_workers), stdout=log,
          stderr=subprocess.STDOUT, env=env, preexec_fn=ignore)

  def train(self, train_command: str = DEFAULT_TRAIN_COMMAND,
            data_dir: str | None = None, num_workers: int | None = None
            ) -> int:
    """Trains the run in a subprocess (`start`) and waits for it.

    Returns:
      The training command's exit status.
    """
    return self.start(train_command, data_dir, num_workers).wait()

  @property
  def launch_file(self) -> Path:
    """Where the run's launcher says where it trains (`record_launch`)."""
    return self.output_dir / LAUNCH_FILE

  def record_launch(self, **where: Any) -> None:
    """Writes where the run trains to its `launch_file`, replacing what an
    earlier launch wrote there.

    Args:
      **where: ``launcher`` and what it knows: ``host``, ``pid`` (of the
        training process), ``gpu``, ``job_id``, ``stdout``, ``stderr``.
    """
    self.output_dir.mkdir(parents=True, exist_ok=True)
    temporary = self.launch_file.with_suffix(".tmp")
    temporary.write_text(json.dumps(where, sort_keys=True) + "\n")
    temporary.replace(self.launch_file)  # Whole or not at all.

  @property
  def launch_record(self) -> dict[str, Any]:
    """What the run's last launch recorded (`record_launch`); empty if
    none."""
    try:
      return json.loads(self.launch_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
      return {}

  def training_here(self) -> bool:
    """Whether the run's recorded training process runs on this host now.

    It is taken to, where ``/proc`` can tell, only if a process of the
    recorded id has the run's directory name, its hash, in its command line
    (process ids are reused).
    """
    launch = self.launch_record
    if launch.get("host") != socket.gethostname() or "pid" not in launch:
      return False
    try:
      cmdline = Path(f"/proc/{launch['pid']}/cmdline").read_bytes()
    except OSError:
      return False
    return self.output_dir.name.encode() in cmdline

  def where(self) -> str:
    """Where the run trains or last trained, in words; empty if unknown."""
    launch = self.launch_record
    if not launch:
      return ""
    parts = [launch["launcher"]]
    if "job_id" in launch:
      parts.append(f"job {launch['job_id']}")
    if "host" in launch:
      parts.append(f"on {launch['host']}")
    if launch.get("gpu"):  # The local executor gives none as "".
      parts.append(f"GPU {launch['gpu']}")
    if "pid" in launch:
      parts.append(f"pid {launch['pid']}")
    if self.training_here():
      parts.append("(training now)")
    if "stdout" in launch:
      parts.append(f"log {launch['stdout']} {launch['stderr']}")
    return " ".join(parts)

  @property
  def label(self) -> str:
    """What the run trains, in words: dataset, method (its algorithm, and
    its weight averaging where it has one: `averaging_flags.method`) and
    seeds."""
    a = self.args
    return (f"{a['dataset']} {averaging_flags.method(a)} "
            f"test_envs={a['test_envs']}"
            f" hparams_seed={a['hparams_seed']} trial_seed={a['trial_seed']}")

  def __str__(self) -> str:
    where = self.where()
    return (f"{self.status.value:<12} {self.output_dir}  {self.label}"
            + (f"  [{where}]" if where else ""))


def report_damaged(runs: Sequence[Run]) -> list[Run]:
  """Says on stderr which runs have damaged records, and why; returns them.

  A launch skips them; ``delete_incomplete``
  (`experiments.runs.sweep.delete_incomplete`) deletes them.
  """
  damaged = []
  for run in runs:
    if run.output_dir.exists() and (why := run.damage) is not None:
      print(f"Skipped {run.output_dir}, its records damaged: {why}. "
            "delete_incomplete deletes it, to train it again.",
            file=sys.stderr)
      damaged.append(run)
  return damaged


def summary(runs: Sequence[Run]) -> str:
  """How many runs are in each status."""
  counts = {status: 0 for status in Status}
  for run in runs:
    counts[run.status] += 1
  return f"{len(runs)} runs: " + ", ".join(
      f"{n} {status.value}" for status, n in counts.items())
