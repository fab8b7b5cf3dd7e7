"""DomainBed sweeps: datasets x algorithms x held-out domains x hparams x seeds.

The sweep's command line. Each run (`experiments.runs.run.Run`) trains one
``(dataset, algorithm, test env, hparams_seed, trial_seed)`` with ``python
-m experiments.train`` in a subprocess, writing to ``<output_dir>/<md5 of
its arguments>``. ``hparams_seed`` 0 is the default hparams, the others
random draws; the training seed is derived from a hash of the run's
identity, as in DomainBed.

``launch`` saves the sweep's grid to ``<output_dir>/sweep.json``, and every
later command given that ``--output_dir`` alone takes its grid from there
(`experiments.runs.grid`). On a terminal, ``launch`` says how many runs it
will train and asks first, as DomainBed's ``sweep.py`` does;
``--skip_confirmation`` does not ask, nor does a launch whose input is not a
terminal (a script, a batch job), which goes ahead.

The sweep is resumable: a run directory holding a ``done`` file is skipped,
and one without is launched again (training resumes from its last
checkpoint), so a killed sweep is restarted with the same command. A run
packed in the output directory's ``runs.jsonl.gz``
(`experiments.rundir.pack.pack_runs`, how a study is committed) is done
too. A run whose records fail `experiments.rundir.records.read_run` (damage
that no run leaves, even killed) is neither skipped as done nor launched: it
is listed as damaged with the reason, and ``delete_incomplete`` deletes it
with the incomplete runs.

``--launcher`` picks one of `experiments.runs.launchers.REGISTRY` to train
the runs: ``local``, ``multi_gpu`` or ``slurm``. Every launcher writes where
a run trains (host, GPU, process, SLURM job and its logs) to the run's
``launch.json``, and ``list`` shows it; a run whose training process still
runs on this host, or whose SLURM job is still queued or running, is not
launched again.

Usage::

    python -m experiments.runs.sweep launch --datasets RotatedDigits \\
        --algorithms ERM PGrad --n_hparams 20 --n_trials 3 \\
        --output_dir sweeps/digits --jobs 2
    python -m experiments.runs.sweep launch --launcher multi_gpu ...
    python -m experiments.runs.sweep launch --algorithms ERM \\
        --averaging swad --output_dir sweeps/digits_swad  # "ERM + SWAD"
    python -m experiments.runs.sweep launch --launcher slurm \\
        --slurm_partition gpu --slurm_time 240 ...
    python -m experiments.runs.sweep list --output_dir sweeps/digits
    python -m experiments.runs.sweep delete_incomplete \\
        --output_dir sweeps/digits
    python -m experiments.runs.sweep reproduce --output_dir sweeps/digits
    python -m experiments.runs.sweep cost --step_ms 119 --steps 5000 ...

``reproduce`` and ``longer`` retrain finished runs (`experiments.runs.rerun`);
``cost`` estimates the GPU-hours of a sweep's training steps.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from experiments import averaging_flags
from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments.data import datasets
from experiments.data import photo_datasets
from experiments.runs import grid as grid_lib
from experiments.runs import launchers
from experiments.runs import rerun
from experiments.runs import run as run_lib


def cost(runs: Sequence[run_lib.Run], step_ms: float,
         gpu_counts: Sequence[int]) -> str:
  """What the training steps of ``runs`` cost, at ``step_ms`` a step.

  Evaluation, start-up and compilation are not counted. Each run trains
  its ``steps`` (else its dataset's default) on one GPU, and the runs are
  independent: on several GPUs they are placed longest first on the GPU
  that frees first, as the launchers place them.

  Args:
    runs: the sweep's runs.
    step_ms: milliseconds a training step.
    gpu_counts: the numbers of GPUs to give the time on.

  Returns:
    The GPU-hours, and the hours on each number of GPUs, in words.

  Raises:
    UsageError: a run's dataset trains for epochs, not a set number of
      steps, and ``--steps`` is not given.
  """
  hours = []
  for run in runs:
    steps = run.args.get("steps", catalog.DATASETS[run.args["dataset"]].steps)
    if steps is None:
      raise errors.UsageError(
          f"{run.args['dataset']} trains for epochs, not a set number of "
          "steps; give --steps to cost it.")
    hours.append(steps * step_ms / 1000 / 3600)
  total_steps = round(sum(hours) * 3600 * 1000 / step_ms)
  lines = [f"{len(runs)} runs, {total_steps:,} training steps at {step_ms:g} "
           f"ms a step: {sum(hours):.1f} GPU-hours (training steps only)."]
  for gpus in gpu_counts:
    busy = [0.0] * gpus
    for run_hours in sorted(hours, reverse=True):
      busy[busy.index(min(busy))] += run_hours
    lines.append(f"  on {gpus} GPU{'s' if gpus > 1 else ''}: "
                 f"{max(busy):.1f} h")
  return "\n".join(lines)


PROG = "python -m experiments.runs.sweep"


def delete_incomplete(runs: Sequence[run_lib.Run]) -> list[run_lib.Run]:
  """Deletes the directories of incomplete and damaged runs; returns those
  runs."""
  incomplete = [run for run in runs
                if run.status in (run_lib.Status.INCOMPLETE,
                                  run_lib.Status.DAMAGED)]
  for run in incomplete:
    shutil.rmtree(run.output_dir)
  return incomplete


def make_parser() -> argparse.ArgumentParser:
  """The sweep's command line."""
  parser = argparse.ArgumentParser(prog=PROG,
                                   description=__doc__.splitlines()[0])
  parser.add_argument(
      "command", nargs="?", default="launch",
      choices=["launch", "list", "delete_incomplete", "cost",
               *rerun.COMMANDS],
      help="launch: train every run that is not done; list: the status of "
      "every run, and where it trains; delete_incomplete: delete the "
      "directories of started but unfinished runs, and of runs whose "
      "records are damaged; cost: the GPU-hours of the runs' training "
      "steps at --step_ms; reproduce: retrain a sample of the done runs and "
      "compare their records; longer: train one run for more steps and say "
      "when it plateaus (experiments/runs/rerun.py). Default: launch.")
  grid = parser.add_argument_group(
      "grid", f"The runs of the sweep. launch saves them in --output_dir's "
      f"{grid_lib.GRID_FILE}; later commands take them from there, and a "
      "flag that "
      "contradicts them is an error. Without a saved grid, the defaults "
      "below.")
  grid.add_argument(
      "--datasets", nargs="+", default=argparse.SUPPRESS,
      choices=list(catalog.DATASETS), metavar="DATASET",
      help=f"Default: {' '.join(grid_lib.DEFAULT_DATASETS)}.")
  grid.add_argument(
      "--algorithms", nargs="+", default=argparse.SUPPRESS,
      choices=list(catalog.ALGORITHMS), metavar="ALGORITHM",
      help="Default: all of them.")
  grid.add_argument(
      "--test_envs", nargs="+", type=int, default=argparse.SUPPRESS,
      help="Domains to hold out, one per run; default: every domain.")
  grid.add_argument(
      "--n_hparams", type=int, default=argparse.SUPPRESS,
      help="Runs hparams_seed 0 (default hparams) to n_hparams-1; default: 20.")
  grid.add_argument("--n_trials", type=int, default=argparse.SUPPRESS,
                      help="Runs trial_seed 0 to n_trials-1; default: 3.")
  grid.add_argument("--steps", type=int, default=argparse.SUPPRESS,
                      help="Training steps; default: training's default.")
  grid.add_argument(
      "--checkpoint_freq", type=int, default=argparse.SUPPRESS,
      help="Steps between evaluations; default: training's default.")
  grid.add_argument(
      "--plateau_check_freq", type=int, default=argparse.SUPPRESS,
      help="Every run stops at the first multiple of this many steps at "
      "which it has plateaued (--steps is then the most it trains); "
      "default: none.")
  grid.add_argument("--hparams", default=argparse.SUPPRESS,
                      help="JSON object of hparams fixed for every run.")
  grid.add_argument(
      "--model", default=argparse.SUPPRESS, choices=list(catalog.MODELS),
      help="Every run's model; default: each dataset's.")
  grid.add_argument(
      "--trajectory_freq", type=int, default=argparse.SUPPRESS,
      help="Steps between params snapshots of the default-hparams runs of "
      f"{' and '.join(catalog.TRAJECTORY_ALGORITHMS)}; default: none.")
  grid.add_argument(
      "--averaging", default=argparse.SUPPRESS,
      choices=list(averaging_flags.KNOBS),
      help="Every run averages its weights so, at its knobs' defaults, and "
      "is reported as its algorithm with it ('ERM + SWAD'); another "
      "averaging is another sweep, in another --output_dir. Default: none.")
  grid.add_argument(
      "--extend_grid", action="store_true",
      help="Add runs to the saved grid (more datasets, algorithms, held-out "
      "domains, draws or trials); launch saves the larger grid.")
  parser.add_argument("--output_dir", required=True,
                      help="The sweep's directory, holding a folder per run.")
  parser.add_argument("--data_dir", default=None,
                      help="Passed on to training; default: its default.")
  launchers.add_arguments(parser)
  parser.add_argument(
      "--step_ms", type=float, default=None,
      help="cost: milliseconds a training step, e.g. as measured.")
  parser.add_argument(
      "--gpu_counts", type=int, nargs="+", default=[1, 8, 64],
      help="cost: the numbers of GPUs to give the time on; default: 1 8 64.")
  parser.add_argument(
      "--skip_confirmation", "--yes", action="store_true",
      help="launch and delete_incomplete: go ahead without asking. A launch "
      "whose input is not a terminal does not ask either.")
  rerun.add_arguments(parser)
  return parser


def check_arguments(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> None:
  """Refuses flags of another launcher or command, and bad numbers (exit
  2)."""
  launchers.check_arguments(parser, args)
  if (args.step_ms is not None) != (args.command == "cost"):
    parser.error("cost needs --step_ms, and --step_ms is only for cost.")
  if args.command == "cost" and (
      args.step_ms <= 0 or min(args.gpu_counts) < 1):
    parser.error("--step_ms must be positive and --gpu_counts at least 1.")
  for flag in ("n_hparams", "n_trials"):
    # A grid of no runs would be saved, and the intended one then refused.
    if getattr(args, flag, 1) < 1:
      parser.error(f"--{flag} must be at least 1.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The sweep's flags, as given on the command line."""
  parser = make_parser()
  args = parser.parse_args(argv)
  rerun.check_arguments(parser, args)
  check_arguments(parser, args)
  return args


def grid_for(args: argparse.Namespace) -> dict[str, Any]:
  """The grid of the sweep in ``--output_dir`` (`grid_lib.resolve_grid`): the saved
  one, checked against the grid flags given, else the flags given over the
  defaults, which only ``launch`` and ``cost`` take (they describe a sweep
  to be; the other commands read one that is).

  Raises:
    UsageError: as `grid_lib.resolve_grid`.
  """
  given = {name: getattr(args, name) for name in grid_lib.GRID_DEFAULTS
           if hasattr(args, name)}
  return grid_lib.resolve_grid(args.output_dir, given,
                               grid_lib.read_grid(args.output_dir),
                      extend=args.extend_grid,
                      defaults=args.command in ("launch", "cost"))


def runs_for(args: argparse.Namespace) -> list[run_lib.Run]:
  """The runs of the sweep that parsed command-line flags describe
  (`grid_for`)."""
  return grid_lib.make_runs(output_dir=args.output_dir, **grid_for(args))


def confirm_launch(runs: Sequence[run_lib.Run],
                   skip_confirmation: bool) -> bool:
  """Whether to launch: on a terminal, the answer to "Launch? (y/n)" after
  the count of runs to train, as DomainBed's ``sweep.py`` asks; without a
  terminal (a script, a batch job) or with ``skip_confirmation``, yes."""
  todo = sum(run.status is not run_lib.Status.DONE for run in runs)
  if skip_confirmation or not todo or not sys.stdin.isatty():
    return True
  answer = input(f"Launch {todo} runs of {len(runs)}? (y/n) ")
  return answer.strip().lower() in ("y", "yes")


def check_folders(runs: Sequence[run_lib.Run], data_dir: str | None) -> None:
  """Refuses a sweep whose runs still to train read a folder dataset that
  is not there, before the weights they would start from are fetched: the
  missing data, not a download, is what to fix first, as a single run says.

  Raises:
    errors.UsageError: a dataset's folder is missing; the message says
      where it was looked for and how to put it there.
  """
  for run in runs:
    name = run.args["dataset"]
    if run.status is run_lib.Status.DONE or name not in catalog.FOLDER_DATASETS:
      continue
    folder, domains = catalog.FOLDER_DATASETS[name]
    try:
      photo_datasets.folder_root(name, folder, domains, data_dir)
    except datasets.DatasetNotFoundError as e:
      raise errors.UsageError(str(e)) from None


def fetch_weights(runs: Sequence[run_lib.Run]) -> list[str]:
  """Downloads, once and before any run starts, the ImageNet weights that
  the runs still to train start from (``--pretrained imagenet``, the photo
  datasets' default, or ``imagenet_augmix``), so that runs starting at once
  do not each download them, and a host without network access fails here
  rather than in every run.

  Returns:
    The models whose weights are cached now (``resnet50``, or
    ``resnet50 (imagenet_augmix)`` for other weights than torchvision's).

  Raises:
    errors.UsageError: the weights are neither cached nor downloadable;
      the message says where to put the file, or to pass
      ``--pretrained none``.
  """
  weights = sorted({
      (config.model, config.pretrained) for config in (
          config_lib.Config(**run.args).resolve() for run in runs
          if run.status is not run_lib.Status.DONE)
      if config.pretrained in ("imagenet", "imagenet_augmix")})
  if weights:
    # Imported only here: it imports JAX, which a digits sweep never needs.
    # pylint: disable-next=import-outside-toplevel
    from experiments.weights import imagenet
    for model, pretrained in weights:
      try:
        imagenet.fetch_imagenet(model, pretrained)
      except imagenet.WeightsUnavailableError as e:
        raise errors.UsageError(str(e)) from None
  return [model if pretrained == "imagenet" else f"{model} ({pretrained})"
          for model, pretrained in weights]


def _launch(args: argparse.Namespace, grid: Mapping[str, Any],
            runs: Sequence[run_lib.Run]) -> list[run_lib.Run]:
  """Trains ``runs``, the sweep of ``grid``, with the launcher the flags
  name (`launchers.REGISTRY`), once the ImageNet weights they start from
  are cached (`fetch_weights`) and the grid is saved
  (`grid_lib.save_grid`); returns the failed runs."""
  check_folders(runs, args.data_dir)
  fetch_weights(runs)
  if grid_lib.read_grid(args.output_dir) != grid:
    grid_lib.save_grid(args.output_dir, grid)
  return launchers.REGISTRY[args.launcher].launch(runs, args)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    grid = grid_for(args)
    runs = grid_lib.make_runs(output_dir=args.output_dir, **grid)
  except ValueError as e:  # A usage error, as argparse's: status 2.
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  if args.command in rerun.COMMANDS:
    return rerun.main(make_parser(), args, runs, args.output_dir)
  if args.command == "cost":
    try:
      print(cost(runs, args.step_ms, args.gpu_counts))
    except errors.UsageError as e:
      print(f"{PROG}: error: {e}", file=sys.stderr)
      return 2
    return 0
  if args.command == "list":
    for run in runs:
      print(run)
  print(run_lib.summary(runs))

  if args.command == "launch":
    if not confirm_launch(runs, args.skip_confirmation):
      print("Nothing launched.")
      return 1
    damaged = run_lib.report_damaged(runs)
    try:
      failed = _launch(args, grid, runs)
    except errors.UsageError as e:
      print(f"{PROG}: error: {e}", file=sys.stderr)
      return 2
    except KeyboardInterrupt:
      going = launchers.REGISTRY[args.launcher].interrupted
      print("Interrupted; the same command resumes the sweep"
            + (f" ({going})." if going else "."), file=sys.stderr)
      return 130
    for run in failed:
      print(f"Failed (see {run.log_file}): {run}")
    print(run_lib.summary(runs))
    return 1 if failed or damaged else 0

  if args.command == "delete_incomplete":
    n = sum(run.status in (run_lib.Status.INCOMPLETE, run_lib.Status.DAMAGED)
            for run in runs)
    if not n:
      print("Nothing to delete.")
      return 0
    if not args.skip_confirmation:
      if not sys.stdin.isatty():
        # Deleting is not undone: without a terminal to ask on, only an
        # explicit flag goes ahead.
        print(f"{PROG}: error: delete_incomplete asks before deleting; pass "
              "--skip_confirmation (--yes) to delete without a terminal.",
              file=sys.stderr)
        return 2
      if input(f"Delete {n} incomplete or damaged runs? [y/N] ") != "y":
        return 1
    print(f"Deleted {len(delete_incomplete(runs))} incomplete or damaged "
          "runs.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
