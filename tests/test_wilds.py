"""Tests for experiments/wilds.py on tiny folders in WILDS's layout."""

import numpy as np
import pytest
from PIL import Image

from experiments import catalog
from experiments import datasets
from experiments import input_pipeline
from experiments import wilds
import wilds_data


def test_poverty_map_splits_domains_channels_and_labels(tmp_path):
  rows = wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  train, val, test = wilds.POVERTY_FOLDS["A"]
  assert dataset.domain_names == train + wilds.EVAL_SPLITS
  assert dataset.num_train_domains == 13 and dataset.num_classes == 1
  assert dataset.test_envs == tuple(range(13, 17))
  assert dataset.domain_names[dataset.selection_env] == "val"
  assert dataset.input_shape == (8, 8, 8) and dataset.epochs == 200

  by_name = dict(zip(dataset.domain_names, dataset.domains))
  countries = np.array([r["country"] for r in rows])
  # OOD splits: exactly the fold's validation and test countries.
  assert sorted(set(countries[by_name["val"].rows])) == sorted(val)
  assert sorted(set(countries[by_name["test"].rows])) == sorted(test)
  assert len(by_name["val"]) == 15 and len(by_name["test"]) == 15
  # In-distribution: WILDS shuffles the training countries' rows with
  # default_rng(ord("A") + 541433) and takes the first 6 for evaluation.
  shuffled = np.arange(39)
  np.random.default_rng(ord("A") + 541433).shuffle(shuffled)
  np.testing.assert_array_equal(by_name["id_val"].rows, shuffled[:3])
  np.testing.assert_array_equal(by_name["id_test"].rows, shuffled[3:6])
  train_rows = np.concatenate([by_name[c].rows for c in train
                               if c in by_name])
  assert sorted(train_rows) == sorted(shuffled[6:])
  for country in train:
    if country in by_name:
      assert set(countries[by_name[country].rows]) == {country}

  element = by_name["val"][0]
  row = int(by_name["val"].rows[0])
  stored = np.load(tmp_path / wilds.POVERTY_DIR / "images"
                   / f"landsat_poverty_img_{row}.npz")["x"]
  # Stored normalised and channels-first; served as is, channels-last.
  np.testing.assert_array_equal(element["image"], np.moveaxis(stored, 0, -1))
  assert element["image"].dtype == np.float32
  assert element["label"].dtype == np.float32
  np.testing.assert_allclose(element["label"], rows[row]["wealthpooled"],
                             rtol=1e-6)
  assert element["group"] == int(rows[row]["urban"])


def test_poverty_map_folds_move_the_countries(tmp_path):
  rows = wilds_data.write_poverty(tmp_path)
  countries = np.array([r["country"] for r in rows])
  train, val, test = wilds.POVERTY_FOLDS["C"]
  dataset = wilds.poverty_map(data_dir=tmp_path, fold="C", id_eval_size=6)
  assert dataset.name == "PovertyMap-C" and "PovertyMap-C" in catalog.DATASETS
  assert dataset.domain_names == train + wilds.EVAL_SPLITS
  by_name = dict(zip(dataset.domain_names, dataset.domains))
  assert sorted(set(countries[by_name["test"].rows])) == sorted(test)
  assert sorted(set(countries[by_name["val"].rows])) == sorted(val)
  with pytest.raises(ValueError, match="fold must be one of"):
    wilds.poverty_splits(["kenya"], fold="F")
  # WILDS's 2,000 in-distribution evaluation rows leave none to train on.
  with pytest.raises(ValueError, match="no training examples"):
    datasets.get_dataset("PovertyMap", data_dir=tmp_path)


def test_fmow_splits_years_regions_and_normalisation(tmp_path):
  rows = wilds_data.write_fmow(tmp_path)
  dataset = datasets.get_dataset("FMoW", data_dir=tmp_path)
  # Training domains: the years of the training split before 2013.
  assert dataset.domain_names == ("2005", "2010", "2012") + wilds.EVAL_SPLITS
  assert dataset.num_classes == 62 and dataset.input_shape == (8, 8, 3)
  assert dataset.epochs == 10
  by_name = dict(zip(dataset.domain_names, dataset.domains))
  expected = {"2005": [0, 1], "2010": [2], "2012": [4], "id_val": [5],
              "id_test": [6], "val": [7, 8], "test": [10, 11]}
  for name, rows_of in expected.items():
    np.testing.assert_array_equal(by_name[name].rows, rows_of)

  element = by_name["val"][1]  # Row 8: a country with no region.
  assert element["group"] == -1
  assert by_name["val"][0]["group"] == wilds.FMOW_REGIONS.index("Americas")
  assert element["label"] == wilds.FMOW_CATEGORIES.index(rows[8]["category"])
  # Row 8 follows the "seq" row 3, so its image is the 8th: rgb_img_7.
  pixels = np.asarray(Image.open(tmp_path / wilds.FMOW_DIR / "images"
                                 / "rgb_img_7.png"), np.float64) / 255
  np.testing.assert_allclose(
      element["image"],
      (pixels - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225], rtol=1e-5,
      atol=1e-6)


@pytest.mark.parametrize("name, folder", [("FMoW", "fmow_v1.1"),
                                          ("PovertyMap", "poverty_v1.1")])
def test_missing_wilds_data_names_the_download(tmp_path, name, folder):
  with pytest.raises(datasets.DatasetNotFoundError,
                     match=f"{name} not found.*{folder}.*download_datasets"):
    datasets.get_dataset(name, data_dir=tmp_path)


def test_wilds_batches_carry_labels_and_groups(tmp_path):
  wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  splits = input_pipeline.split_domains(dataset, holdout_fraction=0.0, seed=0)
  iterator = input_pipeline.make_train_iterator(
      dataset, [0, 1, 2], splits, batch_size=2, seed=0, num_threads=0)
  batch = next(iterator)
  assert batch["image"].shape == (3, 2, 8, 8, 8)
  assert batch["label"].dtype == np.float32 and batch["group"].shape == (3, 2)
