"""SLURM array jobs through submitit: a job per run, requeued on preemption.

The ``slurm`` launcher (`experiments.runs.launchers`) submits a job per run
(`submit`) with the resources of the ``--slurm_*`` flags (`SlurmResources`).
A job that SLURM preempts or that reaches its time limit stops its training
(SIGTERM), is requeued, and resumes from the run's last checkpoint
(`TrainingJob`). ``cluster="local"`` runs the same jobs on this host through
submitit's local executor instead. Each job records its id and logs in its
run's ``launch.json`` (`experiments.runs.run.Run.record_launch`), and
`slurm_states` asks SLURM where they stand.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import submitit

from experiments import errors
from experiments.runs import gpus as gpus_lib
from experiments.runs import run as run_lib

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


# Seconds between looks at the jobs of a sweep, by cluster: the local
# executor's are processes here, SLURM's are asked of sacct, which a cluster
# rations.
POLL_S = {"local": 1.0, "slurm": 30.0}


def slurm_states(runs: Sequence[run_lib.Run]) -> dict[str, str]:
  """The states of the SLURM jobs that ``runs`` recorded, by job id.

  One ``sacct`` call asks for all of them: submitit's watcher asks for every
  job created before its first look.
  """
  jobs = [submitit.SlurmJob(Path(launch["folder"]), launch["job_id"])
          for launch in (run.launch_record for run in runs)
          if launch.get("cluster") == "slurm"]
  # sacct writes e.g. "CANCELLED by 123"; submitit "UNKNOWN" without it.
  return {job.job_id: job.state.split(" ")[0] for job in jobs}


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

  def check_host(self) -> None:
    """Raises `errors.UsageError` if this host cannot submit the jobs: the
    cluster is SLURM's and it has no ``sbatch``."""
    if self.cluster == "slurm" and shutil.which("sbatch") is None:
      raise errors.UsageError(
          "--launcher slurm submits with sbatch, which this host lacks: run "
          "the sweep on a SLURM login node, or try it here with "
          "--slurm_cluster local.")

  def executor(self, folder: Path) -> submitit.AutoExecutor:
    """A submitit executor asking for these resources for each job."""
    executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster)
    gpus = self.gpus_per_job
    if self.cluster == "local":
      # The local executor gives each job CUDA_VISIBLE_DEVICES 0 to
      # gpus - 1 whether this host has those GPUs or not.
      gpus = min(gpus, gpus_lib.nvidia_gpu_count())
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

  def __init__(self, run: run_lib.Run, train_command: str,
               data_dir: str | None, num_workers: int | None) -> None:
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


def submit(
    runs: Sequence[run_lib.Run],
    *,
    sweep_dir: str | Path,
    resources: SlurmResources,
    train_command: str = run_lib.DEFAULT_TRAIN_COMMAND,
    data_dir: str | None = None,
    num_workers: int | None = None,
) -> list[tuple[run_lib.Run, submitit.Job]]:
  """Submits an array job of a job per run; records each job's id and logs
  in its run's `run_lib.Run.launch_file`.

  Args:
    runs: the runs to train, none done or training already.
    sweep_dir: the sweep's directory; submitit's files go in its
      `SUBMITIT_DIR`.
    resources: what each job asks for (`SlurmResources.check_host` first).
    train_command: the training program, given each run's flags.
    data_dir: passed on as ``--data_dir`` unless ``None``.
    num_workers: every run's ``--num_workers``; ``None``: training's
      default, the cores SLURM gives its job.

  Returns:
    Each submitted run with its job.
  """
  if not runs:
    return []
  folder = Path(sweep_dir).absolute() / SUBMITIT_DIR / "%j"
  executor = resources.executor(folder)
  with executor.batch():
    jobs = [executor.submit(TrainingJob(run, train_command, data_dir,
                                        num_workers)) for run in runs]
  for run, job in zip(runs, jobs):
    if run.launch_record.get("job_id") == job.job_id:
      continue  # The job has started, and recorded more.
    run.record_launch(
        launcher="slurm", cluster=resources.cluster, folder=str(folder),
        job_id=job.job_id, stdout=str(job.paths.stdout),
        stderr=str(job.paths.stderr))
  return list(zip(runs, jobs))


def as_completed(jobs: Sequence[submitit.Job],
                 cluster: str) -> Iterator[submitit.Job]:
  """Yields ``jobs`` as they complete, looking every `POLL_S` of their
  cluster."""
  return submitit.helpers.as_completed(jobs, poll_frequency=POLL_S[cluster])


def succeeded(job: submitit.Job) -> bool:
  """Whether a completed job trained its run."""
  return job.exception() is None
