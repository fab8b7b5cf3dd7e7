"""Tests for experiments/training/loop.py: the loop trains a run that the
train command has resolved and claimed, and refuses nothing of its own.
Training end to end (records, resuming, signals) is tested in
tests/experiments/test_train.py."""

import pytest

from experiments import errors
from experiments import train
from experiments.rundir import claim
from experiments.rundir import records
from experiments.training import loop

TINY = ["--steps", "2", "--checkpoint_freq", "2", "--eval_examples", "16",
        "--loss_examples", "8", "--hparams", '{"batch_size": 3, "B": 1}']


def test_a_fresh_directory_another_process_started_first_stops_the_loop(
    tmp_path):
  # Two processes claimed one fresh run, its directory not there yet (two
  # launches of one command): the first to write starts the directory and
  # holds its lock, and the other finds out as it starts it, having
  # written nothing. The loop's one refusal, no usage error: the train
  # command converts it as the claim's (test_train.py).
  run = tmp_path / "run"
  spec = train.resolve_run([*TINY, "--output_dir", str(run)])
  with claim.claim_run(run, resume=spec.resume) as claimed:
    assert not run.exists()
    run.mkdir()
    with claim.RunDirectoryLock(run) as other:
      other.acquire()
      with pytest.raises(claim.RunDirectoryBusyError,
                         match="another process is training this run"
                         ) as raised:
        loop.train(spec, claimed)
  assert not isinstance(raised.value, errors.UsageError)
  assert [p.name for p in run.iterdir()] == [records.LOCK_FILE]
