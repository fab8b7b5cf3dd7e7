"""Tests for experiments/study.py: launching, listing, reproducing and
lengthening a study."""

import json

import pytest

from experiments import records
from experiments import study
from experiments import sweep
from experiments.studies import digits


def test_study_skips_runs_marked_done(tmp_path, capsys):
  runs = digits.runs(str(tmp_path))
  for run in runs:
    run.output_dir.mkdir()
    (run.output_dir / records.RESULTS_FILE).write_text('{"step": 1}\n')
    (run.output_dir / records.DONE_FILE).touch()
  assert study.main(["--output_dir", str(tmp_path)]) == 0
  assert f"{len(runs)} runs: {len(runs)} done" in capsys.readouterr().out


def _record(step, acc, **args):
  return {"args": {"dataset": "RotatedDigits", "output_dir": "a", **args},
          "step": step, "step_time": 0.1 * step, "env0_in_acc": acc}


def test_first_difference_ignores_only_where_and_how_fast():
  committed = [_record(1, 0.5), _record(2, 0.75)]
  moved = [{**r, "args": {**r["args"], "output_dir": "b"}, "step_time": 9.0}
           for r in committed]
  assert study.first_difference(committed, moved) is None
  changed = [moved[0], {**moved[1], "env0_in_acc": 0.7500001}]
  assert study.first_difference(committed, changed) == (
      "step 2: env0_in_acc = 0.7500001, 0.75 committed")
  assert study.first_difference(committed, moved[:1]) == (
      "1 records, 2 committed")
  other_args = [_record(1, 0.5, seed=3), _record(2, 0.75, seed=3)]
  assert "args" in study.first_difference(committed, other_args)


def test_sample_takes_one_run_per_group_holding_out_the_lowest_domain(
    tmp_path):
  runs = digits.runs(str(tmp_path))
  chosen = study.sample(runs, [1])
  # 2 datasets x 5 algorithms x 3 trials of the random draw.
  assert len(chosen) == 2 * len(digits.ALGORITHMS) * digits.N_TRIALS
  assert all(run.args["hparams_seed"] == 1 and run.args["test_envs"] == [0]
             for run in chosen)
  assert len(study.sample(runs)) == len(chosen) * 2 + 2 * len(
      digits.CLAIM_ALGORITHMS) * digits.N_TRIALS
  erm = study.sample(runs, [0], ["ERM"])
  assert sorted((r.args["dataset"], r.args["trial_seed"]) for r in erm) == [
      (d, t) for d in sorted(digits.DATASETS) for t in range(digits.N_TRIALS)]
  assert all(r.args["algorithm"] == "ERM" and r.args["hparams_seed"] == 0
             and r.args["test_envs"] == [0] for r in erm)


def test_reproduce_retrains_a_run_to_equal_records(tmp_path):
  # A finished one-run "study", trained as the study trains its runs.
  tiny = {"dataset": "RotatedDigits", "algorithm": "ERM", "test_envs": [1],
          "hparams_seed": 0, "trial_seed": 0, "seed": 0, "steps": 2,
          "checkpoint_freq": 2, "eval_examples": 16, "loss_examples": 8,
          "hparams": json.dumps({"batch_size": 3, "cnn_width": 8,
                                 "image_size": 8})}
  run = sweep.Run.create(tiny, tmp_path / "study")
  assert sweep.launch([run]) == []
  report = study.reproduce([run], [run], tmp_path / "scratch", jobs=1)
  [result] = report["runs"]
  assert result["equal"] and result["difference"] is None, result
  assert result["group"] == ["RotatedDigits", "ERM", 0, 0]
  assert report["estimated_hours"] == round(result["seconds"] / 3600, 2)

  # The retrained records stay in the scratch directory; a committed record
  # changed afterwards is found.
  retrained = records.read_run(
      tmp_path / "scratch" / run.output_dir.name).records
  committed = records.read_run(run.output_dir).records
  committed[-1]["env1_in_acc"] += 0.25
  assert study.first_difference(committed, retrained).startswith(
      "step 2: env1_in_acc = ")


def test_reproduce_without_finished_runs_says_so(tmp_path, capsys):
  assert study.main(["reproduce", "--output_dir", str(tmp_path)]) == 1
  assert "no finished runs to reproduce" in capsys.readouterr().err
  assert study.main(["reproduce", "--output_dir", str(tmp_path),
                     "--hparams_seeds", "0", "--algorithms", "ERM"]) == 1
  assert ("no finished runs with hparams_seed in [0] of ERM to reproduce"
          in capsys.readouterr().err)


