"""DomainBed sweeps: datasets x algorithms x held-out domains x hparams x seeds.

Each run trains one ``(dataset, algorithm, test env, hparams_seed,
trial_seed)`` with ``python -m experiments.train`` in a subprocess, writing to
``<output_dir>/<md5 of its arguments>``. ``hparams_seed`` 0 is the default
hparams, the others random draws; the training seed is derived from a hash of
the run's identity, as in DomainBed.

The sweep is resumable: a run directory holding a ``done`` file is skipped, and
one without is launched again (training resumes from its last checkpoint), so
a killed sweep is restarted with the same command. A run whose records fail
`experiments.records.read_run` (damage that no run leaves, even killed) is
neither skipped as done nor launched: it is listed as damaged with the
reason, and ``delete_incomplete`` deletes it with the incomplete runs.

Usage::

    python -m experiments.sweep launch --datasets RotatedDigits \\
        --algorithms ERM PGrad --n_hparams 20 --n_trials 3 \\
        --output_dir sweeps/digits --jobs 2
    python -m experiments.sweep list --datasets RotatedDigits ...
    python -m experiments.sweep delete_incomplete --datasets RotatedDigits ...
    python -m experiments.sweep reproduce --datasets RotatedDigits ...

``reproduce`` and ``longer`` retrain finished runs (`experiments.rerun`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import hashlib
import inspect
import json
import shlex
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tqdm

from experiments import catalog
from experiments import config as config_lib
from experiments import hparams_registry
from experiments import records
from experiments import rerun

# The datasets that ship with the code, so a default sweep needs no downloads.
DEFAULT_DATASETS = ("RotatedDigits", "ColoredDigits")
DEFAULT_TRAIN_COMMAND = f"{shlex.quote(sys.executable)} -m experiments.train"
# Where a run's stdout and stderr go, inside its directory.
LOG_FILE = "train.log"


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
    """Read from the directory now, so it follows the run's progress."""
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
      self, train_command: str, data_dir: str | None = None
  ) -> list[str]:
    """The command line that trains this run.

    Args:
      train_command: the program and leading arguments, e.g.
        ``"python -m experiments.train"``.
      data_dir: passed on as ``--data_dir`` unless ``None``.

    Returns:
      The command as an argument list.
    """
    flags = {**self.args, "output_dir": str(self.output_dir)}
    if data_dir is not None:
      flags["data_dir"] = data_dir
    command = shlex.split(train_command)
    for name, value in sorted(flags.items()):
      values = value if isinstance(value, list) else [value]
      command += [f"--{name}", *map(str, values)]
    return command

  @property
  def log_file(self) -> Path:
    """Where training writes the run's stdout and stderr."""
    return self.output_dir / LOG_FILE

  def train(self, train_command: str = DEFAULT_TRAIN_COMMAND,
            data_dir: str | None = None) -> int:
    """Trains the run in a subprocess, logging to its directory.

    Returns:
      The training command's exit status.
    """
    self.output_dir.mkdir(parents=True, exist_ok=True)
    # Runs that differ only in seeds or held-out domain compile the same
    # programs: a persistent compilation cache shared by the sweep compiles
    # each once.
    env = {"JAX_COMPILATION_CACHE_DIR":
               str(self.output_dir.parent / ".jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           **os.environ}
    # Appends, so the logs of a resumed run follow those of its earlier tries.
    with open(self.log_file, "a") as log:
      process = subprocess.run(self.command(train_command, data_dir),
                               stdout=log, stderr=subprocess.STDOUT,
                               check=False, env=env)
    return process.returncode

  def __str__(self) -> str:
    a = self.args
    return (
        f"{self.status.value:<12} {self.output_dir}  {a['dataset']}"
        f" {a['algorithm']} test_envs={a['test_envs']}"
        f" hparams_seed={a['hparams_seed']} trial_seed={a['trial_seed']}"
    )


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

  Returns:
    The runs.
  """
  optional = {"steps": steps, "checkpoint_freq": checkpoint_freq,
              "plateau_check_freq": plateau_check_freq}
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


def launch(
    runs: Sequence[Run],
    *,
    train_command: str = DEFAULT_TRAIN_COMMAND,
    data_dir: str | None = None,
    jobs: int = 1,
) -> list[Run]:
  """Trains every run that is neither done nor damaged, ``jobs`` at a time.

  Args:
    runs: the sweep's runs.
    train_command: the training program, given each run's flags.
    data_dir: passed on as ``--data_dir`` unless ``None``.
    jobs: how many runs train at once.

  Returns:
    The runs whose training exited with an error.
  """
  todo = [run for run in runs
          if run.status not in (Status.DONE, Status.DAMAGED)]
  failed = []
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
  try:
    futures = {
        pool.submit(run.train, train_command, data_dir): run for run in todo
    }
    with tqdm.tqdm(
        total=len(runs), initial=len(runs) - len(todo), unit="run"
    ) as progress:
      for future in concurrent.futures.as_completed(futures):
        if future.result() != 0:
          failed.append(futures[future])
        progress.update()
  finally:
    # On Ctrl-C the running children get the signal too; start no others.
    pool.shutdown(cancel_futures=True)
  return failed


def summary(runs: Sequence[Run]) -> str:
  """How many runs are in each status."""
  counts = {status: 0 for status in Status}
  for run in runs:
    counts[run.status] += 1
  return f"{len(runs)} runs: " + ", ".join(
      f"{n} {status.value}" for status, n in counts.items())


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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "command", nargs="?", default="launch",
      choices=["launch", "list", "delete_incomplete", *rerun.COMMANDS],
      help="launch: train every run that is not done; list: the status of "
      "every run; delete_incomplete: delete the directories of started but "
      "unfinished runs, and of runs whose records are damaged; reproduce: "
      "retrain a sample of the done runs and compare their records; longer: "
      "train one run for more steps and say when it plateaus "
      "(experiments/rerun.py). Default: launch.")
  parser.add_argument(
      "--datasets", nargs="+", default=list(DEFAULT_DATASETS),
      choices=list(catalog.DATASETS), metavar="DATASET",
      help=f"Default: {' '.join(DEFAULT_DATASETS)}.")
  parser.add_argument(
      "--algorithms", nargs="+", default=list(catalog.ALGORITHMS),
      choices=list(catalog.ALGORITHMS), metavar="ALGORITHM",
      help="Default: all of them.")
  parser.add_argument(
      "--test_envs", nargs="+", type=int, default=None,
      help="Domains to hold out, one per run; default: every domain.")
  parser.add_argument(
      "--n_hparams", type=int, default=20,
      help="Runs hparams_seed 0 (default hparams) to n_hparams-1; default: 20.")
  parser.add_argument("--n_trials", type=int, default=3,
                      help="Runs trial_seed 0 to n_trials-1; default: 3.")
  parser.add_argument("--steps", type=int, default=None,
                      help="Training steps; default: training's default.")
  parser.add_argument(
      "--checkpoint_freq", type=int, default=None,
      help="Steps between evaluations; default: training's default.")
  parser.add_argument(
      "--plateau_check_freq", type=int, default=None,
      help="Every run stops at the first multiple of this many steps at "
      "which it has plateaued (--steps is then the most it trains); "
      "default: none.")
  parser.add_argument("--hparams", default=None,
                      help="JSON object of hparams fixed for every run.")
  parser.add_argument(
      "--trajectory_freq", type=int, default=None,
      help="Steps between params snapshots of the default-hparams runs of "
      f"{' and '.join(catalog.TRAJECTORY_ALGORITHMS)}; default: none.")
  parser.add_argument("--output_dir", required=True,
                      help="The sweep's directory, holding a folder per run.")
  parser.add_argument("--data_dir", default=None,
                      help="Passed on to training; default: its default.")
  parser.add_argument("--jobs", type=int, default=1,
                      help="How many runs train at once; default: 1.")
  parser.add_argument(
      "--train_command", default=DEFAULT_TRAIN_COMMAND,
      help="The training program; each run's flags are appended to it.")
  parser.add_argument("--yes", action="store_true",
                      help="Delete without asking for confirmation.")
  rerun.add_arguments(parser)
  return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The sweep's flags, as given on the command line."""
  parser = make_parser()
  args = parser.parse_args(argv)
  rerun.check_arguments(parser, args)
  return args


def runs_for(args: argparse.Namespace) -> list[Run]:
  """The runs of the sweep that parsed command-line flags describe: every
  parameter of `make_runs` is the flag of its name."""
  return make_runs(**{name: getattr(args, name)
                      for name in inspect.signature(make_runs).parameters})


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    runs = runs_for(args)
  except ValueError as e:  # A usage error, as argparse's: status 2.
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.command in rerun.COMMANDS:
    return rerun.main(make_parser(), args, runs, args.output_dir)
  if args.command == "list":
    for run in runs:
      print(run)
  print(summary(runs))

  if args.command == "launch":
    damaged = report_damaged(runs)
    try:
      failed = launch(runs, train_command=args.train_command,
                      data_dir=args.data_dir, jobs=args.jobs)
    except KeyboardInterrupt:
      print("Interrupted; the same command resumes the sweep.",
            file=sys.stderr)
      return 130
    for run in failed:
      print(f"Failed (see {run.log_file}): {run}")
    print(summary(runs))
    return 1 if failed or damaged else 0

  if args.command == "delete_incomplete":
    n = sum(run.status in (Status.INCOMPLETE, Status.DAMAGED) for run in runs)
    if not args.yes and input(
        f"Delete {n} incomplete or damaged runs? [y/N] ") != "y":
      return 1
    print(f"Deleted {len(delete_incomplete(runs))} incomplete or damaged "
          "runs.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
