"""The sweep's runs, launching and resuming, with a stand-in training script."""

import json
import shlex
import sys
import textwrap

import pytest

from experiments import sweep

# Stands in for experiments.train: records its flags and each launch, fails
# for hparams_seed 3, and otherwise finishes the run.
FAKE_TRAIN = textwrap.dedent("""\
    import argparse, json, pathlib, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir")
    parser.add_argument("--hparams_seed", type=int)
    args, _ = parser.parse_known_args()
    out = pathlib.Path(args.output_dir)
    with open(out / "launches", "a") as f:
      f.write(json.dumps(sys.argv[1:]) + "\\n")
    if args.hparams_seed == 3:
      sys.exit("failed on purpose")
    (out / "results.jsonl").write_text('{"step": 7}\\n')
    (out / "done").write_text("")
""")


@pytest.fixture
def train_command(tmp_path):
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAIN)
  return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def sweep_flags(output_dir, n_hparams=3):
  return ["--datasets", "ColoredDigits", "--algorithms", "ERM", "PGrad",
          "--test_envs", "1", "--n_hparams", str(n_hparams), "--n_trials", "1",
          "--steps", "7", "--output_dir", str(output_dir)]


def launches(run):
  path = run.output_dir / "launches"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_seed_hash_is_deterministic_and_distinct():
  seed = sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert seed == sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 0)
  assert 0 <= seed < 2**31
  assert seed != sweep.seed_hash("RotatedDigits", "ERM", [0], 0, 1)


def test_make_runs_holds_out_every_domain_by_default(tmp_path):
  kwargs = dict(output_dir=tmp_path, datasets=["ColoredDigits"],
                algorithms=["ERM", "PGrad"], n_hparams=2, n_trials=3)
  runs = sweep.make_runs(**kwargs)
  # 3 domains x 2 algorithms x 2 hparam draws x 3 trials.
  assert len(runs) == 36
  assert {tuple(r.args["test_envs"]) for r in runs} == {(0,), (1,), (2,)}
  assert len({r.output_dir for r in runs}) == 36
  assert len({r.args["seed"] for r in runs}) == 36
  assert all(r.output_dir.parent == tmp_path for r in runs)
  # The directories depend on the arguments only.
  assert [r.output_dir for r in sweep.make_runs(**kwargs)] == [
      r.output_dir for r in runs]
  longer = sweep.make_runs(**kwargs, steps=100)
  assert not {r.output_dir for r in longer} & {r.output_dir for r in runs}
  stopping = sweep.make_runs(**kwargs, steps=100, plateau_check_freq=50)
  assert all(r.args["plateau_check_freq"] == 50 for r in stopping)
  assert "plateau_check_freq" not in runs[0].args
  command = stopping[0].command("train")
  assert command[command.index("--plateau_check_freq") + 1] == "50"
  assert not {r.output_dir for r in stopping} & {r.output_dir for r in longer}


def test_command_passes_every_flag():
  run = sweep.Run.create(
      {"dataset": "ColoredDigits", "algorithm": "PGrad", "test_envs": [2],
       "hparams_seed": 1, "trial_seed": 0, "seed": 5, "hparams": '{"lr": 1}'},
      "sweep")
  command = run.command("python -m experiments.train", data_dir="data")
  assert command[:3] == ["python", "-m", "experiments.train"]
  flags = dict(zip(command[3::2], command[4::2]))
  assert flags == {
      "--algorithm": "PGrad", "--data_dir": "data",
      "--dataset": "ColoredDigits",
      "--hparams": '{"lr": 1}', "--hparams_seed": "1",
      "--output_dir": str(run.output_dir), "--seed": "5", "--test_envs": "2",
      "--trial_seed": "0"}


def test_launch_skips_done_runs_and_resumes_the_others(tmp_path, train_command):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 6
  done, incomplete = runs[0], runs[1]
  done.output_dir.mkdir()
  (done.output_dir / "results.jsonl").write_text('{"step": 7}\n')
  (done.output_dir / "done").write_text("")
  incomplete.output_dir.mkdir()
  assert [r.status for r in runs[:3]] == [
      sweep.Status.DONE, sweep.Status.INCOMPLETE, sweep.Status.NOT_STARTED]

  assert sweep.main(flags + ["--jobs", "2"]) == 0
  assert launches(done) == []
  assert all(len(launches(r)) == 1 for r in runs[1:])
  assert all(r.status is sweep.Status.DONE for r in runs)
  argv = launches(runs[2])[0]
  assert argv[argv.index("--steps") + 1] == "7"
  assert argv[argv.index("--output_dir") + 1] == str(runs[2].output_dir)

  # A restarted sweep has nothing left to do.
  assert sweep.main(flags) == 0
  assert all(len(launches(r)) == 1 for r in runs[1:])


