"""A sweep's grid: the runs it names, and the grid saved in its directory."""

import json

import pytest

from experiments import errors
from experiments.runs import grid
from experiments.runs import rerun
from experiments.runs import sweep

from test_sweep import launches, sweep_flags
from test_sweep import train_command  # pylint: disable=unused-import


def test_make_runs_holds_out_every_domain_by_default(tmp_path):
  kwargs = dict(output_dir=tmp_path, datasets=["ColoredDigits"],
                algorithms=["ERM", "PGrad"], n_hparams=2, n_trials=3)
  runs = grid.make_runs(**kwargs)
  # 3 domains x 2 algorithms x 2 hparam draws x 3 trials.
  assert len(runs) == 36
  assert {tuple(r.args["test_envs"]) for r in runs} == {(0,), (1,), (2,)}
  assert len({r.output_dir for r in runs}) == 36
  assert len({r.args["seed"] for r in runs}) == 36
  assert all(r.output_dir.parent == tmp_path for r in runs)
  # The directories depend on the arguments only.
  assert [r.output_dir for r in grid.make_runs(**kwargs)] == [
      r.output_dir for r in runs]
  longer = grid.make_runs(**kwargs, steps=100)
  assert not {r.output_dir for r in longer} & {r.output_dir for r in runs}
  stopping = grid.make_runs(**kwargs, steps=100, plateau_check_freq=50)
  assert all(r.args["plateau_check_freq"] == 50 for r in stopping)
  assert "plateau_check_freq" not in runs[0].args
  command = stopping[0].command("train")
  assert command[command.index("--plateau_check_freq") + 1] == "50"
  assert not {r.output_dir for r in stopping} & {r.output_dir for r in longer}


def test_averaging_runs_are_their_algorithms_runs_averaged(tmp_path):
  kwargs = dict(output_dir=tmp_path, datasets=["ColoredDigits"],
                algorithms=["ERM"], n_hparams=1, n_trials=2)
  plain = grid.make_runs(**kwargs)
  assert [r.output_dir for r in grid.make_runs(**kwargs, averaging="none")
          ] == [r.output_dir for r in plain]
  averaged = grid.make_runs(**kwargs, averaging="swad")
  assert not {r.output_dir for r in averaged} & {r.output_dir for r in plain}
  # The same runs, seeds included, with --averaging: they train alike.
  assert [{k: v for k, v in r.args.items() if k != "averaging"}
          for r in averaged] == [r.args for r in plain]
  assert all(r.args["averaging"] == "swad" for r in averaged)
  command = averaged[0].command("train")
  assert command[command.index("--averaging") + 1] == "swad"
  # Compared with their own trials, not the algorithm's.
  assert {rerun.group(r)[1] for r in averaged} == {"ERM + SWAD"}


def test_fixed_hparams_reach_only_the_algorithms_that_have_them(tmp_path):
  runs = grid.make_runs(
      output_dir=tmp_path, datasets=["ColoredDigits"],
      algorithms=["ERM", "Fishr"], n_hparams=1, n_trials=1, test_envs=[0],
      hparams='{"cnn_width": 8, "penalty_anneal_iters": 50}')
  by_algorithm = {r.args["algorithm"]: json.loads(r.args["hparams"])
                  for r in runs}
  assert by_algorithm == {
      "ERM": {"cnn_width": 8},
      "Fishr": {"cnn_width": 8, "penalty_anneal_iters": 50}}
  with pytest.raises(ValueError, match="No swept algorithm has.*'nope'"):
    grid.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                    algorithms=["ERM"], n_hparams=1, n_trials=1,
                    hparams='{"nope": 1}')


@pytest.mark.parametrize("hparams, message", [
    ('{"lr": 1', "--hparams is not valid JSON"),
    ("[1]", "--hparams must be a JSON object"),
    ('{"nope": 1}', "No swept algorithm has the hparams ['nope']"),
])
def test_bad_fixed_hparams_are_usage_errors(tmp_path, capsys, hparams, message):
  assert sweep.main(sweep_flags(tmp_path) + ["--hparams", hparams]) == 2
  assert message in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


def test_sweep_saves_trajectories_of_default_runs_only(tmp_path):
  runs = grid.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                         algorithms=["ERM", "Fish"], n_hparams=2, n_trials=1,
                         test_envs=[0], trajectory_freq=5)
  saved = {(r.args["algorithm"], r.args["hparams_seed"])
           for r in runs if "trajectory_freq" in r.args}
  assert saved == {("ERM", 0)}


