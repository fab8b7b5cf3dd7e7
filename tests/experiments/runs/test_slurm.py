"""The slurm launcher through submitit's local executor: its jobs, and
requeueing and resuming them, with test_sweep.py's stand-in training script
and with real training."""

import os
import pathlib
import shlex
import signal
import socket
import sys
import textwrap
import threading

import numpy as np
import pytest

from experiments import train
from experiments.runs import gpus as gpus_lib
from experiments.rundir import records
from experiments.runs import rerun
from experiments.runs import run as run_lib
from experiments.runs import slurm
from experiments.runs import sweep

from test_sweep import HOLD_STEP, launches, sweep_flags, wait_for_notice
from test_sweep import fixture_held_run_notices, train_command  # pylint: disable=unused-import


def test_slurm_without_sbatch_is_a_usage_error(
    tmp_path, train_command, monkeypatch, capsys):
  monkeypatch.setenv("PATH", str(tmp_path))  # No sbatch.
  flags = sweep_flags(tmp_path) + ["--train_command", train_command,
                                   "--launcher", "slurm"]
  assert sweep.main(flags) == 2
  assert "--slurm_cluster local" in capsys.readouterr().err
  assert not (tmp_path / slurm.SUBMITIT_DIR).exists()


def slurm_flags(output_dir, train_command, n_hparams):
  """A sweep of ``2 * n_hparams`` runs through submitit's local executor."""
  return sweep_flags(output_dir, n_hparams=n_hparams) + [
      "--train_command", train_command, "--launcher", "slurm",
      "--slurm_cluster", "local", "--slurm_gpus_per_job", "0"]


def test_slurm_sweep_finishes_and_lists_its_jobs(
    tmp_path, train_command, capsys):
  flags = slurm_flags(tmp_path, train_command, n_hparams=2)
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert sweep.main(flags) == 0
  assert all(r.status is run_lib.Status.DONE for r in runs)
  assert all(len(launches(r)) == 1 for r in runs)

  capsys.readouterr()
  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out.splitlines()
  job_ids = set()
  for run in runs:
    record = run.launch_record
    (line,) = [line for line in listing if str(run.output_dir) in line]
    assert line.startswith("done")
    assert line.endswith(
        f"[slurm job {record['job_id']} on {socket.gethostname()} pid "
        f"{launches(run)[0]['pid']} log {record['stdout']} "
        f"{record['stderr']}]")
    # The job's own log, submitit's, says it ran.
    assert "Job completed successfully" in open(record["stdout"]).read()
    job_ids.add(record["job_id"])
  assert len(job_ids) == 4
  # Nothing is submitted again.
  assert sweep.main(flags) == 0
  assert all(len(launches(r)) == 1 for r in runs)


def run_in_thread(function, *args):
  """Starts ``function(*args)``; returns the thread and what it returns."""
  result = []
  thread = threading.Thread(target=lambda: result.append(function(*args)))
  thread.start()
  return thread, result


def start_held_slurm_sweep(tmp_path, train_command, monkeypatch, notices,
                           steps):
  """A 2-run slurm sweep of ``steps`` fake steps launched in a thread, once
  its first run is held after `HOLD_STEP` steps; its flags, runs, thread and
  result."""
  flags = slurm_flags(tmp_path, train_command, n_hparams=1) + [
      "--steps", str(steps)]
  runs = sweep.runs_for(sweep.parse_args(flags))
  monkeypatch.setenv("FAKE_HOLD", str(runs[0].output_dir))
  thread, result = run_in_thread(sweep.main, flags)
  assert wait_for_notice(notices) == b"held"
  assert int((runs[0].output_dir / "progress").read_text()) == HOLD_STEP
  return flags, runs, thread, result


@pytest.mark.slow
def test_slurm_preempted_job_is_requeued_and_resumes(
    tmp_path, train_command, monkeypatch, held_run_notices):
  _, runs, thread, result = start_held_slurm_sweep(
      tmp_path, train_command, monkeypatch, held_run_notices, steps=30)
  # SLURM's warning of preemption, to the job's process (the training's
  # parent); SLURM then requeues the job, as the local executor does.
  os.kill(launches(runs[0])[0]["ppid"], signal.SIGUSR2)
  thread.join(timeout=120)
  assert result == [0]
  first, second = launches(runs[0])
  # The signal came while it was held: it stopped after the next step.
  stopped_at = int((runs[0].output_dir / "stopped").read_text())
  assert stopped_at == HOLD_STEP + 1
  assert second["start"] == stopped_at
  assert first["ppid"] != second["ppid"]  # Another job process.
  assert all(r.status is run_lib.Status.DONE for r in runs)
  assert len(launches(runs[1])) == 1


@pytest.mark.slow
def test_slurm_killed_job_resumes_when_submitted_again(
    tmp_path, train_command, monkeypatch, held_run_notices, capsys):
  flags, runs, thread, result = start_held_slurm_sweep(
      tmp_path, train_command, monkeypatch, held_run_notices, steps=20)
  os.kill(launches(runs[0])[0]["pid"], signal.SIGKILL)
  thread.join(timeout=120)
  assert result == [1]
  assert f"Failed (see {runs[0].log_file})" in capsys.readouterr().out
  assert runs[0].status is run_lib.Status.INCOMPLETE
  killed_at = int((runs[0].output_dir / "progress").read_text())

  assert sweep.main(flags) == 0
  first, second = launches(runs[0])
  assert second["start"] == killed_at == HOLD_STEP
  assert all(r.status is run_lib.Status.DONE for r in runs)
  assert len(launches(runs[1])) == 1


