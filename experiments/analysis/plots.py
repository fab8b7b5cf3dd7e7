"""The report's figures: training dynamics, and the paper's claims.

Every training-dynamics function takes records (see `experiments.rundir.records`)
of one dataset and held-out domain and writes one PNG, titled with the
dataset and the held-out domain, with a line per method: an algorithm, or an
algorithm with its weight averaging ("ERM + SWAD",
`model_selection.method`), drawn in its algorithm's colour
(`algorithm_colour`) and its averaging's line style (`AVERAGING_STYLES`).
`plot_claims` draws what `experiments.analysis.claims` measures. Domains are named as
``env{i} (name)`` where the records carry their names. Curves are averaged
over the runs in the records, which are meant to differ only in
``trial_seed``. The figures are drawn on
`matplotlib.figure.Figure`, which renders with the Agg backend without
touching pyplot's global state.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from matplotlib import colormaps
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from PIL import Image

from experiments import catalog
from experiments.analysis import claims
from experiments.analysis import model_selection
from experiments.analysis.model_selection import by_run, group_by
from experiments.rundir.records import Record, env_key, held_out_env, train_envs

# Every figure's resolution, and the most colours of its PNG (`save`).
DPI = 120
PNG_COLOURS = 256


def save(fig: Figure, path: str | Path) -> None:
  """Writes ``fig`` to ``path``: a PNG at `DPI`, in at most `PNG_COLOURS`
  colours.

  A plot's flat colours and anti-aliased edges need no more colours; the
  palette takes about a third of the bytes of matplotlib's full-colour PNG,
  and leaves out its note of matplotlib's version, so equal pixels are
  equal files.
  """
  fig.savefig(path, dpi=DPI)
  to_palette(path)


def to_palette(path: str | Path) -> None:
  """Rewrites a PNG in at most `PNG_COLOURS` colours, as `save` writes
  every figure."""
  with Image.open(path) as drawn:
    full = drawn.convert("RGB")
  full.quantize(PNG_COLOURS, method=Image.Quantize.MEDIANCUT,
                dither=Image.Dither.NONE).save(path, optimize=True)

# The hue step of the palette past tab20's colours: a golden ratio of a turn
# never comes back to a hue already taken.
_GOLDEN_RATIO = (5**0.5 - 1) / 2


def domain_name(env: int, names: Sequence[str] | None) -> str:
  """Domain ``env`` as ``env{i} (name)``, or ``env{i}`` without ``names``
  (records written before domains were named).

  >>> domain_name(1, ["0°", "15°"]), domain_name(1, None)
  ('env1 (15°)', 'env1')
  """
  return f"env{env}" if names is None else f"env{env} ({names[env]})"


def held_out_title(record: Record) -> str:
  """The dataset and held-out domain of a record's run, for a title."""
  return (f"{record['args']['dataset']}, held out "
          f"{domain_name(held_out_env(record), record.get('domains'))}")


def _values_over_runs(
    records: Sequence[Record], key: str
) -> tuple[np.ndarray, list[np.ndarray]]:
  """The sorted steps with a ``record[key]``, and the runs' values at each."""
  by_step = group_by((r for r in records if key in r), lambda r: r["step"])
  steps = np.array(sorted(by_step))
  return steps, [np.array([r[key] for r in by_step[s]], np.float64)
                 for s in steps]


def mean_std_over_runs(
    records: Sequence[Record], key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean and standard deviation of ``record[key]`` at every step.

  Args:
    records: records of one or more runs.
    key: a scalar metric, e.g. ``"env0_in_loss"``.

  Returns:
    ``(steps, mean, std)``: the sorted steps with a value, and the mean and
    (population) standard deviation over the runs at each.
  """
  steps, values = _values_over_runs(records, key)
  return (
      steps,
      np.array([v.mean() for v in values]),
      np.array([v.std() for v in values]),
  )


# Normalised eigenvalues below this are at numerical zero (the float32
# eigendecomposition's rounding, about 1e-8 of the largest): not drawn.
EIGENVALUE_FLOOR = 1e-6


class _PlainLogFormatter(ticker.LogFormatter):
  """Labels a log axis's ticks as plain numbers (``0.7``), not as
  ``7×10⁻¹``; which ticks are labelled is matplotlib's choice."""

  def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
    del vmin, vmax  # The number alone decides its text.
    return f"{x:g}"


# The most entries a column of a legend beside a figure holds: about what
# the figures' 3.3 to 3.5 inches fit at the legend's font size.
LEGEND_ROWS = 11


def legend_beside(fig: Figure, title: str | None = None,
                  axes: Axes | None = None) -> None:
  """The legend of ``axes`` (else of the figure's first axes) beside the
  figure, not over its lines, in as many columns as fit its height."""
  handles, labels = (axes or fig.axes[0]).get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside right upper", fontsize="small",
             ncols=math.ceil(len(labels) / LEGEND_ROWS), title=title,
             title_fontsize="small")