def test_make_runs_counts_domains_in_the_catalog_without_data(tmp_path):
  # Neither dataset's data is here; DomainBed's sweep holds out its 6 and 4
  # ENVIRONMENTS in turn.
  runs = grid.make_runs(output_dir=tmp_path,
                         datasets=["RotatedMNIST", "TerraIncognita"],
                         algorithms=["ERM"], n_hparams=1, n_trials=1)
  assert [(r.args["dataset"], r.args["test_envs"]) for r in runs] == [
      ("RotatedMNIST", [env]) for env in range(6)] + [
          ("TerraIncognita", [env]) for env in range(4)]


def test_launch_saves_its_grid_and_the_directory_alone_names_the_sweep(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  assert sweep.main(flags) == 0
  assert json.loads((tmp_path / grid.GRID_FILE).read_text()) == {
      **grid.GRID_DEFAULTS, "datasets": ["ColoredDigits"],
      "algorithms": ["ERM", "PGrad"], "test_envs": [1], "n_hparams": 3,
      "n_trials": 1, "steps": 7}
  runs = sweep.runs_for(sweep.parse_args(flags))
  capsys.readouterr()
  alone = ["--output_dir", str(tmp_path)]
  assert sweep.main(["list", *alone]) == 0
  out = capsys.readouterr().out
  assert "6 runs: 6 done, 0 incomplete, 0 not started" in out
  assert all(str(run.output_dir) in out for run in runs)
  # Launched again from the directory alone, it has nothing to do.
  assert sweep.main(["launch", *alone, "--train_command", train_command]) == 0
  assert all(len(launches(run)) == 1 for run in runs)
  # The algorithms in another order are the same grid.
  assert sweep.main(["list", *alone, "--algorithms", "PGrad", "ERM"]) == 0


def test_a_directory_without_a_grid_is_not_listed_as_the_default_sweep(
    tmp_path, capsys):
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 2
  error = capsys.readouterr().err
  assert grid.GRID_FILE in error and "--datasets" in error
  assert "10800" not in error


@pytest.mark.parametrize("command", ["list", "launch", "delete_incomplete"])
def test_flags_that_contradict_the_saved_grid_exit_2_naming_them(
    tmp_path, train_command, capsys, command):
  sweep_dir = tmp_path / "sweep"
  flags = sweep_flags(sweep_dir) + ["--train_command", train_command]
  assert sweep.main(flags) == 0
  capsys.readouterr()
  assert sweep.main([command, "--output_dir", str(sweep_dir), "--n_trials",
                     "2", "--steps", "8", "--train_command", train_command,
                     "--yes"]) == 2
  error = capsys.readouterr().err
  assert "--n_trials 2 (the grid has --n_trials 1)" in error
  assert "--steps 8 (the grid has --steps 7)" in error
  assert "--extend_grid" in error
  assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == sorted(
      r.output_dir.name for r in sweep.runs_for(sweep.parse_args(flags)))


def test_extend_grid_adds_runs_and_saves_the_larger_grid(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command]
  assert sweep.main(flags) == 0
  alone = ["--output_dir", str(tmp_path), "--train_command", train_command]
  assert sweep.main(["launch", *alone, "--n_hparams", "3",
                     "--extend_grid"]) == 0
  assert json.loads((tmp_path / grid.GRID_FILE).read_text())[
      "n_hparams"] == 3
  capsys.readouterr()
  assert sweep.main(["list", *alone]) == 0
  assert "6 runs: 6 done" in capsys.readouterr().out
  # Fewer draws, or other steps, would leave runs of the grid out.
  for shrink in (["--n_hparams", "2"], ["--steps", "8"]):
    assert sweep.main(["launch", *alone, *shrink, "--extend_grid"]) == 2
    assert "would leave out" in capsys.readouterr().err
  assert json.loads((tmp_path / grid.GRID_FILE).read_text())[
      "n_hparams"] == 3


# A sweep.json as launch wrote it before sweeps took --averaging.
OLD_GRID = {"algorithms": ["ERM", "PGrad"], "checkpoint_freq": None,
            "datasets": ["ColoredDigits"], "hparams": None, "model": None,
            "n_hparams": 3, "n_trials": 1, "plateau_check_freq": None,
            "steps": 7, "test_envs": [1], "trajectory_freq": None}


def test_a_grid_saved_before_averaging_reads_as_averaging_none(
    tmp_path, train_command, capsys):
  (tmp_path / grid.GRID_FILE).write_text(json.dumps(OLD_GRID, indent=1))
  assert grid.read_grid(tmp_path) == {**OLD_GRID, "averaging": "none"}
  # Its runs are the ones it named then: the flags' runs, without averaging.
  runs = sweep.runs_for(sweep.parse_args(sweep_flags(tmp_path)))
  assert not any("averaging" in run.args for run in runs)
  alone = ["--output_dir", str(tmp_path), "--train_command", train_command]
  assert sweep.main(["launch", *alone, "--averaging", "none"]) == 0
  assert all(len(launches(run)) == 1 for run in runs)
  capsys.readouterr()
  assert sweep.main(["list", *alone]) == 0
  assert "6 runs: 6 done" in capsys.readouterr().out
  assert sweep.main(["list", *alone, "--averaging", "swad"]) == 2
  assert ("--averaging swad (the grid has --averaging none)"
          in capsys.readouterr().err)


@pytest.mark.parametrize("keys", [
    {**OLD_GRID, "averagin": "swad"},  # A foreign key.
    {k: v for k, v in OLD_GRID.items() if k != "steps"},  # One missing.
    {k: v for k, v in OLD_GRID.items() if k != "steps"} | {"averaging": "swad"},
])
def test_a_grid_of_other_keys_is_still_refused(tmp_path, keys):
  (tmp_path / grid.GRID_FILE).write_text(json.dumps(keys))
  with pytest.raises(errors.UsageError,
                     match="is not a sweep's grid: it must hold"):
    grid.read_grid(tmp_path)


def test_an_averaging_that_is_none_of_the_choices_is_refused(tmp_path):
  # A sweep.json edited by hand reaches make_runs unchecked by argparse.
  with pytest.raises(ValueError,
                     match="--averaging 'SWAD' is none of none, ema, sma, swad"):
    grid.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                   algorithms=["ERM"], n_hparams=1, n_trials=1,
                   averaging="SWAD")


