"""A study's runs, one command: train them, list them, reproduce a sample.

Usage::

    python -m experiments.runs.study --jobs 2          # train what is missing
    python -m experiments.runs.study list              # where every run stands
    python -m experiments.runs.study pack              # pack the finished runs
    python -m experiments.runs.study reproduce --hparams_seeds 1 \\
        --output results/study_reproduction/draw1.json  # retrain a sample
    python -m experiments.analysis.report --input_dir results/study \\
        --output_dir results/study_report
    python -m experiments.runs.study longer --dataset RotatedDigits \\
        --algorithm Fish --hparams_seed 1 --trial_seed 2 --test_env 0 \\
        --longer_steps 16000  # one run trained on, to see when it plateaus

A study is a config, ``experiments/studies/<name>.py`` (see
`experiments.studies`), picked by ``--study`` (default: ``digits``, the
converged DomainBed-protocol study of the embedded digits,
`experiments.studies.digits`).

Runs are launched in the study's order. They live in
``<output_dir>/<md5 of their args>``. ``pack`` writes the finished ones, and
those of the longer command, to one compressed file in each directory
(``runs.jsonl.gz``, `experiments.rundir.pack.pack_runs`): every run's config and
records, where it trained if it recorded that, and for the runs that saved
params snapshots what the paper's claims read of them
(`experiments.analysis.claims.ProjectedPath`). The packs are
what is committed; run directories, with their checkpoints, params and logs,
are not (see .gitignore). So the same command continues a study stopped
half-way, on this machine from the runs' checkpoints and on a fresh clone from
the pack: finished and packed runs are skipped, the others train.

``reproduce`` retrains a sample of the finished runs and compares their
records: bit for bit where a run trained in the environment it is retrained
in, else against the noise of its trials (docs/study.md, "Reproducing the
study"; requirements/study.txt locks the versions that trained the
committed study); ``longer`` trains one run on past its plateau
(`experiments.runs.rerun`, which serves plain sweeps too). ``--algorithms``
narrows ``reproduce``'s sample to some of the study's methods: "ERM" is
ERM's runs without weight averaging, "ERM + SWAD" its runs with SWAD's.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from experiments import averaging_flags
from experiments.runs import environment
from experiments.runs import launchers
from experiments.rundir import pack as pack_lib
from experiments.rundir import records
from experiments.runs import rerun
from experiments.runs import run as run_lib
from experiments import studies

DEFAULT_STUDY = "digits"
# Where a study's REQUIREMENTS are found, whatever the working directory.
REPOSITORY = Path(__file__).resolve().parents[2]


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


def study_lock(study: ModuleType) -> tuple[str, dict[str, str]] | None:
  """The study's ``REQUIREMENTS``, a file of the repository that locks the
  versions its committed runs trained with, and those versions
  (`experiments.runs.environment.locked_versions`); None for a study
  without one."""
  name = getattr(study, "REQUIREMENTS", None)
  if name is None:
    return None
  text = (REPOSITORY / name).read_text(encoding="utf-8")
  return name, environment.locked_versions(text)


def pack(directory: Path) -> int:
  """Packs the finished runs in ``directory`` (`pack_lib.pack_runs`), with
  what the paper's claims read of their params snapshots in place of these
  (`experiments.analysis.claims.project_paths`), and says what it packed.

  Returns:
    How many finished run directories were left out, damaged.
  """
  # Here, not at the top: launching and training import nothing of the
  # analysis.
  from experiments.analysis import claims  # pylint: disable=import-outside-toplevel
  snapshots = {}
  for run_dir in pack_lib.finished_run_dirs(directory):
    if files := records.trajectory_files(run_dir):
      try:
        snapshots[run_dir] = (records.read_run(run_dir).records[0], files)
      except records.DamagedRunError:
        continue  # pack_runs says why it leaves the run out.
  paths = claims.project_paths(snapshots)
  packed, skipped = pack_lib.pack_runs(
      directory, {run_dir.name: path.to_json()
                  for run_dir, path in paths.items()})
  for run_dir, why in skipped.items():
    print(f"Left out {run_dir}: {why}.", file=sys.stderr)
  print(f"Packed {len(packed)} runs in {directory / pack_lib.PACK_FILE}.")
  return len(skipped)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.runs.study",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("command", nargs="?", default="launch",
                      choices=["launch", "list", "pack", *rerun.COMMANDS],
                      help="launch (default): train every run not done; "
                      "list: the status of every run; pack: write the done "
                      "runs, and the longer command's, to one compressed "
                      f"file, {pack_lib.PACK_FILE}, in their directory; "
                      "reproduce: retrain a sample of the done runs and "
                      "compare their records; longer: train one run for "
                      "more steps and say when it plateaus.")
  parser.add_argument("--study", default=DEFAULT_STUDY,
                      help="The study config, experiments/studies/<STUDY>.py; "
                      f"default: {DEFAULT_STUDY}.")
  parser.add_argument("--output_dir", default=None,
                      help="Default: the study's OUTPUT_DIR.")
  parser.add_argument("--jobs", type=int, default=2,
                      help="Runs trained at once; default: 2.")
  parser.add_argument("--algorithms", nargs="+", default=None,
                      metavar="METHOD",
                      help="reproduce: the methods to sample, as the list "
                      "command and the report name them: an algorithm "
                      "('ERM': its runs without weight averaging) or an "
                      "algorithm and its averaging ('ERM + SWAD'); default: "
                      "all.")
  rerun.add_arguments(parser)
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}.")
  rerun.check_arguments(parser, args)
  try:
    study = load_study(args.study)
  except ValueError as e:
    parser.error(str(e))
  args.output_dir = args.output_dir or study.OUTPUT_DIR
  runs = study.runs(args.output_dir)
  if args.algorithms is not None:
    known = {averaging_flags.method(run.args) for run in runs}
    if unknown := [a for a in args.algorithms if a not in known]:
      parser.error(f"--algorithms {' '.join(unknown)}: the study trains "
                   f"none of them; it trains {', '.join(sorted(known))}.")
  if args.command in rerun.COMMANDS:
    sampled = [run for run in runs if args.algorithms is None
               or averaging_flags.method(run.args) in args.algorithms]
    return rerun.main(parser, args, sampled, args.output_dir,
                      study_lock(study))
  if args.command == "list":
    for run in runs:
      print(run)
    print(run_lib.summary(runs))
    return 0
  if args.command == "pack":
    damaged = sum(pack(Path(directory)) for directory in (
        args.output_dir, rerun.longer_dir(args.output_dir, args.longer_dir))
        if Path(directory).is_dir())
    print(run_lib.summary(runs))
    return 1 if damaged else 0
  print(run_lib.summary(runs))
  damaged = run_lib.report_damaged(runs)
  try:
    failed = launchers.train_on_host(runs, jobs=args.jobs)
  except KeyboardInterrupt:
    print("Interrupted; the same command resumes the study.", file=sys.stderr)
    return 130
  for run in failed:
    print(f"Failed (see {run.log_file}): {run}")
  print(run_lib.summary(runs))
  return 1 if failed or damaged else 0


if __name__ == "__main__":
  sys.exit(main())
