"""Tests for experiments/training/weight_averaging.py: runs of the train
command with ``--averaging``, their averaged params checked against float64
NumPy averages of the params recorded along the run (``--trajectory_freq
1``), their records, their stop and their resume.

The runs are `test_train`'s short default command (PGrad-B on
RotatedDigits, tiny batches, small evaluations), in this process.
"""

import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax import traverse_util

from experiments import algorithms
from experiments import averaging
from experiments import config as config_lib
from experiments import train
from experiments.models import layers
from experiments.rundir import records
from experiments.training import loop
from experiments.training import stopping
from experiments.training import weight_averaging
from test_averaging import RefAveragedModel
from test_averaging import RefLossValley
from test_train import FLAGS
from test_train import TIMING
from test_train import _SIGNAL_IN_STEP
from test_train import _train_command
from test_train import read_records
from test_train import run_after
from test_train import run_here
from test_train_photos import fixture_data_dir  # pylint: disable=unused-import

STEPS, FREQ = 10, 2
TRAIN_DOMAINS = (4, 5)  # FLAGS hold out domains 0 to 3.
# The float32 averages of the run's params differ from float64 by a few
# roundings of the params' size (<= 1): 1.6e-7 at most measured (EMA, SMA,
# SWAD), where one step moves a param by up to 4e-4, and a term more or
# less moves the averages by 1e-4 and more.
ATOL = 1e-6


def _averaging_flags(output_dir, *averaging):
  return [*FLAGS, "--trajectory_freq", "1", "--averaging", *averaging,
          "--output_dir", str(output_dir)]


def _flat_params(npz_path):
  """The params of a params file, flattened in the leaf order of the
  trajectory snapshots (JAX's: keys sorted, list indices as numbers)."""
  with np.load(npz_path) as npz:
    keys = sorted((k for k in npz.files if k.startswith("params/")),
                  key=lambda k: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                 for p in k.split("/")])
    return np.concatenate([npz[k].ravel() for k in keys])


def _trajectory(output_dir, steps=STEPS):
  """The params after every step, 0 to ``steps``, in float64; checked to end
  at the final params, which fixes their leaf order."""
  points = [np.load(records.trajectory_file(output_dir, step)).astype(
      np.float64) for step in range(steps + 1)]
  np.testing.assert_array_equal(
      points[-1], _flat_params(output_dir / records.FINAL_PARAMS_FILE))
  return points


def _averaged(output_dir):
  return _flat_params(output_dir / records.AVERAGED_PARAMS_FILE).astype(
      np.float64)


def _assert_both_models_recorded(run_records, every_record=True):
  env_keys = [k for k in run_records[-1] if records.parse_env_key(k)]
  for record in run_records if every_record else run_records[-1:]:
    for key in env_keys:
      assert np.isfinite(record[records.AVERAGED_PREFIX + key]), key


@pytest.fixture(name="ema_run", scope="module")
def fixture_ema_run(tmp_path_factory):
  output_dir = tmp_path_factory.mktemp("ema")
  assert train.main(_averaging_flags(output_dir, "ema", "--ema_decay",
                                     "0.7")) == 0
  return output_dir


def test_ema_averages_the_params_of_every_step(ema_run):
  run_records = read_records(ema_run)
  assert run_records[-1]["args"]["averaging"] == "ema"
  assert run_records[-1]["args"]["ema_decay"] == 0.7
  _assert_both_models_recorded(run_records)
  points = _trajectory(ema_run)
  reference = points[0]
  for point in points[1:]:
    reference = 0.7 * reference + 0.3 * point
  np.testing.assert_allclose(_averaged(ema_run), reference, rtol=0,
                             atol=ATOL)
  # Not the last params, which the average would equal were it not one.
  assert np.abs(points[-1] - reference).max() > 100 * ATOL


def test_sma_averages_from_its_start(tmp_path, capsys):
  start_iter = 4
  assert run_here(_averaging_flags(tmp_path, "sma", "--sma_start_iter",
                                   str(start_iter)), capsys).returncode == 0
  run_records = read_records(tmp_path)
  _assert_both_models_recorded(run_records)
  points = _trajectory(tmp_path)
  # DomainBed's: the params after update start_iter - 1 and every later one.
  reference = np.mean(points[start_iter - 1:], axis=0)
  np.testing.assert_allclose(_averaged(tmp_path), reference, rtol=0,
                             atol=ATOL)
  assert np.abs(np.mean(points[start_iter:], axis=0) - reference
                ).max() > 100 * ATOL


