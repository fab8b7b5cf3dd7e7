"""Tests for experiments/runs/rerun.py: reproducing and lengthening finished
runs, from a study's command line and from a plain sweep's."""

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments import averaging_flags
from experiments.runs import environment
from experiments.runs import grid
from experiments.runs import noise
from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import rerun
from experiments.runs import run as run_lib
from experiments.runs import study
from experiments.runs import sweep
from experiments.studies import digits

from test_noise import run_records

LONGER = ["longer", "--dataset", "RotatedDigits", "--algorithm", "Fish",
          "--hparams_seed", "1", "--trial_seed", "2", "--test_env", "0"]


def _record(step, acc, **args):
  return {"args": {"dataset": "RotatedDigits", "output_dir": "a", **args},
          "step": step, "step_time": 0.1 * step, "env0_in_acc": acc}


def test_first_difference_ignores_only_where_and_how_fast():
  committed = [_record(1, 0.5), _record(2, 0.75)]
  # Timed again, and by a loop that also times its start (committed records
  # predate those fields).
  moved = [{**r, "args": {**r["args"], "output_dir": "b"}, "step_time": 9.0,
            "compile_time": 3.0, "time_to_first_step": 4.0}
           for r in committed]
  assert rerun.first_difference(committed, moved) is None
  changed = [moved[0], {**moved[1], "env0_in_acc": 0.7500001}]
  assert rerun.first_difference(committed, changed) == (
      "step 2: env0_in_acc = 0.7500001, 0.75 committed")
  assert rerun.first_difference(committed, moved[:1]) == (
      "1 records, 2 committed")
  other_args = [_record(1, 0.5, seed=3), _record(2, 0.75, seed=3)]
  assert "args" in rerun.first_difference(committed, other_args)


def test_sample_takes_one_run_per_group_holding_out_the_lowest_domain(
    tmp_path):
  runs = digits.runs(str(tmp_path))
  chosen = rerun.sample(runs, [1])
  # 2 datasets x 5 algorithms x 3 trials of the random draw.
  assert len(chosen) == 2 * len(digits.ALGORITHMS) * digits.N_TRIALS
  assert all(run.args["hparams_seed"] == 1 and run.args["test_envs"] == [0]
             for run in chosen)
  # The recipes (ERM + SWAD, ..., ERM++) are groups of their own.
  recipes = len(digits.AVERAGED) + len(digits.RECIPE_ALGORITHMS)
  assert len(rerun.sample(runs)) == len(chosen) * 2 + 2 * (len(
      digits.CLAIM_ALGORITHMS) + recipes) * digits.N_TRIALS
  erm = rerun.sample([r for r in runs if r.args["algorithm"] == "ERM"
                      and "averaging" not in r.args], [0])
  assert sorted((r.args["dataset"], r.args["trial_seed"]) for r in erm) == [
      (d, t) for d in sorted(digits.DATASETS) for t in range(digits.N_TRIALS)]
  assert all(r.args["algorithm"] == "ERM" and r.args["hparams_seed"] == 0
             and r.args["test_envs"] == [0] for r in erm)


# A one-run sweep, trained as a sweep trains its runs.
TINY_SWEEP = ["--datasets", "RotatedDigits", "--algorithms", "ERM",
              "--n_hparams", "1", "--n_trials", "1", "--test_envs", "1",
              "--steps", "2", "--checkpoint_freq", "2", "--hparams",
              json.dumps({"batch_size": 3, "cnn_width": 8, "image_size": 8})]


def test_a_plain_sweep_reproduces_its_runs_to_equal_records(tmp_path,
                                                            capsys):
  flags = [*TINY_SWEEP, "--output_dir", str(tmp_path / "sweep")]
  assert sweep.main(flags) == 0
  [run] = sweep.runs_for(sweep.parse_args(flags))
  assert sweep.main(["reproduce", *flags, "--output",
                     str(tmp_path / "report.json")]) == 0
  out = capsys.readouterr().out
  assert "\nequal: RotatedDigits ERM 0 0, " in out
  report = json.loads((tmp_path / "report.json").read_text())
  [result] = report["runs"]
  assert result["equal"] and result["difference"] is None, result
  assert result["group"] == ["RotatedDigits", "ERM", 0, 0]
  assert report["estimated_hours"] == round(result["seconds"] / 3600, 2)
  # Trained and retrained on this machine, which each run recorded.
  [trained] = result["trained_on"]
  assert trained == records.read_environment(run.output_dir)[0]
  assert result["retrained_on"] == [trained]

  # Packed, as a study is committed, the run is compared with the same
  # records, and says where it trained.
  committed = records.read_run(run.output_dir).records
  pack.pack_runs(run.output_dir.parent, {})
  shutil.rmtree(run.output_dir)
  assert pack.finished_records(run.output_dir) == committed
  assert pack.run_environment(run.output_dir) == [trained]
  assert run.status is run_lib.Status.DONE

  # A committed record changed afterwards is found.
  changed = [*committed[:-1], {**committed[-1], "env1_in_acc": 2.0}]
  assert rerun.first_difference(committed, changed) == (
      "step 2: env1_in_acc = 2.0, "
      f"{committed[-1]['env1_in_acc']!r} committed")



