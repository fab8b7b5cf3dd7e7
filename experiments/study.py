"""The converged DomainBed-protocol study of the embedded digits, one command.

Usage::

    python -m experiments.study --jobs 2          # train what is missing
    python -m experiments.study list              # where every run stands
    python -m experiments.report --input_dir results/study \\
        --output_dir results/study_report

The protocol is DomainBed's (see docs/study.md for how it was chosen and
measured): RotatedDigits and ColoredDigits, every domain held out in turn,
``hparams_seed`` 0 (the defaults) and `N_HPARAMS` - 1 random draws, `N_TRIALS`
trials, training-domain validation and oracle selection in the report. It
trains `ALGORITHMS` over every draw and held-out domain, and the claims'
ablations (`experiments.claims`) at their defaults with domain 0 held out.
Every run trains `STEPS` steps at `FIXED_HPARAMS` (the digits' native 8x8
inputs, a CNN of width 8), evaluating every `CHECKPOINT_FREQ` steps.

Runs are launched default hparams first, trial by trial, then the random draws.
They live in ``results/study/<md5 of their args>``. The JSON-lines records, the
``done`` markers and the trajectories are committed; checkpoints, final params
and logs are not (see .gitignore). So the same command continues a study
stopped half-way, on this machine from the runs' checkpoints and on a fresh
clone from what was committed: finished runs are skipped, unfinished ones train
again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from experiments import catalog
from experiments import hparams_registry
from experiments import sweep

DATASETS = ("RotatedDigits", "ColoredDigits")
ALGORITHMS = ("ERM", "PGrad", "PGrad-B", "Fish", "Fishr")
CLAIM_ALGORITHMS = tuple(name for name, entry in catalog.ALGORITHMS.items()
                         if entry.variant_of)
N_HPARAMS = 2
N_TRIALS = 3
# PGrad (B = 1) is the slowest to converge: its training loss is still 0.15
# and falling at step 1,000 (docs/study.md).
STEPS = 2000
CHECKPOINT_FREQ = 100
CLAIM_TEST_ENVS = (0,)
# Fishr's penalty switches on at 30% of training, DomainBed's 1,500 of 5,000.
# The digits' native 8x8 scans: a step costs a fifth of 14x14's
# (docs/study.md).
FIXED_HPARAMS = {"image_size": 8, "cnn_width": 8,
                 "penalty_anneal_iters": 3 * STEPS // 10}
TRAJECTORY_FREQ = 100
OUTPUT_DIR = "results/study"


def study_runs(output_dir: str = OUTPUT_DIR) -> list[sweep.Run]:
  """Every run of the study.

  Trajectories are saved only by trial 0's default runs of ERM and PGrad, to
  keep the committed results small.
  """
  def runs_of(algorithms, n_hparams, test_envs=None):
    # Only the fixed hparams that these algorithms have (sweep's check).
    known = set().union(*(hparams_registry.default_hparams(a, d)
                          for a in algorithms for d in DATASETS))
    fixed = {k: v for k, v in FIXED_HPARAMS.items() if k in known}
    return sweep.make_runs(
        output_dir=output_dir, datasets=DATASETS, algorithms=algorithms,
        n_hparams=n_hparams, n_trials=N_TRIALS, test_envs=test_envs,
        steps=STEPS,
        checkpoint_freq=CHECKPOINT_FREQ,
        hparams=json.dumps(fixed, sort_keys=True),
        trajectory_freq=TRAJECTORY_FREQ)

  runs = (runs_of(ALGORITHMS, N_HPARAMS)
          + runs_of(CLAIM_ALGORITHMS, 1, CLAIM_TEST_ENVS))
  kept = []
  for run in runs:
    if run.args["trial_seed"] and "trajectory_freq" in run.args:
      args = {k: v for k, v in run.args.items() if k != "trajectory_freq"}
      run = sweep.Run.create(args, output_dir)
    kept.append(run)
  # The default-hparams runs of every trial first: they are the cheapest (a
  # random draw's batch is up to 8x the default's), and a study stopped
  # part-way then holds complete default-hparams comparisons over trials.
  return sorted(kept, key=lambda run: (run.args["hparams_seed"],
                                       run.args["trial_seed"]))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("command", nargs="?", default="launch",
                      choices=["launch", "list"],
                      help="launch (default): train every run not done; "
                      "list: the status of every run.")
  parser.add_argument("--output_dir", default=OUTPUT_DIR,
                      help=f"Default: {OUTPUT_DIR}.")
  parser.add_argument("--jobs", type=int, default=2,
                      help="Runs trained at once; default: 2.")
  args = parser.parse_args(argv)
  runs = study_runs(args.output_dir)
  if args.command == "list":
    for run in runs:
      print(run)
    print(sweep.summary(runs))
    return 0
  print(sweep.summary(runs))
  try:
    failed = sweep.launch(runs, jobs=args.jobs)
  except KeyboardInterrupt:
    print("Interrupted; the same command resumes the study.", file=sys.stderr)
    return 130
  for run in failed:
    print(f"Failed (see {run.output_dir / sweep.LOG_FILE}): {run}")
  print(sweep.summary(runs))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
