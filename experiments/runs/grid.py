"""A sweep's grid: the flags that name its runs, and the runs they name.

``launch`` writes the sweep's grid (datasets, algorithms, hparam draws,
trials, steps and the other flags that name runs) to
``<output_dir>/sweep.json`` (`GRID_FILE`, `save_grid`), and every later
command given that ``--output_dir`` alone takes its grid from there
(`resolve_grid`). A grid flag that contradicts the saved grid is a usage
error naming the difference; ``--extend_grid`` adds runs to the grid (more
draws, trials, datasets, algorithms or held-out domains) and the next launch
saves the larger grid. `make_runs` lists a grid's runs: datasets x
algorithms x held-out domains x hparams x seeds, as DomainBed's sweep does.

A grid's ``averaging`` (``--averaging``) is every run's: a sweep of ERM
with SWAD is a sweep of "ERM + SWAD" runs. Another averaging names none of
the grid's runs, so it is another sweep, in another directory, not an
extension. A grid saved before sweeps took a flag lacks its key; it is read
with the flag's value that names the runs it named then
(`_ADDED_GRID_FLAGS`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import averaging_flags
from experiments import catalog
from experiments import errors
from experiments import hparams_registry
from experiments.runs import run as run_lib

# The datasets that ship with the code, so a default sweep needs no downloads.
DEFAULT_DATASETS = ("RotatedDigits", "ColoredDigits")
# The sweep's grid, `make_runs`'s arguments, in its directory (`save_grid`).
GRID_FILE = "sweep.json"
# The flags that make a sweep's grid, `make_runs`'s parameters but its
# directory, with their defaults.
GRID_DEFAULTS = {
    "datasets": list(DEFAULT_DATASETS), "algorithms": list(catalog.ALGORITHMS),
    "test_envs": None, "n_hparams": 20, "n_trials": 3, "steps": None,
    "checkpoint_freq": None, "plateau_check_freq": None, "hparams": None,
    "trajectory_freq": None, "model": None, "averaging": "none"}
# The grid flags added after sweeps saved their grids, with the value that
# names the runs that a grid saved without them named.
_ADDED_GRID_FLAGS = {"averaging": "none"}
# Grid flags whose order does not matter.
_UNORDERED_GRID_FLAGS = ("datasets", "algorithms", "test_envs")


def _held_out_envs(
    dataset: str, test_envs: Sequence[int] | None
) -> list[int]:
  """The given test envs, or else every domain of the dataset, counted in
  the catalog (as DomainBed counts its ``ENVIRONMENTS``) without its data."""
  if test_envs is not None:
    return list(test_envs)
  return list(range(len(catalog.DATASETS[dataset].domains)))


def make_runs(
    *,
    output_dir: str | Path,
    datasets: Sequence[str],
    algorithms: Sequence[str],
    n_hparams: int,
    n_trials: int,
    test_envs: Sequence[int] | None = None,
    steps: int | None = None,
    checkpoint_freq: int | None = None,
    plateau_check_freq: int | None = None,
    hparams: str | None = None,
    trajectory_freq: int | None = None,
    model: str | None = None,
    averaging: str | None = None,
) -> list[run_lib.Run]:
  """Lists the runs of a sweep, trial by trial.

  Args:
    output_dir: the sweep's directory.
    datasets: dataset names.
    algorithms: algorithm names.
    n_hparams: hparams seeds ``0 .. n_hparams - 1`` are run (0: defaults).
    n_trials: trial seeds ``0 .. n_trials - 1`` are run.
    test_envs: the domains to hold out, one per run; ``None`` holds out every
      domain of each dataset in turn.
    steps: passed on to training unless ``None``.
    checkpoint_freq: passed on to training unless ``None``.
    plateau_check_freq: passed on to training unless ``None``: every run
      stops at the first of these checks at which it has plateaued, and
      ``steps`` is the most it trains.
    hparams: a JSON object of fixed hparams. Each run gets the ones its
      algorithm has (so ``penalty_anneal_iters`` reaches only Fishr's runs);
      a name that no swept algorithm has is an error.
    trajectory_freq: passed on to the default-hparams runs (hparams_seed 0)
      of the algorithms whose paths the claims compare
      (`catalog.TRAJECTORY_ALGORITHMS`), unless ``None``.
    model: passed on to training unless ``None`` (then each dataset's
      default model).
    averaging: passed on to training unless ``None`` or ``"none"``: every
      run averages its weights so (``--averaging``, at its knobs' defaults).

  Returns:
    The runs.
  """
  optional = {"steps": steps, "checkpoint_freq": checkpoint_freq,
              "plateau_check_freq": plateau_check_freq, "model": model,
              "averaging": averaging}
  optional = {k: v for k, v in optional.items() if v not in (None, "none")}
  if averaging is not None:
    _check_averaging(averaging, algorithms)
  try:
    fixed = json.loads(hparams) if hparams else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"--hparams is not valid JSON ({e}): {hparams}") from None
  if not isinstance(fixed, dict):
    raise ValueError(f"--hparams must be a JSON object, got {hparams}.")
  known = {(d, a): hparams_registry.default_hparams(a, d).keys()
           for d in datasets for a in algorithms}
  unknown = sorted(set(fixed).difference(*known.values()))
  if unknown:
    raise ValueError(f"No swept algorithm has the hparams {unknown}.")
  envs = {d: _held_out_envs(d, test_envs) for d in datasets}
  runs = []
  for trial_seed in range(n_trials):
    for dataset in datasets:
      for algorithm in algorithms:
        for env in envs[dataset]:
          for hparams_seed in range(n_hparams):
            args = {
                "dataset": dataset,
                "algorithm": algorithm,
                "test_envs": [env],
                "hparams_seed": hparams_seed,
                "trial_seed": trial_seed,
                "seed": run_lib.seed_hash(
                    dataset, algorithm, [env], hparams_seed, trial_seed),
                **optional,
            }
            if (trajectory_freq is not None and hparams_seed == 0
                and algorithm in catalog.TRAJECTORY_ALGORITHMS):
              args["trajectory_freq"] = trajectory_freq
            own = {k: v for k, v in fixed.items()
                   if k in known[dataset, algorithm]}
            if own:
              args["hparams"] = json.dumps(own, sort_keys=True)
            runs.append(run_lib.Run.create(args, output_dir))
  return runs


def _check_averaging(averaging: str, algorithms: Sequence[str]) -> None:
  """Refuses an averaging that training would refuse for every run of the
  grid, or for every run of one of its algorithms.

  Raises:
    ValueError: ``averaging`` is none of `averaging_flags.KNOBS`, or is
      not ``"none"`` for a grid of ERMPlusPlus, which averages itself.
  """
  if averaging not in averaging_flags.KNOBS:
    raise ValueError(f"--averaging {averaging!r} is none of "
                     f"{', '.join(averaging_flags.KNOBS)}.")
  if averaging != "none" and "ERMPlusPlus" in algorithms:
    raise ValueError(
        f"--averaging {averaging}: ERMPlusPlus averages its weights itself, "
        "and training refuses to average them again. Give --algorithms "
        "without ERMPlusPlus (the default is all of them), or sweep it in "
        "another --output_dir without --averaging.")


def read_grid(output_dir: str | Path) -> dict[str, Any] | None:
  """The grid that `save_grid` saved in a sweep's directory, or ``None``.

  A grid saved before a flag of `_ADDED_GRID_FLAGS` was added gets that
  flag's value there, which names the runs the grid named then.

  Raises:
    UsageError: the grid file is not a JSON object of grid flags.
  """
  path = Path(output_dir) / GRID_FILE
  try:
    grid = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, json.JSONDecodeError) as e:
    raise errors.UsageError(
        f"{path} cannot be read as the sweep's grid ({e}); restore it, or "
        "delete it and give the sweep's flags again.") from None
  if not isinstance(grid, dict) or not (
      set(GRID_DEFAULTS) - set(_ADDED_GRID_FLAGS) <= set(grid)
      <= set(GRID_DEFAULTS)):
    raise errors.UsageError(
        f"{path} is not a sweep's grid: it must hold exactly the keys "
        f"{sorted(GRID_DEFAULTS)} (those but {sorted(_ADDED_GRID_FLAGS)} if "
        "saved before they were added); restore it, or delete it and give "
        "the sweep's flags again.")
  return {**_ADDED_GRID_FLAGS, **grid}


def save_grid(output_dir: str | Path, grid: Mapping[str, Any]) -> None:
  """Writes a sweep's grid (`GRID_DEFAULTS`'s keys) to its directory's
  `GRID_FILE`, whole or not at all."""
  path = Path(output_dir) / GRID_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.with_suffix(".tmp")
  temporary.write_text(json.dumps(dict(grid), indent=1, sort_keys=True)
                       + "\n")
  temporary.replace(path)


def _same_grid_value(name: str, given: Any, saved: Any) -> bool:
  """Whether a grid flag's value names the runs its saved value names: the
  order of datasets, algorithms and domains, and the spelling of the
  ``--hparams`` JSON, do not matter."""
  if name in _UNORDERED_GRID_FLAGS and given is not None and saved is not None:
    return sorted(given) == sorted(saved)
  if name == "hparams" and given is not None and saved is not None:
    try:
      return json.loads(given) == json.loads(saved)
    except json.JSONDecodeError:
      return False
  return given == saved


def _flag_text(name: str, value: Any) -> str:
  """A grid flag as it is written on the command line."""
  if value is None:
    return f"no --{name}"
  if isinstance(value, list):
    return f"--{name} {' '.join(map(str, value))}"
  return f"--{name} {shlex.quote(str(value))}"


def resolve_grid(output_dir: str | Path, given: Mapping[str, Any],
                 saved: Mapping[str, Any] | None, *, extend: bool = False,
                 defaults: bool = True) -> dict[str, Any]:
  """A sweep's grid: the saved one, with the grid flags given checked
  against it.

  Args:
    output_dir: the sweep's directory.
    given: the grid flags given on the command line, by name.
    saved: the grid saved in the directory (`read_grid`), if any.
    extend: ``given`` may add runs to the saved grid (``--extend_grid``);
      it must keep every run the saved grid has.
    defaults: without a saved grid, the flags not given take their
      defaults (`GRID_DEFAULTS`); else the flags must be given.

  Returns:
    The grid, `make_runs`'s arguments but ``output_dir``.

  Raises:
    UsageError: a given flag contradicts the saved grid and ``extend`` is
      off, or ``extend`` drops runs of the saved grid, or there is neither
      a saved grid nor ``defaults`` nor any flag given.
  """
  grid_file = Path(output_dir) / GRID_FILE
  if saved is None:
    if not defaults and not given:
      raise errors.UsageError(
          f"{output_dir} holds no sweep grid ({GRID_FILE}, which launch "
          "writes): no sweep was launched there, or one before sweeps saved "
          "their grids. Check --output_dir, or give the flags the sweep was "
          "launched with (--datasets, --algorithms, --n_hparams, ...).")
    if extend:
      raise errors.UsageError(
          f"--extend_grid: {output_dir} holds no grid ({GRID_FILE}) to "
          "extend.")
    return {**GRID_DEFAULTS, **given}
  differences = [
      f"{_flag_text(name, value)} (the grid has "
      f"{_flag_text(name, saved[name])})"
      for name, value in given.items()
      if not _same_grid_value(name, value, saved[name])]
  grid = {**saved, **given}
  if differences and not extend:
    raise errors.UsageError(
        f"{output_dir} is a sweep of another grid ({grid_file}): "
        + "; ".join(differences) + ". Leave these flags out to use the "
        "saved grid, pass --extend_grid to add runs to it, or give another "
        "--output_dir for another sweep.")
  if differences:
    kept = {run.output_dir for run in make_runs(output_dir=output_dir, **grid)}
    dropped = [run for run in make_runs(output_dir=output_dir, **saved)
               if run.output_dir not in kept]
    if dropped:
      raise errors.UsageError(
          f"--extend_grid adds runs to a grid, but "
          + "; ".join(differences) + f" would leave out {len(dropped)} of "
          f"the {grid_file} grid's runs (e.g. {dropped[0].label}). Keep "
          "every dataset, algorithm and held-out domain, at least as many "
          "draws and trials, and the same other flags"
          + ("; a sweep of another --averaging goes in another --output_dir "
             "(the report reads both under their parent)."
             if grid["averaging"] != saved["averaging"] else "."))
  return grid