def test_a_sweep_of_averaging_runs_reproduces_them_as_their_method(
    tmp_path, capsys):
  flags = [*TINY_SWEEP, "--averaging", "swad", "--output_dir",
           str(tmp_path / "sweep")]
  assert sweep.main(flags) == 0
  [run] = sweep.runs_for(sweep.parse_args(flags))
  trained = records.read_run(run.output_dir).records
  assert {record["args"]["averaging"] for record in trained} == {"swad"}
  assert "averaged_segments" in trained[-1]
  capsys.readouterr()
  assert sweep.main(["reproduce", "--output_dir", str(tmp_path / "sweep"),
                     "--output", str(tmp_path / "report.json")]) == 0
  assert "\nequal: RotatedDigits ERM + SWAD 0 0, " in capsys.readouterr().out
  [result] = json.loads((tmp_path / "report.json").read_text())["runs"]
  assert result["group"] == ["RotatedDigits", "ERM + SWAD", 0, 0]


def test_sample_picks_algorithms_by_their_method(tmp_path):
  kwargs = dict(output_dir=tmp_path, datasets=["ColoredDigits"],
                algorithms=["ERM", "PGrad"], n_hparams=1, n_trials=2,
                test_envs=[0])
  plain = grid.make_runs(**kwargs)
  averaged = grid.make_runs(**kwargs, averaging="swad")
  runs = plain + averaged
  # "ERM" is ERM's runs without averaging; "ERM + SWAD" those with it.
  assert rerun.sample(runs, algorithms=["ERM"]) == [
      r for r in plain if r.args["algorithm"] == "ERM"]
  assert rerun.sample(runs, algorithms=["ERM + SWAD", "PGrad"]) == [
      r for r in runs if averaging_flags.method(r.args) in (
          "ERM + SWAD", "PGrad")]
  assert len(rerun.sample(runs)) == 8


def test_longer_names_the_run_by_its_method(tmp_path, capsys):
  flags = [*TINY_SWEEP, "--averaging", "swad", "--output_dir",
           str(tmp_path / "sweep")]
  [run] = sweep.runs_for(sweep.parse_args(flags))
  longer = rerun.longer_run(
      [run], dataset="RotatedDigits", algorithm="ERM + SWAD", hparams_seed=0,
      trial_seed=0, test_env=1, longer_steps=5, output_dir=tmp_path / "l")
  assert longer.args == {**run.args, "steps": 5}
  # ERM's runs without averaging are not the sweep's: it says whose it has.
  assert ("no run of ERM on RotatedDigits with hparams_seed 0, trial_seed 0 "
          "and test_env 1; the runs are of ERM + SWAD (the names --algorithm "
          "takes)") in _refused_longer_run(flags, test_env=1, capsys=capsys)
  assert not (tmp_path / "sweep_longer").exists()

MACHINE = {"processor": "AMD EPYC 7B13", "backend": "cpu", "jax": "0.10.2"}
OTHER_MACHINE = {"processor": "Intel(R) Xeon(R) Platinum 8481C",
                 "backend": "cpu", "jax": "0.10.2"}


@dataclasses.dataclass(frozen=True)
class CopiedRun:
  """A finished run as `rerun.reproduce` sees one, whose training writes the
  records of ``source`` changed by ``change`` (by default, not at all) and
  records ``machine`` (None: nothing) as where it trained."""

  output_dir: Path
  args: dict[str, Any]
  source: Path
  machine: dict[str, Any] | None
  change: Callable[[dict[str, Any]], dict[str, Any]] = lambda record: record

  def train(self) -> int:
    self.output_dir.mkdir(parents=True)
    for record in records.read_run(self.source).records:
      records.append_record(self.output_dir, self.change(record))
    records.mark_done(self.output_dir)
    if self.machine is not None:
      records.append_environment(self.output_dir, self.machine)
    return 0


