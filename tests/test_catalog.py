"""Tests for experiments/catalog.py: the names, facts and builders."""

import importlib
import inspect
import subprocess
import sys

import pytest

from experiments import catalog
from test_train import REPO


@pytest.mark.parametrize("entries", [catalog.DATASETS, catalog.MODELS,
                                     catalog.ALGORITHMS])
def test_every_name_has_a_builder_where_its_entry_says(entries):
  # The catalog names its builders without importing them; this imports all.
  for name, entry in entries.items():
    module, attribute = entry.builder.split(":")
    builder = getattr(importlib.import_module(module), attribute)
    assert callable(builder), name
    parameters = inspect.signature(
        builder.__init__ if inspect.isclass(builder) else builder).parameters
    assert set(entry.options) <= set(parameters), name


def test_facts_name_registered_things():
  for name, entry in catalog.DATASETS.items():
    assert entry.model in catalog.MODELS, name
    assert entry.steps is None or entry.steps > 0, name
    assert (entry.steps is None) == (entry.wilds is not None), name
    # The MNIST CNN for digits, an ImageNet network for photos.
    assert entry.small_images != catalog.MODELS[entry.model].imagenet, name
  for name, entry in catalog.ALGORITHMS.items():
    assert entry.variant_of is None or entry.variant_of in catalog.ALGORITHMS
    assert bool(entry.variant_of) == bool(entry.fixed_hparams), name


def test_algorithms_model_options_are_build_model_arguments():
  from experiments import models  # pylint: disable=g-import-not-at-top
  arguments = inspect.signature(models.build_model).parameters
  for name, entry in catalog.ALGORITHMS.items():
    assert set(entry.model_options) <= set(arguments), name
  assert catalog.ALGORITHMS["ARM"].model_options == {"context_net": True}


def test_model_options_follow_the_hparams():
  cnn = catalog.MODELS["mnist_cnn"].hparams_options
  assert cnn({"cnn_width": 16}) == {"widths": (16, 32, 32, 32)}
  assert cnn({}) == {}
  for name in ("resnet18", "resnet50", "densenet121"):
    options = catalog.MODELS[name].hparams_options
    assert options({"bn_mode": "train", "resnet_dropout": 0.5}) == {
        "bn_mode": "train", "dropout": 0.5}
    assert options({}) == {"bn_mode": "frozen", "dropout": 0.0}


def test_the_names_and_facts_import_no_jax():
  code = ("import sys\n"
          "from experiments import catalog, config, hparams_registry\n"
          "config.parse_args(['--dataset', 'PACS', '--algorithm', 'Fish'])\n"
          "print(sorted({'jax', 'flax', 'optax', 'grain', 'orbax'}"
          " & sys.modules.keys()))\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          capture_output=True, text=True, check=True)
  assert result.stdout.strip() == "[]"
