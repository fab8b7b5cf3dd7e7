"""Tests for experiments/study.py: the study's runs."""

import json

from experiments import study
from experiments import sweep


def test_study_runs_follow_the_protocol(tmp_path):
  runs = study.study_runs(str(tmp_path))
  envs = 6 + 3  # RotatedDigits and ColoredDigits, every domain held out.
  main = envs * len(study.ALGORITHMS) * study.N_HPARAMS * study.N_TRIALS
  # The ablations hold out domain 0 of each dataset.
  ablations = 2 * len(study.CLAIM_ALGORITHMS) * study.N_TRIALS
  assert len(runs) == main + ablations
  assert len({run.output_dir for run in runs}) == len(runs)
  assert all(run.output_dir.parent == tmp_path for run in runs)
  for run in runs:
    args = run.args
    assert args["steps"] == study.STEPS
    assert args["checkpoint_freq"] == study.CHECKPOINT_FREQ
    hparams = json.loads(args["hparams"])
    assert hparams["image_size"] == 8 and hparams["cnn_width"] == 8
    # The anneal step reaches Fishr alone, which has it.
    assert ("penalty_anneal_iters" in hparams) == (args["algorithm"] == "Fishr")
    if args["algorithm"] in study.CLAIM_ALGORITHMS:
      assert args["hparams_seed"] == 0 and args["test_envs"] == [0]
  trajectories = {(r.args["dataset"], r.args["algorithm"], r.args["trial_seed"],
                   r.args["hparams_seed"]) for r in runs
                  if "trajectory_freq" in r.args}
  assert trajectories == {(d, a, 0, 0) for d in study.DATASETS
                          for a in ("ERM", "PGrad")}
  assert sum("trajectory_freq" in r.args for r in runs) == 2 * envs
  # Launched defaults first, trial by trial.
  order = [(r.args["hparams_seed"], r.args["trial_seed"]) for r in runs]
  assert order == sorted(order)


def test_study_skips_runs_marked_done(tmp_path, capsys):
  runs = study.study_runs(str(tmp_path))
  for run in runs:
    run.output_dir.mkdir()
    (run.output_dir / sweep.DONE_FILE).touch()
  assert study.main(["--output_dir", str(tmp_path)]) == 0
  assert f"{len(runs)} runs: {len(runs)} done" in capsys.readouterr().out
