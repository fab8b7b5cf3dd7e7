"""Tests for experiments/analysis/claims.py.

The numbers are checked against float64 NumPy loops on hand-made records;
`test_report.py` checks the figures the report command draws from them.
"""

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import threadpoolctl

from experiments.analysis import claims
from test_model_selection import make_record


@pytest.fixture(name="one_openmp_thread", scope="module", autouse=True)
def fixture_one_openmp_thread():
  """Runs t-SNE (scikit-learn's, on OpenMP threads) on one thread.

  Its threads wait for each other by spinning, at every one of the
  optimisation's many short parallel steps: for a path of a few points, on
  cores busy with other tests, two threads took 15 times the CPU time of one
  (2.0 s against 0.13 s) for the same embedding. Importing t-SNE loads
  scikit-learn's OpenMP, which the limit then reaches.
  """
  from sklearn import manifold  # pylint: disable=import-outside-toplevel,unused-import
  with threadpoolctl.threadpool_limits(1, user_api="openmp"):
    yield

def _roughness_by_loop(values):
  total = 0.0
  changes = []
  for before, after in zip(values[:-1], values[1:]):
    change = float(after) - float(before)
    changes.append(change)
    total += abs(change)
  mean = sum(changes) / len(changes)
  std = (sum((c - mean) ** 2 for c in changes) / len(changes)) ** 0.5
  return total, total - abs(float(values[-1]) - float(values[0])), std


def test_curve_roughness_matches_a_loop():
  values = np.random.default_rng(0).random(9)
  got = claims.curve_roughness(values)
  total, excess, std = _roughness_by_loop(values)
  np.testing.assert_allclose(
      [got["total_variation"], got["excess_variation"], got["change_std"]],
      [total, excess, std], rtol=1e-12)
  # A monotone descent has no excess variation.
  assert claims.curve_roughness([3.0, 2.0, 0.5])["excess_variation"] == 0.0


def test_a_curve_of_one_evaluation_has_no_roughness():
  with pytest.raises(ValueError, match="two evaluations, got 1"):
    claims.curve_roughness([0.5])


def _exact_norm(vector):
  """The Euclidean norm from the exact sum of squares, rounded once."""
  return math.sqrt(float(sum(Fraction(float(x)) ** 2 for x in vector)))


def test_path_lengths_are_the_same_in_any_order_of_the_params():
  # BLAS's norm sums in an order that depends on the machine, and so did the
  # committed claims.json's last digits: the lengths are the exactly rounded
  # ones, whatever order the params come in.
  rng = np.random.default_rng(3)
  points = rng.standard_normal((3, 20_001))
  lengths = claims.path_lengths(points)
  assert lengths["displacement"] == _exact_norm(points[-1] - points[0])
  steps = [_exact_norm(b - a) for a, b in zip(points[:-1], points[1:])]
  assert lengths["length"] == float(sum(map(Fraction, steps)))
  shuffled = points[:, rng.permutation(points.shape[1])]
  assert claims.path_lengths(shuffled) == lengths


def test_claims_are_the_same_in_any_order_of_the_runs():
  # One domain's loss rises by c and falls back: excess variation 2 c, for
  # c = 0.1, 0.2, 0.3; the other domain's falls steadily, excess 0. Summed
  # left to right, 0.2 + 0.4 + 0.6 is 1.2000000000000002; right to left, 1.2.
  rises = (0.1, 0.2, 0.3)
  runs = [_loss_records("ERM", trial, [[1.0, 0.5, 0.25], [0.0, c, 0.0]])
          for trial, c in enumerate(rises)]
  forward, backward = (
      claims.smoothness([r for run in ordered for r in run])["ERM"]
      for ordered in (runs, runs[::-1]))
  assert json.dumps(forward) == json.dumps(backward)
  # The exact sum of the six curves' excess variations, rounded once.
  assert forward["excess_variation"] == float(
      sum(Fraction(2 * c) for c in rises)) / 6


def _loss_records(algorithm, trial, losses):
  """A run of "Toy" (3 domains, env 0 held out) with losses[i][t] for env i+1."""
  return [make_record("Toy", algorithm, 0, 0, trial, 10 * (t + 1),
                      in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                      env1_in_loss=losses[0][t], env2_in_loss=losses[1][t])
          for t in range(len(losses[0]))]


