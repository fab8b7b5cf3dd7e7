"""The paper's claims, measured on the runs of a sweep.

Each claim becomes one number per algorithm in ``claims.json`` and one figure
(`experiments.analysis.plots.plot_claims`), written by
``python -m experiments.analysis.report`` next to the tables:

* Smooth training (PGrad's Q3, Figure 3): the roughness of every training
  domain's loss curve ``env{i}_in_loss`` (see `curve_roughness`) and how
  often one domain's loss rises between evaluations (`rising_rate`), for
  `SMOOTHNESS_ALGORITHMS`.
* Trajectories (its appendix A.4): the params saved by runs trained with
  ``--trajectory_freq`` (`catalog.TRAJECTORY_ALGORITHMS`), projected to 2-D
  by PCA and by t-SNE, and the length and straightness of each path
  (`path_lengths`). `project_paths` reads the snapshots once into a
  `ProjectedPath` per run, which is also what a study's pack keeps in
  their place (`experiments.rundir.pack.pack_runs`).
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
run's end, and the trajectory-length comparison reads each run's end. A
claim read from changes between evaluations is not measured where a run has
a single evaluation, nor a claim read from the losses where a run records
none (`unmeasured` says so).

The numbers are sums taken with `math.fsum`, which rounds the exact sum once:
unlike NumPy's and BLAS's sums, whose order of additions depends on the
machine and library, it gives every machine the same last digits, so a
rebuilt ``claims.json`` equals the committed one. The projections, which
t-SNE's optimisation makes sensitive to the last digits, are read from the
pack as they were computed where it was written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from experiments.analysis.model_selection import by_run, group_by
from experiments.catalog import ALGORITHMS, TRAJECTORY_ALGORITHMS
from experiments.rundir.records import (Record, env_key, has_training_losses,
                                      held_out_env, train_envs)

SMOOTHNESS_ALGORITHMS = ("ERM", "PGrad", "PGrad-B", "Fish")
BOTTOM_ALGORITHMS = ("PGrad", "PGrad-Bottom")
LENGTH_ALGORITHMS = ("PGrad-k1", "PGrad-k2", "PGrad", "PGrad-kall", "PGrad-B")
MEASURED_HPARAMS_SEED = 0
# How params paths are projected to 2-D, in the figure's order (`project`).
PROJECTIONS = ("pca", "tsne")
# The report's subdirectory for the claims' numbers and figures.
CLAIMS_DIR = "claims"
CLAIMS_FILE = "claims.json"
# A claim read from runs with fewer evaluations than this (over the steps
# it reads) says so (`few_evaluations`): two points make one change, which
# tells neither a curve's smoothness nor its trend.
FEW_EVALUATIONS = 3


def mean(values: Iterable[float]) -> float:
  """The mean, from the exactly rounded sum (`math.fsum`): the same on every
  machine and in every order of the values.

  >>> values = [0.1, 0.2, 0.3]
  >>> sum(values) == sum(values[::-1]), mean(values) == mean(values[::-1])
  (False, True)
  """
  values = [float(v) for v in values]
  return math.fsum(values) / len(values)


def std(values: Iterable[float], ddof: int = 0) -> float:
  """The standard deviation, ``sqrt(sum (v - mean)^2 / (n - ddof))``, from
  exactly rounded sums as `mean`."""
  values = [float(v) for v in values]
  centre = mean(values)
  return math.sqrt(math.fsum((v - centre) ** 2 for v in values)
                   / (len(values) - ddof))


def norm(vector: np.ndarray) -> float:
  """The Euclidean norm from the exactly rounded sum of squares (BLAS's
  norm differs in its last digits between machines)."""
  vector = np.asarray(vector, np.float64).ravel()
  return math.sqrt(math.fsum(vector * vector))


def curve_roughness(values: Sequence[float]) -> dict[str, float]:
  """How far a loss curve is from a smooth descent.

  Args:
    values: the loss at two or more consecutive evaluations.

  Returns:
    ``total_variation``: ``sum |L[t+1] - L[t]|``; ``excess_variation``: the
    total variation minus the net change ``|L[-1] - L[0]|``, which is 0 for a
    monotone curve and twice the total of the rises of a descending one;
    ``change_std``: the standard deviation of the changes ``L[t+1] - L[t]``.

  Raises:
    ValueError: for fewer than two values, which have no change.

  >>> curve_roughness([3.0, 1.0, 2.0, 0.0])  # Changes -2, 1, -2.
  ... # doctest: +ELLIPSIS
  {'total_variation': 5.0, 'excess_variation': 2.0, 'change_std': 1.414...}
  """
  if len(values) < 2:
    raise ValueError(f"A loss curve's roughness needs two evaluations, got "
                     f"{len(values)}.")
  changes = np.diff(np.asarray(values, np.float64))
  total = math.fsum(np.abs(changes))
  return {"total_variation": total,
          "excess_variation": total - abs(math.fsum(changes)),
          "change_std": std(changes)}


def loss_curves(run: Sequence[Record]) -> np.ndarray:
  """``(training domains, evaluations)``: every training domain's loss."""
  return np.array([[r[env_key(i, "in", "loss")] for r in run]
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
        **{m: mean(c[m] for c in per_curve) for m in per_curve[0]},
        "rising_rate": mean(rising), "runs": len(rising)}
  return summary


def load_trajectory(
    files: Mapping[int, Path]
) -> tuple[np.ndarray, np.ndarray]:
  """The params snapshots of a run trained with ``--trajectory_freq``.

  Args:
    files: its snapshot files by step (`records.trajectory_files`).

  Returns:
    ``(steps (T,), points (T, P))`` in step order.
  """
  return (np.array(list(files)),
          np.stack([np.load(p).astype(np.float64) for p in files.values()]))


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


class ProjectedPath(NamedTuple):
  """What the claims read of a run's params snapshots (`project_paths`).

  Attributes:
    lengths: the path's `path_lengths`.
    projections: ``{method: (T, 2) points}`` for every method of
      `PROJECTIONS`, the snapshots projected jointly with the other paths of
      the run's dataset, held-out domain and trial; empty where those lack
      an algorithm of `catalog.TRAJECTORY_ALGORITHMS`, whose figure is not
      drawn.
    projected_with: the names of the run directories projected jointly, in
      the order they were stacked.
  """

  lengths: dict[str, float]
  projections: dict[str, np.ndarray]
  projected_with: tuple[str, ...]

  def to_json(self) -> dict[str, Any]:
    """The path as JSON, which keeps every float exactly."""
    return {"lengths": self.lengths,
            "projections": {method: points.tolist()
                            for method, points in self.projections.items()},
            "projected_with": list(self.projected_with)}

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> ProjectedPath:
    """The path `to_json` wrote."""
    return cls(dict(data["lengths"]),
               {method: np.array(points, np.float64)
                for method, points in data["projections"].items()},
               tuple(data["projected_with"]))


def _path_key(record: Record) -> tuple[str, str, int, int] | None:
  """``(dataset, algorithm, held-out domain, trial_seed)`` of a run whose
  params path the claims read, from one of its records; None for another
  run."""
  args = record["args"]
  if (args["hparams_seed"] != MEASURED_HPARAMS_SEED
      or args["algorithm"] not in TRAJECTORY_ALGORITHMS
      or len(args["test_envs"]) != 1):
    return None
  return (args["dataset"], args["algorithm"], args["test_envs"][0],
          args["trial_seed"])


def _latest(runs: Iterable[tuple[Record, Any]]) -> dict[tuple, Any]:
  """Per `_path_key`, the last of ``runs`` (in path order) with that key,
  at the place of the first: a later run of a key replaces an earlier one."""
  latest = {}
  for record, value in runs:
    if (key := _path_key(record)) is not None:
      latest[key] = value
  return latest


def project_paths(
    snapshots: Mapping[Path, tuple[Record, Mapping[int, Path]]]
) -> dict[Path, ProjectedPath]:
  """Reads the params snapshots of the runs the claims measure, and projects
  those of each dataset, held-out domain and trial jointly.

  Args:
    snapshots: by run directory, one of its records and its snapshot files
      (`records.trajectory_files`).

  Returns:
    By run directory, the runs' `ProjectedPath`; runs of other hparams or
    algorithms are left out.
  """
  latest = _latest((snapshots[run_dir][0], run_dir)
                   for run_dir in sorted(snapshots))
  groups = group_by(latest.items(), lambda item: (item[0][0], *item[0][2:]))
  projected = {}
  for members in groups.values():
    run_dirs = [run_dir for _, run_dir in members]
    paths = [load_trajectory(snapshots[run_dir][1])[1] for run_dir in run_dirs]
    joint = {}
    if len(members) == len(TRAJECTORY_ALGORITHMS):
      stacked = np.concatenate(paths)
      joint = {method: project(stacked, method) for method in PROJECTIONS}
    names = tuple(run_dir.name for run_dir in run_dirs)
    ends = np.cumsum([len(points) for points in paths])
    for run_dir, points, end in zip(run_dirs, paths, ends):
      projected[run_dir] = ProjectedPath(
          path_lengths(points),
          {method: np.asarray(found[end - len(points):end], np.float64)
           for method, found in joint.items()},
          names)
  return projected


def path_lengths(points: np.ndarray) -> dict[str, float]:
  """The length of a params path, its end-to-end distance and their ratio.

  Args:
    points: ``(T, P)`` params snapshots in step order.

  Returns:
    ``length`` (sum of the distances between consecutive snapshots),
    ``displacement`` (first to last) and ``straightness`` (their ratio; 1 for
    a straight path).
  """
  length = math.fsum(norm(step) for step in np.diff(points, axis=0))
  displacement = norm(points[-1] - points[0])
  return {"length": length, "displacement": displacement,
          "straightness": displacement / length if length else 1.0}


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
      "relative_loss_change": mean(change(run) for run in common[name]),
      "relative_loss_change_at_end": mean(change(run) for run in runs),
      "steps": mean(run[-1]["step"] for run in runs),
      "runs": len(runs)} for name, runs in whole.items()}


