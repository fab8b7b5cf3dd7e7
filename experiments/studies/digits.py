"""The converged DomainBed-protocol study of the embedded digits.

RotatedDigits and ColoredDigits, every domain held out in turn,
``hparams_seed`` 0 (the defaults) and `N_HPARAMS` - 1 random draws,
`N_TRIALS` trials. It trains `ALGORITHMS` over every draw and held-out
domain, the claims' ablations at their defaults with domain 0 held out, and
the weight-averaging recipes (`AVERAGED`, and ERM++ with its
validation-driven learning rate) at their defaults over every held-out
domain.
Every run trains at `FIXED_HPARAMS` (the digits' native 8x8 inputs, a CNN of
width 8), evaluating every `CHECKPOINT_FREQ` steps, until it has plateaued
(`experiments.runs.convergence`): it checks every `STEPS` steps and stops at
the first check at which it has, training at most `MAX_STEPS` steps
(docs/study.md says how these were chosen and measured).

    python -m experiments.runs.study --study digits
"""

from __future__ import annotations

import json

from experiments import averaging_flags
from experiments import catalog
from experiments import hparams_registry
from experiments.runs import grid as grid_lib
from experiments.runs import run as run_lib

DATASETS = ("RotatedDigits", "ColoredDigits")
# Every algorithm of the paper's Table 2, in its order: ERM, the ten
# baselines by category, then PGrad, PGrad-B and PGrad-BMix.
ALGORITHMS = ("ERM", "IRM", "MMD", "DANN", "CORAL", "GroupDRO", "MLDG",
              "MixUp", "ARM", "Fish", "Fishr", "PGrad", "PGrad-B",
              "PGrad-BMix")
CLAIM_ALGORITHMS = tuple(name for name, entry in catalog.ALGORITHMS.items()
                         if entry.variant_of)
# Weight averaging along the run (``--averaging``), the recipes of domain
# generalization since 2021: (algorithm, averaging). A run averaging the
# weights of an algorithm has that algorithm's seed, so it trains exactly
# as that algorithm's run of the same trial and held-out domain (but where
# SWAD's valley stops it first), and the two compare pair by pair.
AVERAGED = (("ERM", "swad"), ("PGrad-B", "swad"), ("ERM", "sma"))
# ERM++ as DomainBed's train_autolr.py trains it: its linear probe, its
# moving average, and its learning rate lowered on its validation loss's
# plateaus, the run ended by the third change (hparam auto_lr).
RECIPE_ALGORITHMS = ("ERMPlusPlus",)
N_HPARAMS = 2
N_TRIALS = 3
# PGrad (B = 1), the slowest of the default hparams to converge, needs 2,000
# steps (its training loss is still 0.15 and falling at step 1,000); random
# draws with small learning rates need up to about 10,000 (docs/study.md).
STEPS = 2000
MAX_STEPS = 6 * STEPS
CHECKPOINT_FREQ = 100
CLAIM_TEST_ENVS = (0,)
# Fishr's penalty switches on at 30% of the first check's steps, as
# DomainBed's at 1,500 of 5,000.
# The digits' native 8x8 scans: a step costs a fifth of 14x14's
# (docs/study.md). MLDG pairs the training domains at random, the rule of
# DomainBed before b93c22a: ColoredDigits trains on two domains, and b93c22a's
# meta-test split builds no pairs from two.
FIXED_HPARAMS = {"image_size": 8, "cnn_width": 8,
                 "penalty_anneal_iters": 3 * STEPS // 10,
                 "mldg_pairs": "random_pairs", "auto_lr": True}
TRAJECTORY_FREQ = 100
OUTPUT_DIR = "results/study"
# The versions that trained the committed runs, as far as can be known
# (docs/study.md, "Reproducing the study"): reproduce holds the runs, which
# recorded none, against them.
REQUIREMENTS = "requirements/study.txt"


def runs(output_dir: str = OUTPUT_DIR) -> list[run_lib.Run]:
  """Every run of the study.

  Trajectories are saved only by trial 0's default runs of ERM and PGrad:
  the claims draw one trial's params paths per held-out domain.
  """
  def runs_of(algorithms, n_hparams, test_envs=None, averaging=None):
    # Only the fixed hparams that these algorithms have (sweep's check).
    known = set().union(*(hparams_registry.default_hparams(a, d)
                          for a in algorithms for d in DATASETS))
    fixed = {k: v for k, v in FIXED_HPARAMS.items() if k in known}
    return grid_lib.make_runs(
        output_dir=output_dir, datasets=DATASETS, algorithms=algorithms,
        n_hparams=n_hparams, n_trials=N_TRIALS, test_envs=test_envs,
        steps=MAX_STEPS,
        checkpoint_freq=CHECKPOINT_FREQ,
        plateau_check_freq=STEPS,
        hparams=json.dumps(fixed, sort_keys=True),
        trajectory_freq=None if averaging else TRAJECTORY_FREQ,
        averaging=averaging)

  planned = (runs_of(ALGORITHMS, N_HPARAMS)
             + runs_of(CLAIM_ALGORITHMS, 1, CLAIM_TEST_ENVS))
  recipes = ([run for algorithm, averaging in AVERAGED
              for run in runs_of((algorithm,), 1, averaging=averaging)]
             + runs_of(RECIPE_ALGORITHMS, 1))
  kept = []
  for run in planned:
    if run.args["trial_seed"] and "trajectory_freq" in run.args:
      args = {k: v for k, v in run.args.items() if k != "trajectory_freq"}
      run = run_lib.Run.create(args, output_dir)
    kept.append(run)
  # The default-hparams runs first: they are the cheapest (a random draw's
  # batch is up to 8x the default's). Then an algorithm at a time, every
  # trial of it: a study stopped part-way holds complete default-hparams
  # rows (every held-out domain, every trial) for its first algorithms.
  # The recipes, added to a study already trained, come last.
  position = {name: i for i, name in enumerate(ALGORITHMS + CLAIM_ALGORITHMS)}
  order = sorted(kept, key=lambda run: (run.args["hparams_seed"],
                                        position[run.args["algorithm"]],
                                        run.args["trial_seed"]))
  methods = [averaging_flags.method({"algorithm": a, "averaging": averaging})
             for a, averaging in AVERAGED] + list(RECIPE_ALGORITHMS)
  return order + sorted(recipes, key=lambda run: (
      methods.index(averaging_flags.method(run.args)),
      run.args["trial_seed"]))