def test_smoothness_averages_domains_and_runs_as_numpy():
  rng = np.random.default_rng(1)
  runs = {("ERM", 0): rng.random((2, 6)), ("ERM", 1): rng.random((2, 6)),
          ("PGrad", 0): np.sort(rng.random((2, 6)))[:, ::-1]}
  records = [r for (algorithm, trial), losses in runs.items()
             for r in _loss_records(algorithm, trial, losses)]
  summary = claims.smoothness(records)

  erm_curves = [c for key in (("ERM", 0), ("ERM", 1)) for c in runs[key]]
  expected = np.mean([_roughness_by_loop(c) for c in erm_curves], axis=0)
  got = summary["ERM"]
  np.testing.assert_allclose(
      [got["total_variation"], got["excess_variation"], got["change_std"]],
      expected, rtol=1e-12)
  rising = np.mean([np.mean([(np.diff(runs[key], axis=1)[:, t] > 0).any()
                             for t in range(5)])
                    for key in (("ERM", 0), ("ERM", 1))])
  np.testing.assert_allclose(got["rising_rate"], rising, rtol=1e-12)
  assert got["runs"] == 2
  # Monotone descents: no excess variation, no domain ever rises.
  assert summary["PGrad"]["excess_variation"] == pytest.approx(0.0, abs=1e-12)
  assert summary["PGrad"]["rising_rate"] == 0.0


def test_path_lengths_and_pca_projection_as_numpy():
  rng = np.random.default_rng(2)
  # Points in a random 2-D plane of a 50-D space: PCA keeps their distances.
  plane = np.linalg.qr(rng.normal(size=(50, 2)))[0].T
  coordinates = np.cumsum(rng.normal(size=(12, 2)), axis=0)
  points = coordinates @ plane + rng.normal(size=50)
  lengths = claims.path_lengths(points)
  length = sum(np.sqrt(((points[t + 1] - points[t]) ** 2).sum())
               for t in range(11))
  displacement = np.sqrt(((points[-1] - points[0]) ** 2).sum())
  np.testing.assert_allclose(
      [lengths["length"], lengths["displacement"], lengths["straightness"]],
      [length, displacement, displacement / length], rtol=1e-12)
  projected = claims.project(points, "pca")
  distances = lambda x: np.linalg.norm(x[:, None] - x[None], axis=-1)
  np.testing.assert_allclose(distances(projected), distances(coordinates),
                             atol=1e-9)
  embedded = claims.project(points, "tsne")
  assert embedded.shape == (12, 2) and np.all(np.isfinite(embedded))
  with pytest.raises(ValueError, match="pca"):
    claims.project(points, "umap")


def _snapshots(run_dir, record, points):
  """Writes a run's params snapshots to ``run_dir``, a file per step, as
  training does; returns what `claims.project_paths` reads of the run."""
  run_dir.mkdir()
  files = {}
  for step, point in enumerate(points):
    files[step] = run_dir / f"{step}.npy"
    np.save(files[step], point.astype(np.float32))
  return record, files


def test_paths_are_projected_jointly_and_kept_exactly_as_json(tmp_path):
  rng = np.random.default_rng(3)
  erm, pgrad = (make_record("ColoredDigits", a, 1, 0, 0, 10, in_accs=[0.5] * 3,
                            out_accs=[0.5] * 3) for a in ("ERM", "PGrad"))
  erm_points = rng.normal(size=(7, 20)).astype(np.float32)
  pgrad_points = rng.normal(size=(5, 20)).astype(np.float32)
  snapshots = {
      tmp_path / "run_b": _snapshots(tmp_path / "run_b", erm, erm_points),
      tmp_path / "run_a": _snapshots(tmp_path / "run_a", pgrad, pgrad_points)}
  # Another draw's run is not read; a lone path has no figure to share.
  other = make_record("ColoredDigits", "ERM", 1, 1, 0, 10, in_accs=[0.5] * 3,
                      out_accs=[0.5] * 3)
  snapshots[tmp_path / "run_c"] = _snapshots(tmp_path / "run_c", other,
                                             erm_points)
  lone = make_record("ColoredDigits", "ERM", 2, 0, 0, 10, in_accs=[0.5] * 3,
                     out_accs=[0.5] * 3)
  snapshots[tmp_path / "run_d"] = _snapshots(tmp_path / "run_d", lone,
                                             erm_points)
  paths = claims.project_paths(snapshots)
  assert set(paths) == {tmp_path / "run_a", tmp_path / "run_b",
                        tmp_path / "run_d"}
  # Stacked in path order, projected together.
  stacked = np.concatenate([pgrad_points, erm_points]).astype(np.float64)
  for method in claims.PROJECTIONS:
    joint = claims.project(stacked, method)
    np.testing.assert_array_equal(
        paths[tmp_path / "run_a"].projections[method], joint[:5])
    np.testing.assert_array_equal(
        paths[tmp_path / "run_b"].projections[method], joint[5:])
  assert paths[tmp_path / "run_b"].projected_with == ("run_a", "run_b")
  assert paths[tmp_path / "run_b"].lengths == claims.path_lengths(
      erm_points.astype(np.float64))
  assert paths[tmp_path / "run_d"].projections == {}
  for path in paths.values():
    again = claims.ProjectedPath.from_json(
        json.loads(json.dumps(path.to_json())))
    assert again.lengths == path.lengths
    assert again.projected_with == path.projected_with
    assert again.projections.keys() == path.projections.keys()
    for method, points in path.projections.items():
      assert again.projections[method].dtype == np.float64
      np.testing.assert_array_equal(again.projections[method], points)


