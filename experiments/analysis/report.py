"""Markdown tables and plots of a sweep, in DomainBed's layout.

For every model selection method there is one table per dataset, with a row per
algorithm and a column per held-out domain plus their average, and a summary
table with a column per dataset. A cell is the selected test accuracy as mean ±
standard error over trials, in percent; ``X`` marks a missing result. Runs
that average their weights (``--averaging``) are rows of their own ("ERM +
SWAD", after ERM), read by their averaged model
(`model_selection.averaged_model`); more tables then read their trained
weights, and the claims leave them out. A training table per dataset says
where the runs ended (`experiments.runs.convergence`): final training loss and accuracy, whether the
validation accuracy had plateaued, and the training time. Training curves of
the runs with default hparams are plotted next to the tables
(`experiments.analysis.curves`): held-out accuracy and per-domain training
loss of every row's method, averaging runs included, and the eigenvalue
spectrum of every algorithm that records one (the PGrad variants).

Usage::

    python -m experiments.analysis.report --input_dir sweeps/digits \\
        --output_dir results/digits

writes ``results/digits/results.md`` and ``results/digits/plots/*.png``, and
the paper's claims measured by `experiments.analysis.claims` to
``results/digits/claims/`` (``claims.json`` and a PNG per figure). The runs
are read from their directories and from packs (``runs.jsonl.gz``,
`experiments.rundir.pack.pack_runs`), as a committed study keeps them. Where
``--input_dir`` is a sweep's directory, the report counts the runs of its
saved grid (`experiments.runs.grid.GRID_FILE`) that are done, so that a
report of a sweep still training says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments import catalog
from experiments import errors
from experiments.analysis import claims as claims_lib
from experiments.analysis import curves
from experiments.runs import convergence
from experiments.runs import grid as grid_lib
from experiments.analysis import model_selection
from experiments.analysis import plots
from experiments.rundir import pack
from experiments.rundir import records as records_lib
from experiments.runs import run as run_lib
from experiments.analysis import wilds_report
from experiments.analysis.model_selection import SelectedAccuracies
from experiments.rundir.records import Record

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """A Markdown table with a left-aligned first column, the rest centred.

  >>> print(markdown_table(["a", "b"], [["x", "1"]]))
  | a | b |
  | :-- | :-: |
  | x | 1 |
  """
  lines = [header, [":--"] + [":-:"] * (len(header) - 1), *rows]
  return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def table_row(label: str, columns: Sequence[Sequence[float]],
              trials: int = 0) -> list[str]:
  """A row of accuracies over trials per column, then DomainBed's "Avg".

  Args:
    label: the first cell.
    columns: per column, one accuracy in [0, 1] per trial (maybe none).
    trials: how many trials a complete cell has: a cell with fewer says how
      many of them it holds (its standard error is over those alone; one
      has none), and so does an average over such cells.

  Returns:
    The cells: the label, "mean ± error" per column ("X" when empty, the
    mean alone and n = 1 for one trial), and the mean of the column means
    ("X" when any column is empty).

  >>> table_row("ERM", [[0.5, 0.7], [0.8]])
  ['ERM', '60.0 ± 7.1', '80.0 (n = 1)', '70.0']
  >>> table_row("ERM", [[0.5, 0.7], [0.8]], trials=2)
  ['ERM', '60.0 ± 7.1', '80.0 (1 of 2 trials)', '70.0 (incomplete)']
  """
  def cell(accs):
    if not 0 < len(accs) < trials:
      return model_selection.format_mean(accs)
    text = (model_selection.format_mean(accs) if len(accs) > 1
            else f"{model_selection.mean_and_error(accs)[0]:.1f}")
    return f"{text} ({len(accs)} of {trials} trials)"

  cells = [cell(accs) for accs in columns]
  if all(len(accs) for accs in columns):
    means = [model_selection.mean_and_error(accs)[0] for accs in columns]
    average = f"{np.mean(means):.1f}"
    if any(len(accs) < trials for accs in columns):
      average += " (incomplete)"
  else:
    average = "X"
  return [label, *cells, average]


# Per (dataset, algorithm), the hparam draws of each trial group
# (`model_selection.draw_counts`).
DrawCounts = Mapping[tuple[str, str], Sequence[int]]


def row_label(algorithm: str, counts: Sequence[int], most: int) -> str:
  """A row's label: the algorithm, and the hparam draws its cells selected
  among where any holds fewer than ``most``, its table's most.

  >>> row_label("IRM", [2, 2], 2)
  'IRM'
  >>> row_label("IRM", [1, 1], 2)
  'IRM (1 of 2 draws)'
  >>> row_label("IRM", [1, 2], 2)
  'IRM (1-2 of 2 draws)'
  """
  if not counts or min(counts) == most:
    return algorithm
  fewest, held = min(counts), max(counts)
  span = f"{fewest}" if fewest == held else f"{fewest}-{held}"
  return f"{algorithm} ({span} of {most} draws)"


def _labels(algorithms: Sequence[str], datasets: Sequence[str],
            draws: DrawCounts | None) -> list[str]:
  """Every row's label over the tables' datasets (`row_label`)."""
  if draws is None:
    return list(algorithms)
  counts = [[n for dataset in datasets for n in draws.get((dataset, a), ())]
            for a in algorithms]
  most = max((n for row in counts for n in row), default=0)
  return [row_label(a, row, most) for a, row in zip(algorithms, counts)]


def _most_trials(rows: Sequence[Sequence[Sequence[float]]]) -> int:
  """The most trials any cell of a table holds: what a complete cell has."""
  return max((len(accs) for columns in rows for accs in columns), default=0)


def dataset_table(
    selected: SelectedAccuracies,
    dataset: str,
    algorithms: Sequence[str],
    num_domains: int,
    domain_names: Sequence[str] | None = None,
    draws: DrawCounts | None = None,
) -> str:
  """One dataset's table: an algorithm per row, a held-out domain per column.

  Args:
    selected: the selected accuracies of one selection method.
    dataset: the dataset.
    algorithms: the rows, in order.
    num_domains: the dataset's number of domains.
    domain_names: their names, shown next to the env indices; None shows the
      indices alone (records written before names were recorded).
    draws: the hparam draws of every trial group; a row whose cells hold
      fewer than the table's most says so (`row_label`). None says nothing.

  Returns:
    The Markdown table.
  """
  columns = [[list(selected.get((dataset, algorithm, env), {}).values())
              for env in range(num_domains)] for algorithm in algorithms]
  trials = _most_trials(columns)
  rows = [table_row(label, row, trials) for label, row
          in zip(_labels(algorithms, [dataset], draws), columns)]
  envs = [plots.domain_name(i, domain_names) for i in range(num_domains)]
  header = ["Algorithm", *envs, "Avg"]
  return markdown_table(header, rows)


def trial_averages(
    selected: SelectedAccuracies, dataset: str, algorithm: str, num_domains: int
) -> list[float]:
  """Per trial, the selected test accuracy averaged over held-out domains.

  DomainBed averages whatever domains a trial has; only the trials with a
  result for every domain are kept here, so that all averages are over the
  same domains.

  Args:
    selected: the selected accuracies of one selection method.
    dataset: the dataset.
    algorithm: the algorithm.
    num_domains: the dataset's number of domains.

  Returns:
    One average accuracy in [0, 1] per complete trial.
  """
  per_env = [selected.get((dataset, algorithm, env), {})
             for env in range(num_domains)]
  trials = set.intersection(*(set(accs) for accs in per_env))
  return [float(np.mean([accs[t] for accs in per_env])) for t in sorted(trials)]


def summary_table(
    selected: SelectedAccuracies,
    algorithms: Sequence[str],
    num_domains: dict[str, int],
    draws: DrawCounts | None = None,
) -> str:
  """The summary table: an algorithm per row, a dataset per column.

  Args:
    selected: the selected accuracies of one selection method.
    algorithms: the rows, in order.
    num_domains: the columns, in order, with their numbers of domains.
    draws: as `dataset_table`'s, over every dataset.

  Returns:
    The Markdown table.
  """
  columns = [[trial_averages(selected, dataset, algorithm, n)
              for dataset, n in num_domains.items()]
             for algorithm in algorithms]
  trials = _most_trials(columns)
  rows = [table_row(label, row, trials) for label, row
          in zip(_labels(algorithms, list(num_domains), draws), columns)]
  return markdown_table(["Algorithm", *num_domains, "Avg"], rows)


def over_measured(values: Sequence[float],
                  text: Callable[[list[float]], str]) -> str:
  """``text`` of the values measured (not NaN), saying over how many runs
  where some are not, and "n/a" where none is: a run of one evaluation has
  no validation change, older records no step time.

  >>> over_measured([1.0, float("nan")], lambda v: f"{sum(v):.1f}")
  '1.0 (1 of 2 runs)'
  >>> over_measured([float("nan")], lambda v: f"{sum(v):.1f}")
  'n/a'
  """
  measured = [v for v in values if not math.isnan(v)]
  if not measured:
    return "n/a"
  if len(measured) < len(values):
    return f"{text(measured)} ({len(measured)} of {len(values)} runs)"
  return text(measured)


def _mean_se_text(values: Sequence[float], number: str) -> str:
  """Mean ± standard error of the measured values, in the ``number``
  format; a single value, which has no error, with ``(n = 1)``."""
  def mean_se(measured):
    mean, se = claims_lib.mean_se(measured)
    if len(measured) == 1:
      return f"{number.format(mean)} (n = 1)"
    return f"{number.format(mean)} ± {number.format(se)}"

  return over_measured(values, mean_se)


def training_table(records: Sequence[Record],
                   algorithms: Sequence[str]) -> str:
  """Where one dataset's runs ended: a row per algorithm, over all its runs.

  Args:
    records: the dataset's records.
    algorithms: the rows, in order; those without runs are left out.

  Returns:
    The Markdown table: mean ± standard error over runs of the final
    training-domain loss and accuracy and of the validation accuracy's change
    over the last steps, how many runs plateaued, of all and of those that
    training-domain validation selects (the runs behind the results table),
    the median and largest number of steps the runs trained (runs that stop
    at their plateau differ), and the median training time per run.
  """
  runs = model_selection.group_by(model_selection.by_run(records),
                                  lambda run: model_selection.method(run[0]))
  selected = model_selection.group_by(
      ((algorithm, convergence.run_end(
          model_selection.TrainingDomainValidation.selected_run(group)))
       for (_, algorithm, _, _), group
       in model_selection.trial_groups(records).items()),
      lambda pair: pair[0])
  rows = []
  for algorithm in (a for a in algorithms if a in runs):
    found = [convergence.run_end(run) for run in runs[algorithm]]
    steps = [run[-1]["step"] for run in runs[algorithm]]
    chosen = [end for _, end in selected.get(algorithm, [])]
    rows.append([
        algorithm, str(len(found)),
        f"{sum(end.plateaued for end in found)}/{len(found)}",
        f"{sum(end.plateaued for end in chosen)}/{len(chosen)}",
        _mean_se_text([end.loss for end in found], "{:.4f}"),
        _mean_se_text([100 * end.accuracy for end in found], "{:.1f}"),
        _mean_se_text([100 * end.validation_change for end in found],
                      "{:.1f}"),
        f"{np.median(steps):,.0f}; {max(steps):,}",
        over_measured([end.seconds for end in found],
                      lambda seconds: f"{np.median(seconds):.0f}")])
  return markdown_table(
      ["Algorithm", "runs", "plateaued", "selected runs plateaued",
       "final training loss",
       "training acc. (%)",
       f"validation change, last {convergence.WINDOW:.0%} of steps (pts)",
       "steps (median; most)", "training time per run (s, median)"], rows)


def render(records: Sequence[Record], output_dir: Path,
           scope: str = "") -> str:
  """Builds the Markdown report and writes its plots.

  Args:
    records: all records of a sweep.
    output_dir: the report's directory; plots go to its ``plots/``.
    scope: which runs the records were chosen from, said after their count,
      e.g. ``" (runs with hparams_seed 0)"``.

  Returns:
    The Markdown text; plots are linked relative to ``output_dir``.
  """
  wilds_table = wilds_report.wilds_table(records)
  records = [r for r in records if len(r["args"]["test_envs"]) == 1]
  unselectable = len(model_selection.by_run(
      [r for r in records if not model_selection.has_validation(r)]))
  records = [r for r in records if model_selection.has_validation(r)]
  by_dataset = model_selection.group_by(records, lambda r: r["args"]["dataset"])
  datasets = catalog.DATASETS.in_order(by_dataset)
  algorithms = model_selection.in_order(map(model_selection.method, records))
  num_domains = {d: records_lib.num_envs(by_dataset[d][0])
                 for d in datasets}
  domain_names = {d: next((r["domains"] for r in by_dataset[d]
                           if "domains" in r), None) for d in datasets}

  lines = [
      "# Results",
      "",
      f"{len(records)} records{scope}. Cells: the selected model's held-out"
      " domain accuracy (%), mean ± standard error over trials (n = 1: a"
      " single trial, which has no standard error); X: missing."
      " A row whose cells selected among fewer hparam draws than its"
      " table's most says how many.",
  ]
  if unselectable:
    runs, them = (("1 run holds", "it") if unselectable == 1
                  else (f"{unselectable} runs hold", "them"))
    lines += ["", f"{runs} out no validation data (--holdout_fraction 0, "
              f"ERM++'s second stage): no model selection reads {them}, and "
              f"this report leaves {them} out; the records hold the held-out "
              "domains' accuracy at every evaluation (env{i}_in_acc)."]
  read = {"": model_selection.averaged_model(records)}
  averaging = [r for r in records if model_selection.averages(r)]
  if averaging:
    lines += ["", "The runs that average their weights (an algorithm \"+ "
              "SWAD\", \"+ EMA\", \"+ SMA\") are read by their averaged "
              "model (SWAD's: its final model, in its last record); the last "
              "tables read their trained weights. In the training curves "
              "they are lines of their own; the paper's claims leave them "
              "out."]
    read[", the trained weights of the runs that average"] = averaging
  for title, selection_records in read.items():
    rows = [a for a in algorithms
            if any(model_selection.method(r) == a for r in selection_records)]
    draws = model_selection.draw_counts(selection_records)
    for method in model_selection.SELECTION_METHODS:
      selected = model_selection.selected_accuracies(selection_records,
                                                     method)
      lines += ["", f"## Model selection: {method.name}{title}"]
      for dataset in datasets:
        lines += ["", f"### {dataset}", "",
                  dataset_table(selected, dataset, rows,
                                num_domains[dataset], domain_names[dataset],
                                draws)]
      lines += ["", "### Averages", "",
                summary_table(selected, rows, num_domains, draws)]

  lines += ["", "## Training", "",
            "Where the runs ended (`experiments.runs.convergence`): a run has "
            "plateaued when its training-domain validation accuracy moved by "
            "at most one standard error over the last "
            f"{convergence.WINDOW:.0%} of its steps. The selected runs are "
            "those that training-domain validation picks, one per trial and "
            "held-out domain: the runs behind the accuracy tables. Training "
            "time excludes evaluation and includes compilation."]
  for dataset in datasets:
    lines += ["", f"### {dataset}", "", training_table(by_dataset[dataset],
                                                      algorithms)]
    runs = model_selection.by_run(by_dataset[dataset])
    lacking = sum(not records_lib.has_training_losses(run[-1]) for run in runs)
    if lacking:
      lines += ["", f"{lacking} of the {len(runs)} runs record no "
                "training-domain losses (env{i}_in_loss, which DomainBed's own "
                "runs do not write): their final training loss is n/a."]

  if wilds_table:
    lines += ["", "## WILDS", "",
              "The paper's layout: every run's checkpoint selected on the OOD "
              "validation split; mean ± standard deviation over runs "
              "(PovertyMap: every fold and seed).", "",
              markdown_table(*wilds_table)]

  # The curves of the runs that average their weights are as the tables':
  # lines of their own, their held-out accuracy their averaged model's.
  lines += curves.section({d: by_dataset[d] for d in datasets}, output_dir)
  return "\n".join(lines) + "\n"


def claim_number(value: float) -> str:
  """A claim's number in a table: four significant digits, and counts such
  as steps in full (``11,333``, not ``1.133e+04``)."""
  return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def claims_section(
    runs: Mapping[Path, Sequence[Record]], output_dir: Path,
    packed_paths: Mapping[Path, Mapping[str, Any]] | None = None,
) -> str:
  """Measures the paper's claims; writes them and their plots to ``claims/``.

  Args:
    runs: the sweep's runs (directories or packed) with their records.
    output_dir: the report's directory.
    packed_paths: what the packed runs among ``runs`` keep of their params
      snapshots (`pack.SweepRecords.trajectories`); the others'
      snapshots are read from their directories.

  Returns:
    The Markdown section: a table per dataset and claim, then the figures.

  Raises:
    claims_lib.ProjectedApartError: the params paths of one figure come
      partly from a pack and partly from run directories.
  """
  claims_dir = output_dir / claims_lib.CLAIMS_DIR
  claims_dir.mkdir(parents=True, exist_ok=True)
  paths = claims_lib.project_paths(
      {run_dir: (run[0], files) for run_dir, run in runs.items()
       if (files := records_lib.trajectory_files(run_dir))})
  paths.update((run_dir, claims_lib.ProjectedPath.from_json(path))
               for run_dir, path in (packed_paths or {}).items()
               if run_dir in runs)
  selected = claims_lib.select(
      [record for run in runs.values() for record in run],
      [(runs[run_dir][0], paths[run_dir]) for run_dir in sorted(paths)])
  claims = claims_lib.measure(selected)
  unmeasured = claims_lib.unmeasured(selected)
  few = claims_lib.few_evaluations(selected)
  figures = plots.plot_claims(selected, claims, claims_dir)
  numbers = claims_dir / claims_lib.CLAIMS_FILE
  numbers.write_text(json.dumps(claims, indent=1) + "\n")
  link = numbers.relative_to(output_dir).as_posix()
  lines = ["", "## The paper's claims (hparams_seed 0)", "",
           f"Numbers: [{link}]({link}); see experiments/analysis/claims.py for what "
           "each measures."]
  for dataset, found in claims.items():
    for claim, per_algorithm in found.items():
      measures = list(next(iter(per_algorithm.values())))
      rows = [[algorithm, *(claim_number(numbers[m]) for m in measures)]
              for algorithm, numbers in per_algorithm.items()]
      lines += ["", f"### {dataset}: {claim.replace('_', ' ')}", "",
                markdown_table(["Algorithm", *measures], rows)]
      if (warning := few.get(dataset, {}).get(claim)) is not None:
        warning = f"Warning: {dataset} {claim.replace('_', ' ')}: {warning}."
        print(warning, file=sys.stderr)
        lines += ["", warning]
  for dataset, reasons in unmeasured.items():
    for claim, why in reasons.items():
      reason = (f"{dataset}: no {claim.replace('_', ' ')} numbers or "
                f"figures: {why}.")
      print(reason, file=sys.stderr)
      lines += ["", reason]
  for caption, path in figures:
    link = path.relative_to(output_dir).as_posix()
    lines += ["", caption, "", f"![{caption}]({link})"]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.analysis.report",
                                   description=__doc__.splitlines()[0])
  parser.add_argument(
      "--input_dir", required=True,
      help=f"Searched recursively for runs' {records_lib.RESULTS_FILE} files "
      f"and for packed runs ({pack.PACK_FILE}).")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument(
      "--hparams_seeds", type=int, nargs="+", metavar="SEED",
      help="Report only the runs with these hparams_seed, e.g. 0 for the "
      "default hparams alone (a sweep whose random draws are unfinished); "
      "default: every run.")
  args = parser.parse_args(argv)
  # A mistyped path would otherwise read as a sweep with no runs yet.
  if not Path(args.input_dir).is_dir():
    parser.error(f"--input_dir {args.input_dir}: no such directory.")

  found = pack.load_runs(args.input_dir)
  for run_dir, why in found.skipped.items():
    print(f"Skipped {run_dir}, its records damaged: {why}.", file=sys.stderr)
  runs = found.runs
  scope = ""
  if args.hparams_seeds is not None:
    runs = {run_dir: run for run_dir, run in runs.items()
            if run[0]["args"]["hparams_seed"] in args.hparams_seeds}
    scope = (" (runs with hparams_seed "
             f"{', '.join(map(str, sorted(set(args.hparams_seeds))))})")
  records = [record for run in runs.values() for record in run]
  if not records:
    print(f"No {records_lib.RESULTS_FILE} or {pack.PACK_FILE} records "
          f"under {args.input_dir}{scope}.", file=sys.stderr)
    return 1
  if found.skipped:
    scope += (f"; {len(found.skipped)} runs skipped, their records damaged: "
              + ", ".join(str(p) for p in found.skipped))
  try:
    grid = grid_lib.read_grid(args.input_dir)
  except errors.UsageError as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2
  if grid is not None:
    scope += (f". The sweep's grid ({grid_lib.GRID_FILE}) has "
              + run_lib.summary(grid_lib.make_runs(
                  output_dir=args.input_dir, **grid)))
  output_dir = Path(args.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  report = output_dir / "results.md"
  try:
    # The paper's claims are of its algorithms, without weight averaging.
    claimed = {run_dir: run for run_dir, run in runs.items()
               if not model_selection.averages(run[0])}
    report.write_text(render(records, output_dir, scope)
                      + claims_section(claimed, output_dir,
                                       found.trajectories))
  except claims_lib.ProjectedApartError as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2
  print(f"Wrote {report}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
