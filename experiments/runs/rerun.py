"""Training finished runs again: a sample to reproduce, or one for longer.

Both commands work on the runs of any sweep or study, however they were
listed (`experiments.runs.sweep`'s flags, or a study config's ``runs``):

    python -m experiments.runs.sweep reproduce --datasets RotatedDigits \\
        --algorithms ERM PGrad --n_hparams 2 --output_dir sweeps/digits
    python -m experiments.runs.study reproduce --hparams_seeds 1 \\
        --output results/study_reproduction/draw1.json
    python -m experiments.runs.study longer --dataset RotatedDigits \\
        --algorithm Fish --hparams_seed 1 --trial_seed 2 --test_env 0 \\
        --longer_steps 16000

``reproduce`` retrains a sample of the finished runs (in their directories
or packed: `experiments.rundir.pack.finished_records`) from scratch in a
scratch directory, one per ``(dataset, algorithm, hparams_seed, trial_seed)``
(the run holding out the lowest domain), ``--jobs`` at a time, and checks
that every record comes out equal to the committed one, timing excepted. It
times each run whole (start-up, compilation, training and evaluation) and
estimates from them what the sampled groups cost on this machine: each
sampled run's time stands for the other held-out domains of its group.

Floating-point results change with the processor and the package versions,
so the report says where each run trained and where it trained again (the
runs' environment files, `experiments.rundir.records.ENVIRONMENT_FILE`). Where
the two are the same, a run must come out equal, bit for bit. Where they
differ, or the run did not record where it trained, a run whose records
differ is judged against the spread of its cell's committed trials
(`experiments.runs.noise.judge_noise`): "within the trials' noise" or
"differs beyond" it, at the numbers a study reports of it
(`experiments.runs.noise.reported_numbers`). ``--changed_hparams`` retrains
with some hparams changed, to see the check find a real change.

``longer`` trains one run for a given number of steps without stopping at its
plateau, in its own directory (default: the runs' directory with
``_longer`` appended), and prints where the convergence criterion says the
run would have ended at each evaluation. It has the run's arguments but
``steps`` and the plateau checks, and nothing in training depends on the
total (the learning rates are constant, Fishr's anneal step is fixed), so its
steps are the run's own up to where that one stopped; it shows what happens
after.

This module lists no runs and so imports neither `experiments.runs.sweep` nor
a study: it takes their runs (`experiments.runs.run.Run`) and trains them
with their own ``train`` method.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import averaging_flags
from experiments import hparams_registry
from experiments.runs import convergence
from experiments.runs import environment
from experiments.runs import noise as noise_lib
from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import run as run_lib

COMMANDS = ("reproduce", "longer")
# Fields of a record that differ between two trainings of one run: where it
# was written and how fast it went.
_UNREPRODUCIBLE = ("output_dir", *records.TIMING_FIELDS)
# The flags that pick the longer command's run, and its length.
_LONGER_FLAGS = ("dataset", "algorithm", "hparams_seed", "trial_seed",
                 "test_env", "longer_steps")
# What a run's --algorithm means where runs are picked by it.
_METHOD_HELP = ("The run's method, as the list command and the report name "
                "it: its algorithm ('ERM': without weight averaging), or its "
                "algorithm and averaging ('ERM + SWAD').")
# The characters of a run's first difference that its line shows.
_SHOWN = 160
# What `reproduce` finds of a run, and whether it passes.
VERDICTS = {"equal": True, "within the trials' noise": True,
            "differs beyond the trials' noise": False,
            "DIFFERENT in the environment it trained in": False,
            "DIFFERENT, with no trials' noise to judge it by": False,
            "failed": False}


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



def group(run: run_lib.Run) -> tuple[Any, ...]:
  """The run's ``(dataset, algorithm, hparams_seed, trial_seed)``; its
  algorithm with its weight averaging where it has one
  (`averaging_flags.method`: "ERM + SWAD" is compared with its own
  trials, not ERM's)."""
  a = run.args
  return (a["dataset"], averaging_flags.method(a), a["hparams_seed"],
          a["trial_seed"])


def sample(runs: Sequence[run_lib.Run],
           hparams_seeds: Sequence[int] | None = None,
           algorithms: Sequence[str] | None = None) -> list[run_lib.Run]:
  """One run per `group`, the one holding out the lowest domain, from the
  given draws and algorithms (default: all).

  ``algorithms`` are methods' names (`averaging_flags.method`), as the
  report's rows and `group` name them: "ERM" is ERM's runs without weight
  averaging, "ERM + SWAD" those with SWAD's.
  """
  chosen = {}
  for run in sorted(runs, key=lambda run: run.args["test_envs"]):
    if ((hparams_seeds is None or run.args["hparams_seed"] in hparams_seeds)
        and (algorithms is None
             or averaging_flags.method(run.args) in algorithms)):
      chosen.setdefault(group(run), run)
  return list(chosen.values())


def _cell(run: run_lib.Run) -> tuple[Any, ...]:
  """The run's dataset, algorithm, draw and held-out domains: its trials
  differ in nothing else."""
  a = run.args
  return (a["dataset"], averaging_flags.method(a), a["hparams_seed"],
          tuple(a["test_envs"]))


def with_hparams(run: run_lib.Run, changed: dict[str, Any]) -> run_lib.Run:
  """``run`` with ``changed`` in its ``--hparams``, under its own name (a
  copy retrained with them must compare with the run's records)."""
  hparams = json.loads(run.args.get("hparams") or "{}")
  return dataclasses.replace(run, args={
      **run.args, "hparams": json.dumps({**hparams, **changed})})


def verdict(result: dict[str, Any]) -> str:
  """What `reproduce` found of one run (a key of `VERDICTS`): equal
  records; where the run trained in this environment, different ones;
  else whether the numbers the study reports lie within its trials' noise.
  """
  if result["exit_status"]:
    return "failed"
  if result["equal"]:
    return "equal"
  trained, retrained = result["trained_on"], result["retrained_on"]
  if trained and retrained and all(entry == retrained[0] for entry in trained):
    return "DIFFERENT in the environment it trained in"
  if result["noise"] is None:
    return "DIFFERENT, with no trials' noise to judge it by"
  if all(number["within"] for number in result["noise"].values()):
    return "within the trials' noise"
  return "differs beyond the trials' noise"


def reproduce(runs: Sequence[run_lib.Run], chosen: Sequence[run_lib.Run],
              scratch_dir: Path, jobs: int,
              changed_hparams: dict[str, Any] | None = None
              ) -> dict[str, Any]:
  """Retrains ``chosen`` (finished runs among ``runs``) under ``scratch_dir``.

  Args:
    runs: every run of the sweep, for the size of each chosen run's group
      and the trials of its cell.
    chosen: the runs to retrain, each from scratch, ``jobs`` at a time.
    scratch_dir: where the copies train (with their own compilation cache).
    jobs: how many copies train at once.
    changed_hparams: hparams that the copies train with in place of the
      runs' own (`with_hparams`); None: none.

  Returns:
    A report: for every chosen run its group, whether its records (not its
    trajectory snapshots) came out equal, timing excepted, or where they
    first differ, its wall time in seconds, the machines it trained on
    (``trained_on``: the run's environment entries, None for a run from
    before runs recorded them) and on which it was retrained
    (``retrained_on``, the copy's; None if it wrote none), for records that
    differ how the numbers a study reports lie among its cell's trials
    (``noise``, `noise_lib.judge_noise`), and the `verdict`; the changed
    hparams; and the estimated wall time of all of ``runs`` in the chosen
    groups at ``jobs`` runs at a time (each chosen run's time times its
    group's size, over ``jobs``).
  """
  cells = collections.defaultdict(list)
  for run in runs:
    cells[_cell(run)].append(run)

  def retrain(run):
    copy = dataclasses.replace(
        with_hparams(run, changed_hparams) if changed_hparams else run,
        output_dir=scratch_dir / run.output_dir.name)
    start = time.monotonic()
    returncode = copy.train()
    seconds = time.monotonic() - start
    committed = pack.finished_records(run.output_dir)
    retrained = None if returncode else records.read_run(
        copy.output_dir).records
    difference = (f"exit status {returncode}" if returncode else
                  first_difference(committed, retrained))
    noise = None
    if difference is not None and retrained:
      trials = [finished for trial in cells[_cell(run)] if (
          finished := pack.finished_records(trial.output_dir))]
      try:
        noise = noise_lib.judge_noise(
            noise_lib.reported_numbers(retrained),
            noise_lib.reported_numbers(committed),
            [noise_lib.reported_numbers(trial) for trial in trials])
      except KeyError:
        pass  # Records without accuracies (a regression's): not judged.
    result = {"run": run.output_dir.name, "group": list(group(run)),
              "equal": difference is None, "difference": difference,
              "exit_status": returncode, "seconds": round(seconds, 1),
              "trained_on": pack.run_environment(run.output_dir),
              "retrained_on": records.read_environment(copy.output_dir),
              "noise": noise}
    return {**result, "verdict": verdict(result)}

  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    results = list(pool.map(retrain, chosen))
  sizes = collections.Counter(map(group, runs))
  total = sum(r["seconds"] * sizes[tuple(r["group"])] for r in results)
  return {"runs": results, "changed_hparams": changed_hparams,
          "false_alarm_rate": noise_lib.FALSE_ALARM_RATE,
          "runs_in_sampled_groups": sum(sizes[group(run)] for run in chosen),
          "jobs": jobs,
          "estimated_hours": round(total / jobs / 3600, 2)}


def _versions_note(differing: Sequence[str], whose: str) -> str:
  if differing:
    return (f"  The installed versions of {', '.join(differing)} differ from "
            f"{whose}.")
  return f"  The installed versions are {whose}."


def describe_environments(results: Sequence[dict[str, Any]],
                          lock: tuple[str, dict[str, str]] | None = None
                          ) -> str:
  """Where `reproduce`'s runs trained and were retrained, and what differs.

  Args:
    results: `reproduce`'s runs.
    lock: for runs from before environments were recorded, a file that
      locks the versions they trained with, and those versions
      (`experiments.runs.environment.locked_versions`); None: none.

  Returns:
    Each environment once (`experiments.runs.environment.summary`), with
    how many runs trained there and what differs where they were retrained,
    the installed versions named; runs that recorded none are counted as
    unrecorded and, given ``lock``, held against its versions.
  """
  trained = collections.Counter(
      json.dumps(r["trained_on"]) for r in results)
  retrained = [json.loads(entry) for entry in dict.fromkeys(
      json.dumps(r["retrained_on"][0]) for r in results if r["retrained_on"])]
  lines = []
  for entries, count in trained.items():
    entries = json.loads(entries)
    if entries is None:
      lines.append(f"Trained on: unrecorded ({count} runs, from before runs "
                   "recorded where they trained)" + ("." if lock is None else
                   f"; processor unknown, versions as {lock[0]} locks them: "
                   + ", ".join(f"{name} {version}"
                               for name, version in lock[1].items()) + "."))
      if lock is not None:
        lines += [_versions_note([name for name, version in lock[1].items()
                                  if now.get(name) != version],
                                 f"{lock[0]}'s") for now in retrained]
      continue
    lines.append(f"Trained on ({count} runs): " + "; then ".join(
        map(environment.summary, entries)))
    for now in retrained:
      differences = environment.differences(entries, now)
      lines += [f"  not as retrained: {line}" for line in differences]
      lines.append(_versions_note(
          [field for field in (line.split(":")[0] for line in differences)
           if field in environment.PACKAGES], "the runs'"))
  for entry in retrained:
    count = sum(r["retrained_on"] is not None and r["retrained_on"][0] == entry
                for r in results)
    lines.append(f"Retrained on ({count} runs): {environment.summary(entry)}")
  return "\n".join(lines)


def longer_run(runs: Sequence[run_lib.Run], *, dataset: str, algorithm: str,
               hparams_seed: int, trial_seed: int, test_env: int,
               longer_steps: int, output_dir: str | Path) -> run_lib.Run:
  """One of ``runs`` made ``steps`` long without stopping at its plateau.

  Args:
    runs: the sweep's runs.
    dataset, algorithm, hparams_seed, trial_seed, test_env: which run;
      ``algorithm`` is its method (`averaging_flags.method`): "ERM" for a
      run of ERM without weight averaging, "ERM + SWAD" for one with.
    longer_steps: how long the copy trains; at least the run's steps
      between plateau checks (``plateau_check_freq``), if it has them.
    output_dir: the directory its run directory goes under.

  Returns:
    A run with the chosen run's arguments but ``steps`` (``longer_steps``;
    no plateau checks or trajectory snapshots), under ``output_dir``.

  Raises:
    ValueError: the runs have no such run, or ``longer_steps`` is below its
      ``plateau_check_freq``.
  """
  wanted = (dataset, algorithm, hparams_seed, trial_seed, [test_env])
  for run in runs:
    if (*group(run), run.args["test_envs"]) == wanted:
      min_steps = run.args.get("plateau_check_freq", 0)
      if longer_steps < min_steps:
        raise ValueError(f"--longer_steps must be at least the run's "
                         f"plateau_check_freq, {min_steps}; got "
                         f"{longer_steps}.")
      args = {k: v for k, v in run.args.items()
              if k not in ("trajectory_freq", "plateau_check_freq")}
      return type(run).create({**args, "steps": longer_steps}, output_dir)
  methods = sorted({averaging_flags.method(run.args) for run in runs})
  raise ValueError(
      f"There is no run of {algorithm} on {dataset} with hparams_seed "
      f"{hparams_seed}, trial_seed {trial_seed} and test_env {test_env}; "
      + ("" if algorithm in methods else
         f"the runs are of {', '.join(methods)} (the names --algorithm "
         "takes); ")
      + "the list command lists the runs.")


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the two commands' flags to a command line that lists runs."""
  options = parser.add_argument_group(
      "reproduce", "Which finished runs to retrain, and where to report.")
  options.add_argument("--hparams_seeds", type=int, nargs="+", default=None,
                      help="The draws to sample; default: all.")
  options.add_argument("--output", default=None,
                      help="Also write the report there (JSON).")
  options.add_argument("--changed_hparams", type=_hparams_object,
                       default=None, metavar="JSON",
                       help="Retrain with these hparams in place of the "
                       "runs' own, e.g. '{\"lr\": 0.003}', to see that the "
                       "check finds a real change.")
  longer = parser.add_argument_group(
      "longer", "Which run to train on, and for how long.")
  for name in _LONGER_FLAGS[:-1]:
    longer.add_argument(f"--{name}", type=str if name in (
        "dataset", "algorithm") else int, help=_METHOD_HELP if name == (
            "algorithm") else None)
  longer.add_argument("--longer_steps", type=int,
                      help="How many steps the longer run trains.")
  longer.add_argument("--every", type=int, default=1000,
                      help="Print every this many steps; default: 1000.")
  longer.add_argument("--longer_dir", default=None,
                      help="Where the longer run goes; default: the runs' "
                      "directory with _longer appended.")


def _hparams_object(text: str) -> dict[str, Any]:
  """``--changed_hparams``: a JSON object, or a usage error naming it."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
  if not isinstance(value, dict) or not value:
    raise argparse.ArgumentTypeError(
        f"a JSON object of hparams to change is needed, e.g. "
        f"'{{\"lr\": 0.003}}'; got {text!r}")
  return value


def longer_dir(output_dir: str | Path, chosen: str | None = None) -> Path:
  """Where the longer command's runs go: ``chosen`` (``--longer_dir``), else
  the runs' directory, ``output_dir``, with ``_longer`` appended."""
  return Path(chosen or f"{Path(output_dir)}_longer")


def check_arguments(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> None:
  """Refuses the longer command's flags on another command (exit 2)."""
  stray = [f"--{name}" for name in _LONGER_FLAGS
           if getattr(args, name) is not None]
  if stray and args.command != "longer":
    parser.error(f"{' '.join(stray)}: only for the longer command.")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace,
         runs: Sequence[run_lib.Run], output_dir: str | Path,
         lock: tuple[str, dict[str, str]] | None = None) -> int:
  """Runs ``args.command``, one of `COMMANDS`, on ``runs``.

  Args:
    parser: the command line's parser, for usage errors.
    args: its parsed flags (`add_arguments`'s, and ``jobs``).
    runs: the runs of the sweep or study, in ``output_dir``.
    output_dir: their directory.
    lock: for reproduce, what `describe_environments` holds the runs that
      recorded no environment against; None: nothing.

  Returns:
    The exit status.
  """
  if args.command == "reproduce":
    # A mistyped path would otherwise read as a sweep with no finished runs.
    if not Path(output_dir).is_dir():
      parser.error(f"--output_dir {output_dir}: no such directory; it is the "
                   "one the runs were launched into.")
    if args.changed_hparams:
      _check_changed_hparams(parser, runs, args.changed_hparams)
    return _reproduce_command(runs, args, output_dir, lock)
  return _longer_command(parser, runs, args, output_dir)


def _check_changed_hparams(parser: argparse.ArgumentParser,
                           runs: Sequence[run_lib.Run],
                           changed: dict[str, Any]) -> None:
  """Refuses (exit 2) ``--changed_hparams`` that some algorithm of ``runs``
  lacks or that are out of range: every copy would exit 2, and the reason
  would be lost with its scratch directory."""
  for algorithm, dataset in sorted({(run.args["algorithm"],
                                     run.args["dataset"]) for run in runs}):
    try:
      hparams_registry.check_hparams(algorithm, dataset, changed)
    except ValueError as e:
      parser.error(f"--changed_hparams: {e}")


def _reproduce_command(runs: Sequence[run_lib.Run], args: argparse.Namespace,
                       output_dir: str | Path,
                       lock: tuple[str, dict[str, str]] | None) -> int:
  chosen = [run for run in sample(runs, args.hparams_seeds)
            if pack.finished_records(run.output_dir) is not None]
  if not chosen:
    draws = ("" if args.hparams_seeds is None else
             f" with hparams_seed in {args.hparams_seeds}")
    print(f"error: no finished runs{draws} to reproduce in {output_dir}.",
          file=sys.stderr)
    return 1
  changed = (f", with {json.dumps(args.changed_hparams)} in their hparams"
             if args.changed_hparams else "")
  print(f"Retraining {len(chosen)} runs, {args.jobs} at a time{changed}.")
  with tempfile.TemporaryDirectory(prefix="reproduce_") as scratch:
    report = reproduce(runs, chosen, Path(scratch), args.jobs,
                       args.changed_hparams)
  for result in report["runs"]:
    # A difference in the args (--changed_hparams) names them all: the
    # report keeps it whole.
    difference = result["difference"] or ""
    print(f"{result['verdict']}: {' '.join(map(str, result['group']))}, "
          f"{result['seconds']:.1f} s"
          + (f"; {difference[:_SHOWN]}{'…' * (len(difference) > _SHOWN)}"
             if difference else ""))
    for name, number in (result["noise"] or {}).items():
      label = noise_lib.NUMBERS[name] + ":"
      print(f"  {label:24} {number['retrained']:8.4f} "
            f"retrained, {number['committed']:8.4f} committed; trials "
            f"{number['mean']:8.4f} ± {number['sd']:.4f} "
            f"(n = {len(number['trials'])}), within ± {number['allowed']:.4f}"
            f"{'' if number['within'] else '  BEYOND'}")
  print(describe_environments(report["runs"], lock))
  print(f"{report['runs_in_sampled_groups']} runs in the sampled groups: "
        f"about {report['estimated_hours']} h at {args.jobs} at a time.")
  if args.output:
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
  return 0 if all(VERDICTS[r["verdict"]] for r in report["runs"]) else 1


def _longer_command(parser: argparse.ArgumentParser,
                    runs: Sequence[run_lib.Run], args: argparse.Namespace,
                    output_dir: str | Path) -> int:
  missing = [f"--{name}" for name in _LONGER_FLAGS
             if getattr(args, name) is None]
  if missing:
    parser.error(f"longer needs {' '.join(missing)}.")
  if args.every < 1:
    parser.error(f"--every must be at least 1, got {args.every}.")
  try:
    run = longer_run(runs,
                     output_dir=longer_dir(output_dir, args.longer_dir),
                     **{name: getattr(args, name) for name in _LONGER_FLAGS})
  except ValueError as e:
    parser.error(str(e))
  if pack.finished_records(run.output_dir) is None:
    print(f"Training {run}.")
    if returncode := run.train():
      print(f"Failed (see {run.log_file}).", file=sys.stderr)
      return returncode
  print(describe_ends(pack.finished_records(run.output_dir), args.every))
  return 0