def _reference_swad(points, losses, config):
  """swad's trainer on the run's params and recorded losses, in float64:
  a segment per evaluation, of the ``FREQ`` steps up to it (the params
  after update ``s`` being ``points[s]``, swad's step ``s - 1``)."""
  valley = RefLossValley(*config)
  segment = None
  for update, point in enumerate(points[1:], start=1):
    if segment is None:
      segment = RefAveragedModel({"p": point})
    segment.update_parameters({"p": point}, step=update - 1)
    if update % FREQ == 0:
      valley.update_and_evaluate(segment, losses[update // FREQ - 1])
      segment = None
      if valley.dead_valley:
        break
  return valley.get_final_model()


def _check_swad(output_dir, config):
  run_records = read_records(output_dir)
  for record in run_records:
    np.testing.assert_allclose(
        record[weight_averaging.SWAD_LOSS],
        np.mean([record[f"env{i}_out_loss"] for i in TRAIN_DOMAINS]),
        rtol=1e-15)
  # The final model's metrics, in the last record only, as swad reports it.
  _assert_both_models_recorded(run_records, every_record=False)
  assert not any(k.startswith(records.AVERAGED_PREFIX)
                 for r in run_records[:-1] for k in r)
  final = _reference_swad(_trajectory(output_dir, run_records[-1]["step"]),
                          [r[weight_averaging.SWAD_LOSS] for r in run_records],
                          config)
  last = run_records[-1]
  assert last[weight_averaging.AVERAGED_SEGMENTS] == final.n_averaged
  assert last[weight_averaging.AVERAGED_FIRST_STEP] == final.start_step + 1
  assert last[weight_averaging.AVERAGED_LAST_STEP] == final.end_step + 1
  np.testing.assert_allclose(_averaged(output_dir), final.params["p"],
                             rtol=0, atol=ATOL)
  return run_records


def test_swad_averages_the_segments_its_valley_picks(tmp_path, capsys):
  assert run_here(_averaging_flags(tmp_path, "swad"), capsys).returncode == 0
  run_records = _check_swad(tmp_path, (3, 6, 0.3))
  assert [r["step"] for r in run_records] == list(range(FREQ, STEPS + 1, FREQ))
  assert not any(r[weight_averaging.SWAD_DEAD] for r in run_records)
  assert run_records[-1][weight_averaging.AVERAGED_SEGMENTS] > 1


def test_swad_stops_the_run_where_its_valley_dies(tmp_path, capsys):
  # A valley of one segment, no tolerance: it dies at the first evaluation
  # whose loss exceeds the first's.
  flags = _averaging_flags(tmp_path, "swad", "--swad_n_converge", "1",
                           "--swad_n_tolerance", "1",
                           "--swad_tolerance_ratio", "0")
  result = run_here(flags, capsys)
  assert result.returncode == 0, result.stderr
  run_records = _check_swad(tmp_path, (1, 1, 0.0))
  losses = [r[weight_averaging.SWAD_LOSS] for r in run_records]
  dies = next(i for i, loss in enumerate(losses) if loss > losses[0])
  assert len(run_records) == dies + 1 < STEPS // FREQ
  assert [r[weight_averaging.SWAD_DEAD] for r in run_records] == (
      [False] * dies + [True])
  step = run_records[-1]["step"]
  assert (f"Stopped at step {step} of at most {STEPS}: SWAD's loss valley "
          "ended") in result.stderr
  assert (tmp_path / records.DONE_FILE).exists()
  assert stopping.stops_at(config_lib.parse_args(flags), run_records, step)
  # Finished: the same command trains no further.
  again = run_here(flags, capsys)
  assert again.returncode == 0 and read_records(tmp_path) == run_records


@pytest.mark.slow
def test_a_signalled_run_resumes_its_average_bit_for_bit(tmp_path, capsys):
  # SWAD's state holds the most: a segment, a window, the valley in NumPy.
  flags = [*FLAGS, "--averaging", "swad"]
  reference, output_dir = tmp_path / "reference", tmp_path / "run"
  assert run_here([*flags, "--output_dir", str(reference)],
                  capsys).returncode == 0
  # Signalled in step FREQ + 1: checkpointed there, between evaluations,
  # mid-segment.
  stopped = run_after(
      _SIGNAL_IN_STEP.format(calls=FREQ + 1, sig=int(signal.SIGTERM)),
      _train_command([*flags, "--output_dir", str(output_dir)]))
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
  resumed = run_here([*flags, "--output_dir", str(output_dir)], capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Resuming from step {FREQ + 1}." in resumed.stderr
  for name in (records.FINAL_PARAMS_FILE, records.AVERAGED_PARAMS_FILE):
    with np.load(reference / name) as expected, np.load(
        output_dir / name) as got:
      assert expected.files == got.files
      for key in expected.files:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  def comparable(record):
    return {k: v for k, v in record.items() if k not in ("args", *TIMING)}

  assert ([comparable(r) for r in read_records(output_dir)]
          == [comparable(r) for r in read_records(reference)])


class _TwoBatchNorms(nnx.Module):
  """BatchNorm, scaled ReLU, BatchNorm: the second's statistics depend on
  the first's train-mode output."""

  def __init__(self, features):
    rngs = nnx.Rngs(0)
    self.first = layers.batch_norm(features, "train", rngs=rngs)
    self.second = layers.batch_norm(features, "train", rngs=rngs)

  def __call__(self, x, *, rngs=None):  # As a classifier takes dropout's.
    del rngs
    return self.second(2.0 * jax.nn.relu(self.first(x)))


def test_batch_statistics_are_the_concatenated_domains_own():
  model = _TwoBatchNorms(3)
  network, params, stats = algorithms.Network.split(model)
  # Running statistics far from the batch's: they must weigh nothing.
  stats = jax.tree.map(lambda s: s + 5.0, stats)
  rng = np.random.default_rng(0)
  # Two domains of 4 examples of 2x2 pixels, unnormalised.
  images = rng.normal(3.0, 2.0, size=(2, 4, 2, 2, 3)).astype(np.float32)
  got = nnx.to_pure_dict(weight_averaging.batch_statistics(
      network, params, stats, {"image": jnp.asarray(images)}))
  x = images.reshape(-1, 3).astype(np.float64)  # swad's torch.cat.
  expected = {}
  for name in ("first", "second"):
    mean, var = x.mean(0), x.var(0, ddof=1)
    expected[name] = {"mean": mean, "var": var}
    # Train mode normalises with the biased variance; scale 1, bias 0.
    x = 2.0 * np.maximum((x - mean) / np.sqrt(x.var(0) + 1e-5), 0.0)
  for name, layer in expected.items():
    for stat, value in layer.items():
      # float32 sums of 32 values of O(1): 1.9e-6 at most measured over 20
      # draws; a wrong momentum or divisor moves them by 1e-1 and more.
      np.testing.assert_allclose(got[name][stat], value, rtol=0, atol=1e-5,
                                 err_msg=f"{name} {stat}")


def test_only_trained_batchnorm_is_recomputed():
  _, _, stats = algorithms.Network.split(_TwoBatchNorms(3))
  assert weight_averaging.bn_trains({"bn_mode": "train"}, stats)
  assert not weight_averaging.bn_trains({"bn_mode": "frozen"}, stats)
  assert not weight_averaging.bn_trains({}, stats)
  assert not weight_averaging.bn_trains({"bn_mode": "train"}, {})


@pytest.mark.slow
def test_swads_batchnorm_statistics_are_recomputed_from_the_next_batches(
    data_dir, tmp_path, capsys, monkeypatch):
  # A PACS-like folder, a ResNet whose BatchNorm trains: SWAD's final model
  # takes the statistics of the training batches after the last step.
  monkeypatch.setattr(weight_averaging, "BATCHNORM_BATCHES", 2)
  steps = 4
  flags = ["--dataset", "PACS", "--algorithm", "ERM", "--model", "resnet18",
           "--pretrained", "none", "--data_dir", str(data_dir),
           "--steps", str(steps), "--checkpoint_freq", "2",
           "--hparams", '{"batch_size": 4, "image_size": 32, '
           '"bn_mode": "train", "lr": 1e-3}',
           "--eval_examples", "4", "--eval_batch_size", "8",
           "--loss_examples", "4", "--num_workers", "0",
           "--averaging", "swad", "--output_dir", str(tmp_path / "run")]
  assert run_here(flags, capsys).returncode == 0
  with np.load(tmp_path / "run" / records.AVERAGED_PARAMS_FILE) as npz:
    saved = {key: npz[key] for key in npz.files}
  # The same batches, from a fresh iterator past the run's steps, through
  # the averaged params.
  setup = loop._set_up(train.resolve_run([*flags, "--output_dir",
                                          str(tmp_path / "again")]))
  for _ in range(steps):
    next(setup.train_iter)
  batches = [setup.sharder.batch(next(setup.train_iter), 1)
             for _ in range(weight_averaging.BATCHNORM_BATCHES)]
  setup.train_iter.close()
  params = nnx.State(traverse_util.unflatten_dict(
      {tuple(int(p) if p.isdigit() else p for p in key.split("/")[1:]): value
       for key, value in saved.items() if key.startswith("params/")}))
  expected = traverse_util.flatten_dict(nnx.to_pure_dict(
      averaging.cumulative_batch_statistics(
          lambda batch: weight_averaging.batch_statistics(
              setup.network, params, setup.state.stats, batch), batches)))
  stats = {key: value for key, value in saved.items()
           if key.startswith("stats/")}
  assert len(stats) == len(expected) > 0
  for path, value in expected.items():
    np.testing.assert_array_equal(
        stats["/".join(["stats", *map(str, path)])], value)
  # Not the trained weights' statistics, nor their average.
  with np.load(tmp_path / "run" / records.FINAL_PARAMS_FILE) as final:
    assert all(not np.array_equal(final[key], value)
               for key, value in stats.items())
