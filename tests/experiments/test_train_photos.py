"""Training on photos: DomainBed's PACS protocol, augmentation on, end to end.

The runs read a generated PACS folder (DomainBed's layout, 40x40 JPEGs)
into 32x32 crops (the ``image_size`` hparam) for DomainBed's MNIST CNN, so
that a run takes seconds on a CPU; everything else is the photo path as a
user runs it: decoding, DomainBed's augmentation, ImageNet normalisation,
threads reading ahead, checkpoints and resumption. The README's command is
followed up to its first batch, with the ResNet-50 it names.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import input_pipeline as input_benchmark
from experiments.data import photo_augmentation as augmentation
from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline
from experiments import train
from experiments.rundir import records
from experiments.training import evaluate
from experiments.training import sharding
from experiments.training import steps as train_steps
from test_models import random_state_dict
from test_imagenet import fixture_server  # pylint: disable=unused-import
from test_imagenet import serve_weights
import torch_writer
from test_train import kill_at_first_checkpoint, run_after, run_here

REPO = Path(__file__).resolve().parents[2]
STEPS, FREQ = 4, 2
# 3 training domains x 8 crops of 32x32x3 bytes: 74 KB a batch, more than a
# Linux pipe holds (64 KiB; test_batches_larger_than_a_pipe_buffer_end_the_run)
# and no more, as the model's steps take longer the larger the batch.
BATCH_SIZE, IMAGE_SIZE = 8, 32
FLAGS = ["--dataset", "PACS", "--algorithm", "ERM", "--model", "mnist_cnn",
         "--steps", str(STEPS), "--checkpoint_freq", str(FREQ),
         "--hparams", json.dumps({"batch_size": BATCH_SIZE,
                                  "image_size": IMAGE_SIZE}),
         "--eval_examples", "4", "--eval_batch_size", "8",
         "--loss_examples", "4"]
TIMING = records.TIMING_FIELDS


@pytest.fixture(name="data_dir", scope="module")
def fixture_data_dir(tmp_path_factory):
  """PACS's four domains, two classes, five 40x40 photos each."""
  return input_benchmark.write_photo_folder(
      tmp_path_factory.mktemp("data"), classes=("dog", "horse"),
      per_class=5, size=40)


def _args(data_dir, output_dir, workers):
  return [*FLAGS, "--data_dir", str(data_dir), "--output_dir",
          str(output_dir), "--num_workers", str(workers)]


def _command(data_dir, output_dir, workers):
  return [sys.executable, "-m", "experiments.train",
          *_args(data_dir, output_dir, workers)]


