"""A study's runs, one command: train them, list them, reproduce a sample.

Usage::

    python -m experiments.study --jobs 2          # train what is missing
    python -m experiments.study list              # where every run stands
    python -m experiments.study reproduce --hparams_seeds 1 \\
        --output results/study_reproduction/draw1.json  # retrain a sample
    python -m experiments.analysis.report --input_dir results/study \\
        --output_dir results/study_report
    python -m experiments.study longer --dataset RotatedDigits \\
        --algorithm Fish --hparams_seed 1 --trial_seed 2 --test_env 0 \\
        --steps 16000     # one run trained on, to see when it plateaus

A study is a config, ``experiments/studies/<name>.py`` (see
`experiments.studies`), picked by ``--study`` (default: ``digits``, the
converged DomainBed-protocol study of the embedded digits,
`experiments.studies.digits`).

Runs are launched in the study's order. They live in
``<output_dir>/<md5 of their args>``. The JSON-lines records, the
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
``longer`` trains one run of the study for a given number of steps without
stopping at its plateau, in its own directory (default: the study's
``LONGER_DIR``), and
prints where the convergence criterion says the run would have ended at each
evaluation. It has the study run's arguments but ``steps`` and the plateau
checks, and nothing in training depends on the total (the learning rates
are constant, Fishr's anneal step is fixed), so its steps are the study
run's own up to where that one stopped; it shows what happens after.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import importlib
import json
import pkgutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from experiments import convergence
from experiments import records
from experiments import studies
from experiments import sweep

DEFAULT_STUDY = "digits"

# Fields of a record that differ between two trainings of one run: where it
# was written and how fast it went.
_UNREPRODUCIBLE = ("output_dir", "step_time", "data_wait_time")


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
           hparams_seeds: Sequence[int] | None = None,
           algorithms: Sequence[str] | None = None) -> list[sweep.Run]:
  """One run per (dataset, algorithm, hparams_seed, trial_seed) group, the one
  holding out the lowest domain, from the given draws and algorithms
  (default: all)."""
  chosen = {}
  for run in sorted(runs, key=lambda run: run.args["test_envs"]):
    if ((hparams_seeds is None or run.args["hparams_seed"] in hparams_seeds)
        and (algorithms is None or run.args["algorithm"] in algorithms)):
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
    committed = records.read_run(run.output_dir).records
    difference = (f"exit status {returncode}" if returncode else
                  first_difference(committed,
                                   records.read_run(copy.output_dir).records))
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


def load_study(name: str) -> ModuleType:
  """The study config ``experiments/studies/<name>.py``.

  Raises:
    ValueError: there is no such study; it names those there are.
  """
  found = sorted(module.name for module in pkgutil.iter_modules(studies.__path__)
                 if not module.ispkg)
  if name not in found:
    raise ValueError(f"--study {name!r}: no experiments/studies/{name}.py; "
                     f"the studies are {', '.join(found)}.")
  return importlib.import_module(f"experiments.studies.{name}")


def longer_run(runs: Sequence[sweep.Run], *, dataset: str, algorithm: str,
               hparams_seed: int, trial_seed: int, test_env: int, steps: int,
               min_steps: int, output_dir: str | Path) -> sweep.Run:
  """The study's run of one configuration, made ``steps`` long without
  stopping at its plateau.

  Args:
    runs: the study's runs.
    dataset, algorithm, hparams_seed, trial_seed, test_env: which run.
    steps: how long the copy trains; at least ``min_steps``.
    min_steps: the study's steps between plateau checks (its ``STEPS``).
    output_dir: the directory its run directory goes under.

  Returns:
    A run with the study run's arguments but ``steps`` (and no plateau
    checks or trajectory snapshots), under ``output_dir``.

  Raises:
    ValueError: ``steps`` is below ``min_steps``, or the study has no such
      run.
  """
  if steps < min_steps:
    raise ValueError(f"--steps must be at least the study's {min_steps}, got "
                     f"{steps}.")
  wanted = (dataset, algorithm, hparams_seed, trial_seed, [test_env])
  for run in runs:
    if (*_group(run), run.args["test_envs"]) == wanted:
      args = {k: v for k, v in run.args.items()
              if k not in ("trajectory_freq", "plateau_check_freq")}
      return sweep.Run.create({**args, "steps": steps}, output_dir)
  raise ValueError(
      f"The study has no run of {algorithm} on {dataset} with hparams_seed "
      f"{hparams_seed}, trial_seed {trial_seed} and test_env {test_env}; "
      "`python -m experiments.study list` lists its runs.")


def describe_ends(run: Sequence[records.Record], every: int) -> str:
  """A table of where a run would have ended every ``every`` steps, and the
  step from which its criterion always held."""
  ends = convergence.run_ends(run)
  held_out = records.held_out_env(run[0])
  lines = [f"{'step':>6} {'train loss':>10} {'train acc':>9} "
           f"{'val. move':>9} {'1 SE':>6} {'plateaued':>9} {'held-out':>8}"]
  for (step, end), record in zip(ends, run):
    if step % every == 0 or step == ends[-1][0]:
      lines.append(
          f"{step:>6} {end.loss:>10.4f} {end.accuracy:>9.3f} "
          f"{end.validation_change:>9.3f} {end.validation_se:>6.3f} "
          f"{'yes' if end.plateaued else 'no':>9} "
          f"{record[records.env_key(held_out, 'in', 'acc')]:>8.3f}")
  settled = convergence.settled_step(ends)
  lines.append("Plateaued at every evaluation from step "
               f"{settled} on." if settled is not None else
               "Not plateaued at the last evaluation.")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("command", nargs="?", default="launch",
                      choices=["launch", "list", "reproduce", "longer"],
                      help="launch (default): train every run not done; "
                      "list: the status of every run; reproduce: retrain a "
                      "sample of the done runs and compare their records; "
                      "longer: train one run for more steps and say when it "
                      "plateaus.")
  parser.add_argument("--study", default=DEFAULT_STUDY,
                      help="The study config, experiments/studies/<STUDY>.py; "
                      f"default: {DEFAULT_STUDY}.")
  parser.add_argument("--output_dir", default=None,
                      help="Default: the study's OUTPUT_DIR.")
  parser.add_argument("--jobs", type=int, default=2,
                      help="Runs trained at once; default: 2.")
  parser.add_argument("--hparams_seeds", type=int, nargs="+", default=None,
                      help="reproduce: the draws to sample; default: all.")
  parser.add_argument("--algorithms", nargs="+", default=None,
                      metavar="ALGORITHM",
                      help="reproduce: the algorithms to sample; default: "
                      "all.")
  parser.add_argument("--output", default=None,
                      help="reproduce: also write the report there (JSON).")
  longer = parser.add_argument_group(
      "longer", "Which run of the study to train on, and for how long.")
  longer.add_argument("--dataset")
  longer.add_argument("--algorithm")
  longer.add_argument("--hparams_seed", type=int)
  longer.add_argument("--trial_seed", type=int)
  longer.add_argument("--test_env", type=int)
  longer.add_argument("--steps", type=int)
  longer.add_argument("--every", type=int, default=1000,
                      help="Print every this many steps; default: 1000.")
  longer.add_argument("--longer_dir", default=None,
                      help="Where the longer run goes; default: the study's "
                      "LONGER_DIR.")
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}.")
  stray = [f"--{name}" for name in _LONGER_FLAGS
           if getattr(args, name) is not None]
  if stray and args.command != "longer":
    parser.error(f"{' '.join(stray)}: only for the longer command.")
  try:
    study = load_study(args.study)
  except ValueError as e:
    parser.error(str(e))
  args.output_dir = args.output_dir or study.OUTPUT_DIR
  runs = study.runs(args.output_dir)
  if args.algorithms is not None:
    known = {run.args["algorithm"] for run in runs}
    if unknown := [a for a in args.algorithms if a not in known]:
      parser.error(f"--algorithms {' '.join(unknown)}: the study trains "
                   f"none of them; it trains {', '.join(sorted(known))}.")
  if args.command == "reproduce":
    return _reproduce_command(runs, args)
  if args.command == "longer":
    return _longer_command(parser, runs, args, study)
  if args.command == "list":
    for run in runs:
      print(run)
    print(sweep.summary(runs))
    return 0
  print(sweep.summary(runs))
  damaged = sweep.report_damaged(runs)
  try:
    failed = sweep.launch(runs, jobs=args.jobs)
  except KeyboardInterrupt:
    print("Interrupted; the same command resumes the study.", file=sys.stderr)
    return 130
  for run in failed:
    print(f"Failed (see {run.output_dir / sweep.LOG_FILE}): {run}")
  print(sweep.summary(runs))
  return 1 if failed or damaged else 0


def _reproduce_command(runs: Sequence[sweep.Run],
                       args: argparse.Namespace) -> int:
  chosen = [run for run in sample(runs, args.hparams_seeds, args.algorithms)
            if run.status is sweep.Status.DONE]
  if not chosen:
    draws = ("" if args.hparams_seeds is None else
             f" with hparams_seed in {args.hparams_seeds}")
    draws += ("" if args.algorithms is None else
              f" of {' '.join(args.algorithms)}")
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


# The flags that pick the longer command's run, and its length.
_LONGER_FLAGS = ("dataset", "algorithm", "hparams_seed", "trial_seed",
                 "test_env", "steps")


def _longer_command(parser: argparse.ArgumentParser,
                    runs: Sequence[sweep.Run], args: argparse.Namespace,
                    study: ModuleType) -> int:
  missing = [f"--{name}" for name in _LONGER_FLAGS
             if getattr(args, name) is None]
  if missing:
    parser.error(f"longer needs {' '.join(missing)}.")
  if args.every < 1:
    parser.error(f"--every must be at least 1, got {args.every}.")
  try:
    run = longer_run(runs, output_dir=args.longer_dir or study.LONGER_DIR,
                     min_steps=study.STEPS,
                     **{name: getattr(args, name) for name in _LONGER_FLAGS})
  except ValueError as e:
    parser.error(str(e))
  if run.status is not sweep.Status.DONE:
    print(f"Training {run}.")
    if returncode := sweep.train_run(run):
      print(f"Failed (see {run.output_dir / sweep.LOG_FILE}).",
            file=sys.stderr)
      return returncode
  print(describe_ends(records.read_run(run.output_dir).records,
                      args.every))
  return 0


if __name__ == "__main__":
  sys.exit(main())