def _trained_cell(directory, trained_on):
  """Three finished trials of one cell, trained on ``trained_on`` (None:
  unrecorded), in ``directory``."""
  trials = []
  for trial, (acc, val, loss) in enumerate(
      [(0.65, 0.70, 1e-4), (0.62, 0.68, 1.2e-4), (0.66, 0.66, 1.1e-4)]):
    source = directory / f"trial{trial}"
    source.mkdir(parents=True)
    for record in run_records([acc - 0.1, acc], [(val, val)] * 2,
                               [(1.0, 1.0), (loss, loss)], trial_seed=trial):
      records.append_record(source, record)
    records.mark_done(source)
    for entry in trained_on or []:
      if entry is not None:  # None: steps trained before entries were kept.
        records.append_environment(source, entry,
                                   unrecorded_before=None in trained_on)
    trials.append(source)
  return trials


def _last_digits(record):
  return {**record, "env0_in_acc": record["env0_in_acc"] + 1 / 240}


def _ten_times_the_loss(record):
  return {**record, "env1_in_loss": 10 * record["env1_in_loss"],
          "env2_in_loss": 10 * record["env2_in_loss"]}


def test_reproduce_judges_by_noise_only_where_the_environment_differs(
    tmp_path):
  cases = {  # name: where it trained, where again, what changed, verdict
      "same": ([MACHINE], MACHINE, None, "equal"),
      "same, changed": ([MACHINE], MACHINE, _last_digits,
                        "DIFFERENT in the environment it trained in"),
      "elsewhere": ([OTHER_MACHINE], MACHINE, _last_digits,
                    "within the trials' noise"),
      "moved": ([OTHER_MACHINE, MACHINE], MACHINE, _last_digits,
                "within the trials' noise"),
      "resumed": ([None, MACHINE], MACHINE, _last_digits,
                  "within the trials' noise"),
      "unrecorded": (None, MACHINE, _last_digits, "within the trials' noise"),
      "unrecorded, planted": (None, MACHINE, _ten_times_the_loss,
                              "differs beyond the trials' noise")}
  results = {}
  for name, (trained_on, machine, change, _) in cases.items():
    trials = _trained_cell(tmp_path / name, trained_on)
    runs = [CopiedRun(source, records.read_run(source).records[0]["args"],
                      source, machine, change or (lambda record: record))
            for source in trials]
    [result] = rerun.reproduce(runs, runs[:1], tmp_path / "scratch" / name,
                               jobs=1)["runs"]
    results[name] = result
  assert {name: result["verdict"] for name, result in results.items()} == {
      name: case[-1] for name, case in cases.items()}
  assert [rerun.VERDICTS[case[-1]] for case in cases.values()] == [
      True, False, True, True, True, True, False]
  assert results["resumed"]["trained_on"] == [None, MACHINE]
  assert results["same"]["noise"] is None
  planted = results["unrecorded, planted"]["noise"]
  assert [planted[name]["within"] for name in noise.NUMBERS] == [
      True, True, False]
  assert math.isclose(planted["log_final_loss"]["retrained"],
                      np.log(1e-3), rel_tol=1e-12)
  assert (results["moved"]["trained_on"], results["moved"]["retrained_on"]
          ) == ([OTHER_MACHINE, MACHINE], [MACHINE])

  # Each environment is said once, with what differs.
  described = rerun.describe_environments(list(results.values()))
  assert "Trained on: unrecorded (2 runs" in described
  assert ("  not as retrained: processor: Intel(R) Xeon(R) Platinum 8481C "
          "trained, AMD EPYC 7B13 now") in described
  assert described.count("Retrained on (7 runs): AMD EPYC 7B13") == 1
  assert "Trained on (1 runs): unrecorded; then AMD EPYC 7B13" in described
  versions = rerun.describe_environments([{
      **results["same"], "trained_on": [{**MACHINE, "jax": "0.11.2"}]}])
  assert ("The installed versions of jax differ from the runs'."
          in versions)
  assert "The installed versions are the runs'." in described
  # Runs that recorded nothing, held against the versions of a lock.
  locked = rerun.describe_environments(
      [results["unrecorded"]], ("lock.txt", {"jax": "0.10.2", "flax": "0.9"}))
  assert locked.splitlines()[:2] == [
      "Trained on: unrecorded (1 runs, from before runs recorded where they "
      "trained); processor unknown, versions as lock.txt locks them: jax "
      "0.10.2, flax 0.9.",
      "  The installed versions of flax differ from lock.txt's."]