def _records(output_dir):
  lines = (output_dir / "results.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def _params(output_dir):
  with np.load(output_dir / "final_params.npz") as npz:
    return {key: npz[key] for key in npz.files}


# The reference run's standard error, by its output directory.
_LOGS = {}


@pytest.fixture(name="reference", scope="module")
def fixture_reference(data_dir, tmp_path_factory):
  """An uninterrupted run, its batches built by two worker processes."""
  output_dir = tmp_path_factory.mktemp("reference")
  result = subprocess.run(_command(data_dir, output_dir, 2), cwd=REPO,
                          capture_output=True, text=True, check=False,
                          timeout=300)
  assert result.returncode == 0, result.stderr
  _LOGS[output_dir] = result.stderr
  return output_dir


@pytest.mark.slow
def test_photo_run_says_what_it_runs_and_ends_without_a_warning(reference):
  log = _LOGS[reference]
  assert (f"{STEPS} steps, a checkpoint every {FREQ}; 32x32x3 images, "
          f"augmentation on, 2 input workers; run directory {reference}."
          in log), log
  # The bar's phases are labelled: compiling before the first step, then
  # training, and evaluating at every checkpoint.
  for phase in ("compiling", "training", "evaluating"):
    assert f"{phase}:" in log, phase
  assert "data wait" in log and "images/s=" in log
  assert "Warning" not in log, log


@pytest.mark.slow
def test_photo_run_leaves_no_shared_memory_for_the_tracker(reference):
  # Its input workers free the batches they built ahead as they stop:
  # Python's resource tracker finds none at exit, and does not warn.
  assert "leaked" not in _LOGS[reference], _LOGS[reference]


@pytest.mark.slow
def test_batches_larger_than_a_pipe_buffer_end_the_run(reference):
  # The reference run's batches are more than a Linux pipe holds (64 KiB),
  # so a batch that a worker sent through its queue and had half written
  # when it was stopped would leave the run waiting forever for the rest at
  # exit (the fixture's timeout).
  batch_bytes = 3 * BATCH_SIZE * IMAGE_SIZE**2 * 3
  assert batch_bytes > 64 * 1024
  assert _records(reference)[-1]["hparams"]["batch_size"] == BATCH_SIZE
  assert (reference / "done").exists()


@pytest.mark.slow
def test_photo_run_records_its_throughput_and_augments_by_default(
    reference):
  records = _records(reference)
  assert [r["step"] for r in records] == list(range(FREQ, STEPS + 1, FREQ))
  for record in records:
    assert record["hparams"]["data_augmentation"] is True
    assert record["hparams"]["image_size"] == IMAGE_SIZE
    for key in TIMING:
      assert record[key] >= 0, key
    # Waiting for data and for the device are parts of a step's time.
    assert (record["data_wait_time"] + record["device_wait_time"]
            <= record["step_time"])
    for i in range(4):
      assert 0 <= record[f"env{i}_in_acc"] <= 1


@pytest.mark.slow
def test_photo_run_killed_and_resumed_ends_bit_for_bit_as_uninterrupted(
    data_dir, reference, tmp_path, capsys):
  # Killed after its first checkpoint, resumed with other worker counts:
  # the augmentation's draws depend on (seed, step, example) alone. The
  # resumed run, the same command, runs in this process.
  output_dir = tmp_path / "run"
  kill_at_first_checkpoint(_command(data_dir, output_dir, 1), output_dir,
                           FREQ)
  resumed = run_here(_args(data_dir, output_dir, 0), capsys)
  assert resumed.returncode == 0, resumed.stderr
  assert "Resuming from step" in resumed.stderr
  expected, got = _params(reference), _params(output_dir)
  assert got.keys() == expected.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  def comparable(record):
    return {k: v for k, v in record.items() if k not in ("args", *TIMING)}

  assert ([comparable(r) for r in _records(output_dir)]
          == [comparable(r) for r in _records(reference)])


# Prepended to a train command: once the run is resolved, its folder
# checked, every photo of DATA is damaged, as a failing disk would.
_DAMAGE_PHOTOS_ONCE_CHECKED = """\
import pathlib
from experiments.rundir import claim
claim_run = claim.claim_run
def damage_then_claim_run(*args, **kwargs):
  for path in pathlib.Path({data!r}).rglob("*.jpg"):
    path.write_bytes(b"not a photo")
  return claim_run(*args, **kwargs)
claim.claim_run = damage_then_claim_run
"""


def test_a_photo_damaged_as_the_run_reads_it_is_named_on_one_line(
    data_dir, tmp_path):
  # Damaged after the check, a photo stops the run as training reads it:
  # the command says which, exit status 2, without a traceback, and a
  # fresh run leaves nothing, having written nothing.
  data, output_dir = tmp_path / "data", tmp_path / "run"
  shutil.copytree(data_dir, data)
  damaged = run_after(_DAMAGE_PHOTOS_ONCE_CHECKED.format(data=str(data)),
                      _command(data, output_dir, 2), timeout=300)
  assert damaged.returncode == 2, damaged.stderr
  assert "Traceback" not in damaged.stderr
  error = f"{config_lib.PROG}: error: Cannot read image {data / 'PACS'}"
  lines = damaged.stderr.splitlines()
  assert lines[-1].startswith(error), damaged.stderr
  assert "Restore the file and rerun the same command" in lines[-1]
  assert sum(line.startswith(config_lib.PROG) for line in lines) == 1
  assert not output_dir.exists()


def test_evaluation_augments_the_training_domains_only(data_dir):
  # DomainBed evaluates a training domain through its augmentation, a test
  # domain through the test-time transform; the draws are per (seed, step,
  # example), so an evaluation repeats exactly.
  dataset = datasets.resized(
      datasets.get_dataset("PACS", data_dir=data_dir), 16)
  augment = augmentation.training_augmentation(
      dataset, {"data_augmentation": True})
  splits = input_pipeline.split_domains(dataset, seed=0)
  sets = [{"in": in_split, "out": out_split} for in_split, out_split in splits]
  config = config_lib.Config(dataset="PACS", test_envs=[2], num_workers=2,
                             eval_batch_size=5)

  def evaluated_images(step, augment=augment):
    seen = []

    def eval_step(params, stats, images, labels, *count):
      del params, stats, count
      seen.append(np.asarray(images))
      return jnp.zeros(len(labels), jnp.int32), jnp.zeros(len(labels))

    state = train_steps.TrainState(jnp.int32(step), None, None, None)
    evaluate.evaluate(eval_step, state, dataset, sets, config,
                      sharding.Sharder(), augment)
    # Batches of 5 (the largest split has 8 images), in order of domain
    # and split; the padding of a last batch is dropped.
    sizes = [len(s) for domain in sets for s in domain.values()]
    images = np.concatenate(seen)
    offsets = np.cumsum([0] + [-(-n // 5) * 5 for n in sizes])
    return [images[o:o + n] for o, n in zip(offsets, sizes)]

  plain = evaluated_images(6, augment=None)
  augmented = evaluated_images(6)
  for d, domain in enumerate(sets):
    for s, indices in enumerate(domain.values()):
      k = 2 * d + s
      expected = np.stack([dataset.domains[d][int(i)]["image"]
                           for i in indices])
      np.testing.assert_array_equal(plain[k], expected)
      if d in config.test_envs:
        np.testing.assert_array_equal(augmented[k], expected)
      else:
        assert not np.allclose(augmented[k], expected), (d, s)
  again, later = evaluated_images(6), evaluated_images(7)
  for k in range(len(augmented)):
    np.testing.assert_array_equal(again[k], augmented[k])
    if k // 2 not in config.test_envs:
      assert not np.array_equal(later[k], augmented[k])


@pytest.mark.slow
def test_readme_pacs_command_builds_a_pretrained_resnet50_and_its_batches(
    data_dir, server, monkeypatch, tmp_path, capsys):
  # The README's command, python -m experiments.train --dataset PACS
  # --data_dir ~/data, on the generated folder, up to its first batch: its
  # model holds ImageNet weights, fetched over HTTP, and its batches are
  # PGrad-B's, augmented, at 224x224. (Training a ResNet-50 takes minutes
  # per step on a CPU.) The weights served are a random state dict of
  # torchvision's ResNet-50 names and shapes, under a name of their hash.
  state_dict = random_state_dict(50)
  torch_writer.write_state_dict(tmp_path / "resnet50.pth", state_dict)
  serve_weights(server, monkeypatch, "resnet50",
                (tmp_path / "resnet50.pth").read_bytes())
  spec = train.resolve_run(["--dataset", "PACS", "--data_dir", str(data_dir),
                            "--output_dir", str(tmp_path / "run")])
  # Fetched as the run is resolved, before any model is built.
  assert len(server.requests) == 1
  config, hparams, dataset = spec.config, dict(spec.hparams), spec.dataset
  model = train_steps.build_model(config, dataset, hparams, spec.weights)
  assert "Featurizer weights from" in capsys.readouterr().err
  assert len(server.requests) == 1
  assert (config.model, config.algorithm, config.pretrained) == (
      "resnet50", "PGrad-B", "imagenet")
  # The stem's kernel is torchvision's, OIHW turned HWIO.
  np.testing.assert_array_equal(
      model.featurizer.conv1.kernel[...],
      state_dict["conv1.weight"].transpose(2, 3, 1, 0))
  augment = augmentation.training_augmentation(dataset, hparams)
  splits = input_pipeline.split_domains(dataset, seed=config.trial_seed)
  # Built in this process: a batch is the same whatever the number of input
  # workers (test_pipeline.py), and the command's workers (one per core)
  # would each build batches of 99 photos ahead, which the test never reads.
  batch = next(input_pipeline.make_train_iterator(
      augment.dataset, [1, 2, 3], splits, batch_size=hparams["batch_size"],
      seed=config.seed, num_workers=0, transform=augment.transform))
  assert batch["image"].shape == (3, 33, 224, 224, 3)
  # Normalised in the training step (train_steps.normalized).
  assert batch["image"].dtype == np.uint8