# Small evaluations, for the real training runs.
TRAIN_FLAGS = "--eval_examples 16 --eval_batch_size 16 --loss_examples 8"


# experiments.train, whose run in FAKE_HOLD sends a datagram to FAKE_NOTIFY
# as it takes its NOTIFY_STEP-th step (`evaluate.MetricMeter.add` sums each
# step's metrics), so that a test acts on it mid-training.
TRAIN_NOTIFYING = textwrap.dedent("""\
    import os, socket, sys
    from experiments import train
    from experiments.training import evaluate
    NOTIFY_STEP = {notify_step}
    add, steps = evaluate.MetricMeter.add, []
    def add_and_notify(self, metrics):
      add(self, metrics)
      steps.append(1)
      output_dir = sys.argv[sys.argv.index("--output_dir") + 1]
      if len(steps) == NOTIFY_STEP and output_dir == os.environ["FAKE_HOLD"]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notice:
          try:
            notice.sendto(b"step", "\\0" + os.environ["FAKE_NOTIFY"])
          except OSError:  # A resumed run's: the test listens no more.
            pass
    evaluate.MetricMeter.add = add_and_notify
    sys.exit(train.main())
""")


@pytest.mark.slow
def test_slurm_sweep_of_real_training_resumes_a_preempted_run_exactly(
    tmp_path, monkeypatch, held_run_notices):
  # Preempted after its checkpoint at step 20, as it takes step 25 (the
  # steps after it are fast, their evaluations not).
  script = tmp_path / "train_notifying.py"
  script.write_text(TRAIN_NOTIFYING.format(notify_step=25))
  # The script imports experiments, which runs from the checkout: Python
  # puts the script's folder on the path, not the working directory.
  checkout = str(pathlib.Path(__file__).resolve().parents[3])
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      filter(None, [checkout, os.environ.get("PYTHONPATH")])))
  # The sweep passes the rest of each run's flags.
  train_command = (f"{shlex.quote(sys.executable)} "
                   f"{shlex.quote(str(script))} {TRAIN_FLAGS}")
  flags = slurm_flags(tmp_path / "sweep", train_command, n_hparams=1) + [
      "--algorithms", "ERM", "--n_trials", "2", "--steps", "60",
      "--checkpoint_freq", "20", "--hparams", '{"batch_size": 6}']
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 2
  monkeypatch.setenv("FAKE_HOLD", str(runs[0].output_dir))
  thread, result = run_in_thread(sweep.main, flags)
  assert wait_for_notice(held_run_notices, timeout_s=300) == b"step"
  # The job's process is the training process's parent.
  training = runs[0].launch_record["pid"]
  job = int(open(f"/proc/{training}/stat").read().rsplit(")", 1)[1].split()[1])
  os.kill(job, signal.SIGUSR2)
  thread.join(timeout=600)
  assert result == [0]
  # Stopped by the job's checkpoint, requeued, and resumed.
  assert "Requeued job" in open(runs[0].launch_record["stdout"]).read()
  assert "Resuming from step" in runs[0].log_file.read_text()

  # Trained straight through in this process, with the sweep's flags: a
  # subprocess would import JAX, Flax and Orbax once more.
  reference = tmp_path / "reference"
  command = runs[0].command(TRAIN_FLAGS)
  command[command.index("--output_dir") + 1] = str(reference)
  assert train.main(command) == 0
  straight, resumed = (reference, runs[0].output_dir)
  assert rerun.first_difference(records.read_run(straight).records,
                                records.read_run(resumed).records) is None
  with np.load(straight / records.FINAL_PARAMS_FILE) as expected, np.load(
      resumed / records.FINAL_PARAMS_FILE) as got:
    assert expected.files == got.files
    for key in expected.files:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def test_a_run_whose_slurm_job_is_queued_is_not_submitted_again(
    tmp_path, train_command, monkeypatch, capsys):
  # Stands in for SLURM's sacct (what submitit asks, with --parsable2): job
  # 4242's array task 0 is pending, task 1 has failed.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sacct").write_text(
      "#!/bin/sh\necho 'JobID|State|NodeList'\n"
      "echo '4242_0|PENDING|None assigned'\necho '4242_1|FAILED|node3'\n")
  (bin_dir / "sacct").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  flags = sweep_flags(tmp_path / "sweep", n_hparams=1) + [
      "--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  for task, run in enumerate(runs):
    run.record_launch(launcher="slurm", cluster="slurm",
                      folder=str(tmp_path / "submitit" / "%j"),
                      job_id=f"4242_{task}", stdout="out", stderr="err")
  assert slurm.slurm_states(runs) == {"4242_0": "PENDING",
                                      "4242_1": "FAILED"}

  assert sweep.main(flags) == 0
  assert (f"Skipped {runs[0].output_dir}: its SLURM job 4242_0 is PENDING"
          in capsys.readouterr().err)
  assert launches(runs[0]) == []
  assert len(launches(runs[1])) == 1


def test_slurm_local_on_a_host_without_gpus_names_none(
    tmp_path, train_command, capsys):
  # --slurm_gpus_per_job left at its default, 1.
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command, "--launcher", "slurm",
      "--slurm_cluster", "local"]
  assert sweep.main(flags) == 0
  submitted = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("Submitted")]
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert sorted(submitted) == sorted(
      f"Submitted SLURM job {run.launch_record['job_id']}: {run.output_dir}  "
      f"{run.label}" for run in runs)
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 0
  listing = capsys.readouterr().out
  gpus = gpus_lib.nvidia_gpu_count()
  assert ("GPU 0" in listing) == (gpus > 0)
  assert all(launches(run)[0]["gpu"] == ("0" if gpus else "")
             for run in runs)
