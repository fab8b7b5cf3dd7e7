"""Launchers: where a sweep's runs train, as a registry.

In the spirit of DomainBed's ``command_launchers.py``, a launcher is a
function and one `REGISTRY` line. The function takes the sweep's runs and
its parsed flags, trains the runs that are neither done, damaged nor
training already (`to_launch`), waits for them (`wait_for`) and returns
those that failed. Its `Launcher` entry carries the rest: its line of
``--launcher``'s help, the flags of its own with their checks, and what a
Ctrl-C leaves going. The sweep's command line (`experiments.runs.sweep`)
builds ``--launcher``'s choices and help from `REGISTRY`, adds every
launcher's flags (`add_arguments`) and checks them (`check_arguments`), so
adding a launcher touches nothing else (experiments/README.md, "Adding a
launcher").

* ``local``: ``--jobs`` runs at a time on this host.
* ``multi_gpu``: one run per GPU at a time, each seeing only its own through
  ``CUDA_VISIBLE_DEVICES``; the next run starts as soon as a GPU frees. The
  GPUs are ``--gpus``, else those ``CUDA_VISIBLE_DEVICES`` lists, else those
  ``nvidia-smi -L`` lists (`experiments.runs.gpus`). Only NVIDIA GPUs are
  pinned this way.
* ``slurm``: an array job through submitit, a job per run, with its
  resources from the ``--slurm_*`` flags (`experiments.runs.slurm`).

On one host, runs that train at once share its cores: ``--num_workers`` of
each run defaults to the cores over the runs at once. Every launcher writes
where a run trains to the run's ``launch.json``
(`experiments.runs.run.Run.record_launch`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import queue
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import tqdm

from experiments import config as config_lib
from experiments.runs import gpus as gpus_lib
from experiments.runs import run as run_lib
from experiments.runs import slurm as slurm_lib


@dataclasses.dataclass(frozen=True)
class Launcher:
  """A way to train a sweep's runs, and the flags it takes.

  Attributes:
    launch: ``launch(runs, args)`` trains those of the sweep's ``runs``
      that `to_launch` gives, as the parsed flags ``args`` say
      (``train_command``, ``data_dir``, ``num_workers``, ``output_dir`` and
      its own), waits for them and returns those that failed. It raises
      `experiments.errors.UsageError` where the flags or the host cannot
      train them.
    help: what it does, a clause of ``--launcher``'s help.
    add_flags: adds its own flags to the container it is given: the
      sweep's options, or its own group when ``group`` is set. Each flag's
      default must mean "not given", so that `check` can tell.
    check: the usage error of its flags, or ``None``. It is called whatever
      the launcher chosen (``args.launcher``), so that it refuses its flags
      given with another launcher, as well as their bad values.
    group: the description of an argument group of its own, listed after
      the flags that every launcher takes (as ``--slurm_*``); ``None``: its
      flags are among the sweep's options, after ``--launcher``.
    interrupted: what a Ctrl-C of the sweep leaves going, if anything; the
      sweep's message says it.
  """

  launch: Callable[[Sequence[run_lib.Run], argparse.Namespace],
                   list[run_lib.Run]]
  help: str
  add_flags: Callable[[argparse._ActionsContainer], None]
  check: Callable[[argparse.Namespace], str | None]
  group: str | None = None
  interrupted: str | None = None


def default_num_workers(concurrent: int) -> int:
  """``--num_workers`` for each of ``concurrent`` runs training at once on
  this host: its cores split between them, so that their input workers do
  not oversubscribe it (0: each run builds its batches itself)."""
  return config_lib.default_num_workers() // concurrent


def still_training(run: run_lib.Run, states: Mapping[str, str]) -> str | None:
  """Why ``run`` is training already and must not be launched again, or
  ``None``: its recorded process runs on this host, or its SLURM job is
  queued or running.

  Args:
    run: a run not done.
    states: `slurm_lib.slurm_states`.
  """
  launch = run.launch_record
  if run.training_here():
    return f"its training process {launch['pid']} runs on this host"
  state = states.get(launch.get("job_id"))
  if (launch.get("cluster") == "slurm"
      and state in slurm_lib.SLURM_ACTIVE_STATES):
    return f"its SLURM job {launch['job_id']} is {state}"
  return None


def to_launch(runs: Sequence[run_lib.Run]) -> list[run_lib.Run]:
  """The runs neither done nor damaged nor training already, saying on
  stderr which are training already and where."""
  pending = [run for run in runs
             if run.status not in (run_lib.Status.DONE, run_lib.Status.DAMAGED)]
  states = slurm_lib.slurm_states(pending)
  todo = []
  for run in pending:
    if (why := still_training(run, states)) is not None:
      print(f"Skipped {run.output_dir}: {why}.", file=sys.stderr)
      continue
    todo.append(run)
  return todo


def wait_for(jobs: Sequence[Any], runs: Sequence[run_lib.Run],
             outcome: Callable[[Any], bool],
             completed: Callable[[Sequence[Any]], Iterable[Any]]
             ) -> list[Any]:
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
  done = sum(run.status is run_lib.Status.DONE for run in runs)
  with tqdm.tqdm(total=done + len(jobs), initial=done,
                 unit="run") as progress:
    for job in completed(jobs):
      if not outcome(job):
        failed.append(job)
      progress.update()
  return failed


def train_on_host(
    runs: Sequence[run_lib.Run],
    *,
    train_command: str = run_lib.DEFAULT_TRAIN_COMMAND,
    data_dir: str | None = None,
    jobs: int = 1,
    gpus: Sequence[str] | None = None,
    num_workers: int | None = None,
) -> list[run_lib.Run]:
  """Trains on this host every run neither done, damaged nor training
  already: ``jobs`` at a time (the ``local`` launcher), or one per GPU at a
  time (``multi_gpu``).

  Args:
    runs: the sweep's runs.
    train_command: the training program, given each run's flags.
    data_dir: passed on as ``--data_dir`` unless ``None``.
    jobs: how many runs train at once, when ``gpus`` is ``None``.
    gpus: the GPUs (`gpus_lib.visible_gpus`): each run sees one of them
      alone as its ``CUDA_VISIBLE_DEVICES``, and the next run starts on a
      GPU as soon as the run on it ends.
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

  def train(run: run_lib.Run) -> int:
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

  todo = to_launch(runs)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(slots))
  try:
    futures = {pool.submit(train, run): run for run in todo}
    failed = wait_for(list(futures), runs,
                      lambda future: future.result() == 0,
                      concurrent.futures.as_completed)
  finally:
    # On Ctrl-C the running children get the signal too; start no others.
    pool.shutdown(cancel_futures=True)
  return [futures[future] for future in failed]


