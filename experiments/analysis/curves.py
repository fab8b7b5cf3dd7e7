"""The report's training curves: which runs are plotted, and what is said.

Next to the report's tables (`experiments.analysis.report`), the runs with
default hparams (``hparams_seed`` `PLOTTED_HPARAMS_SEED`) of every dataset
and held-out domain are plotted (`experiments.analysis.plots`): held-out
accuracy and per-domain training loss of every method, and the eigenvalue
spectrum of every algorithm that records one (the PGrad variants). A method
is an algorithm, or an algorithm with its weight averaging ("ERM + SWAD",
`model_selection.method`), as the tables' rows: a run that averages its
weights is a line of its own, its held-out accuracy its averaged model's
(SWAD's final model alone, a point) and its training loss its trained
weights' (averaging does not change training). A plot that cannot be drawn
is named, with the reason, in the report and on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib.figure import Figure

from experiments import averaging_flags
from experiments.analysis import model_selection
from experiments.analysis import plots
from experiments.rundir import records as records_lib
from experiments.rundir.records import Record

PLOTS_DIR = "plots"
# The runs whose training curves are plotted: DomainBed's default hparams.
PLOTTED_HPARAMS_SEED = 0
# What the curves of a run that averages its weights show, said in the
# captions of the plots that have one.
AVERAGED_ACCURACY = ("; a run that averages its weights: its averaged "
                     "model's (SWAD's final model alone, a point)")
TRAINED_LOSS = ("; a run that averages its weights: its trained weights' "
                "(averaging does not change training)")


class Plot(NamedTuple):
  """A figure written by `write_plots`.

  Attributes:
    caption: what it shows.
    path: the PNG.
    figure: the drawn figure, for inspection.
  """

  caption: str
  path: Path
  figure: Figure


def write_plots(
    records: Sequence[Record], dataset: str, env: int, plots_dir: Path
) -> tuple[list[Plot], list[str]]:
  """Plots the default-hparams runs of one dataset and held-out domain.

  Args:
    records: all records of the dataset with that single held-out domain.
    dataset: the dataset.
    env: the held-out domain.
    plots_dir: where the PNGs go.

  Returns:
    The plots written, and for every plot not drawn, why.
  """
  runs = [r for r in records
          if r["args"]["hparams_seed"] == PLOTTED_HPARAMS_SEED]
  if not runs:
    return [], [f"no plots: no run has hparams_seed {PLOTTED_HPARAMS_SEED}"]
  by_method = model_selection.group_by(runs, model_selection.method)
  methods = model_selection.in_order(by_method)
  averaging = any(map(model_selection.averages, runs))
  loss_runs = [r for r in runs if records_lib.has_training_losses(r)]
  # (caption, file suffix, plot function, records or [] with the reason).
  figures = [
      ("held-out accuracy" + AVERAGED_ACCURACY * averaging, "accuracy",
       plots.plot_heldout_accuracy, runs, ""),
      ("training loss per domain" + TRAINED_LOSS * averaging, "loss",
       plots.plot_loss_curves, loss_runs, "no run records env{i}_in_loss"),
  ]
  skipped = []
  unread = [m for m in methods
            if not model_selection.averaged_model(by_method[m])]
  if unread:
    skipped.append(f"no held-out accuracy of {', '.join(unread)}: their runs "
                   "have not yet evaluated their averaged model (SWAD's: at "
                   "the end)")
  without_loss = [m for m in methods if not any(
      map(records_lib.has_training_losses, by_method[m]))]
  if loss_runs and without_loss:
    skipped.append(f"no loss curves of {', '.join(without_loss)}: their runs "
                   "record no env{i}_in_loss")
  # An averaging run's spectrum is of its training, which averaging does not
  # change: its algorithm's, drawn from the algorithm's own runs where there
  # are any, else from the averaging runs'.
  plain = {m for m in methods if not model_selection.averages(by_method[m][0])}
  algorithms = [m for m in methods if m in plain
                or by_method[m][0]["args"]["algorithm"] not in plain]
  spectra = [a for a in algorithms
             if any(r.get("eigenvalues") for r in by_method[a])]
  figures += [(f"{a} eigenvalue spectrum",
               f"{a.replace(averaging_flags.JOINT, '+')}_eigenvalues",
               plots.plot_eigenvalue_spectrum, by_method[a], "")
              for a in spectra]
  if not spectra:
    skipped.append(f"no eigenvalue spectrum: none of {', '.join(algorithms)} "
                   "records eigenvalues (the PGrad variants do)")
  written = []
  for caption, suffix, plot, selection, why_not in figures:
    if not selection:
      skipped.append(f"no {caption} plot: {why_not}")
      continue
    path = plots_dir / f"{dataset}_env{env}_{suffix}.png"
    written.append(Plot(caption, path, plot(selection, path)))
  return written, skipped


def section(by_dataset: Mapping[str, Sequence[Record]],
            output_dir: Path) -> list[str]:
  """The report's training curves, written to ``output_dir``'s `PLOTS_DIR`.

  Args:
    by_dataset: the records of every dataset's runs with a single held-out
      domain, in the report's order of the datasets.
    output_dir: the report's directory.

  Returns:
    The section's Markdown lines: every plot's caption and link (relative to
    ``output_dir``), and why any plot is not drawn, which goes to stderr too.
  """
  plots_dir = output_dir / PLOTS_DIR
  plots_dir.mkdir(parents=True, exist_ok=True)
  lines = ["", f"## Training curves (hparams_seed {PLOTTED_HPARAMS_SEED})"]
  for dataset, records in by_dataset.items():
    by_env = model_selection.group_by(records, records_lib.held_out_env)
    for env in sorted(by_env):
      written, skipped = write_plots(by_env[env], dataset, env, plots_dir)
      for plot in written:
        link = plot.path.relative_to(output_dir).as_posix()
        lines += ["", f"{dataset}, held-out env{env}: {plot.caption}", "",
                  f"![{dataset} env{env} {plot.caption}]({link})"]
      for reason in skipped:
        print(f"{dataset}, held-out env{env}: {reason}.", file=sys.stderr)
        lines += ["", f"{dataset}, held-out env{env}: {reason}."]
  return lines