def test_failed_runs_stay_incomplete_and_can_be_deleted(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path, n_hparams=4)
  # hparams_seed 3 fails, for both algorithms.
  assert sweep.main(flags + ["--train_command", train_command]) == 1
  assert "8 runs: 6 done, 2 incomplete, 0 not started" in (
      capsys.readouterr().out)

  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out.splitlines()
  incomplete = [line for line in listing if line.startswith("incomplete")]
  assert len(incomplete) == 2
  assert all("hparams_seed=3" in line for line in incomplete)

  assert sweep.main(["delete_incomplete", "--yes"] + flags) == 0
  assert sweep.main(["list"] + flags) == 0
  assert "8 runs: 6 done, 0 incomplete, 2 not started" in (
      capsys.readouterr().out)


def test_damaged_runs_are_neither_done_nor_launched_and_say_why(
    tmp_path, train_command, capsys):
  flags = sweep_flags(tmp_path) + ["--train_command", train_command]
  runs = sweep.runs_for(sweep.parse_args(flags))
  damaged = runs[0]
  damaged.output_dir.mkdir()
  # Finished, but its records reordered.
  (damaged.output_dir / "results.jsonl").write_text(
      '{"step": 7}\n{"step": 5}\n')
  (damaged.output_dir / "done").write_text("")
  assert damaged.status is sweep.Status.DAMAGED

  assert sweep.main(flags) == 1
  out, err = capsys.readouterr()
  assert launches(damaged) == []
  assert all(len(launches(r)) == 1 for r in runs[1:])
  assert "6 runs: 5 done, 0 incomplete, 0 not started, 1 damaged" in out
  assert (f"Skipped {damaged.output_dir}, its records damaged: "
          f"{damaged.output_dir / 'results.jsonl'} (a finished run): line 2 "
          "is of step 5, after step 7") in err
  assert "delete_incomplete deletes it" in err

  assert sweep.main(["list"] + flags) == 0
  listing = capsys.readouterr().out
  assert listing.startswith(f"damaged      {damaged.output_dir}")
  assert sweep.main(["delete_incomplete", "--yes"] + flags) == 0
  assert not damaged.output_dir.exists()
  assert sweep.main(flags) == 0
  assert len(launches(damaged)) == 1


def test_fixed_hparams_reach_only_the_algorithms_that_have_them(tmp_path):
  runs = sweep.make_runs(
      output_dir=tmp_path, datasets=["ColoredDigits"],
      algorithms=["ERM", "Fishr"], n_hparams=1, n_trials=1, test_envs=[0],
      hparams='{"cnn_width": 8, "penalty_anneal_iters": 50}')
  by_algorithm = {r.args["algorithm"]: json.loads(r.args["hparams"])
                  for r in runs}
  assert by_algorithm == {
      "ERM": {"cnn_width": 8},
      "Fishr": {"cnn_width": 8, "penalty_anneal_iters": 50}}
  with pytest.raises(ValueError, match="No swept algorithm has.*'nope'"):
    sweep.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
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
  runs = sweep.make_runs(output_dir=tmp_path, datasets=["ColoredDigits"],
                         algorithms=["ERM", "Fish"], n_hparams=2, n_trials=1,
                         test_envs=[0], trajectory_freq=5)
  saved = {(r.args["algorithm"], r.args["hparams_seed"])
           for r in runs if "trajectory_freq" in r.args}
  assert saved == {("ERM", 0)}


def test_make_runs_counts_domains_in_the_catalog_without_data(tmp_path):
  # Neither dataset's data is here; DomainBed's sweep holds out its 6 and 4
  # ENVIRONMENTS in turn.
  runs = sweep.make_runs(output_dir=tmp_path,
                         datasets=["RotatedMNIST", "TerraIncognita"],
                         algorithms=["ERM"], n_hparams=1, n_trials=1)
  assert [(r.args["dataset"], r.args["test_envs"]) for r in runs] == [
      ("RotatedMNIST", [env]) for env in range(6)] + [
          ("TerraIncognita", [env]) for env in range(4)]