def trainer(args: argparse.Namespace) -> dict[str, Any]:
  """What every launcher passes on to training, from the parsed flags."""
  return dict(train_command=args.train_command, data_dir=args.data_dir,
              num_workers=args.num_workers)


# local: --jobs runs at a time on this host.


def local(runs: Sequence[run_lib.Run],
          args: argparse.Namespace) -> list[run_lib.Run]:
  """Trains ``--jobs`` runs at a time on this host."""
  return train_on_host(runs, jobs=args.jobs, **trainer(args))


def _local_flags(parser: argparse._ActionsContainer) -> None:
  parser.add_argument("--jobs", type=int, default=1,
                      help="How many runs train at once (local launcher); "
                      "default: 1.")


def _check_local(args: argparse.Namespace) -> str | None:
  if args.jobs != 1 and args.launcher != "local":
    return (f"--jobs: only with --launcher local; {args.launcher} "
            "decides how many runs train at once.")
  if args.jobs < 1:
    return f"--jobs must be at least 1, got {args.jobs}."
  return None


# multi_gpu: one run per GPU at a time.


def multi_gpu(runs: Sequence[run_lib.Run],
              args: argparse.Namespace) -> list[run_lib.Run]:
  """Trains one run per GPU at a time on this host, each seeing only its
  own GPU."""
  return train_on_host(runs, gpus=gpus_lib.visible_gpus(args.gpus),
                       **trainer(args))


def _multi_gpu_flags(parser: argparse._ActionsContainer) -> None:
  parser.add_argument(
      "--gpus", default=None,
      help="multi_gpu: the GPUs, comma-separated ids or UUIDs, e.g. 0,1,2,3; "
      "default: those CUDA_VISIBLE_DEVICES lists, else those nvidia-smi -L "
      "lists.")


def _check_multi_gpu(args: argparse.Namespace) -> str | None:
  if args.gpus is not None and args.launcher != "multi_gpu":
    return "--gpus: only with --launcher multi_gpu."
  return None


# slurm: an array job through submitit.

# The --slurm_* flags, by their `slurm_lib.SlurmResources` field.
_SLURM_FLAGS = {"cluster": "slurm_cluster", "partition": "slurm_partition",
                "gpus_per_job": "slurm_gpus_per_job",
                "cpus_per_job": "slurm_cpus_per_job",
                "time_min": "slurm_time", "mem_gb": "slurm_mem_gb",
                "array_parallelism": "slurm_array_parallelism"}