LONGER = ["longer", "--dataset", "RotatedDigits", "--algorithm", "Fish",
          "--hparams_seed", "1", "--trial_seed", "2", "--test_env", "0"]


def test_longer_run_is_the_study_run_made_longer(tmp_path):
  runs = digits.runs(str(tmp_path / "study"))
  run = study.longer_run(
      runs, dataset="ColoredDigits", algorithm="ERM", hparams_seed=0,
      trial_seed=0, test_env=2, steps=5000, min_steps=digits.STEPS,
      output_dir=tmp_path / "longer")
  (original,) = [r for r in runs if r.args["dataset"] == "ColoredDigits"
                 and r.args["algorithm"] == "ERM" and r.args["trial_seed"] == 0
                 and r.args["hparams_seed"] == 0 and r.args["test_envs"] == [2]]
  # Trial 0's default ERM run saves trajectories and stops at its plateau;
  # the longer one does neither.
  assert "trajectory_freq" in original.args
  assert "plateau_check_freq" in original.args
  assert run.args == {**{k: v for k, v in original.args.items()
                         if k not in ("trajectory_freq",
                                      "plateau_check_freq")},
                      "steps": 5000}
  assert run.output_dir.parent == tmp_path / "longer"


def test_longer_refuses_what_the_study_lacks_before_training(tmp_path, capsys):
  for flags, message in [
      (["--steps", "3000", "--test_env", "6"], "no run of Fish on "
       "RotatedDigits with hparams_seed 1, trial_seed 2 and test_env 6"),
      (["--steps", "1000"], f"at least the study's {digits.STEPS}"),
      ([], "longer needs --steps"),
      (["--steps", "3000", "--every", "0"], "--every must be at least 1"),
      (["--steps", "3000", "list"], "only for the longer command")]:
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


def test_longer_prints_where_a_finished_run_would_have_ended(tmp_path,
                                                             capsys):
  run = study.longer_run(
      digits.runs(str(tmp_path)), dataset="RotatedDigits",
      algorithm="Fish", hparams_seed=1, trial_seed=2, test_env=0,
      steps=3000, min_steps=digits.STEPS, output_dir=tmp_path / "longer")
  run.output_dir.mkdir(parents=True)
  # Training-domain validation climbs to step 2000, then holds.
  run_records = []
  for step in range(100, 3100, 100):
    record = {"args": {**run.args, "test_envs": [0]}, "step": step,
              "step_time": 0.01, "env0_in_acc": step / 6000,
              "env0_out_acc": step / 6000}
    for i in range(1, 6):
      record.update({f"env{i}_out_acc": min(step, 2000) / 2500,
                     f"env{i}_out_examples": 60, f"env{i}_in_acc": 0.9,
                     f"env{i}_in_loss": 1000 / step})
    run_records.append(record)
  (run.output_dir / "results.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in run_records))
  (run.output_dir / records.DONE_FILE).touch()
  assert study.main([*LONGER, "--steps", "3000", "--output_dir",
                     str(tmp_path), "--longer_dir",
                     str(tmp_path / "longer")]) == 0
  out = capsys.readouterr().out
  assert "Training" not in out
  rows = [line.split() for line in out.splitlines()[1:-1]]
  assert [row[0] for row in rows] == ["1000", "2000", "3000"]
  # One SE of 80% over 5 x 60 validation examples: 0.023.
  assert rows[-1][1:] == ["0.3333", "0.900", "0.000", "0.023", "yes", "0.500"]
  # The window of step 2400 starts at 2000; from there on nothing moves.
  assert out.splitlines()[-1] == (
      "Plateaued at every evaluation from step 2400 on.")


@pytest.mark.parametrize("flags, message", [
    (["--study", "photos"], "no experiments/studies/photos.py; the studies "
     "are digits"),
    (["reproduce", "--algorithms", "ERM", "MixUp"], "--algorithms MixUp: the "
     "study trains none of them")])
def test_unknown_studies_and_algorithms_are_usage_errors(tmp_path, capsys,
                                                         flags, message):
  with pytest.raises(SystemExit) as e:
    study.main([*flags, "--output_dir", str(tmp_path)])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
