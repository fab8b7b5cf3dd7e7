"""Tests for experiments/rundir/claim.py: a run directory belongs to one
configuration, refused to another, and overwritten only of its run's
files. The refusals are checked through the train command, exit status 2,
as a user meets them."""

import json

import pytest

from experiments import config as config_lib
from experiments import errors
from experiments import train
from experiments.rundir import claim
from experiments.rundir import records


def _write_run_config(output_dir, flags):
  config = config_lib.parse_args([*flags, "--output_dir", str(output_dir)])
  output_dir.mkdir(parents=True)
  (output_dir / records.CONFIG_FILE).write_text(json.dumps(
      claim.run_record(config.identity(), config.hyperparameters())))


def test_a_directory_of_another_configuration_is_refused(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  run = tmp_path / "run"
  _write_run_config(run, ["--seed", "3"])
  for flags, expected in [
      (["--seed", "4"], "seed: 4 here, 3 there"),
      (["--seed", "3", "--hparams", '{"lr": 0.01}'],
       "hparams.lr: 0.01 here, 0.001 there"),
  ]:
    assert train.main([*flags, "--output_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "another --output_dir" in err and "--overwrite" in err
  assert [p.name for p in run.iterdir()] == [records.CONFIG_FILE]
  # The same configuration (wherever its data is) resumes.
  config = config_lib.parse_args(["--seed", "3", "--output_dir", str(run),
                                  "--data_dir", "elsewhere"])
  assert claim.claim_run_directory(
      config.output_dir, config.identity(), config.hyperparameters(),
      overwrite=config.overwrite)

  # Run files without a config.json: a run of unknown configuration.
  legacy = tmp_path / "legacy"
  legacy.mkdir()
  (legacy / "results.jsonl").write_text("{}\n")
  assert train.main(["--output_dir", str(legacy)]) == 2
  assert "results.jsonl but no config.json" in capsys.readouterr().err
  assert (legacy / "results.jsonl").exists()

  # A config file that is not JSON: a damaged run of unknown configuration.
  (legacy / "config.json").write_text('{"args": {"se')
  assert train.main(["--output_dir", str(legacy)]) == 2
  err = capsys.readouterr().err
  assert f"{legacy / 'config.json'} is not JSON" in err and "--overwrite" in err


def test_overwrite_deletes_the_run_files_only(tmp_path):
  run = tmp_path / "run"
  _write_run_config(run, ["--seed", "3"])
  for name in ("dataset.json", "environment.json", "results.jsonl",
               "final_params.npz", "done"):
    (run / name).write_text("")
  (run / "checkpoints").mkdir()
  (run / "checkpoints" / "2").write_text("")
  (run / "notes.txt").write_text("mine")
  config = config_lib.parse_args(["--seed", "4", "--overwrite",
                                  "--output_dir", str(run)])
  assert not claim.claim_run_directory(
      config.output_dir, config.identity(), config.hyperparameters(),
      overwrite=config.overwrite)
  assert [p.name for p in run.iterdir()] == ["notes.txt"]


def _write_records(output_dir, steps, checkpointed):
  """A run's results file of ``steps`` and its checkpoint folders of
  ``checkpointed`` (empty, as the claim reads only their names)."""
  (output_dir / records.RESULTS_FILE).write_text(
      "".join(json.dumps({"step": step}) + "\n" for step in steps))
  for step in checkpointed:
    (output_dir / records.CHECKPOINT_DIR / str(step)).mkdir(parents=True)


def _is_locked(output_dir):
  """Whether a process holds the run directory's lock, as another process
  finds out (``flock``'s locks are per open file, so this one's too)."""
  with claim.RunDirectoryLock(output_dir) as other:
    try:
      other.acquire()
    except claim.RunDirectoryBusyError:
      return True
  return False


def test_a_claim_takes_the_lock_and_checks_what_the_run_goes_on_from(
    tmp_path):
  # Fresh, no directory: nothing taken or created; the run takes the lock
  # as it creates the directory.
  fresh = tmp_path / "fresh"
  with claim.claim_run(fresh, resume=False) as claimed:
    assert (claimed.run, claimed.finished) == (None, False)
    assert not fresh.exists()
  # A run to resume: held until the claim ends, its records checked
  # against the last checkpoint, which a killed run's record follows.
  run = tmp_path / "run"
  _write_run_config(run, [])
  _write_records(run, [2, 4, 6], [2, 4])
  with claim.claim_run(run, resume=True) as claimed:
    assert _is_locked(run)
    assert not claimed.finished
    assert (claimed.run.checkpoint_step, claimed.run.unsaved) == (4, 1)
    assert [r["step"] for r in claimed.run.checkpointed] == [2, 4]
  assert not _is_locked(run)
  # Finished: its records, and no lock, as it writes nothing.
  _write_records(run, [2, 4, 6], [6])
  records.mark_done(run)
  with claim.claim_run(run, resume=True) as claimed:
    assert not _is_locked(run)
    assert claimed.finished and claimed.run.records[-1] == {"step": 6}


def test_a_claim_refuses_a_locked_directory_or_damaged_records(tmp_path):
  # Not usage errors, which the loop that the claim hands the run to
  # never raises: the train command converts these as it converts those
  # (test_train.py, exit status 2).
  run = tmp_path / "run"
  _write_run_config(run, [])
  with claim.RunDirectoryLock(run) as other:
    other.acquire()
    for resume in (False, True):
      with pytest.raises(claim.RunDirectoryBusyError,
                         match="another process is training this run"):
        with claim.claim_run(run, resume=resume):
          pass
  assert not issubclass(claim.RunDirectoryBusyError, errors.UsageError)
  # Step 6's checkpoint has no record: no run, even killed, leaves that.
  _write_records(run, [2, 4], [2, 6])
  with pytest.raises(records.DamagedRunError,
                     match="it has no record of step 6") as raised:
    with claim.claim_run(run, resume=True):
      pass
  assert not isinstance(raised.value, errors.UsageError)
  assert not _is_locked(run)