def slurm_resources(args: argparse.Namespace) -> slurm_lib.SlurmResources:
  """The `slurm_lib.SlurmResources` of the given ``--slurm_*`` flags."""
  return slurm_lib.SlurmResources(**{
      field: getattr(args, flag) for field, flag in _SLURM_FLAGS.items()
      if getattr(args, flag) is not None})


def slurm(runs: Sequence[run_lib.Run],
          args: argparse.Namespace) -> list[run_lib.Run]:
  """Submits an array job of a job per run, says each job's id, and waits
  for them."""
  resources = slurm_resources(args)
  resources.check_host()
  jobs = slurm_lib.submit(to_launch(runs), sweep_dir=args.output_dir,
                          resources=resources, **trainer(args))
  for run, job in jobs:
    print(f"Submitted SLURM job {job.job_id}: {run.output_dir}  {run.label}")
  failed = wait_for(
      [job for _, job in jobs], runs, slurm_lib.succeeded,
      lambda jobs: slurm_lib.as_completed(jobs, resources.cluster))
  return [run for run, job in jobs if any(job is f for f in failed)]


def _slurm_flags(group: argparse._ActionsContainer) -> None:
  group.add_argument("--slurm_cluster", choices=["slurm", "local"],
                     help="local: submitit's local executor, every job at "
                     "once on this host; default: slurm.")
  group.add_argument("--slurm_partition",
                     help="Default: the cluster's default.")
  group.add_argument("--slurm_gpus_per_job", type=int, help="Default: 1.")
  group.add_argument("--slurm_cpus_per_job", type=int,
                     help="Default: the cluster's default.")
  group.add_argument(
      "--slurm_time", type=int, metavar="MINUTES",
      help="Each job's time limit; a run that needs longer is requeued and "
      "resumes from its checkpoint. Default: 240.")
  group.add_argument("--slurm_mem_gb", type=float,
                     help="Default: the cluster's default.")
  group.add_argument("--slurm_array_parallelism", type=int,
                     help="Jobs of the array running at once; default: 256.")


def _check_slurm(args: argparse.Namespace) -> str | None:
  given = [f"--{flag}" for flag in _SLURM_FLAGS.values()
           if getattr(args, flag) is not None]
  if given and args.launcher != "slurm":
    return f"{' '.join(given)}: only with --launcher slurm."
  return None


REGISTRY = {
    "local": Launcher(local, "--jobs runs at a time on this host",
                      _local_flags, _check_local),
    "multi_gpu": Launcher(
        multi_gpu, "one run per GPU at a time, each seeing only its own",
        _multi_gpu_flags, _check_multi_gpu),
    "slurm": Launcher(
        slurm, "an array job through submitit, a job per run (the "
        "--slurm_* flags)", _slurm_flags, _check_slurm,
        group="Each job of --launcher slurm (defaults: SlurmResources).",
        interrupted="submitted SLURM jobs go on: sweep list shows them"),
}
DEFAULT = "local"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds ``--launcher``, chosen from `REGISTRY`; then the flags of the
  launchers without a group; the flags that every launcher passes on to
  training; and the group of each launcher that has one."""
  parser.add_argument(
      "--launcher", default=DEFAULT, choices=list(REGISTRY),
      help="; ".join(f"{name}: {launcher.help}"
                     for name, launcher in REGISTRY.items())
      + f". Default: {DEFAULT}.")
  for launcher in REGISTRY.values():
    if launcher.group is None:
      launcher.add_flags(parser)
  parser.add_argument(
      "--num_workers", type=int, default=None,
      help="Every run's input workers (passed on; not part of a run's "
      "identity). Default: local and multi_gpu, this host's cores over the "
      "runs at once; slurm, training's default: the cores of its job.")
  parser.add_argument(
      "--train_command", default=run_lib.DEFAULT_TRAIN_COMMAND,
      help="The training program; each run's flags are appended to it.")
  for name, launcher in REGISTRY.items():
    if launcher.group is not None:
      launcher.add_flags(parser.add_argument_group(name, launcher.group))


def check_arguments(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> None:
  """Refuses a launcher's flags given with another launcher, and bad
  numbers (`parser.error`: exit 2)."""
  for launcher in REGISTRY.values():
    if (error := launcher.check(args)) is not None:
      parser.error(error)
  if args.num_workers is not None and args.num_workers < 0:
    parser.error(f"--num_workers must be >= 0, got {args.num_workers}.")
