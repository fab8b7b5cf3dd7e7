"""End-to-end training on tiny PovertyMap and FMoW folders (WILDS layout).

WILDS's PovertyMap sets 2,000 in-distribution rows aside for evaluation; the
tiny folder has 69 rows, so the runs set 6 aside instead.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments.data import datasets
from experiments import train
from experiments.training import steps as train_steps
from experiments.data import wilds
from test_train import kill_at_first_checkpoint, run_here
import wilds_data

ID_EVAL_SIZE = 6
SMALL = ["--eval_batch_size", "16", "--model", "mnist_cnn"]
# SMALL, the batches built in the run's process: a run's results do not
# depend on its input workers (tests/experiments/data/test_pipeline.py), and
# a worker process takes about 1.5 s of CPU to start (it imports Grain and
# JAX). The resumed run of test_poverty_map_run_resumes_after_a_kill has one.
NO_WORKERS = ["--num_workers", "0", *SMALL]


@pytest.fixture(name="small_id_eval")
def fixture_small_id_eval(monkeypatch):
  monkeypatch.setattr(wilds, "POVERTY_ID_EVAL_SIZE", ID_EVAL_SIZE)


def _records(output_dir):
  return [json.loads(line) for line in
          (Path(output_dir) / "results.jsonl").read_text().splitlines()]


def _pgrad_flags(data_dir, output_dir, workers):
  """PGrad on 3 sampled countries a step: 4 steps, a checkpoint every 2."""
  return ["--dataset", "PovertyMap", "--algorithm", "PGrad", "--data_dir",
          str(data_dir), "--output_dir", str(output_dir), "--steps", "4",
          "--checkpoint_freq", "2", "--hparams",
          '{"domains_per_step": 3, "batch_size": 4}', "--num_workers",
          str(workers), *SMALL]


@pytest.fixture(name="pgrad_run", scope="module")
def fixture_pgrad_run(tmp_path_factory):
  """A PovertyMap folder, and the output directory and last record of an
  uninterrupted `_pgrad_flags` run on it, in this process."""
  data = tmp_path_factory.mktemp("data")
  wilds_data.write_poverty(data)
  output_dir = tmp_path_factory.mktemp("pgrad") / "run"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(wilds, "POVERTY_ID_EVAL_SIZE", ID_EVAL_SIZE)
    record = train.claim_and_train(train.resolve_run(
        _pgrad_flags(data, output_dir, 0)))
  return data, output_dir, record


def test_poverty_map_trains_pgrad_on_sampled_countries(pgrad_run):
  _, output_dir, record = pgrad_run
  assert record["args"]["test_envs"] == [13, 14, 15, 16]
  assert record["args"]["holdout_fraction"] == 0.0
  assert record["domains"][13:] == list(catalog.WILDS_EVAL_SPLITS)
  assert record["hparams"]["outer_lr_per_domain"] is True
  # Regression metrics with WILDS's urban/rural worst group, per split.
  for split in range(13, 17):
    for metric in ("mse", "r", "worst_r"):
      assert np.isfinite(record[f"env{split}_in_{metric}"]), (split, metric)
    # A group's r may exceed the split's: with 3 rows, a group of 2 has
    # r = +-1 and a group of 1 none, which the worst group skips.
    assert -1 <= record[f"env{split}_in_worst_r"] <= 1
  # The 3-domain rollout's spectrum: 3 inner steps, so 4 points.
  assert len(record["eigenvalues"]) == 4
  assert [r["step"] for r in _records(output_dir)] == [2, 4]
  # An epoch is a pass over the 33 training rows, at 3 * 4 rows per step.
  np.testing.assert_allclose(record["epoch"], 4 * 12 / 33)


def test_poverty_map_evaluates_images_without_augmentation(tmp_path,
                                                          small_id_eval):
  del small_id_eval
  wilds_data.write_poverty(tmp_path / "data")

  def evaluation(data_augmentation):
    # An lr of 1e-30 leaves every weight as it was (Adam's first step moves
    # a weight by about lr, far below a float32 ulp of its value), so the
    # two runs evaluate the same model, after training on augmented and on
    # stored images. The biases, initially 0, move to about 1e-30, which no
    # output can show.
    hparams = {"lr": 1e-30, "batch_size": 4, "domains_per_step": 3,
               "data_augmentation": data_augmentation}
    record = train.claim_and_train(train.resolve_run([
        "--dataset", "PovertyMap", "--algorithm", "ERM", "--data_dir",
        str(tmp_path / "data"), "--output_dir",
        str(tmp_path / str(data_augmentation)), "--steps", "1",
        "--hparams", json.dumps(hparams), *NO_WORKERS]))
    assert record["hparams"]["data_augmentation"] is data_augmentation
    return {key: value for key, value in record.items()
            if key.startswith("env") and not key.endswith("_examples")}

  augmented, stored = evaluation(True), evaluation(False)
  # Every split, training countries' included: equal metrics, so the same
  # images were evaluated. Evaluating the training countries' images
  # augmented changes 42 of these 68 metrics, by up to 11 times.
  assert len(stored) == 17 * 4 and augmented == stored


def test_poverty_map_refuses_to_stop_on_an_accuracy_plateau(tmp_path,
                                                           small_id_eval):
  del small_id_eval
  wilds_data.write_poverty(tmp_path / "data")
  with pytest.raises(errors.UsageError, match="regression"):
    train.claim_and_train(train.resolve_run([
        "--dataset", "PovertyMap", "--data_dir", str(tmp_path / "data"),
        "--output_dir", str(tmp_path / "run"), "--steps", "4",
        "--checkpoint_freq", "2", "--plateau_check_freq", "2", *NO_WORKERS]))
  assert not (tmp_path / "run").exists()


def test_poverty_map_default_length_is_200_epochs(tmp_path, small_id_eval):
  del small_id_eval
  wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path)
  config = config_lib.Config(dataset="PovertyMap", algorithm="PGrad")
  hparams = config.hyperparameters()
  resolved = train.wilds_protocol(config, dataset, hparams)
  # 39 in-distribution rows - 6 evaluated = 33 training rows.
  assert resolved.steps == -(-200 * 33 // (hparams["batch_size"] * 8))
  assert resolved.test_envs == [13, 14, 15, 16]


def test_fmow_default_length_is_10_epochs(tmp_path):
  wilds_data.write_fmow(tmp_path)
  dataset = wilds.fmow(data_dir=tmp_path)
  config = config_lib.Config(
      dataset="FMoW", algorithm="ERM",
      hparams='{"batch_size": 1, "domains_per_step": 2}').resolve()
  resolved = train.wilds_protocol(config, dataset, config.hyperparameters())
  # 5 training rows (wilds_data.FMOW_SPLIT_ROWS), 2 a step: 10 * 5 / 2.
  assert resolved.steps == 25 and resolved.holdout_fraction == 0.0
  assert resolved.test_envs == [4, 5, 6, 7]


def test_poverty_maps_network_starts_from_scratch_unwarned(
    tmp_path, small_id_eval, capsys):
  # WILDS trains PovertyMap's 8-band ResNet-18 from scratch: nothing is
  # downloaded or said of weights. (FMoW's DenseNet-121 starts from ImageNet
  # weights, as WILDS's: test_config.py.)
  del small_id_eval
  wilds_data.write_poverty(tmp_path)
  config = config_lib.parse_args(["--dataset", "PovertyMap", "--data_dir",
                                  str(tmp_path)])
  assert (config.model, config.pretrained) == ("resnet18", None)
  train_steps.build_model(config, datasets.get_dataset("PovertyMap",
                                                    data_dir=tmp_path),
                       config.hyperparameters())
  assert capsys.readouterr().err == ""


def test_fmow_erm_phase_then_pgrad(tmp_path):
  data = tmp_path / "data"
  wilds_data.write_fmow(data)
  flags = ["--dataset", "FMoW", "--data_dir", str(data), "--steps", "2",
           "--checkpoint_freq", "2", *NO_WORKERS]
  domains = '"domains_per_step": 2, "batch_size": 2'
  erm = train.claim_and_train(train.resolve_run([
      *flags, "--algorithm", "ERM", "--output_dir", str(tmp_path / "erm"),
      "--hparams", "{" + domains + "}"]))
  assert erm["hparams"]["lr"] == 1e-4
  pgrad = train.claim_and_train(train.resolve_run([
      *flags, "--algorithm", "PGrad", "--output_dir", str(tmp_path / "pgrad"),
      "--init_params", str(tmp_path / "erm" / "final_params.npz"),
      "--hparams", "{" + domains + "}"]))
  assert pgrad["hparams"]["outer_lr"] == 0.01
  val = pgrad["domains"].index("val")
  # Accuracy and worst-region accuracy ("Other" left out) of every split.
  for key in ("acc", "worst_acc"):
    assert 0 <= pgrad[f"env{val}_in_{key}"] <= 1
  with pytest.raises(ValueError, match="does not fit the model"):
    train.claim_and_train(train.resolve_run([
        *flags[:-2], "--model", "resnet18", "--algorithm", "PGrad",
        "--output_dir", str(tmp_path / "bad"), "--init_params",
        str(tmp_path / "erm" / "final_params.npz")]))


def _command(data_dir, output_dir, workers):
  # The tiny folder needs a smaller in-distribution evaluation set.
  script = (f"from experiments.data import wilds; "
            f"wilds.POVERTY_ID_EVAL_SIZE = {ID_EVAL_SIZE}; "
            "from experiments import train; import sys; "
            "sys.exit(train.main(sys.argv[1:]))")
  return [sys.executable, "-c", script,
          *_pgrad_flags(data_dir, output_dir, workers)]


def _params(output_dir):
  with np.load(output_dir / "final_params.npz") as npz:
    return {key: npz[key] for key in npz.files}


@pytest.mark.slow
def test_poverty_map_run_resumes_after_a_kill(pgrad_run, tmp_path,
                                              small_id_eval, capsys):
  del small_id_eval
  # The uninterrupted run is the fixture's. The killed run runs in a process
  # of its own, the resumed one in this process; the resumed run's batches
  # are built by a worker process, from the iterator's state restored, the
  # others' in the runs' processes.
  data, reference, _ = pgrad_run
  output_dir = tmp_path / "run"
  kill_at_first_checkpoint(_command(data, output_dir, 0), output_dir, 2)
  resumed = run_here(_pgrad_flags(data, output_dir, 1), capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from step" in resumed.stderr
  # Trained on augmented images (PovertyMap's default), drawn again alike.
  assert all(r["hparams"]["data_augmentation"] for r in _records(output_dir))
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