def log_y_axis(axes: Axes) -> None:
  """A log y axis labelled in plain numbers (`_PlainLogFormatter`)."""
  axes.set_yscale("log")
  axes.yaxis.set_major_formatter(_PlainLogFormatter())
  axes.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))


def step_x_axis(axes: Axes) -> None:
  """Labels the x-axis "step" and ticks it at whole steps: around a single
  evaluation matplotlib would tick steps that never happen (9.6, 9.8, ...)."""
  axes.set_xlabel("step")
  # nbins="auto", as matplotlib's own locator: as many ticks as the axis's
  # length holds without their labels running into each other.
  axes.xaxis.set_major_locator(
      ticker.MaxNLocator(nbins="auto", integer=True, min_n_ticks=1))


def single_point_marker(steps: Sequence[Any]) -> str | None:
  """A marker for a curve of one point, which a line alone does not draw
  (a sweep of one evaluation per run); None draws lines alone."""
  return "o" if len(steps) == 1 else None


class AveragingStyle(NamedTuple):
  """How the curves of a weight averaging's runs are drawn, in their
  algorithm's colour.

  Attributes:
    linestyle: its lines' matplotlib line style.
    marker: its points' marker, where a run has one point alone (SWAD's
      final model; a sweep of one evaluation).
  """

  linestyle: str
  marker: str


# Per ``--averaging``, its curves' style: an algorithm's own runs solid,
# each averaging of it in its colour, dashed or dotted apart.
AVERAGING_STYLES = {
    "none": AveragingStyle("-", "o"),
    "ema": AveragingStyle("--", "s"),
    "sma": AveragingStyle(":", "^"),
    "swad": AveragingStyle("-.", "D"),
}


def _plot_band(axes: Axes, records: Sequence[Record], key: str, *,
               spread: str = "std"):
  """Plots one method's mean curve over runs with a band: +-1 standard
  deviation, or with ``spread="range"`` from the lowest run to the highest
  (on a log scale, where the mean minus a standard deviation can be
  negative). Where every run has one point alone (SWAD's final model, a
  sweep of one evaluation), the points are markers with that spread as
  error bars, not joined: a line between the final points of runs that
  ended at different steps is no curve, and a band at one step no band."""
  steps, mean, std = mean_std_over_runs(records, key)
  if spread == "range":
    _, values = _values_over_runs(records, key)
    low, high = (np.array([v.min() for v in values]),
                 np.array([v.max() for v in values]))
  else:
    low, high = mean - std, mean + std
  args = records[0]["args"]
  style = AVERAGING_STYLES[args.get("averaging", "none")]
  colour = algorithm_colour(args["algorithm"])
  label = model_selection.method(records[0])
  points = [r for r in records if key in r]
  if len(by_run(points)) == len(points):
    axes.errorbar(steps, mean, yerr=(mean - low, high - mean), label=label,
                  color=colour, linestyle="none", marker=style.marker,
                  capsize=3)
    return
  (line,) = axes.plot(steps, mean, label=label, color=colour,
                      linestyle=style.linestyle)
  axes.fill_between(steps, low, high, alpha=0.25, color=line.get_color(),
                    linewidth=0)


def palette_colour(index: int) -> tuple[float, ...]:
  """The ``index``-th colour of the algorithms' palette, as RGBA.

  The first 20 are "tab20"'s; those after have hues a golden ratio of a turn
  apart (each distinct from every other and from tab20's, whose brightest
  channel is never 0.8 with the dimmest 0.2), so the palette grows with the
  registry and an algorithm's colour never changes when one is added after
  it.
  """
  tab20 = colormaps["tab20"]
  if index < tab20.N:
    return tab20(index)
  hue = (index - tab20.N) * _GOLDEN_RATIO % 1.0
  return (*colorsys.hsv_to_rgb(hue, 0.75, 0.8), 1.0)


def algorithm_colour(algorithm: str) -> tuple[float, ...]:
  """One colour per registered algorithm, the same in every plot: the
  `palette_colour` of its registry position.

  matplotlib's default cycle repeats after 10 lines, so a study of more
  algorithms drew two of them alike.
  """
  return palette_colour(list(catalog.ALGORITHMS).index(algorithm))