def held_out_accuracy(run: Sequence[Record]) -> float:
  """The final held-out domain accuracy of a run (its ``in`` split)."""
  return float(run[-1][env_key(held_out_env(run[0]), "in", "acc")])


def mean_se(values: Sequence[float]) -> tuple[float, float]:
  """Mean and standard error (sample standard deviation / sqrt(n); 0 for a
  single value)."""
  se = (std(values, ddof=1) / math.sqrt(len(values)) if len(values) > 1
        else 0.0)
  return mean(values), se


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


class ClaimRecords(NamedTuple):
  """What the claims read on one dataset (`select`).

  Attributes:
    smoothness: the records of `SMOOTHNESS_ALGORITHMS`, up to the last step
      every run reached (`common_steps`).
    bottom: the records of `BOTTOM_ALGORITHMS` on the held-out domains both
      have (`same_held_out`); empty without a ``PGrad-Bottom`` run.
    trajectory_length: the records of `LENGTH_ALGORITHMS` on the held-out
      domains all of them have.
    trajectories: ``{(held-out domain, trial_seed): {algorithm:
      ProjectedPath}}`` of the runs of `catalog.TRAJECTORY_ALGORITHMS` that
      saved params snapshots, in that key order.
  """

  smoothness: list[Record]
  bottom: list[Record]
  trajectory_length: list[Record]
  trajectories: dict[tuple[int, int], dict[str, ProjectedPath]]