def test_paths_projected_apart_are_refused(tmp_path):
  rng = np.random.default_rng(4)
  runs = [make_record("ColoredDigits", a, 0, 0, 0, 10, in_accs=[0.5] * 3,
                      out_accs=[0.5] * 3) for a in ("ERM", "PGrad")]
  paths = claims.project_paths(
      {tmp_path / a["args"]["algorithm"]: _snapshots(
          tmp_path / a["args"]["algorithm"], a, rng.normal(size=(4, 6)))
       for a in runs})
  together = [(run, paths[tmp_path / run["args"]["algorithm"]])
              for run in runs]
  assert claims.select(runs, together)["ColoredDigits"].trajectories[0, 0]
  # PGrad's path projected with another run than ERM's.
  apart = [together[0], (runs[1], together[1][1]._replace(
      projected_with=("elsewhere",)))]
  with pytest.raises(claims.ProjectedApartError,
                     match="held-out env0, trial 0: the params paths were "
                     "projected apart"):
    claims.select(runs, apart)


def test_comparisons_keep_the_held_out_domains_every_algorithm_has():
  records = [make_record("ColoredDigits", algorithm, env, 0, 0, 10,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3)
             for algorithm, envs in (("PGrad", (0, 1, 2)), ("PGrad-k1", (0,)),
                                     ("PGrad-B", (0, 2)))
             for env in envs]
  kept = claims.same_held_out(records)
  assert sorted((r["args"]["algorithm"], r["args"]["test_envs"][0])
                for r in kept) == [("PGrad", 0), ("PGrad-B", 0),
                                   ("PGrad-k1", 0)]
  assert claims.same_held_out(records[:3]) == records[:3]  # PGrad alone.
  assert claims.same_held_out([]) == []


def test_common_steps_cut_every_run_at_the_shortest_runs_end():
  # ERM stopped at step 20, PGrad-Bottom trained on to 40.
  records = [make_record("RotatedDigits", algorithm, 0, 0, 0, step,
                         in_accs=[0.5] * 6, out_accs=[0.5] * 6)
             for algorithm, end in (("ERM", 20), ("PGrad-Bottom", 40))
             for step in range(10, end + 1, 10)]
  kept = claims.common_steps(records)
  assert sorted((r["args"]["algorithm"], r["step"]) for r in kept) == [
      ("ERM", 10), ("ERM", 20), ("PGrad-Bottom", 10), ("PGrad-Bottom", 20)]
  assert claims.common_steps(records[2:]) == records[2:]  # One run: whole.
  assert claims.common_steps([]) == []


def test_loss_changes_over_the_common_steps_and_to_each_end():
  # PGrad stops at step 20; PGrad-Bottom's two trials train to 40 and 30.
  rng = np.random.default_rng(1)
  records = []
  for algorithm, trial, end in (("PGrad", 0, 20), ("PGrad-Bottom", 0, 40),
                                ("PGrad-Bottom", 1, 30)):
    for step in range(10, end + 1, 10):
      record = make_record("RotatedDigits", algorithm, 0, 0, trial, step,
                           in_accs=[0.5] * 6, out_accs=[0.5] * 6)
      for i in range(6):
        record[f"env{i}_in_loss"] = float(rng.uniform(0.5, 3.0))
      records.append(record)

  def change_by_loop(algorithm, trial, last_step):
    means = []
    for record in records:
      a = record["args"]
      if (a["algorithm"], a["trial_seed"]) == (algorithm, trial) and (
          record["step"] in (10, last_step)):
        means.append(sum(record[f"env{i}_in_loss"] for i in range(1, 6)) / 5)
    return (means[1] - means[0]) / means[0]

  got = claims.loss_changes(records)
  assert got["PGrad"] == pytest.approx({
      "relative_loss_change": change_by_loop("PGrad", 0, 20),
      "relative_loss_change_at_end": change_by_loop("PGrad", 0, 20),
      "steps": 20, "runs": 1})
  assert got["PGrad-Bottom"] == pytest.approx({
      "relative_loss_change": np.mean(
          [change_by_loop("PGrad-Bottom", t, 20) for t in (0, 1)]),
      "relative_loss_change_at_end": np.mean(
          [change_by_loop("PGrad-Bottom", 0, 40),
           change_by_loop("PGrad-Bottom", 1, 30)]),
      "steps": 35, "runs": 2})
