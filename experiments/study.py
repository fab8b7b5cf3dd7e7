"""The converged DomainBed-protocol study of the embedded digits, one command.

Usage::

    python -m experiments.study --jobs 2          # train what is missing
    python -m experiments.study list              # where every run stands
    python -m experiments.study reproduce --hparams_seeds 1 \\
        --output results/study_reproduction/draw1.json  # retrain a sample
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

``reproduce`` retrains a sample of the finished runs from scratch in a scratch
directory, one per ``(dataset, algorithm, hparams_seed, trial_seed)`` (the
run holding out the lowest domain), two at a time as the study trains, and
checks that every record comes out equal to the committed one, timing
excepted. It times each run whole (start-up, compilation, training and
evaluation) and estimates from them what the sampled draws of the study cost
on this machine: each sampled run's time stands for the other held-out
domains of its group.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import catalog
from experiments import hparams_registry
from experiments import model_selection
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


# Fields of a record that differ between two trainings of one run: where it
# was written and how fast it went.
_UNREPRODUCIBLE = ("output_dir", "step_time")


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
  args = {k: v for k, v in record["args"].items() if k not in _UNREPRODUCIBLE}
  return {**{k: v for k, v in record.items() if k not in _UNREPRODUCIBLE},
          "args": args}


def first_difference(committed: Sequence[dict[str, Any]],
                     retrained: Sequence[dict[str, Any]]) -> str | None:
  """Where two runs' records first differ (timing excepted), or None."""
  if len(committed) != len(retrained):
    return f"{len(retrained)} records, {len(committed)} committed"
  for old, new in zip(map(_comparable, committed), map(_comparable, retrained)):
    for key in sorted(old.keys() | new.keys()):
      if old.get(key) != new.get(key):
        return (f"step {old.get('step')}: {key} = {new.get(key)!r}, "
                f"{old.get(key)!r} committed")
  return None


def _group(run: sweep.Run) -> tuple[Any, ...]:
  a = run.args
  return a["dataset"], a["algorithm"], a["hparams_seed"], a["trial_seed"]


def sample(runs: Sequence[sweep.Run],
           hparams_seeds: Sequence[int] | None = None) -> list[sweep.Run]:
  """One run per (dataset, algorithm, hparams_seed, trial_seed) group, the one
  holding out the lowest domain, from the given draws (default: all)."""
  chosen = {}
  for run in sorted(runs, key=lambda run: run.args["test_envs"]):
    if hparams_seeds is None or run.args["hparams_seed"] in hparams_seeds:
      chosen.setdefault(_group(run), run)
  return list(chosen.values())


def reproduce(runs: Sequence[sweep.Run], chosen: Sequence[sweep.Run],
              scratch_dir: Path, jobs: int) -> dict[str, Any]:
  """Retrains ``chosen`` (finished runs among ``runs``) under ``scratch_dir``.

  Args:
    runs: every run of the study, for the size of each chosen run's group.
    chosen: the runs to retrain, each from scratch, ``jobs`` at a time.
    scratch_dir: where the copies train (with their own compilation cache).
    jobs: how many copies train at once.

  Returns:
    A report: for every chosen run its group, whether its records (not its
    trajectory snapshots) came out equal, timing excepted, or where they
    first differ, and its wall time in seconds; and the estimated wall time
    of all of ``runs`` in the chosen groups at ``jobs`` runs at a time (each
    chosen run's time times its group's size, over ``jobs``).
  """
  def retrain(run):
    copy = sweep.Run.create(run.args, scratch_dir)
    start = time.monotonic()
    returncode = sweep.train_run(copy)
    seconds = time.monotonic() - start
    committed = model_selection.load_records(run.output_dir)
    difference = (f"exit status {returncode}" if returncode else
                  first_difference(committed,
                                   model_selection.load_records(copy.output_dir)))
    return {"run": run.output_dir.name, "group": list(_group(run)),
            "equal": difference is None, "difference": difference,
            "seconds": round(seconds, 1)}

  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    results = list(pool.map(retrain, chosen))
  sizes = collections.Counter(map(_group, runs))
  total = sum(r["seconds"] * sizes[tuple(r["group"])] for r in results)
  return {"runs": results,
          "runs_in_sampled_groups": sum(sizes[_group(run)] for run in chosen),
          "jobs": jobs,
          "estimated_hours": round(total / jobs / 3600, 2)}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("command", nargs="?", default="launch",
                      choices=["launch", "list", "reproduce"],
                      help="launch (default): train every run not done; "
                      "list: the status of every run; reproduce: retrain a "
                      "sample of the done runs and compare their records.")
  parser.add_argument("--output_dir", default=OUTPUT_DIR,
                      help=f"Default: {OUTPUT_DIR}.")
  parser.add_argument("--jobs", type=int, default=2,
                      help="Runs trained at once; default: 2.")
  parser.add_argument("--hparams_seeds", type=int, nargs="+", default=None,
                      help="reproduce: the draws to sample; default: all.")
  parser.add_argument("--output", default=None,
                      help="reproduce: also write the report there (JSON).")
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}.")
  runs = study_runs(args.output_dir)
  if args.command == "reproduce":
    return _reproduce_command(runs, args)
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


def _reproduce_command(runs: Sequence[sweep.Run],
                       args: argparse.Namespace) -> int:
  chosen = [run for run in sample(runs, args.hparams_seeds)
            if run.status is sweep.Status.DONE]
  if not chosen:
    draws = ("" if args.hparams_seeds is None else
             f" with hparams_seed in {args.hparams_seeds}")
    print(f"error: no finished runs{draws} to reproduce in "
          f"{args.output_dir}.", file=sys.stderr)
    return 1
  print(f"Retraining {len(chosen)} runs, {args.jobs} at a time.")
  with tempfile.TemporaryDirectory(prefix="study_reproduce_") as scratch:
    report = reproduce(runs, chosen, Path(scratch), args.jobs)
  for result in report["runs"]:
    print(f"{'equal' if result['equal'] else 'DIFFERENT':9} "
          f"{result['seconds']:7.1f} s  {' '.join(map(str, result['group']))}"
          f"  {result['difference'] or ''}")
  print(f"{report['runs_in_sampled_groups']} runs in the sampled groups: "
        f"about {report['estimated_hours']} h at {args.jobs} at a time.")
  if args.output:
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
  return 0 if all(r["equal"] for r in report["runs"]) else 1


if __name__ == "__main__":
  sys.exit(main())
