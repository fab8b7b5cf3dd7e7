"""Tests for experiments/second_stage.py: ERM++'s second stage
(``--lr_schedule_from``) as its flags resolve: its identity, and its
refusals, each exit 2 with one line that names the fix, nothing written.

(The second stage's training is test_loop_lr_schedule_from.py's.)
"""

import json
import shutil

import pytest

from experiments import config as config_lib
from experiments import train
from experiments.rundir import records
from test_loop_auto_lr import _flags
from test_loop_lr_schedule_from import SHORT_STEPS, _stage2
from test_loop_lr_schedule_from import fixture_stage1  # pylint: disable=unused-import
from test_loop_lr_schedule_from import fixture_stage2  # pylint: disable=unused-import
from test_train import read_records


def test_a_different_first_stage_is_a_different_run(stage1, tmp_path):
  config = config_lib.parse_args(_stage2(tmp_path / "a", stage1))
  moved = tmp_path / "moved"
  shutil.copytree(stage1, moved)
  # Where the first stage lies is not what the run is; its schedule is.
  assert config_lib.parse_args(
      _stage2(tmp_path / "a", moved)).identity() == config.identity()
  assert config.identity()["lr_schedule"] == [
      [r["step"], r["lr"]] for r in read_records(stage1)]
  lines = (moved / records.RESULTS_FILE).read_text().splitlines()
  edited = json.loads(lines[-2])
  edited["lr"] = 0.5
  lines[-2] = json.dumps(edited)
  (moved / records.RESULTS_FILE).write_text("\n".join(lines) + "\n")
  assert config_lib.parse_args(
      _stage2(tmp_path / "a", moved)).identity() != config.identity()


def test_default_runs_record_neither_field():
  for config in (config_lib.Config().resolve(),
                 config_lib.parse_args(["--algorithm", "ERMPlusPlus"])):
    assert not {"lr_schedule_from", "lr_schedule"} & config.record_args().keys()


def _refused(flags, capsys, output_dir):
  # Refused as the flags are parsed: argparse's exit.
  with pytest.raises(SystemExit) as exit_:
    train.main(flags)
  assert exit_.value.code == 2
  done = capsys.readouterr()
  assert done.out == ""
  # argparse's usage, then one line that says why.
  lines = done.err.strip().splitlines()
  errors = [line for line in lines if "error:" in line]
  assert errors == [lines[-1]]
  assert lines[-1].startswith(f"{config_lib.PROG}: error:")
  assert not output_dir.exists()
  return lines[-1]


def test_holdout_fraction_0_without_a_first_stage_is_refused(tmp_path,
                                                             capsys):
  out = tmp_path / "run"
  line = _refused([*_flags(out), "--holdout_fraction", "0"], capsys, out)
  assert "--holdout_fraction 0" in line and "--lr_schedule_from" in line


def test_a_second_stage_must_hold_out_nothing(stage1, tmp_path, capsys):
  out = tmp_path / "run"
  line = _refused(_stage2(out, stage1, holdout="0.2"), capsys, out)
  assert "pass --holdout_fraction 0" in line


def test_a_missing_or_unfinished_first_stage_is_refused(stage1, tmp_path,
                                                        capsys):
  out = tmp_path / "run"
  line = _refused(_stage2(out, tmp_path / "none"), capsys, out)
  assert "no run" in line
  unfinished = tmp_path / "unfinished"
  shutil.copytree(stage1, unfinished)
  (unfinished / records.DONE_FILE).unlink()
  line = _refused(_stage2(out, unfinished), capsys, out)
  assert "not finished" in line and "resume it" in line


def test_a_first_stage_without_a_schedule_is_refused(tmp_path, capsys):
  first = tmp_path / "first"
  assert train.main(_flags(first, auto_lr=False, steps=1)) == 0
  capsys.readouterr()
  out = tmp_path / "run"
  line = _refused(_stage2(out, first, auto_lr=False, steps=1), capsys, out)
  assert "no learning-rate schedule" in line and "auto_lr" in line


def test_a_second_stage_is_no_first_stage(stage1, stage2, tmp_path, capsys):
  out = tmp_path / "run"
  line = _refused(_stage2(out, stage2[0]), capsys, out)
  assert "is a second stage itself" in line
  assert f"--lr_schedule_from {stage2[0]}" in line


def test_a_first_stage_of_other_flags_or_hparams_is_refused(stage1, tmp_path,
                                                            capsys):
  out = tmp_path / "run"
  line = _refused(_stage2(out, stage1, "--seed", "1"), capsys, out)
  assert "seed" in line and "1" in line and "0" in line
  line = _refused(_stage2(out, stage1, steps=SHORT_STEPS), capsys, out)
  assert "steps" in line
  flags = _stage2(out, stage1)
  hparams = json.loads(flags[flags.index("--hparams") + 1])
  flags[flags.index("--hparams") + 1] = json.dumps({**hparams, "lr": 0.5})
  line = _refused(flags, capsys, out)
  assert "hparam lr" in line