class ProjectedApartError(ValueError):
  """The params paths of one figure were not projected jointly: some come
  from a pack and the others from run directories."""


def select(
    records: Sequence[Record],
    paths: Sequence[tuple[Record, ProjectedPath]],
) -> dict[str, ClaimRecords]:
  """The records and params paths each claim reads, per dataset.

  Args:
    records: every record of a sweep; those of the default hparams with one
      held-out domain are read.
    paths: in path order, for every run that saved params snapshots, one
      of its records and its path (`project_paths`, or a pack's).

  Returns:
    ``{dataset: ClaimRecords}``, in the records' dataset order.

  Raises:
    ProjectedApartError: the paths of one dataset, held-out domain and
      trial were projected apart; it names them and the way out.
  """
  records = [r for r in records
             if len(r["args"]["test_envs"]) == 1
             and r["args"]["hparams_seed"] == MEASURED_HPARAMS_SEED]
  saved = _latest(paths)
  selected = {}
  for dataset, recs in group_by(records,
                                lambda r: r["args"]["dataset"]).items():
    bottom = same_held_out(_select(recs, BOTTOM_ALGORITHMS))
    if not any(r["args"]["algorithm"] == "PGrad-Bottom" for r in bottom):
      bottom = []
    paths = {}
    for (d, algorithm, env, trial), path in saved.items():
      if d == dataset:
        paths.setdefault((env, trial), {})[algorithm] = path
    for (env, trial), by_algorithm in paths.items():
      if len({path.projected_with for path in by_algorithm.values()}) > 1:
        runs = "; ".join(f"{algorithm}'s with {', '.join(path.projected_with)}"
                         for algorithm, path in by_algorithm.items())
        raise ProjectedApartError(
            f"{dataset}, held-out env{env}, trial {trial}: the params paths "
            f"were projected apart ({runs}), some packed and some read from "
            "run directories. Pack the runs again from directories holding "
            "all their snapshots (python -m experiments.runs.study pack), or "
            "remove the run directories that replace packed runs.")
    selected[dataset] = ClaimRecords(
        smoothness=common_steps(_select(recs, SMOOTHNESS_ALGORITHMS)),
        bottom=bottom,
        trajectory_length=same_held_out(_select(recs, LENGTH_ALGORITHMS)),
        trajectories=dict(sorted(paths.items())))
  return selected