def _by_method(records: Sequence[Record]) -> dict[str, list[Record]]:
  """The records of each method (`model_selection.method`), in the order of
  the report's rows (`model_selection.in_order`), the legends'."""
  runs = group_by(records, model_selection.method)
  return {name: runs[name] for name in model_selection.in_order(runs)}


def _averaging_note(records: Sequence[Record], what: str) -> str:
  """The end of a legend's title saying what the curves of the runs that
  average their weights show, or nothing where no run averages."""
  if not any(map(model_selection.averages, records)):
    return ""
  return f";\n+ averaging: {what}"


def plot_loss_curves(records: Sequence[Record], path: str | Path) -> Figure:
  """Per-domain training loss of each method (PGrad's Figure 3).

  One panel per training domain ``i`` shows ``env{i}_in_loss`` against the
  step on a log scale (a converged run's loss falls by decades and its tail
  only shows so), one curve per method: the mean over trials, with a band
  from the lowest trial to the highest (over those still training, where
  the trials stopped at different steps). A run that averages its weights
  shows its trained weights' loss: averaging does not change training.

  Args:
    records: records of one dataset and held-out domain, with
      ``env{i}_in_loss``, typically of ERM and PGrad runs.
    path: the PNG to write.

  Returns:
    The figure.
  """
  envs = train_envs(records[0])
  fig = Figure(figsize=(3.2 * len(envs) + 2, 3.3), layout="constrained")
  fig.suptitle(held_out_title(records[0]))
  panels = fig.subplots(1, len(envs), sharey=True, squeeze=False)[0]
  for env, axes in zip(envs, panels):
    for runs in _by_method(records).values():
      _plot_band(axes, runs, env_key(env, "in", "loss"), spread="range")
    # Small: the panels' titles side by side must not run into each other.
    axes.set_title(
        f"training domain {domain_name(env, records[0].get('domains'))}",
        fontsize="small")
    step_x_axis(axes)
    log_y_axis(axes)
  panels[0].set_ylabel("training loss")
  legend_beside(fig, "mean of trials;\nband: lowest\nto highest trial"
                + _averaging_note(records, "the\ntrained weights'"),
                axes=panels[0])
  save(fig, path)
  return fig


def plot_eigenvalue_spectrum(
    records: Sequence[Record], path: str | Path, *, num_intervals: int = 10
) -> Figure:
  """PGrad's normalised trajectory spectrum over training (its Figure 9).

  The steps are cut into ``num_intervals`` equal intervals; in each, the
  normalised eigenvalues (``record["eigenvalues"]``, descending) are averaged
  over the records that fall in it. Each spectral component is one line,
  on a log scale.

  Args:
    records: records of runs of one PGrad variant; those without eigenvalues
      are ignored.
    path: the PNG to write.
    num_intervals: how many intervals of steps to average over.

  Returns:
    The figure, titled with the algorithm, dataset and held-out domain.
  """
  records = [r for r in records if r.get("eigenvalues")]
  steps = np.array([r["step"] for r in records], np.float64)
  spectra = np.array([r["eigenvalues"] for r in records], np.float64)
  edges = np.linspace(steps.min(), steps.max(), num_intervals + 1)
  # The last interval is closed so the final step belongs to it.
  interval = np.minimum(np.searchsorted(edges, steps, side="right") - 1,
                        num_intervals - 1)
  used = np.unique(interval)
  centres = (edges[used] + edges[used + 1]) / 2
  means = np.array([spectra[interval == i].mean(axis=0) for i in used])
  drawn = means.max(axis=0) >= EIGENVALUE_FLOOR

  fig = Figure(figsize=(6.5, 3.5), layout="constrained")
  axes = fig.subplots()
  # One colour per component, in order along a colour map: the default
  # cycle of 10 colours repeats from the 11th component on.
  shades = colormaps["viridis"](np.linspace(0, 0.9, len(drawn)))
  for k in np.flatnonzero(drawn):
    axes.plot(centres, means[:, k], marker="o", color=shades[k],
              label=f"$\\lambda_{{{k + 1}}}$")
  log_y_axis(axes)
  if not drawn.all():
    axes.text(0.02, 0.02, f"{int((~drawn).sum())} at numerical zero "
              f"(< {EIGENVALUE_FLOOR:g}) not drawn",
              transform=axes.transAxes, fontsize="small")
  axes.set_xlabel("step (interval centre)")
  axes.set_ylabel("normalised eigenvalue")
  fig.suptitle(f"{', '.join(_by_method(records))}: "
               f"{held_out_title(records[0])}", fontsize="medium")
  legend_beside(fig)
  save(fig, path)
  return fig


