"""Tests for experiments/train.py and experiments/config.py.

The runs train the default command (PGrad-B on RotatedDigits) on a short
schedule: two training domains, tiny batches, small evaluation subsets. They
run in subprocesses, as a user would, and share a JAX compilation cache so
that only the first one compiles.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments import config as config_lib

REPO = Path(__file__).resolve().parents[1]
STEPS, FREQ = 10, 2
FLAGS = [
    "--steps", str(STEPS), "--checkpoint_freq", str(FREQ),
    "--test_envs", "0", "1", "2", "3", "--hparams", '{"batch_size": 6}',
    "--eval_examples", "16", "--eval_batch_size", "16", "--loss_examples", "8",
]
NUM_DOMAINS, TRAIN_DOMAINS, B = 6, 2, 3


def _command(output_dir):
  return [sys.executable, "-m", "experiments.train", *FLAGS,
          "--output_dir", str(output_dir)]


@pytest.fixture(name="env", scope="module")
def fixture_env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax_cache")
  return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(name="reference", scope="module")
def fixture_reference(tmp_path_factory, env):
  """The output directory of an uninterrupted run."""
  output_dir = tmp_path_factory.mktemp("reference")
  result = subprocess.run(_command(output_dir), cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert "Held-out accuracy" in result.stdout
  return output_dir


def _records(output_dir):
  lines = (output_dir / "results.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def _params(output_dir):
  with np.load(output_dir / "final_params.npz") as npz:
    return {key: npz[key] for key in npz.files}


def test_run_writes_domainbed_results_and_done(reference):
  records = _records(reference)
  assert [r["step"] for r in records] == list(range(FREQ, STEPS + 1, FREQ))
  assert (reference / "done").exists()
  for record in records:
    assert record["args"]["algorithm"] == "PGrad-B"
    assert record["args"]["test_envs"] == [0, 1, 2, 3]
    assert record["domains"] == ["0", "15", "30", "45", "60", "75"]
    assert record["hparams"]["B"] == B and record["hparams"]["batch_size"] == 6
    for key in ("epoch", "loss", "step_time", "ref_norm"):
      assert np.isfinite(record[key]), key
    assert record["num_skipped"] == 0
    for i in range(NUM_DOMAINS):
      assert 0 <= record[f"env{i}_in_acc"] <= 1
      assert 0 <= record[f"env{i}_out_acc"] <= 1
      assert np.isfinite(record[f"env{i}_in_loss"])
    eigenvalues = np.array(record["eigenvalues"])
    assert eigenvalues.shape == (TRAIN_DOMAINS * B + 1,)
    np.testing.assert_allclose(eigenvalues.sum(), 1.0, rtol=1e-5)
    assert np.all(np.diff(eigenvalues) <= 0)
  params = _params(reference)
  assert "params/head/kernel" in params
  assert all(np.all(np.isfinite(v)) for v in params.values())


@pytest.mark.slow
def test_run_killed_and_restarted_ends_bit_for_bit_as_uninterrupted(
    reference, env, tmp_path):
  output_dir = tmp_path / "run"
  process = subprocess.Popen(_command(output_dir), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  first_checkpoint = output_dir / "checkpoints" / str(FREQ)
  deadline = time.monotonic() + 600
  while not first_checkpoint.exists() and process.poll() is None:
    assert time.monotonic() < deadline, "no checkpoint was written"
    time.sleep(0.01)
  process.kill()  # SIGKILL: no clean-up at all.
  process.wait()
  assert not (output_dir / "done").exists(), "the run ended before the kill"
  # A record newer than any checkpoint, and one cut short: both are dropped.
  with (output_dir / "results.jsonl").open("a") as f:
    f.write(json.dumps({"step": STEPS + 1}) + '\n{"step": 4, "env0_in')

  resumed = subprocess.run(_command(output_dir), cwd=REPO, env=env,
                           capture_output=True, text=True, check=False)
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from step" in resumed.stderr
  expected = _params(reference)
  got = _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  def comparable(record):
    record = {**record, "args": {**record["args"], "output_dir": None}}
    del record["step_time"]
    return record

  assert ([comparable(r) for r in _records(output_dir)]
          == [comparable(r) for r in _records(reference)])


@pytest.mark.slow
def test_runs_data_parallel_on_several_devices(reference, env, tmp_path):
  # Same command on two (simulated) devices: the batches are split over a
  # data axis and the run agrees with the one-device run up to the order of
  # floating-point sums.
  env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} "
                             "--xla_force_host_platform_device_count=2"}
  result = subprocess.run(_command(tmp_path), cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert ": 2 cpu devices." in result.stderr
  expected, got = _params(reference), _params(tmp_path)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-3, atol=1e-5,
                               err_msg=key)


def test_every_config_field_is_a_flag():
  flags = {"dataset": "PACS", "algorithm": "Fishr", "test_envs": [1, 2],
           "data_dir": "d", "output_dir": "o", "steps": 7,
           "checkpoint_freq": 3, "seed": 4, "hparams_seed": 5,
           "trial_seed": 6, "holdout_fraction": 0.3, "hparams": '{"ema": 0.9}',
           "model": "resnet18", "pretrained": "w.npz",
           "init_params": "p.npz", "eval_examples": 8,
           "loss_examples": 9, "eval_batch_size": 10}
  assert set(flags) == {f.name for f in dataclasses.fields(config_lib.Config)}
  argv = []
  for name, value in flags.items():
    argv += [f"--{name}", *map(str, value if isinstance(value, list)
                               else [value])]
  assert dataclasses.asdict(config_lib.parse_args(argv)) == flags


def test_defaults_resolve_per_dataset_and_overrides_are_checked():
  config = config_lib.parse_args([]).resolve()
  assert (config.dataset, config.algorithm, config.test_envs) == (
      "RotatedDigits", "PGrad-B", [0])
  assert config.model == "mnist_cnn"
  assert (config.steps, config.checkpoint_freq) == config_lib.SCHEDULES[
      "RotatedDigits"]
  assert config.hyperparameters()["batch_size"] == 63
  assert config_lib.parse_args(["--dataset", "PACS"]).resolve().model == (
      "resnet50")
  override = config_lib.Config(hparams='{"lr": 0.5}')
  assert override.hyperparameters()["lr"] == 0.5
  with pytest.raises(ValueError, match="Unknown hparams"):
    config_lib.Config(hparams='{"meta_lr": 0.5}').hyperparameters()


def test_init_params_loads_a_saved_model_and_rejects_another(tmp_path):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import algorithms, models, train  # pylint: disable=g-import-not-at-top

  def split(width, seed):
    model = models.build_model(
        "mnist_cnn", num_classes=3, input_shape=(8, 8, 1),
        rngs=nnx.Rngs(seed), widths=(width,) * 4)
    _, params, stats = algorithms.Network.split(model)
    return params, stats

  saved_params, saved_stats = split(8, seed=1)
  path = tmp_path / "final_params.npz"
  train.save_params(path, train.TrainState(jnp.zeros(()), saved_params,
                                           saved_stats, None))
  params, stats = train.load_params(path, *split(8, seed=2))
  for got, want in zip(nnx.to_flat_state(params), nnx.to_flat_state(
      saved_params)):
    np.testing.assert_array_equal(got[1][...], want[1][...])
  with pytest.raises(ValueError, match="does not fit the model"):
    train.load_params(path, *split(16, seed=2))