def unmeasured(
    selected: Mapping[str, ClaimRecords]) -> dict[str, dict[str, str]]:
  """The claims whose runs are there but cannot be measured.

  Smoothness reads a loss curve's changes, and the bottom-eigenvector claim
  the change of the loss, over the steps every run reached: a run whose
  records hold no training-domain losses (`has_training_losses`) has no
  curve, and a run with a single evaluation there has no change. The claim
  compares all its runs or is not measured.

  Args:
    selected: what the claims read, per dataset (`select`).

  Returns:
    ``{dataset: {claim: why}}``, for the datasets with such claims.
  """
  reasons = {}
  for dataset, inputs in selected.items():
    found = {}
    for claim, records in (("smoothness", inputs.smoothness),
                           ("bottom", common_steps(inputs.bottom))):
      runs = by_run(records)
      lacking = [run for run in runs
                 if not all(map(has_training_losses, run))]
      single = sum(len(run) < 2 for run in runs)
      if lacking:
        algorithms = ALGORITHMS.in_order(run[0]["args"]["algorithm"]
                                         for run in lacking)
        found[claim] = (
            f"{len(lacking)} of its {len(runs)} runs ({', '.join(algorithms)}) "
            "record no training-domain losses (env{i}_in_loss, which "
            "DomainBed's own runs do not write)")
      elif single:
        found[claim] = (
            f"{single} of its {len(runs)} runs have a single evaluation over "
            "the steps every run reached, and a change of the loss needs two")
    if found:
      reasons[dataset] = found
  return reasons


def few_evaluations(
    selected: Mapping[str, ClaimRecords]) -> dict[str, dict[str, str]]:
  """The measured claims read from runs with fewer than `FEW_EVALUATIONS`
  evaluations over the steps every run reached (but two at least, else
  they are `unmeasured`).

  Args:
    selected: what the claims read, per dataset (`select`).

  Returns:
    ``{dataset: {claim: warning}}``, for the datasets with such claims.
  """
  warnings = {}
  for dataset, inputs in selected.items():
    found = {}
    for claim, records in (("smoothness", inputs.smoothness),
                           ("bottom", common_steps(inputs.bottom))):
      runs = by_run(records)
      few = [len(run) for run in runs if len(run) < FEW_EVALUATIONS]
      if few and min(few) >= 2:
        found[claim] = (
            f"read from {len(few)} of its {len(runs)} runs with only "
            f"{min(few)} evaluations over the steps every run reached (fewer "
            f"than {FEW_EVALUATIONS}): too few points to tell a curve's "
            "smoothness or trend")
    if found:
      warnings[dataset] = found
  return warnings


def measure(selected: Mapping[str, ClaimRecords]) -> dict[str, Any]:
  """Measures every claim.

  Args:
    selected: what the claims read, per dataset (`select`).

  Returns:
    ``{dataset: {claim: {algorithm: numbers}}}``. Claims whose runs are
    missing or too short (`unmeasured`) are left out, and datasets without
    any claim.
  """
  claims = {}
  too_short = unmeasured(selected)
  for dataset, inputs in selected.items():
    found = {}
    short = too_short.get(dataset, {})
    if inputs.smoothness and "smoothness" not in short:
      measured = smoothness(inputs.smoothness)
      found["smoothness"] = {a: measured[a] for a in SMOOTHNESS_ALGORITHMS
                             if a in measured}
    if inputs.bottom and "bottom" not in short:
      found["bottom"] = loss_changes(inputs.bottom)
    if inputs.trajectory_length:
      accuracy = group_by(((run[0]["args"]["algorithm"], held_out_accuracy(run))
                           for run in by_run(inputs.trajectory_length)),
                          lambda p: p[0])
      summary = {}
      for algorithm in LENGTH_ALGORITHMS:
        if algorithm in accuracy:
          final, se = mean_se([acc for _, acc in accuracy[algorithm]])
          summary[algorithm] = {"accuracy": final, "accuracy_se": se,
                                "runs": len(accuracy[algorithm])}
      found["trajectory_length"] = summary
    shapes = {}
    for by_algorithm in inputs.trajectories.values():
      for algorithm, path in by_algorithm.items():
        shapes.setdefault(algorithm, []).append(path.lengths)
    if shapes:
      found["trajectories"] = {
          algorithm: {**{m: mean(s[m] for s in runs) for m in runs[0]},
                      "runs": len(runs)}
          for algorithm, runs in shapes.items()}
    if found:
      claims[dataset] = found
  return claims
