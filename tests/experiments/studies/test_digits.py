"""Tests for experiments/studies/digits.py: the digits study's runs."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments import averaging_flags
from experiments import config as config_lib
from experiments.rundir import claim
from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import rerun
from experiments.runs import run as run_lib
from experiments.studies import digits


def test_study_runs_follow_the_protocol(tmp_path):
  runs = digits.runs(str(tmp_path))
  envs = 6 + 3  # RotatedDigits and ColoredDigits, every domain held out.
  main = envs * len(digits.ALGORITHMS) * digits.N_HPARAMS * digits.N_TRIALS
  # The ablations hold out domain 0 of each dataset.
  ablations = 2 * len(digits.CLAIM_ALGORITHMS) * digits.N_TRIALS
  # The recipes: every held-out domain, at the defaults.
  methods = [averaging_flags.method({"algorithm": a, "averaging": averaging})
             for a, averaging in digits.AVERAGED] + list(
                 digits.RECIPE_ALGORITHMS)
  recipes = envs * len(methods) * digits.N_TRIALS
  assert len(runs) == main + ablations + recipes
  runs, recipe_runs = runs[:main + ablations], runs[main + ablations:]
  order = [(methods.index(averaging_flags.method(r.args)),
            r.args["trial_seed"]) for r in recipe_runs]
  assert order == sorted(order) and len(set(order)) == len(methods) * 3
  paired = {(r.args["dataset"], r.args["algorithm"], tuple(r.args["test_envs"]),
             r.args["trial_seed"]): r.args for r in runs
            if r.args["hparams_seed"] == 0}
  for run in recipe_runs:
    args = run.args
    assert args["hparams_seed"] == 0 and "trajectory_freq" not in args
    hparams = json.loads(args["hparams"])
    assert hparams.get("auto_lr", False) == (args["algorithm"] == "ERMPlusPlus")
    if "averaging" in args:
      # Trained as the algorithm's own run of that trial: the same seed.
      own = paired[args["dataset"], args["algorithm"],
                   tuple(args["test_envs"]), args["trial_seed"]]
      assert {k: v for k, v in args.items() if k != "averaging"} == {
          k: v for k, v in own.items() if k != "trajectory_freq"}
  assert len({run.output_dir for run in runs}) == len(runs)
  assert all(run.output_dir.parent == tmp_path for run in runs)
  assert digits.MAX_STEPS % digits.STEPS == 0
  assert digits.STEPS % digits.CHECKPOINT_FREQ == 0
  for run in runs:
    args = run.args
    # Plateau checks every STEPS steps, at most MAX_STEPS in all.
    assert args["steps"] == digits.MAX_STEPS
    assert args["plateau_check_freq"] == digits.STEPS
    assert args["checkpoint_freq"] == digits.CHECKPOINT_FREQ
    hparams = json.loads(args["hparams"])
    assert hparams["image_size"] == 8 and hparams["cnn_width"] == 8
    # The anneal step reaches Fishr alone, which has it.
    assert ("penalty_anneal_iters" in hparams) == (args["algorithm"] == "Fishr")
    if args["algorithm"] in digits.CLAIM_ALGORITHMS:
      assert args["hparams_seed"] == 0 and args["test_envs"] == [0]
  trajectories = {(r.args["dataset"], r.args["algorithm"], r.args["trial_seed"],
                   r.args["hparams_seed"]) for r in runs
                  if "trajectory_freq" in r.args}
  assert trajectories == {(d, a, 0, 0) for d in digits.DATASETS
                          for a in ("ERM", "PGrad")}
  assert sum("trajectory_freq" in r.args for r in runs) == 2 * envs
  # Launched defaults first, then an algorithm at a time, trial by trial.
  position = {a: i for i, a in enumerate(digits.ALGORITHMS
                                         + digits.CLAIM_ALGORITHMS)}
  order = [(r.args["hparams_seed"], position[r.args["algorithm"]],
            r.args["trial_seed"]) for r in runs]
  assert order == sorted(order)
  assert [r.args["algorithm"] for r in runs[:3]] == ["ERM"] * 3


RESULTS = Path(__file__).resolve().parents[3] / "results"


def _committed(results_dir):
  """The runs committed in ``results/<results_dir>``'s pack, by the
  directory each stands for, to its config.json."""
  root = RESULTS / results_dir
  found = {root / name: run.config
           for name, run in pack.read_pack(root).items()}
  assert found, f"no committed runs in {root / pack.PACK_FILE}"
  return found


def _resolved(run):
  """The config.json that `experiments.train` writes for ``run``."""
  config = config_lib.parse_args(run.command("train")[1:])
  return claim.run_record(config.identity(), config.hyperparameters())


@pytest.mark.parametrize("results_dir", ["study", "study_longer"])
def test_every_committed_run_is_found_under_its_name(results_dir):
  # Every committed run is the one its config.json describes: the study
  # (or its longer command) names it so, and a run of those arguments
  # resumes it rather than refusing its directory.
  planned = {run.output_dir.name: run
             for run in digits.runs(str(RESULTS / "study"))}
  for run_dir, stored in _committed(results_dir).items():
    args = stored["args"]
    if results_dir == "study":
      run = planned[run_dir.name]
    else:
      run = rerun.longer_run(
          list(planned.values()), dataset=args["dataset"],
          algorithm=args["algorithm"], hparams_seed=args["hparams_seed"],
          trial_seed=args["trial_seed"], test_env=args["test_envs"][0],
          longer_steps=args["steps"], output_dir=run_dir.parent)
    assert run.output_dir == run_dir
    assert _resolved(run) == stored, run_dir


def test_the_committed_study_is_every_run_done_and_no_params():
  # A fresh clone holds every run of the study, finished, and no params.
  runs = digits.runs(str(RESULTS / "study"))
  assert all(run.status is run_lib.Status.DONE for run in runs)
  assert {run.output_dir.name for run in runs} == set(
      pack.read_pack(RESULTS / "study"))
  tracked = subprocess.run(["git", "ls-files", "results"], cwd=RESULTS.parent,
                           check=True, capture_output=True, text=True).stdout
  assert tracked, "results/ is not tracked"
  params = [path for path in tracked.splitlines()
            if path.endswith((".npy", ".npz", records.RESULTS_FILE))
            or f"/{records.CHECKPOINT_DIR}/" in path]
  assert params == []


@pytest.mark.parametrize("results_dir", ["study", "study_longer"])
def test_a_committed_pack_packs_again_to_the_same_bytes(results_dir,
                                                        tmp_path):
  # What `study pack` does on a fresh clone, which has no run directories:
  # every packed run is written again as it was read, byte for byte,
  # whatever the pack's format gained since (its runs predate environment
  # files).
  committed = RESULTS / results_dir / pack.PACK_FILE
  shutil.copy(committed, tmp_path / pack.PACK_FILE)
  pack.pack_runs(tmp_path, {})
  assert (tmp_path / pack.PACK_FILE).read_bytes() == committed.read_bytes()
