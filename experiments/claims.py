"""The paper's claims, measured on the runs of a sweep.

Each claim becomes one number per algorithm in ``claims.json`` and one figure,
written by ``python -m experiments.report`` next to the tables:

* Smooth training (PGrad's Q3, Figure 3): the roughness of every training
  domain's loss curve ``env{i}_in_loss`` (see `curve_roughness`) and how
  often one domain's loss rises between evaluations (`rising_rate`), for
  `SMOOTHNESS_ALGORITHMS`.
* Trajectories (its appendix A.4): the params saved by runs trained with
  ``--trajectory_freq``, projected to 2-D by PCA and by t-SNE, and the length
  and straightness of each path (`path_lengths`).
* Bottom eigenvectors (its Q5, appendix A.7): the mean training loss of
  ``PGrad-Bottom`` against ``PGrad`` over training, and its relative change
  (`loss_changes`).
* Trajectory length (its Table 4 ablation): held-out accuracy of PGrad with
  ``k`` = 1, 2, 4 and all components, and of PGrad-B (``B`` = 3).

Only runs with the default hparams (``hparams_seed`` 0) and one held-out
domain are measured, so that every algorithm is compared at its defaults; the
bottom-eigenvector and trajectory-length comparisons keep the held-out
domains every algorithm in them has (`same_held_out`). Runs that stop where
they plateau differ in length, so the smoothness comparison reads every run
up to the last step all of them reached (`common_steps`), the
bottom-eigenvector comparison gives its loss change both there and at each
run's end, and the trajectory-length comparison reads each run's end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from experiments import plots
from experiments.model_selection import Record, by_run, group_by, held_out_env
from experiments.model_selection import train_envs

SMOOTHNESS_ALGORITHMS = ("ERM", "PGrad", "PGrad-B", "Fish")
TRAJECTORY_ALGORITHMS = ("ERM", "PGrad")
BOTTOM_ALGORITHMS = ("PGrad", "PGrad-Bottom")
LENGTH_ALGORITHMS = ("PGrad-k1", "PGrad-k2", "PGrad", "PGrad-kall", "PGrad-B")
MEASURED_HPARAMS_SEED = 0
TRAJECTORY_DIR = "trajectory"  # As experiments.train writes it.
# The report's subdirectory for the claims' numbers and figures.
CLAIMS_DIR = "claims"
CLAIMS_FILE = "claims.json"


def curve_roughness(values: Sequence[float]) -> dict[str, float]:
  """How far a loss curve is from a smooth descent.

  Args:
    values: the loss at consecutive evaluations.

  Returns:
    ``total_variation``: ``sum |L[t+1] - L[t]|``; ``excess_variation``: the
    total variation minus the net change ``|L[-1] - L[0]|``, which is 0 for a
    monotone curve and twice the total of the rises of a descending one;
    ``change_std``: the standard deviation of the changes ``L[t+1] - L[t]``.

  >>> curve_roughness([3.0, 1.0, 2.0, 0.0])  # Changes -2, 1, -2.
  ... # doctest: +ELLIPSIS
  {'total_variation': 5.0, 'excess_variation': 2.0, 'change_std': 1.414...}
  """
  changes = np.diff(np.asarray(values, np.float64))
  total = float(np.abs(changes).sum())
  return {"total_variation": total,
          "excess_variation": total - abs(float(changes.sum())),
          "change_std": float(changes.std())}


def loss_curves(run: Sequence[Record]) -> np.ndarray:
  """``(training domains, evaluations)``: every training domain's loss."""
  return np.array([[r[f"env{i}_in_loss"] for r in run]
                   for i in train_envs(run[0])], np.float64)


def rising_rate(curves: np.ndarray) -> float:
  """The fraction of evaluation intervals in which some domain's loss rose.

  Args:
    curves: ``(domains, evaluations)`` losses, as `loss_curves`.

  Returns:
    A fraction in [0, 1] (0 with fewer than two evaluations).
  """
  changes = np.diff(curves, axis=1)
  return float((changes > 0).any(axis=0).mean()) if changes.size else 0.0


