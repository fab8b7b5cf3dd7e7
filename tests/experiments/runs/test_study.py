"""Tests for experiments/runs/study.py: a study's command line.

What reproduce and longer do is tested in test_rerun.py; here, that the
study's command line reaches them with the study's runs.
"""

import os
import shutil

import pytest

from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import study
from experiments.studies import digits


def test_study_skips_runs_marked_done(tmp_path, capsys):
  runs = digits.runs(str(tmp_path))
  for run in runs:
    run.output_dir.mkdir()
    (run.output_dir / records.RESULTS_FILE).write_text('{"step": 1}\n')
    (run.output_dir / records.DONE_FILE).touch()
  assert study.main(["--output_dir", str(tmp_path)]) == 0
  assert f"{len(runs)} runs: {len(runs)} done" in capsys.readouterr().out


def test_a_packed_study_needs_no_run_directories(tmp_path, capsys,
                                                 monkeypatch):
  # The study's runs written unsynced: syncing each of their files to
  # the disk, as training does for a run killed mid-write, took seconds of
  # waiting for it.
  monkeypatch.setattr(os, "fsync", lambda fd: None)
  runs = digits.runs(str(tmp_path / "study"))
  for run in runs:
    run.output_dir.mkdir(parents=True)
    records.append_record(run.output_dir, {"step": 1})
    records.write_config(run.output_dir, {"args": run.args, "hparams": {}})
    records.mark_done(run.output_dir)
  longer = tmp_path / "study_longer" / "run"
  longer.mkdir(parents=True)
  records.append_record(longer, {"step": 2})
  records.write_config(longer, {"args": {}, "hparams": {}})
  records.mark_done(longer)
  assert study.main(["pack", "--output_dir", str(tmp_path / "study")]) == 0
  out = capsys.readouterr().out
  for directory, count in (("study", len(runs)), ("study_longer", 1)):
    assert (f"Packed {count} runs in {tmp_path / directory / 'runs.jsonl.gz'}"
            in out)
  # A fresh clone: the packs alone, every run done, none launched.
  for run in runs:
    shutil.rmtree(run.output_dir)
  shutil.rmtree(longer)
  assert study.main(["--output_dir", str(tmp_path / "study")]) == 0
  assert f"{len(runs)} runs: {len(runs)} done" in capsys.readouterr().out
  assert sorted(p.name for p in (tmp_path / "study").iterdir()) == [
      pack.PACK_FILE]
  assert pack.read_pack(tmp_path / "study_longer")["run"].records == [
      {"step": 2}]


def test_reproduce_without_finished_runs_says_so(tmp_path, capsys):
  assert study.main(["reproduce", "--output_dir", str(tmp_path)]) == 1
  assert "no finished runs to reproduce" in capsys.readouterr().err
  assert study.main(["reproduce", "--output_dir", str(tmp_path),
                     "--hparams_seeds", "0", "--algorithms", "ERM"]) == 1
  assert ("no finished runs with hparams_seed in [0] to reproduce"
          in capsys.readouterr().err)
  # No directory at all: the user's mistake (exit 2), not a study without
  # finished runs.
  with pytest.raises(SystemExit) as raised:
    study.main(["reproduce", "--output_dir", str(tmp_path / "stduy")])
  assert raised.value.code == 2
  # Named by the command the docs give, not by the file that argparse sees.
  assert (f"python -m experiments.runs.study: error: --output_dir "
          f"{tmp_path / 'stduy'}: no such directory") in capsys.readouterr().err


LONGER = ["longer", "--dataset", "RotatedDigits", "--algorithm", "Fish",
          "--hparams_seed", "1", "--trial_seed", "2", "--test_env", "0"]


def test_longer_refuses_what_the_study_lacks_before_training(tmp_path, capsys):
  for flags, message in [
      (["--longer_steps", "3000", "--test_env", "6"], "no run of Fish on "
       "RotatedDigits with hparams_seed 1, trial_seed 2 and test_env 6"),
      (["--longer_steps", "1000"],
       f"at least the run's plateau_check_freq, {digits.STEPS}"),
      ([], "longer needs --longer_steps"),
      (["--longer_steps", "3000", "--every", "0"],
       "--every must be at least 1"),
      (["--longer_steps", "3000", "list"], "only for the longer command")]:
    command = [*LONGER, *flags]
    if "list" in flags:  # The run's flags without the longer command.
      command = command[1:]
    try:
      study.main([*command, "--output_dir", str(tmp_path),
                  "--longer_dir", str(tmp_path / "longer")])
    except SystemExit as e:
      assert e.code == 2
    else:
      raise AssertionError(f"{flags} was not refused")
    assert message in capsys.readouterr().err
  assert not (tmp_path / "longer").exists()


@pytest.mark.parametrize("flags, message", [
    (["--study", "photos"], "no experiments/studies/photos.py; the studies "
     "are digits"),
    (["reproduce", "--algorithms", "ERM", "PGradParallel"],
     "--algorithms PGradParallel: the study trains none of them")])
def test_unknown_studies_and_algorithms_are_usage_errors(tmp_path, capsys,
                                                         flags, message):
  with pytest.raises(SystemExit) as e:
    study.main([*flags, "--output_dir", str(tmp_path)])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