def test_with_hparams_changes_some_hparams_of_a_run_under_its_name(tmp_path):
  [run] = sweep.runs_for(sweep.parse_args(
      [*TINY_SWEEP, "--output_dir", str(tmp_path)]))
  changed = rerun.with_hparams(run, {"lr": 0.003})
  assert changed.output_dir == run.output_dir
  assert json.loads(changed.args["hparams"]) == {
      **json.loads(run.args["hparams"]), "lr": 0.003}
  assert {k: v for k, v in changed.args.items() if k != "hparams"} == {
      k: v for k, v in run.args.items() if k != "hparams"}


def test_changed_hparams_must_be_a_json_object(tmp_path, capsys):
  for bad in ("lr=3", "[1]", "{}"):
    try:
      study.main(["reproduce", "--output_dir", str(tmp_path),
                  "--changed_hparams", bad])
    except SystemExit as e:
      assert e.code == 2
    else:
      raise AssertionError(f"--changed_hparams {bad} was taken")
    assert "--changed_hparams" in capsys.readouterr().err


def test_changed_hparams_are_checked_before_any_run_retrains(tmp_path,
                                                              capsys):
  # A finished run, its records written as training writes them.
  flags = [*TINY_SWEEP, "--output_dir", str(tmp_path / "sweep")]
  [run] = sweep.runs_for(sweep.parse_args(flags))
  run.output_dir.mkdir(parents=True)
  for record in run_records([0.5, 0.6], [(0.7, 0.7)] * 2,
                            [(1.0, 1.0), (0.5, 0.5)]):
    records.append_record(run.output_dir, record)
  records.mark_done(run.output_dir)
  assert run.status is run_lib.Status.DONE
  # An hparam that ERM lacks, or a value out of range, is the user's
  # mistake, named at once; each copy would only exit 2 without saying why.
  for changed, said in [({"lr_": 0.003}, "Unknown hparams ['lr_'] for ERM"),
                        ({"lr": -1}, "hparam 'lr' must be a number > 0")]:
    try:
      sweep.main(["reproduce", *flags, "--changed_hparams",
                  json.dumps(changed)])
    except SystemExit as e:
      assert e.code == 2
    else:
      raise AssertionError(f"--changed_hparams {changed} was taken")
    out, err = capsys.readouterr()
    assert "Retraining" not in out
    assert f"--changed_hparams: {said}" in err


def _refused_longer_run(flags, *, test_env, capsys):
  """What ``sweep longer`` says, exiting 2, of ERM's run holding out
  ``test_env`` in the sweep of ``flags``, which lacks it."""
  try:
    sweep.main(["longer", *flags, "--dataset", "RotatedDigits",
                "--algorithm", "ERM", "--hparams_seed", "0", "--trial_seed",
                "0", "--test_env", str(test_env), "--longer_steps", "5"])
  except SystemExit as e:
    assert e.code == 2
  else:
    raise AssertionError("a run the sweep lacks was not refused")
  return capsys.readouterr().err


def test_a_plain_sweep_refuses_a_longer_run_it_lacks(tmp_path, capsys):
  flags = [*TINY_SWEEP, "--output_dir", str(tmp_path / "sweep")]
  assert ("no run of ERM on RotatedDigits with hparams_seed 0, trial_seed 0 "
          "and test_env 0" in _refused_longer_run(flags, test_env=0,
                                                  capsys=capsys))
  assert not (tmp_path / "sweep_longer").exists()


def test_longer_run_is_the_study_run_made_longer(tmp_path):
  runs = digits.runs(str(tmp_path / "study"))
  run = rerun.longer_run(
      runs, dataset="ColoredDigits", algorithm="ERM", hparams_seed=0,
      trial_seed=0, test_env=2, longer_steps=5000,
      output_dir=tmp_path / "longer")
  (original,) = [r for r in runs if r.args["dataset"] == "ColoredDigits"
                 and r.args["algorithm"] == "ERM" and "averaging" not in r.args
                 and r.args["trial_seed"] == 0
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


def test_longer_prints_where_a_finished_run_would_have_ended(tmp_path,
                                                             capsys):
  run = rerun.longer_run(
      digits.runs(str(tmp_path)), dataset="RotatedDigits",
      algorithm="Fish", hparams_seed=1, trial_seed=2, test_env=0,
      longer_steps=3000, output_dir=tmp_path / "longer")
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
  assert study.main([*LONGER, "--longer_steps", "3000", "--output_dir",
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




def test_the_digits_study_names_the_lock_of_its_versions():
  name, versions = study.study_lock(digits)
  assert name == "requirements/study.txt"
  # It pins every package whose version a run records.
  assert sorted(versions) == sorted(environment.PACKAGES)
