"""Tests for experiments/rundir/claim.py: a run directory belongs to one
configuration, refused to another, and overwritten only of its run's
files. The refusals are checked through the train command, exit status 2,
as a user meets them."""

import json

from experiments import config as config_lib
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