def smoothness(records: Sequence[Record]) -> dict[str, dict[str, float]]:
  """Per algorithm, the mean roughness of its training-domain loss curves.

  Every measure of `curve_roughness` is averaged over the training domains
  of every run, and `rising_rate` over the runs.

  Args:
    records: records of one dataset (any held-out domains and trials).

  Returns:
    ``{algorithm: {measure: mean, "runs": count}}``.
  """
  summary = {}
  for algorithm, recs in group_by(
      records, lambda r: r["args"]["algorithm"]).items():
    per_curve, rising = [], []
    for run in by_run(recs):
      curves = loss_curves(run)
      per_curve += [curve_roughness(c) for c in curves]
      rising.append(rising_rate(curves))
    summary[algorithm] = {
        **{m: float(np.mean([c[m] for c in per_curve]))
           for m in per_curve[0]},
        "rising_rate": float(np.mean(rising)), "runs": len(rising)}
  return summary


def load_trajectory(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
  """The params snapshots of a run trained with ``--trajectory_freq``.

  Args:
    run_dir: the run's output directory.

  Returns:
    ``(steps (T,), points (T, P))`` in step order.
  """
  files = sorted(p for p in (Path(run_dir) / TRAJECTORY_DIR).glob("*.npy")
                 if p.stem.isdigit())
  return (np.array([int(p.stem) for p in files]),
          np.stack([np.load(p).astype(np.float64) for p in files]))


def path_lengths(points: np.ndarray) -> dict[str, float]:
  """The length of a params path, its end-to-end distance and their ratio.

  Args:
    points: ``(T, P)`` params snapshots in step order.

  Returns:
    ``length`` (sum of the distances between consecutive snapshots),
    ``displacement`` (first to last) and ``straightness`` (their ratio; 1 for
    a straight path).
  """
  length = float(np.linalg.norm(np.diff(points, axis=0), axis=1).sum())
  displacement = float(np.linalg.norm(points[-1] - points[0]))
  return {"length": length, "displacement": displacement,
          "straightness": displacement / length if length else 1.0}


def project(points: np.ndarray, method: str, *, seed: int = 0) -> np.ndarray:
  """Projects ``(N, P)`` points to ``(N, 2)`` by ``"pca"`` or ``"tsne"``.

  PCA uses the top two principal axes of the centred points; t-SNE is
  scikit-learn's, initialised by PCA, with a perplexity below the point
  count as it requires.
  """
  if method == "pca":
    centred = points - points.mean(axis=0)
    _, _, axes = np.linalg.svd(centred, full_matrices=False)
    return centred @ axes[:2].T
  if method == "tsne":
    from sklearn.manifold import TSNE  # Slow import; only needed here.
    perplexity = min(30.0, (len(points) - 1) / 3)
    return TSNE(n_components=2, perplexity=perplexity, init="pca",
                random_state=seed).fit_transform(points)
  raise ValueError(f"method must be 'pca' or 'tsne', got {method!r}.")


def plot_trajectories(
    paths: Mapping[str, np.ndarray], path: str | Path
) -> Figure:
  """Params paths projected jointly to 2-D, by PCA and by t-SNE.

  Args:
    paths: ``{label: (T, P) snapshots}``; all share ``P``.
    path: the PNG to write.

  Returns:
    The figure: one panel per projection, one line per path, its start
    marked with a circle.
  """
  labels = list(paths)
  stacked = np.concatenate([paths[label] for label in labels])
  bounds = np.cumsum([0] + [len(paths[label]) for label in labels])
  fig = Figure(figsize=(9, 4), layout="constrained")
  for axes, method in zip(fig.subplots(1, 2), ("pca", "tsne")):
    projected = project(stacked, method)
    for label, start, end in zip(labels, bounds[:-1], bounds[1:]):
      (line,) = axes.plot(*projected[start:end].T, marker=".", label=label)
      axes.plot(*projected[start], marker="o", markersize=9,
                color=line.get_color())
    axes.set_title({"pca": "PCA", "tsne": "t-SNE"}[method])
    axes.set_xlabel(f"{method} 1")
    axes.set_ylabel(f"{method} 2")
    axes.legend()
  fig.savefig(path, dpi=120)
  return fig


def mean_training_loss(run: Sequence[Record]) -> tuple[np.ndarray, np.ndarray]:
  """``(steps, loss)``: the mean over training domains of ``env{i}_in_loss``."""
  return (np.array([r["step"] for r in run]), loss_curves(run).mean(axis=0))


def loss_changes(records: Sequence[Record]) -> dict[str, dict[str, float]]:
  """Per algorithm, how its mean training-domain loss changed over training.

  Args:
    records: records of one dataset.

  Returns:
    ``{algorithm: {measure: mean over its runs, "runs": count}}``:
    ``relative_loss_change``, ``(L[end] - L[first]) / L[first]`` of
    `mean_training_loss` up to the last step every run reached
    (`common_steps`); ``relative_loss_change_at_end``, the same up to each
    run's own end; and ``steps``, where the runs ended.
  """
  def change(run):
    loss = mean_training_loss(run)[1]
    return float((loss[-1] - loss[0]) / loss[0])

  def algorithm(run):
    return run[0]["args"]["algorithm"]

  common = group_by(by_run(common_steps(records)), algorithm)
  whole = group_by(by_run(records), algorithm)
  return {name: {
      "relative_loss_change": float(np.mean(
          [change(run) for run in common[name]])),
      "relative_loss_change_at_end": float(np.mean(
          [change(run) for run in runs])),
      "steps": float(np.mean([run[-1]["step"] for run in runs])),
      "runs": len(runs)} for name, runs in whole.items()}


def plot_mean_training_loss(
    records: Sequence[Record], path: str | Path
) -> Figure:
  """The mean training-domain loss of every run, one colour per algorithm,
  on a log scale (it spans several decades)."""
  fig = Figure(figsize=(5, 3.5), layout="constrained")
  axes = fig.subplots()
  colours = {}
  for run in by_run(records):
    algorithm = run[0]["args"]["algorithm"]
    label = None if algorithm in colours else algorithm
    (line,) = axes.plot(*mean_training_loss(run), label=label,
                        color=colours.get(algorithm))
    colours.setdefault(algorithm, line.get_color())
  axes.set_yscale("log")
  axes.set_xlabel("step")
  axes.set_ylabel("mean training-domain loss")
  axes.legend()
  fig.savefig(path, dpi=120)
  return fig


def held_out_accuracy(run: Sequence[Record]) -> float:
  """The final held-out domain accuracy of a run (its ``in`` split)."""
  return float(run[-1][f"env{held_out_env(run[0])}_in_acc"])


def plot_roughness_bars(
    summary: Mapping[str, Mapping[str, float]], path: str | Path
) -> Figure:
  """Per algorithm, the excess variation and rising rate of `smoothness`."""
  names = list(summary)
  fig = Figure(figsize=(8, 3.5), layout="constrained")
  for axes, measure_name, label in zip(
      fig.subplots(1, 2), ("excess_variation", "rising_rate"),
      ("excess variation of a domain's loss",
       "intervals where a domain's loss rose")):
    axes.bar(names, [summary[n][measure_name] for n in names])
    axes.set_xlabel("algorithm")
    axes.set_ylabel(label)
  fig.savefig(path, dpi=120)
  return fig


def plot_accuracy_bars(
    summary: Mapping[str, Mapping[str, float]], path: str | Path
) -> Figure:
  """Mean ± standard error of the final held-out accuracy per algorithm."""
  names = list(summary)
  fig = Figure(figsize=(5, 3.5), layout="constrained")
  axes = fig.subplots()
  axes.bar(names, [100 * summary[n]["accuracy"] for n in names],
           yerr=[100 * summary[n]["accuracy_se"] for n in names], capsize=4)
  axes.set_xlabel("algorithm")
  axes.set_ylabel("final held-out accuracy (%)")
  axes.tick_params(axis="x", labelrotation=30)
  fig.savefig(path, dpi=120)
  return fig


def mean_se(values: Sequence[float]) -> tuple[float, float]:
  """Mean and standard error (sample standard deviation / sqrt(n))."""
  values = np.asarray(values, np.float64)
  se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
  return float(values.mean()), float(se)


def _select(records: Sequence[Record], algorithms: Sequence[str]):
  return [r for r in records if r["args"]["algorithm"] in algorithms]


def same_held_out(records: Sequence[Record]) -> list[Record]:
  """The records of the held-out domains that every algorithm among them has.

  The ablations hold out fewer domains than the main runs; comparing them on
  different held-out domains would compare the domains, not the algorithms.
  """
  if not records:
    return []
  held_out = group_by(records, lambda r: r["args"]["algorithm"])
  common = set.intersection(*({held_out_env(r) for r in recs}
                              for recs in held_out.values()))
  return [r for r in records if held_out_env(r) in common]


def common_steps(records: Sequence[Record]) -> list[Record]:
  """The records up to the last step that every run among them reached.

  A loss curve's roughness and change grow with its length, so curves are
  compared over the same steps.
  """
  runs = by_run(records)
  if not runs:
    return []
  end = min(run[-1]["step"] for run in runs)
  return [r for run in runs for r in run if r["step"] <= end]


def measure(
    records: Sequence[Record], input_dir: str | Path, plots_dir: Path
) -> tuple[dict[str, Any], list[tuple[str, Path]]]:
  """Measures every claim on a sweep's records and draws its figures.

  Args:
    records: all records of the sweep.
    input_dir: the sweep's directory, searched for runs' ``trajectory/``.
    plots_dir: where the PNGs go.

  Returns:
    ``(claims, figures)``: ``{dataset: {claim: numbers}}``, and
    ``(caption, path)`` of every figure written. Claims whose runs are
    missing are left out.
  """
  records = [r for r in records if len(r["args"]["test_envs"]) == 1
             and r["args"]["hparams_seed"] == MEASURED_HPARAMS_SEED]
  trajectories = {}
  for results in sorted(Path(input_dir).rglob("results.jsonl")):
    if (results.parent / TRAJECTORY_DIR).is_dir():
      with results.open() as f:
        try:
          args = json.loads(f.readline())["args"]
        except json.JSONDecodeError:  # Killed before its first record.
          continue
      if args["hparams_seed"] != MEASURED_HPARAMS_SEED:
        continue
      trajectories[args["dataset"], args["algorithm"],
                   args["test_envs"][0], args["trial_seed"]] = results.parent
  claims, figures = {}, []
  for dataset, recs in group_by(records,
                                lambda r: r["args"]["dataset"]).items():
    found = {}
    smooth = common_steps(_select(recs, SMOOTHNESS_ALGORITHMS))
    if smooth:
      measured = smoothness(smooth)
      found["smoothness"] = {a: measured[a] for a in SMOOTHNESS_ALGORITHMS
                             if a in measured}
      path = plots_dir / f"{dataset}_roughness.png"
      plot_roughness_bars(found["smoothness"], path)
      figures.append((f"{dataset}: roughness of the training-domain losses",
                      path))
      for env, env_recs in sorted(group_by(smooth, held_out_env).items()):
        path = plots_dir / f"{dataset}_env{env}_smoothness.png"
        plots.plot_loss_curves(env_recs, path)
        figures.append((f"{dataset}, held-out env{env}: training loss per "
                        "domain (smoothness)", path))
    bottom = same_held_out(_select(recs, BOTTOM_ALGORITHMS))
    if any(r["args"]["algorithm"] == "PGrad-Bottom" for r in bottom):
      found["bottom"] = loss_changes(bottom)
      path = plots_dir / f"{dataset}_bottom_loss.png"
      plot_mean_training_loss(bottom, path)
      figures.append((f"{dataset}: mean training loss, bottom against top "
                      "eigenvectors", path))
    lengths = same_held_out(_select(recs, LENGTH_ALGORITHMS))
    if lengths:
      accuracy = group_by(((run[0]["args"]["algorithm"], held_out_accuracy(run))
                           for run in by_run(lengths)), lambda p: p[0])
      summary = {}
      for algorithm in LENGTH_ALGORITHMS:
        if algorithm in accuracy:
          mean, se = mean_se([acc for _, acc in accuracy[algorithm]])
          summary[algorithm] = {"accuracy": mean, "accuracy_se": se,
                                "runs": len(accuracy[algorithm])}
      found["trajectory_length"] = summary
      path = plots_dir / f"{dataset}_trajectory_length.png"
      plot_accuracy_bars(summary, path)
      figures.append((f"{dataset}: final held-out accuracy against k and B",
                      path))
    paths = {}
    for (d, algorithm, env, trial), run_dir in trajectories.items():
      if d == dataset and algorithm in TRAJECTORY_ALGORITHMS:
        paths.setdefault((env, trial), {})[algorithm] = load_trajectory(
            run_dir)[1]
    shapes = {}
    for (env, trial), by_algorithm in sorted(paths.items()):
      for algorithm, points in by_algorithm.items():
        shapes.setdefault(algorithm, []).append(path_lengths(points))
      if len(by_algorithm) == len(TRAJECTORY_ALGORITHMS):
        path = plots_dir / f"{dataset}_env{env}_trial{trial}_trajectory.png"
        plot_trajectories(by_algorithm, path)
        figures.append((f"{dataset}, held-out env{env}, trial {trial}: params "
                        "paths", path))
    if shapes:
      found["trajectories"] = {
          algorithm: {**{m: float(np.mean([s[m] for s in runs]))
                         for m in runs[0]}, "runs": len(runs)}
          for algorithm, runs in shapes.items()}
    if found:
      claims[dataset] = found
  return claims, figures