def test_another_averaging_contradicts_the_saved_grid_in_one_line(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=1) + [
      "--train_command", train_command, "--averaging", "swad"]
  assert sweep.main(flags) == 0
  assert json.loads((tmp_path / grid.GRID_FILE).read_text())[
      "averaging"] == "swad"
  before = sorted(p.name for p in tmp_path.iterdir())
  capsys.readouterr()
  alone = ["--output_dir", str(tmp_path), "--train_command", train_command]
  for command in (["list"], ["launch"], ["cost", "--step_ms", "1"],
                  ["delete_incomplete", "--yes"]):
    assert sweep.main([*command, *alone, "--averaging", "none"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(
        f"python -m experiments.runs.sweep: error: {tmp_path} is a sweep of "
        f"another grid ({tmp_path / grid.GRID_FILE}): --averaging none (the "
        "grid has --averaging swad).")
    assert err.count("\n") == 1
  # Another averaging trains other runs, none of the grid's: not an
  # extension of it, but another sweep.
  assert sweep.main(["launch", *alone, "--averaging", "ema",
                     "--extend_grid"]) == 2
  err = capsys.readouterr().err
  assert ("--averaging ema (the grid has --averaging swad) would leave out 2 "
          "of the") in err
  assert "another --output_dir" in err and err.count("\n") == 1
  assert sorted(p.name for p in tmp_path.iterdir()) == before
  assert json.loads((tmp_path / grid.GRID_FILE).read_text())[
      "averaging"] == "swad"


def test_averaging_for_erm_plus_plus_is_refused_before_any_run(tmp_path,
                                                               capsys):
  # ERM++ averages its own weights; training refuses --averaging for it.
  assert sweep.main(["list", "--output_dir", str(tmp_path), "--datasets",
                     "ColoredDigits", "--averaging", "sma"]) == 2
  err = capsys.readouterr().err
  assert "--averaging sma: ERMPlusPlus averages its weights itself" in err
  assert "--algorithms" in err and err.count("\n") == 1
  assert list(tmp_path.iterdir()) == []