def plot_heldout_accuracy(
    records: Sequence[Record], path: str | Path
) -> Figure:
  """Accuracy on the held-out domain over training, per method.

  The accuracy is ``env{t}_in_acc`` of the held-out domain ``t``, the test
  accuracy of model selection, with a band of +-1 standard deviation over
  trials. A run that averages its weights shows its averaged model's, as
  model selection reads it (`model_selection.averaged_model`): EMA's and
  SMA's at every evaluation, SWAD's final model alone, a point.

  Args:
    records: records of one dataset and held-out domain.
    path: the PNG to write.

  Returns:
    The figure.
  """
  held_out = held_out_env(records[0])
  fig = Figure(figsize=(7, 3.5), layout="constrained")
  axes = fig.subplots()
  for runs in _by_method(records).values():
    if read := model_selection.averaged_model(runs):
      _plot_band(axes, read, env_key(held_out, "in", "acc"))
  axes.set_title(held_out_title(records[0]), fontsize="medium")
  step_x_axis(axes)
  axes.set_ylabel("held-out domain accuracy")
  legend_beside(fig, "mean of trials;\nband: ±1 s.d."
                + _averaging_note(records, "the\naveraged model's;\n"
                                  "a point: its\nfinal model alone"))
  save(fig, path)
  return fig


def plot_trajectories(
    paths: Mapping[str, claims.ProjectedPath], path: str | Path,
    title: str = ""
) -> Figure:
  """Params paths projected jointly to 2-D, by PCA and by t-SNE.

  Args:
    paths: ``{label: ProjectedPath}``, projected jointly
      (`claims.project_paths`).
    path: the PNG to write.
    title: the figure's title, above both panels.

  Returns:
    The figure: one panel per projection, one line per path, its start
    marked with a circle.
  """
  fig = Figure(figsize=(10, 4), layout="constrained")
  fig.suptitle(title)
  for axes, method in zip(fig.subplots(1, 2), claims.PROJECTIONS):
    for label, projected in paths.items():
      points = projected.projections[method]
      (line,) = axes.plot(*points.T, marker=".", label=label)
      axes.plot(*points[0], marker="o", markersize=9,
                color=line.get_color())
    axes.set_title({"pca": "PCA", "tsne": "t-SNE"}[method])
    axes.set_xlabel(f"{method} 1")
    axes.set_ylabel(f"{method} 2")
  legend_beside(fig, "large dot:\nthe start")
  save(fig, path)
  return fig


def plot_mean_training_loss(
    records: Sequence[Record], path: str | Path, title: str = ""
) -> Figure:
  """The mean training-domain loss of every run, one colour per algorithm,
  on a log scale (it spans several decades), under ``title``."""
  fig = Figure(figsize=(6.5, 3.5), layout="constrained")
  axes = fig.subplots()
  # Over the figure, legend included: over the axes alone a long title is
  # cut at the figure's edge.
  fig.suptitle(title, fontsize="medium")
  labelled = set()
  for run in by_run(records):
    algorithm = run[0]["args"]["algorithm"]
    label = None if algorithm in labelled else algorithm
    labelled.add(algorithm)
    steps, loss = claims.mean_training_loss(run)
    axes.plot(steps, loss, label=label, color=algorithm_colour(algorithm),
              marker=single_point_marker(steps))
  log_y_axis(axes)
  step_x_axis(axes)
  axes.set_ylabel("mean training-domain loss")
  legend_beside(fig, "a line per run")
  save(fig, path)
  return fig


class _Bars(NamedTuple):
  """One bar chart of a summary: a bar per algorithm.

  Attributes:
    measure: the summary's key of the bars' heights.
    label: the y axis label.
    error: the summary's key of the error bars' half-lengths, if any.
    scale: what the heights and errors are multiplied by, e.g. 100 for
      percents.
    x_label: the x axis label, what the bars are of.
  """

  measure: str
  label: str
  error: str | None = None
  scale: float = 1.0
  x_label: str = "algorithm"


