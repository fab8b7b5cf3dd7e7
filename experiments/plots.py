"""Training-dynamics plots from the records of a sweep.

Every function takes records (see `experiments.model_selection`) of one
dataset and held-out domain and writes one PNG. Curves are averaged over the
runs in the records, which are meant to differ only in ``trial_seed``. The
figures are drawn on `matplotlib.figure.Figure`, which renders with the Agg
backend without touching pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from experiments import catalog
from experiments.model_selection import Record, group_by, held_out_env
from experiments.model_selection import train_envs


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


def _plot_band(axes: Axes, records: Sequence[Record], key: str, label: str,
               *, spread: str = "std"):
  """Plots a mean curve over runs with a band: +-1 standard deviation, or
  with ``spread="range"`` from the lowest run to the highest (on a log
  scale, where the mean minus a standard deviation can be negative)."""
  steps, mean, std = mean_std_over_runs(records, key)
  if spread == "range":
    _, values = _values_over_runs(records, key)
    low, high = (np.array([v.min() for v in values]),
                 np.array([v.max() for v in values]))
  else:
    low, high = mean - std, mean + std
  (line,) = axes.plot(steps, mean, label=label)
  axes.fill_between(steps, low, high, alpha=0.25, color=line.get_color(),
                    linewidth=0)


def _by_algorithm(records: Sequence[Record]) -> dict[str, list[Record]]:
  """The records of each algorithm, in the registry's order (the legends')."""
  runs = group_by(records, lambda r: r["args"]["algorithm"])
  return {name: runs[name] for name in catalog.ALGORITHMS.in_order(runs)}


def plot_loss_curves(records: Sequence[Record], path: str | Path) -> Figure:
  """Per-domain training loss of each algorithm (PGrad's Figure 3).

  One panel per training domain ``i`` shows ``env{i}_in_loss`` against the
  step on a log scale (a converged run's loss falls by decades and its tail
  only shows so), one curve per algorithm: the mean over trials, with a band
  from the lowest trial to the highest (over those still training, where
  the trials stopped at different steps).

  Args:
    records: records of one dataset and held-out domain, with
      ``env{i}_in_loss``, typically of ERM and PGrad runs.
    path: the PNG to write.

  Returns:
    The figure.
  """
  envs = train_envs(records[0])
  fig = Figure(figsize=(3.2 * len(envs), 3), layout="constrained")
  panels = fig.subplots(1, len(envs), sharey=True, squeeze=False)[0]
  for env, axes in zip(envs, panels):
    for algorithm, runs in _by_algorithm(records).items():
      _plot_band(axes, runs, f"env{env}_in_loss", algorithm, spread="range")
    axes.set_title(f"training domain {env}")
    axes.set_xlabel("step")
    axes.set_yscale("log")
  panels[0].set_ylabel("training loss")
  panels[0].legend()
  fig.savefig(path, dpi=120)
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
    The figure, titled with the algorithm.
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

  fig = Figure(figsize=(5, 3.5), layout="constrained")
  axes = fig.subplots()
  for k, component in enumerate(means.T):
    axes.plot(centres, component, marker="o", label=f"$\\lambda_{{{k + 1}}}$")
  axes.set_yscale("log")
  axes.set_xlabel("step (interval centre)")
  axes.set_ylabel("normalised eigenvalue")
  axes.set_title(", ".join(_by_algorithm(records)))
  axes.legend(fontsize="small")
  fig.savefig(path, dpi=120)
  return fig


def plot_heldout_accuracy(
    records: Sequence[Record], path: str | Path
) -> Figure:
  """Accuracy on the held-out domain over training, per algorithm.

  The accuracy is ``env{t}_in_acc`` of the held-out domain ``t``, the test
  accuracy of model selection, with a band of +-1 standard deviation over
  trials.

  Args:
    records: records of one dataset and held-out domain.
    path: the PNG to write.

  Returns:
    The figure.
  """
  held_out = held_out_env(records[0])
  fig = Figure(figsize=(5, 3.5), layout="constrained")
  axes = fig.subplots()
  for algorithm, runs in _by_algorithm(records).items():
    _plot_band(axes, runs, f"env{held_out}_in_acc", algorithm)
  axes.set_xlabel("step")
  axes.set_ylabel(f"held-out domain {held_out} accuracy")
  axes.legend()
  fig.savefig(path, dpi=120)
  return fig
