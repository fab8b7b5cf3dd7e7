"""DomainBed sweeps: datasets x algorithms x held-out domains x hparams x seeds.

Each run trains one ``(dataset, algorithm, test env, hparams_seed,
trial_seed)`` with ``python -m experiments.train`` in a subprocess, writing to
``<output_dir>/<md5 of its arguments>``. ``hparams_seed`` 0 is the default
hparams, the others random draws; the training seed is derived from a hash of
the run's identity, as in DomainBed.

``launch`` writes the sweep's grid (datasets, algorithms, hparam draws, trials,
steps and the other flags that name runs) to ``<output_dir>/sweep.json``
(`GRID_FILE`), and every later command given that ``--output_dir`` alone
takes its grid from there. A grid flag that contradicts the saved grid is a
usage error (exit 2) naming the difference; ``--extend_grid`` adds runs to
the grid (more draws, trials, datasets, algorithms or held-out domains)
and saves the larger grid. On a terminal, ``launch`` says how many runs it
will train and asks first, as DomainBed's ``sweep.py`` does;
``--skip_confirmation`` does not ask, nor does a launch whose input is not a
terminal (a script, a batch job), which goes ahead.

The sweep is resumable: a run directory holding a ``done`` file is skipped, and
one without is launched again (training resumes from its last checkpoint), so
a killed sweep is restarted with the same command. A run packed in the output
directory's ``runs.jsonl.gz`` (`experiments.rundir.pack.pack_runs`, how a study is
committed) is done too. A run whose records fail
`experiments.rundir.records.read_run` (damage that no run leaves, even killed) is
neither skipped as done nor launched: it is listed as damaged with the
reason, and ``delete_incomplete`` deletes it with the incomplete runs.

Three launchers train the runs, in the spirit of DomainBed's
``command_launchers.py``:

* ``local``: ``--jobs`` runs at a time on this host.
* ``multi_gpu``: one run per GPU at a time, each seeing only its own through
  ``CUDA_VISIBLE_DEVICES``; the next run starts as soon as a GPU frees. The
  GPUs are ``--gpus``, else those ``CUDA_VISIBLE_DEVICES`` lists, else those
  ``nvidia-smi -L`` lists. Only NVIDIA GPUs are pinned this way.
* ``slurm``: an array job through submitit, a job per run, with its
  resources from the ``--slurm_*`` flags. A job that SLURM preempts or that
  reaches its time limit stops its training (SIGTERM), is requeued, and
  resumes from the run's last checkpoint. ``--slurm_cluster local`` runs the
  jobs on this host through submitit's local executor instead.

On one host, runs that train at once share its cores: ``--num_workers`` of
each run defaults to the cores over the runs at once. Every launcher writes
where a run trains (host, GPU, process, SLURM job and its logs) to the run's
``launch.json``, and ``list`` shows it; a run whose training process still
runs on this host, or whose SLURM job is still queued or running, is not
launched again.

Usage::

    python -m experiments.runs.sweep launch --datasets RotatedDigits \\
        --algorithms ERM PGrad --n_hparams 20 --n_trials 3 \\
        --output_dir sweeps/digits --jobs 2
    python -m experiments.runs.sweep launch --launcher multi_gpu ...
    python -m experiments.runs.sweep launch --launcher slurm \\
        --slurm_partition gpu --slurm_time 240 ...
    python -m experiments.runs.sweep list --output_dir sweeps/digits
    python -m experiments.runs.sweep delete_incomplete \\
        --output_dir sweeps/digits
    python -m experiments.runs.sweep reproduce --output_dir sweeps/digits
    python -m experiments.runs.sweep cost --step_ms 119 --steps 5000 ...

``reproduce`` and ``longer`` retrain finished runs (`experiments.runs.rerun`);
``cost`` estimates the GPU-hours of a sweep's training steps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import hashlib
import json
import math
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import submitit
import tqdm

from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments import hparams_registry
from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import rerun

# The datasets that ship with the code, so a default sweep needs no downloads.
DEFAULT_DATASETS = ("RotatedDigits", "ColoredDigits")
DEFAULT_TRAIN_COMMAND = f"{shlex.quote(sys.executable)} -m experiments.train"
# Where a run's stdout and stderr go, inside its directory.
LOG_FILE = "train.log"
# Where a run trains or trained (`Run.record_launch`), inside its directory.
LAUNCH_FILE = "launch.json"
LAUNCHERS = ("local", "multi_gpu", "slurm")
# The sweep's grid, `make_runs`'s arguments, in its directory (`save_grid`).
GRID_FILE = "sweep.json"
# The flags that make a sweep's grid, `make_runs`'s parameters but its
# directory, with their defaults.
GRID_DEFAULTS = {
    "datasets": list(DEFAULT_DATASETS), "algorithms": list(catalog.ALGORITHMS),
    "test_envs": None, "n_hparams": 20, "n_trials": 3, "steps": None,
    "checkpoint_freq": None, "plateau_check_freq": None, "hparams": None,
    "trajectory_freq": None, "model": None}
# Grid flags whose order does not matter.
_UNORDERED_GRID_FLAGS = ("datasets", "algorithms", "test_envs")
# submitit's folder for its pickles and job logs, inside the sweep's
# directory; submitit puts each job's files in a folder named by its id.
SUBMITIT_DIR = "submitit"
# How long a training process stopped by SIGTERM has to write its checkpoint
# before it is killed; SLURM signals a job 90 s before its time limit
# (submitit's default signal_delay_s).
STOP_GRACE_S = 60
# SLURM job states in which a job will still train (squeue's, as sacct
# reports them): a run in one of them is not submitted again.
SLURM_ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED",
    "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"})


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
    """What the run trains, in words: dataset, algorithm and seeds."""
    a = self.args
    return (f"{a['dataset']} {a['algorithm']} test_envs={a['test_envs']}"
            f" hparams_seed={a['hparams_seed']} trial_seed={a['trial_seed']}")

  def __str__(self) -> str:
    where = self.where()
    return (f"{self.status.value:<12} {self.output_dir}  {self.label}"
            + (f"  [{where}]" if where else ""))


def report_damaged(runs: Sequence[Run]) -> list[Run]:
  """Says on stderr which runs have damaged records, and why; returns them.

  `launch` skips them; `delete_incomplete` deletes them.
  """
  damaged = []
  for run in runs:
    if run.output_dir.exists() and (why := run.damage) is not None:
      print(f"Skipped {run.output_dir}, its records damaged: {why}. "
            "delete_incomplete deletes it, to train it again.",
            file=sys.stderr)
      damaged.append(run)
  return damaged


def _held_out_envs(
    dataset: str, test_envs: Sequence[int] | None
) -> list[int]:
  """The given test envs, or else every domain of the dataset, counted in
  the catalog (as DomainBed counts its ``ENVIRONMENTS``) without its data."""
  if test_envs is not None:
    return list(test_envs)
  return list(range(len(catalog.DATASETS[dataset].domains)))


def make_runs(
    *,
    output_dir: str | Path,
    datasets: Sequence[str],
    algorithms: Sequence[str],
    n_hparams: int,
    n_trials: int,
    test_envs: Sequence[int] | None = None,
    steps: int | None = None,
    checkpoint_freq: int | None = None,
    plateau_check_freq: int | None = None,
    hparams: str | None = None,
    trajectory_freq: int | None = None,
    model: str | None = None,
) -> list[Run]:
  """Lists the runs of a sweep, trial by trial.

  Args:
    output_dir: the sweep's directory.
    datasets: dataset names.
    algorithms: algorithm names.
    n_hparams: hparams seeds ``0 .. n_hparams - 1`` are run (0: defaults).
    n_trials: trial seeds ``0 .. n_trials - 1`` are run.
    test_envs: the domains to hold out, one per run; ``None`` holds out every
      domain of each dataset in turn.
    steps: passed on to training unless ``None``.
    checkpoint_freq: passed on to training unless ``None``.
    plateau_check_freq: passed on to training unless ``None``: every run
      stops at the first of these checks at which it has plateaued, and
      ``steps`` is the most it trains.
    hparams: a JSON object of fixed hparams. Each run gets the ones its
      algorithm has (so ``penalty_anneal_iters`` reaches only Fishr's runs);
      a name that no swept algorithm has is an error.
    trajectory_freq: passed on to the default-hparams runs (hparams_seed 0)
      of the algorithms whose paths the claims compare
      (`catalog.TRAJECTORY_ALGORITHMS`), unless ``None``.
    model: passed on to training unless ``None`` (then each dataset's
      default model).

  Returns:
    The runs.
  """
  optional = {"steps": steps, "checkpoint_freq": checkpoint_freq,
              "plateau_check_freq": plateau_check_freq, "model": model}
  optional = {k: v for k, v in optional.items() if v is not None}
  try:
    fixed = json.loads(hparams) if hparams else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"--hparams is not valid JSON ({e}): {hparams}") from None
  if not isinstance(fixed, dict):
    raise ValueError(f"--hparams must be a JSON object, got {hparams}.")
  known = {(d, a): hparams_registry.default_hparams(a, d).keys()
           for d in datasets for a in algorithms}
  unknown = sorted(set(fixed).difference(*known.values()))
  if unknown:
    raise ValueError(f"No swept algorithm has the hparams {unknown}.")
  envs = {d: _held_out_envs(d, test_envs) for d in datasets}
  runs = []
  for trial_seed in range(n_trials):
    for dataset in datasets:
      for algorithm in algorithms:
        for env in envs[dataset]:
          for hparams_seed in range(n_hparams):
            args = {
                "dataset": dataset,
                "algorithm": algorithm,
                "test_envs": [env],
                "hparams_seed": hparams_seed,
                "trial_seed": trial_seed,
                "seed": seed_hash(
                    dataset, algorithm, [env], hparams_seed, trial_seed),
                **optional,
            }
            if (trajectory_freq is not None and hparams_seed == 0
                and algorithm in catalog.TRAJECTORY_ALGORITHMS):
              args["trajectory_freq"] = trajectory_freq
            own = {k: v for k, v in fixed.items()
                   if k in known[dataset, algorithm]}
            if own:
              args["hparams"] = json.dumps(own, sort_keys=True)
            runs.append(Run.create(args, output_dir))
  return runs


def read_grid(output_dir: str | Path) -> dict[str, Any] | None:
  """The grid that `save_grid` saved in a sweep's directory, or ``None``.

  Raises:
    UsageError: the grid file is not a JSON object of grid flags.
  """
  path = Path(output_dir) / GRID_FILE
  try:
    grid = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, json.JSONDecodeError) as e:
    raise errors.UsageError(
        f"{path} cannot be read as the sweep's grid ({e}); restore it, or "
        "delete it and give the sweep's flags again.") from None
  if not isinstance(grid, dict) or set(grid) != set(GRID_DEFAULTS):
    raise errors.UsageError(
        f"{path} is not a sweep's grid: it must hold exactly the keys "
        f"{sorted(GRID_DEFAULTS)}; restore it, or delete it and give the "
        "sweep's flags again.")
  return grid


def save_grid(output_dir: str | Path, grid: Mapping[str, Any]) -> None:
  """Writes a sweep's grid (`GRID_DEFAULTS`'s keys) to its directory's
  `GRID_FILE`, whole or not at all."""
  path = Path(output_dir) / GRID_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.with_suffix(".tmp")
  temporary.write_text(json.dumps(dict(grid), indent=1, sort_keys=True)
                       + "\n")
  temporary.replace(path)


def _same_grid_value(name: str, given: Any, saved: Any) -> bool:
  """Whether a grid flag's value names the runs its saved value names: the
  order of datasets, algorithms and domains, and the spelling of the
  ``--hparams`` JSON, do not matter."""
  if name in _UNORDERED_GRID_FLAGS and given is not None and saved is not None:
    return sorted(given) == sorted(saved)
  if name == "hparams" and given is not None and saved is not None:
    try:
      return json.loads(given) == json.loads(saved)
    except json.JSONDecodeError:
      return False
  return given == saved


def _flag_text(name: str, value: Any) -> str:
  """A grid flag as it is written on the command line."""
  if value is None:
    return f"no --{name}"
  if isinstance(value, list):
    return f"--{name} {' '.join(map(str, value))}"
  return f"--{name} {shlex.quote(str(value))}"


def resolve_grid(output_dir: str | Path, given: Mapping[str, Any],
                 saved: Mapping[str, Any] | None, *, extend: bool = False,
                 defaults: bool = True) -> dict[str, Any]:
  """A sweep's grid: the saved one, with the grid flags given checked
  against it.

  Args:
    output_dir: the sweep's directory.
    given: the grid flags given on the command line, by name.
    saved: the grid saved in the directory (`read_grid`), if any.
    extend: ``given`` may add runs to the saved grid (``--extend_grid``);
      it must keep every run the saved grid has.
    defaults: without a saved grid, the flags not given take their
      defaults (`GRID_DEFAULTS`); else the flags must be given.

  Returns:
    The grid, `make_runs`'s arguments but ``output_dir``.

  Raises:
    UsageError: a given flag contradicts the saved grid and ``extend`` is
      off, or ``extend`` drops runs of the saved grid, or there is neither
      a saved grid nor ``defaults`` nor any flag given.
  """
  grid_file = Path(output_dir) / GRID_FILE
  if saved is None:
    if not defaults and not given:
      raise errors.UsageError(
          f"{output_dir} holds no sweep grid ({GRID_FILE}, which launch "
          "writes): no sweep was launched there, or one before sweeps saved "
          "their grids. Check --output_dir, or give the flags the sweep was "
          "launched with (--datasets, --algorithms, --n_hparams, ...).")
    if extend:
      raise errors.UsageError(
          f"--extend_grid: {output_dir} holds no grid ({GRID_FILE}) to "
          "extend.")
    return {**GRID_DEFAULTS, **given}
  differences = [
      f"{_flag_text(name, value)} (the grid has "
      f"{_flag_text(name, saved[name])})"
      for name, value in given.items()
      if not _same_grid_value(name, value, saved[name])]
  grid = {**saved, **given}
  if differences and not extend:
    raise errors.UsageError(
        f"{output_dir} is a sweep of another grid ({grid_file}): "
        + "; ".join(differences) + ". Leave these flags out to use the "
        "saved grid, pass --extend_grid to add runs to it, or give another "
        "--output_dir for another sweep.")
  if differences:
    kept = {run.output_dir for run in make_runs(output_dir=output_dir, **grid)}
    dropped = [run for run in make_runs(output_dir=output_dir, **saved)
               if run.output_dir not in kept]
    if dropped:
      raise errors.UsageError(
          f"--extend_grid adds runs to a grid, but "
          + "; ".join(differences) + f" would leave out {len(dropped)} of "
          f"the {grid_file} grid's runs (e.g. {dropped[0].label}). Keep "
          "every dataset, algorithm and held-out domain, at least as many "
          "draws and trials, and the same other flags.")
  return grid


def visible_gpus(gpus: str | None = None) -> list[str]:
  """The GPUs a ``multi_gpu`` sweep trains on, one run on each at a time.

  Found without importing JAX (which would take a GPU in this process), as
  DomainBed's multi_gpu launcher finds them but for its ``torch`` fallback.

  Args:
    gpus: comma-separated GPU ids or UUIDs (``--gpus``); ``None``: those
      ``CUDA_VISIBLE_DEVICES`` lists if it is set, else those ``nvidia-smi
      -L`` lists.

  Returns:
    The ids, each to be a run's ``CUDA_VISIBLE_DEVICES``.

  Raises:
    UsageError: no GPU is named or found.
  """
  # Empty entries are dropped, as DomainBed does for a trailing comma.
  if gpus is not None:
    found = [g.strip() for g in gpus.split(",") if g.strip()]
    if not found:
      raise errors.UsageError(
          f"--gpus {gpus!r} names no GPU; give ids such as --gpus 0,1.")
    return found
  if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
    found = [g.strip() for g in listed.split(",") if g.strip()]
    if not found:
      raise errors.UsageError(
          "CUDA_VISIBLE_DEVICES is empty, so no GPU is visible; unset it or "
          "name the GPUs with --gpus 0,1,...")
    return found
  count = nvidia_gpu_count()
  if not count:
    raise errors.UsageError(
        "--launcher multi_gpu found no GPU: CUDA_VISIBLE_DEVICES is unset "
        "and nvidia-smi -L lists none. Name them with --gpus 0,1,... or use "
        "--launcher local.")
  return [str(i) for i in range(count)]


def nvidia_gpu_count() -> int:
  """How many NVIDIA GPUs ``nvidia-smi -L`` lists on this host; 0 without
  ``nvidia-smi``."""
  try:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                             text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return 0
  # Its GPU lines ("GPU 0: NVIDIA H100 ... (UUID: ...)"); MIG lines, indented
  # under them, are not counted.
  return sum(line.startswith("GPU ") for line in listing.splitlines())


def default_num_workers(concurrent: int) -> int:
  """``--num_workers`` for each of ``concurrent`` runs training at once on
  this host: its cores split between them, so that their input workers do
  not oversubscribe it (0: each run builds its batches itself)."""
  return config_lib.default_num_workers() // concurrent


def slurm_states(runs: Sequence[Run]) -> dict[str, str]:
  """The states of the SLURM jobs that ``runs`` recorded, by job id.

  One ``sacct`` call asks for all of them: submitit's watcher asks for every
  job created before its first look.
  """
  jobs = [submitit.SlurmJob(Path(launch["folder"]), launch["job_id"])
          for launch in (run.launch_record for run in runs)
          if launch.get("cluster") == "slurm"]
  # sacct writes e.g. "CANCELLED by 123"; submitit "UNKNOWN" without it.
  return {job.job_id: job.state.split(" ")[0] for job in jobs}


def still_training(run: Run, states: Mapping[str, str]) -> str | None:
  """Why ``run`` is training already and must not be launched again, or
  ``None``: its recorded process runs on this host, or its SLURM job is
  queued or running.

  Args:
    run: a run not done.
    states: `slurm_states`.
  """
  launch = run.launch_record
  if run.training_here():
    return f"its training process {launch['pid']} runs on this host"
  state = states.get(launch.get("job_id"))
  if launch.get("cluster") == "slurm" and state in SLURM_ACTIVE_STATES:
    return f"its SLURM job {launch['job_id']} is {state}"
  return None


def _to_launch(runs: Sequence[Run]) -> list[Run]:
  """The runs neither done nor damaged nor training already, saying on
  stderr which are training already and where."""
  pending = [run for run in runs
             if run.status not in (Status.DONE, Status.DAMAGED)]
  states = slurm_states(pending)
  todo = []
  for run in pending:
    if (why := still_training(run, states)) is not None:
      print(f"Skipped {run.output_dir}: {why}.", file=sys.stderr)
      continue
    todo.append(run)
  return todo


def _wait_for(jobs: Sequence[Any], runs: Sequence[Run],
              outcome: Callable[[Any], bool],
              completed: Callable[[Sequence[Any]], Any]) -> list[Any]:
  """Waits for the ``jobs`` training some of ``runs``, with a progress bar
  over those and the runs done before.

  Args:
    jobs: what is waited for, a job per run.
    runs: the sweep's runs.
    outcome: whether a completed job succeeded.
    completed: yields the jobs as they complete.

  Returns:
    The failed jobs.
  """
  failed = []
  done = sum(run.status is Status.DONE for run in runs)
  with tqdm.tqdm(total=done + len(jobs), initial=done,
                 unit="run") as progress:
    for job in completed(jobs):
      if not outcome(job):
        failed.append(job)
      progress.update()
  return failed


def launch(
    runs: Sequence[Run],
    *,
    train_command: str = DEFAULT_TRAIN_COMMAND,
    data_dir: str | None = None,
    jobs: int = 1,
    gpus: Sequence[str] | None = None,
    num_workers: int | None = None,
) -> list[Run]:
  """Trains on this host every run neither done, damaged nor training
  already: ``jobs`` at a time (the ``local`` launcher), or one per GPU at a
  time (``multi_gpu``).

  Args:
    runs: the sweep's runs.
    train_command: the training program, given each run's flags.
    data_dir: passed on as ``--data_dir`` unless ``None``.
    jobs: how many runs train at once, when ``gpus`` is ``None``.
    gpus: the GPUs (`visible_gpus`): each run sees one of them alone as its
      ``CUDA_VISIBLE_DEVICES``, and the next run starts on a GPU as soon as
      the run on it ends.
    num_workers: every run's ``--num_workers``; ``None``: this host's cores
      split between the runs at once (`default_num_workers`).

  Returns:
    The runs whose training exited with an error.
  """
  slots = list(gpus) if gpus is not None else [None] * jobs
  if num_workers is None:
    num_workers = default_num_workers(len(slots))
  # A GPU is taken off this queue for a run and put back when it ends; a
  # worker thread per slot means one is always free for the thread taking
  # it.
  free = queue.SimpleQueue()
  for slot in slots:
    free.put(slot)

  def train(run: Run) -> int:
    gpu = free.get()
    try:
      process = run.start(
          train_command, data_dir, num_workers,
          environment={} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})
      run.record_launch(
          launcher="local" if gpu is None else "multi_gpu",
          host=socket.gethostname(), pid=process.pid, gpu=gpu)
      return process.wait()
    finally:
      free.put(gpu)

  todo = _to_launch(runs)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(slots))
  try:
    futures = {pool.submit(train, run): run for run in todo}
    failed = _wait_for(list(futures), runs,
                       lambda future: future.result() == 0,
                       concurrent.futures.as_completed)
  finally:
    # On Ctrl-C the running children get the signal too; start no others.
    pool.shutdown(cancel_futures=True)
  return [futures[future] for future in failed]


@dataclasses.dataclass(frozen=True)
class SlurmResources:
  """What each SLURM job of a sweep asks for (the ``--slurm_*`` flags).

  Attributes:
    cluster: ``"slurm"``, or ``"local"`` for submitit's local executor,
      which runs every job at once on this host (to try a sweep out, and for
      tests).
    partition: the partition; ``None``: the cluster's default.
    gpus_per_job: GPUs per job; the local executor gives a job no more
      than this host has.
    cpus_per_job: CPU cores per job, which its run's input workers use;
      ``None``: the cluster's default.
    time_min: each job's time limit, in minutes; a run that needs longer
      is requeued and goes on from its checkpoint.
    mem_gb: memory per job; ``None``: the cluster's default.
    array_parallelism: how many jobs of the array run at once.
  """

  cluster: str = "slurm"
  partition: str | None = None
  gpus_per_job: int = 1
  cpus_per_job: int | None = None
  time_min: int = 240
  mem_gb: float | None = None
  array_parallelism: int = 256

  def executor(self, folder: Path) -> submitit.AutoExecutor:
    """A submitit executor asking for these resources for each job."""
    executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster)
    gpus = self.gpus_per_job
    if self.cluster == "local":
      # The local executor gives each job CUDA_VISIBLE_DEVICES 0 to
      # gpus - 1 whether this host has those GPUs or not.
      gpus = min(gpus, nvidia_gpu_count())
    executor.update_parameters(
        name="pgrad_sweep", timeout_min=self.time_min,
        gpus_per_node=gpus, cpus_per_task=self.cpus_per_job,
        mem_gb=self.mem_gb, slurm_partition=self.partition,
        slurm_array_parallelism=self.array_parallelism)
    return executor


class TrainingJob:
  """A SLURM job's work: training one run, and stopping it to be requeued.

  submitit calls `checkpoint` when SLURM signals the job (preemption, or
  its time limit near); its requeued job calls a new `TrainingJob` of the
  same run, which resumes from the run's checkpoint.
  """

  def __init__(self, run: Run, train_command: str, data_dir: str | None,
               num_workers: int | None) -> None:
    self.run = run
    self.train_command = train_command
    self.data_dir = data_dir
    self.num_workers = num_workers
    self._process: subprocess.Popen | None = None

  def __call__(self) -> str:
    """Trains the run; returns its directory.

    Raises:
      RuntimeError: training exited with an error.
    """
    environment = submitit.JobEnvironment()
    # submitit handles this signal in this process, to checkpoint; the
    # training process must not die of it.
    preemption = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
    self._process = self.run.start(
        self.train_command, self.data_dir, self.num_workers,
        ignored_signal=preemption)
    # All of it, as the sweep may not have recorded its submission yet.
    self.run.record_launch(
        launcher="slurm", cluster=environment.cluster,
        folder=os.environ["SUBMITIT_FOLDER"], job_id=environment.job_id,
        stdout=str(environment.paths.stdout),
        stderr=str(environment.paths.stderr), host=environment.hostname,
        pid=self._process.pid, gpu=os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
      # Waits in short polls: submitit's signal handler, run between them
      # in this thread, then waits for the process itself (`_stop`), which
      # a wait holding Popen's lock here would block.
      while True:
        try:
          returncode = self._process.wait(timeout=1)
          break
        except subprocess.TimeoutExpired:
          continue
    finally:
      self._stop()
    if returncode:
      raise RuntimeError(f"Training exited with status {returncode}; see "
                         f"{self.run.log_file}.")
    return str(self.run.output_dir)

  def _stop(self) -> None:
    """Stops the training process, if it still runs: SIGTERM, then SIGKILL
    after `STOP_GRACE_S`."""
    if self._process is None or self._process.poll() is not None:
      return
    self._process.terminate()
    try:
      self._process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
      self._process.kill()

  def checkpoint(self) -> submitit.helpers.DelayedSubmission:
    """Stops training (its run resumes from its last checkpoint) and returns
    the job to requeue: training the same run."""
    self._stop()
    return submitit.helpers.DelayedSubmission(TrainingJob(
        self.run, self.train_command, self.data_dir, self.num_workers))


def launch_slurm(
    runs: Sequence[Run],
    *,
    sweep_dir: str | Path,
    resources: SlurmResources,
    train_command: str = DEFAULT_TRAIN_COMMAND,
    data_dir: str | None = None,
    num_workers: int | None = None,
) -> list[tuple[Run, submitit.Job]]:
  """Submits an array job of a job per run neither done, damaged nor
  training already (the ``slurm`` launcher); records each job's id and logs
  in its run's `Run.launch_file`.

  Args:
    runs: the sweep's runs.
    sweep_dir: the sweep's directory; submitit's files go in its
      `SUBMITIT_DIR`.
    resources: what each job asks for.
    train_command: the training program, given each run's flags.
    data_dir: passed on as ``--data_dir`` unless ``None``.
    num_workers: every run's ``--num_workers``; ``None``: training's
      default, the cores SLURM gives its job.

  Returns:
    Each submitted run with its job.

  Raises:
    UsageError: the cluster is SLURM's and this host has no ``sbatch``.
  """
  if resources.cluster == "slurm" and shutil.which("sbatch") is None:
    raise errors.UsageError(
        "--launcher slurm submits with sbatch, which this host lacks: run "
        "the sweep on a SLURM login node, or try it here with "
        "--slurm_cluster local.")
  todo = _to_launch(runs)
  if not todo:
    return []
  folder = Path(sweep_dir).absolute() / SUBMITIT_DIR / "%j"
  executor = resources.executor(folder)
  with executor.batch():
    jobs = [executor.submit(TrainingJob(run, train_command, data_dir,
                                        num_workers)) for run in todo]
  for run, job in zip(todo, jobs):
    if run.launch_record.get("job_id") == job.job_id:
      continue  # The job has started, and recorded more.
    run.record_launch(
        launcher="slurm", cluster=resources.cluster, folder=str(folder),
        job_id=job.job_id, stdout=str(job.paths.stdout),
        stderr=str(job.paths.stderr))
  return list(zip(todo, jobs))


def wait_for_slurm(jobs: Sequence[submitit.Job], runs: Sequence[Run],
                   poll_s: float) -> list[submitit.Job]:
  """Waits for ``jobs`` of the sweep of ``runs``, with a progress bar;
  returns those that failed."""
  return _wait_for(
      jobs, runs, lambda job: job.exception() is None,
      lambda jobs: submitit.helpers.as_completed(jobs, poll_frequency=poll_s))


def summary(runs: Sequence[Run]) -> str:
  """How many runs are in each status."""
  counts = {status: 0 for status in Status}
  for run in runs:
    counts[run.status] += 1
  return f"{len(runs)} runs: " + ", ".join(
      f"{n} {status.value}" for status, n in counts.items())


def cost(runs: Sequence[Run], step_ms: float,
         gpu_counts: Sequence[int]) -> str:
  """What the training steps of ``runs`` cost, at ``step_ms`` a step.

  Evaluation, start-up and compilation are not counted. Each run trains
  its ``steps`` (else its dataset's default) on one GPU, and the runs are
  independent: on several GPUs they are placed longest first on the GPU
  that frees first, as `launch` and a SLURM array place them.

  Args:
    runs: the sweep's runs.
    step_ms: milliseconds a training step.
    gpu_counts: the numbers of GPUs to give the time on.

  Returns:
    The GPU-hours, and the hours on each number of GPUs, in words.

  Raises:
    UsageError: a run's dataset trains for epochs, not a set number of
      steps, and ``--steps`` is not given.
  """
  hours = []
  for run in runs:
    steps = run.args.get("steps", catalog.DATASETS[run.args["dataset"]].steps)
    if steps is None:
      raise errors.UsageError(
          f"{run.args['dataset']} trains for epochs, not a set number of "
          "steps; give --steps to cost it.")
    hours.append(steps * step_ms / 1000 / 3600)
  total_steps = round(sum(hours) * 3600 * 1000 / step_ms)
  lines = [f"{len(runs)} runs, {total_steps:,} training steps at {step_ms:g} "
           f"ms a step: {sum(hours):.1f} GPU-hours (training steps only)."]
  for gpus in gpu_counts:
    busy = [0.0] * gpus
    for run_hours in sorted(hours, reverse=True):
      busy[busy.index(min(busy))] += run_hours
    lines.append(f"  on {gpus} GPU{'s' if gpus > 1 else ''}: "
                 f"{max(busy):.1f} h")
  return "\n".join(lines)


def delete_incomplete(runs: Sequence[Run]) -> list[Run]:
  """Deletes the directories of incomplete and damaged runs; returns those
  runs."""
  incomplete = [run for run in runs
                if run.status in (Status.INCOMPLETE, Status.DAMAGED)]
  for run in incomplete:
    shutil.rmtree(run.output_dir)
  return incomplete


def make_parser() -> argparse.ArgumentParser:
  """The sweep's command line."""
  parser = argparse.ArgumentParser(prog="python -m experiments.runs.sweep",
                                   description=__doc__.splitlines()[0])
  parser.add_argument(
      "command", nargs="?", default="launch",
      choices=["launch", "list", "delete_incomplete", "cost",
               *rerun.COMMANDS],
      help="launch: train every run that is not done; list: the status of "
      "every run, and where it trains; delete_incomplete: delete the "
      "directories of started but unfinished runs, and of runs whose "
      "records are damaged; cost: the GPU-hours of the runs' training "
      "steps at --step_ms; reproduce: retrain a sample of the done runs and "
      "compare their records; longer: train one run for more steps and say "
      "when it plateaus (experiments/runs/rerun.py). Default: launch.")
  grid = parser.add_argument_group(
      "grid", f"The runs of the sweep. launch saves them in --output_dir's "
      f"{GRID_FILE}; later commands take them from there, and a flag that "
      "contradicts them is an error. Without a saved grid, the defaults "
      "below.")
  grid.add_argument(
      "--datasets", nargs="+", default=argparse.SUPPRESS,
      choices=list(catalog.DATASETS), metavar="DATASET",
      help=f"Default: {' '.join(DEFAULT_DATASETS)}.")
  grid.add_argument(
      "--algorithms", nargs="+", default=argparse.SUPPRESS,
      choices=list(catalog.ALGORITHMS), metavar="ALGORITHM",
      help="Default: all of them.")
  grid.add_argument(
      "--test_envs", nargs="+", type=int, default=argparse.SUPPRESS,
      help="Domains to hold out, one per run; default: every domain.")
  grid.add_argument(
      "--n_hparams", type=int, default=argparse.SUPPRESS,
      help="Runs hparams_seed 0 (default hparams) to n_hparams-1; default: 20.")
  grid.add_argument("--n_trials", type=int, default=argparse.SUPPRESS,
                      help="Runs trial_seed 0 to n_trials-1; default: 3.")
  grid.add_argument("--steps", type=int, default=argparse.SUPPRESS,
                      help="Training steps; default: training's default.")
  grid.add_argument(
      "--checkpoint_freq", type=int, default=argparse.SUPPRESS,
      help="Steps between evaluations; default: training's default.")
  grid.add_argument(
      "--plateau_check_freq", type=int, default=argparse.SUPPRESS,
      help="Every run stops at the first multiple of this many steps at "
      "which it has plateaued (--steps is then the most it trains); "
      "default: none.")
  grid.add_argument("--hparams", default=argparse.SUPPRESS,
                      help="JSON object of hparams fixed for every run.")
  grid.add_argument(
      "--model", default=argparse.SUPPRESS, choices=list(catalog.MODELS),
      help="Every run's model; default: each dataset's.")
  grid.add_argument(
      "--trajectory_freq", type=int, default=argparse.SUPPRESS,
      help="Steps between params snapshots of the default-hparams runs of "
      f"{' and '.join(catalog.TRAJECTORY_ALGORITHMS)}; default: none.")
  grid.add_argument(
      "--extend_grid", action="store_true",
      help="Add runs to the saved grid (more datasets, algorithms, held-out "
      "domains, draws or trials); launch saves the larger grid.")
  parser.add_argument("--output_dir", required=True,
                      help="The sweep's directory, holding a folder per run.")
  parser.add_argument("--data_dir", default=None,
                      help="Passed on to training; default: its default.")
  parser.add_argument(
      "--launcher", default="local", choices=LAUNCHERS,
      help="local: --jobs runs at a time on this host; multi_gpu: one run "
      "per GPU at a time, each seeing only its own; slurm: an array job "
      "through submitit, a job per run (the --slurm_* flags). Default: "
      "local.")
  parser.add_argument("--jobs", type=int, default=1,
                      help="How many runs train at once (local launcher); "
                      "default: 1.")
  parser.add_argument(
      "--gpus", default=None,
      help="multi_gpu: the GPUs, comma-separated ids or UUIDs, e.g. 0,1,2,3; "
      "default: those CUDA_VISIBLE_DEVICES lists, else those nvidia-smi -L "
      "lists.")
  parser.add_argument(
      "--num_workers", type=int, default=None,
      help="Every run's input workers (passed on; not part of a run's "
      "identity). Default: local and multi_gpu, this host's cores over the "
      "runs at once; slurm, training's default: the cores of its job.")
  parser.add_argument(
      "--train_command", default=DEFAULT_TRAIN_COMMAND,
      help="The training program; each run's flags are appended to it.")
  slurm = parser.add_argument_group(
      "slurm", "Each job of --launcher slurm (defaults: SlurmResources).")
  slurm.add_argument("--slurm_cluster", choices=["slurm", "local"],
                     help="local: submitit's local executor, every job at "
                     "once on this host; default: slurm.")
  slurm.add_argument("--slurm_partition",
                     help="Default: the cluster's default.")
  slurm.add_argument("--slurm_gpus_per_job", type=int, help="Default: 1.")
  slurm.add_argument("--slurm_cpus_per_job", type=int,
                     help="Default: the cluster's default.")
  slurm.add_argument(
      "--slurm_time", type=int, metavar="MINUTES",
      help="Each job's time limit; a run that needs longer is requeued and "
      "resumes from its checkpoint. Default: 240.")
  slurm.add_argument("--slurm_mem_gb", type=float,
                     help="Default: the cluster's default.")
  slurm.add_argument("--slurm_array_parallelism", type=int,
                     help="Jobs of the array running at once; default: 256.")
  parser.add_argument(
      "--step_ms", type=float, default=None,
      help="cost: milliseconds a training step, e.g. as measured.")
  parser.add_argument(
      "--gpu_counts", type=int, nargs="+", default=[1, 8, 64],
      help="cost: the numbers of GPUs to give the time on; default: 1 8 64.")
  parser.add_argument(
      "--skip_confirmation", "--yes", action="store_true",
      help="launch and delete_incomplete: go ahead without asking. A launch "
      "whose input is not a terminal does not ask either.")
  rerun.add_arguments(parser)
  return parser


# The --slurm_* flags, by their `SlurmResources` field.
_SLURM_FLAGS = {"cluster": "slurm_cluster", "partition": "slurm_partition",
                "gpus_per_job": "slurm_gpus_per_job",
                "cpus_per_job": "slurm_cpus_per_job",
                "time_min": "slurm_time", "mem_gb": "slurm_mem_gb",
                "array_parallelism": "slurm_array_parallelism"}


def slurm_resources(args: argparse.Namespace) -> SlurmResources:
  """The `SlurmResources` of the given ``--slurm_*`` flags."""
  return SlurmResources(**{field: getattr(args, flag)
                           for field, flag in _SLURM_FLAGS.items()
                           if getattr(args, flag) is not None})


def check_launcher_arguments(parser: argparse.ArgumentParser,
                             args: argparse.Namespace) -> None:
  """Refuses flags of another launcher or command, and bad numbers (exit
  2)."""
  slurm = [f"--{flag}" for flag in _SLURM_FLAGS.values()
           if getattr(args, flag) is not None]
  if slurm and args.launcher != "slurm":
    parser.error(f"{' '.join(slurm)}: only with --launcher slurm.")
  if args.gpus is not None and args.launcher != "multi_gpu":
    parser.error("--gpus: only with --launcher multi_gpu.")
  if args.jobs != 1 and args.launcher != "local":
    parser.error(f"--jobs: only with --launcher local; {args.launcher} "
                 "decides how many runs train at once.")
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}.")
  if args.num_workers is not None and args.num_workers < 0:
    parser.error(f"--num_workers must be >= 0, got {args.num_workers}.")
  if (args.step_ms is not None) != (args.command == "cost"):
    parser.error("cost needs --step_ms, and --step_ms is only for cost.")
  if args.command == "cost" and (
      args.step_ms <= 0 or min(args.gpu_counts) < 1):
    parser.error("--step_ms must be positive and --gpu_counts at least 1.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The sweep's flags, as given on the command line."""
  parser = make_parser()
  args = parser.parse_args(argv)
  rerun.check_arguments(parser, args)
  check_launcher_arguments(parser, args)
  return args


def grid_for(args: argparse.Namespace) -> dict[str, Any]:
  """The grid of the sweep in ``--output_dir`` (`resolve_grid`): the saved
  one, checked against the grid flags given, else the flags given over the
  defaults, which only ``launch`` and ``cost`` take (they describe a sweep
  to be; the other commands read one that is).

  Raises:
    UsageError: as `resolve_grid`.
  """
  given = {name: getattr(args, name) for name in GRID_DEFAULTS
           if hasattr(args, name)}
  return resolve_grid(args.output_dir, given, read_grid(args.output_dir),
                      extend=args.extend_grid,
                      defaults=args.command in ("launch", "cost"))


def runs_for(args: argparse.Namespace) -> list[Run]:
  """The runs of the sweep that parsed command-line flags describe
  (`grid_for`)."""
  return make_runs(output_dir=args.output_dir, **grid_for(args))


def confirm_launch(runs: Sequence[Run], skip_confirmation: bool) -> bool:
  """Whether to launch: on a terminal, the answer to "Launch? (y/n)" after
  the count of runs to train, as DomainBed's ``sweep.py`` asks; without a
  terminal (a script, a batch job) or with ``skip_confirmation``, yes."""
  todo = sum(run.status is not Status.DONE for run in runs)
  if skip_confirmation or not todo or not sys.stdin.isatty():
    return True
  answer = input(f"Launch {todo} runs of {len(runs)}? (y/n) ")
  return answer.strip().lower() in ("y", "yes")


# Seconds between looks at the jobs of a sweep: the local executor's are
# processes here, SLURM's are asked of sacct, which a cluster rations.
_POLL_S = {"local": 1.0, "slurm": 30.0}


def fetch_weights(runs: Sequence[Run]) -> list[str]:
  """Downloads, once and before any run starts, the ImageNet weights that
  the runs still to train start from (``--pretrained imagenet``, the photo
  datasets' default, or ``imagenet_augmix``), so that runs starting at once
  do not each download them, and a host without network access fails here
  rather than in every run.

  Returns:
    The models whose weights are cached now (``resnet50``, or
    ``resnet50 (imagenet_augmix)`` for other weights than torchvision's).

  Raises:
    errors.UsageError: the weights are neither cached nor downloadable;
      the message says where to put the file, or to pass
      ``--pretrained none``.
  """
  weights = sorted({
      (config.model, config.pretrained) for config in (
          config_lib.Config(**run.args).resolve() for run in runs
          if run.status is not Status.DONE)
      if config.pretrained in ("imagenet", "imagenet_augmix")})
  if weights:
    # Imported only here: it imports JAX, which a digits sweep never needs.
    # pylint: disable-next=import-outside-toplevel
    from experiments.weights import imagenet
    for model, pretrained in weights:
      try:
        imagenet.fetch_imagenet(model, pretrained)
      except imagenet.WeightsUnavailableError as e:
        raise errors.UsageError(str(e)) from None
  return [model if pretrained == "imagenet" else f"{model} ({pretrained})"
          for model, pretrained in weights]


def _launch(args: argparse.Namespace, grid: Mapping[str, Any],
            runs: Sequence[Run]) -> list[Run]:
  """Trains ``runs``, the sweep of ``grid``, with the launcher the flags
  name, once the ImageNet weights they start from are cached
  (`fetch_weights`) and the grid is saved (`save_grid`); returns the failed
  runs."""
  fetch_weights(runs)
  if read_grid(args.output_dir) != grid:
    save_grid(args.output_dir, grid)
  trainer = dict(train_command=args.train_command, data_dir=args.data_dir,
                 num_workers=args.num_workers)
  if args.launcher == "local":
    return launch(runs, jobs=args.jobs, **trainer)
  if args.launcher == "multi_gpu":
    return launch(runs, gpus=visible_gpus(args.gpus), **trainer)
  resources = slurm_resources(args)
  jobs = launch_slurm(runs, sweep_dir=args.output_dir, resources=resources,
                      **trainer)
  for run, job in jobs:
    print(f"Submitted SLURM job {job.job_id}: {run.output_dir}  {run.label}")
  failed = wait_for_slurm([job for _, job in jobs], runs,
                          _POLL_S[resources.cluster])
  return [run for run, job in jobs if any(job is f for f in failed)]


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    grid = grid_for(args)
    runs = make_runs(output_dir=args.output_dir, **grid)
  except ValueError as e:  # A usage error, as argparse's: status 2.
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.command in rerun.COMMANDS:
    return rerun.main(make_parser(), args, runs, args.output_dir)
  if args.command == "cost":
    try:
      print(cost(runs, args.step_ms, args.gpu_counts))
    except errors.UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  if args.command == "list":
    for run in runs:
      print(run)
  print(summary(runs))

  if args.command == "launch":
    if not confirm_launch(runs, args.skip_confirmation):
      print("Nothing launched.")
      return 1
    damaged = report_damaged(runs)
    try:
      failed = _launch(args, grid, runs)
    except errors.UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except KeyboardInterrupt:
      print("Interrupted; the same command resumes the sweep"
            + (" (submitted SLURM jobs go on: sweep list shows them)."
               if args.launcher == "slurm" else "."), file=sys.stderr)
      return 130
    for run in failed:
      print(f"Failed (see {run.log_file}): {run}")
    print(summary(runs))
    return 1 if failed or damaged else 0

  if args.command == "delete_incomplete":
    n = sum(run.status in (Status.INCOMPLETE, Status.DAMAGED) for run in runs)
    if not args.skip_confirmation and input(
        f"Delete {n} incomplete or damaged runs? [y/N] ") != "y":
      return 1
    print(f"Deleted {len(delete_incomplete(runs))} incomplete or damaged "
          "runs.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