def _plot_bars(
    summary: Mapping[str, Mapping[str, float]],
    charts: Sequence[_Bars],
    path: str | Path,
    *,
    title: str,
    width: float,
    name_rotation: float = 0.0,
) -> Figure:
  """Bar charts of a summary side by side, each with a bar per algorithm.

  Args:
    summary: ``{algorithm: {measure: value}}``, the algorithms in the order
      of their bars.
    charts: what each chart shows, left to right.
    path: where the PNG goes.
    title: the figure's title, above the charts.
    width: the figure's width, in inches.
    name_rotation: the angle of the algorithms' names, in degrees.

  Returns:
    The figure.
  """
  names = list(summary)
  fig = Figure(figsize=(width, 3.5), layout="constrained")
  fig.suptitle(title)
  for axes, chart in zip(fig.subplots(1, len(charts), squeeze=False).flat,
                         charts):
    errors = None if chart.error is None else [
        chart.scale * summary[n][chart.error] for n in names]
    heights = [chart.scale * summary[n][chart.measure] for n in names]
    bars = axes.bar(names, heights, yerr=errors, capsize=4)
    # Each bar's value: a bar of 0 is otherwise no bar at all. Inside the
    # bars where error bars stand on their tops.
    axes.bar_label(bars, fmt="%.3g", fontsize="small",
                   label_type="edge" if errors is None else "center")
    if not any(heights):
      # An empty chart reads as a missing one.
      axes.text(0.5, 0.5, "0 for every bar", transform=axes.transAxes,
                ha="center", va="center")
    axes.set_xlabel(chart.x_label)
    axes.set_ylabel(chart.label)
    axes.tick_params(axis="x", labelrotation=name_rotation)
  save(fig, path)
  return fig


def plot_roughness_bars(
    summary: Mapping[str, Mapping[str, float]], path: str | Path,
    title: str = ""
) -> Figure:
  """Per algorithm, the excess variation and rising rate of `smoothness`."""
  return _plot_bars(
      summary,
      [_Bars("excess_variation", "excess variation of a domain's loss"),
       _Bars("rising_rate", "intervals where a domain's loss rose")],
      path, title=title, width=8)


def plot_accuracy_bars(
    summary: Mapping[str, Mapping[str, float]], path: str | Path,
    title: str = ""
) -> Figure:
  """Mean ± standard error of the final held-out accuracy per algorithm."""
  return _plot_bars(
      summary, [_Bars("accuracy", "final held-out accuracy (%)",
                      error="accuracy_se", scale=100,
                      x_label="PGrad-k: k components kept; PGrad-B: "
                      "B = 3 chunks")],
      path, title=title, width=5, name_rotation=30)


def plot_claims(selected: Mapping[str, claims.ClaimRecords],
                measured: Mapping[str, Any],
                plots_dir: Path) -> list[tuple[str, Path]]:
  """Draws the figure of every claim measured.

  Args:
    selected: what the claims read, per dataset (`claims.select`).
    measured: their numbers (`claims.measure`).
    plots_dir: where the PNGs go.

  Returns:
    ``(caption, path)`` of every figure written, dataset by dataset.
  """
  figures = []

  def draw(plot, data, name: str, caption: str):
    """Draws one figure to ``name``.png, titled with its caption."""
    path = plots_dir / f"{name}.png"
    plot(data, path, caption)
    figures.append((caption, path))

  for dataset, found in measured.items():
    inputs = selected[dataset]
    if "smoothness" in found:
      draw(plot_roughness_bars, found["smoothness"], f"{dataset}_roughness",
           f"{dataset}: roughness of the training-domain losses")
      for env, env_recs in sorted(group_by(inputs.smoothness,
                                           held_out_env).items()):
        # Titled with the dataset and held-out domain, as every loss plot.
        path = plots_dir / f"{dataset}_env{env}_smoothness.png"
        plot_loss_curves(env_recs, path)
        figures.append((f"{dataset}, held-out env{env}: training loss per "
                        "domain (smoothness)", path))
    if "bottom" in found:
      draw(plot_mean_training_loss, inputs.bottom, f"{dataset}_bottom_loss",
           f"{dataset}: mean training loss, bottom against top eigenvectors")
    if "trajectory_length" in found:
      lengths = found["trajectory_length"]
      draw(plot_accuracy_bars, lengths, f"{dataset}_trajectory_length",
           f"{dataset}: final held-out accuracy against k and B"
           if len(lengths) > 1 else
           f"{dataset}: final held-out accuracy of {next(iter(lengths))} "
           "alone (no other k or B was run)")
    for (env, trial), by_algorithm in inputs.trajectories.items():
      if len(by_algorithm) == len(catalog.TRAJECTORY_ALGORITHMS):
        draw(plot_trajectories, by_algorithm,
             f"{dataset}_env{env}_trial{trial}_trajectory",
             f"{dataset}, held-out env{env}, trial {trial}: params paths")
  return figures
