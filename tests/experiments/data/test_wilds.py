"""Tests for experiments/data/wilds.py on tiny folders in WILDS's layout."""

import io
import threading
import zipfile

import numpy as np
import pytest
from PIL import Image

from experiments.data import photo_augmentation as augmentation
from experiments import catalog
from experiments.data import datasets
from experiments import hparams_registry
from experiments.data import pipeline as input_pipeline
from experiments.data import wilds
from experiments.data import wilds_augmentation
import wilds_data


def test_poverty_map_splits_domains_channels_and_labels(tmp_path):
  rows = wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  train, val, test = catalog.POVERTY_FOLDS["A"]
  assert dataset.domain_names == train + catalog.WILDS_EVAL_SPLITS
  assert dataset.num_train_domains == 13 and dataset.num_classes == 1
  assert dataset.test_envs == tuple(range(13, 17))
  assert dataset.domain_names[dataset.selection_env] == "val"
  assert dataset.input_shape == (8, 8, 8)

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
  train, val, test = catalog.POVERTY_FOLDS["C"]
  dataset = wilds.poverty_map(data_dir=tmp_path, fold="C", id_eval_size=6)
  assert dataset.name == "PovertyMap-C" and "PovertyMap-C" in catalog.DATASETS
  assert dataset.domain_names == train + catalog.WILDS_EVAL_SPLITS
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
  assert dataset.domain_names == ("2002", "2005", "2010",
                                  "2012") + catalog.WILDS_EVAL_SPLITS
  assert dataset.num_classes == 62 and dataset.input_shape == (8, 8, 3)
  by_name = dict(zip(dataset.domain_names, dataset.domains))
  # WILDS's splits, by UTC timestamp: the -05:00 row 17 is 2016 in UTC.
  for name, rows_of in wilds_data.FMOW_SPLIT_ROWS.items():
    np.testing.assert_array_equal(by_name[name].rows, rows_of, err_msg=name)

  element = by_name["val"][1]  # Row 11: a country with no region.
  assert element["group"] == -1
  assert by_name["val"][0]["group"] == wilds.FMOW_REGIONS.index("Americas")
  assert element["label"] == wilds.FMOW_CATEGORIES.index(rows[11]["category"])
  # The image of row 11 is rgb_img_11, whatever "seq" rows come before it.
  pixels = np.asarray(Image.open(tmp_path / wilds.FMOW_DIR / "images"
                                 / "rgb_img_11.png"), np.float64) / 255
  np.testing.assert_allclose(
      element["image"],
      (pixels - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225], rtol=1e-5,
      atol=1e-6)


def test_every_fmow_split_loads_the_image_of_its_own_row(tmp_path):
  wilds_data.write_fmow(tmp_path)
  dataset = wilds.fmow(data_dir=tmp_path)
  by_name = dict(zip(dataset.domain_names, dataset.domains))
  assert by_name.keys() == wilds_data.FMOW_SPLIT_ROWS.keys()
  for name, expected_rows in wilds_data.FMOW_SPLIT_ROWS.items():
    source = by_name[name]
    assert len(source) == len(expected_rows), name
    for index, row in enumerate(expected_rows):
      # Undo the ImageNet normalisation: the pixel that holds the row.
      red = source[index]["image"][wilds_data.FMOW_ROW_PIXEL[:2]][0]
      stored = round(255 * (red * 0.229 + 0.485))
      assert stored == row, (name, index)


def test_every_poverty_map_split_loads_the_image_of_its_own_row(tmp_path):
  rows = wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  countries = np.array([r["country"] for r in rows])
  seen = []
  for name, source in zip(dataset.domain_names, dataset.domains):
    for index in range(len(source)):
      row = int(source.rows[index])
      element = source[index]
      # Each image holds its row; so each example reads its own file.
      np.testing.assert_array_equal(
          element["image"][wilds_data.POVERTY_ROW_PIXEL], np.full(8, row))
      np.testing.assert_allclose(element["label"], rows[row]["wealthpooled"],
                                 rtol=1e-6)
      if name not in catalog.WILDS_EVAL_SPLITS:
        assert countries[row] == name
      seen.append(row)
  # Every row is served exactly once.
  assert sorted(seen) == list(range(len(rows)))


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
      dataset, [0, 1, 2], splits, batch_size=2, seed=0, num_workers=0)
  batch = next(iterator)
  assert batch["image"].shape == (3, 2, 8, 8, 8)
  assert batch["label"].dtype == np.float32 and batch["group"].shape == (3, 2)


@pytest.mark.parametrize("algorithm", ["ERM", "PGrad-B"])
def test_only_poverty_map_has_wilds_training_augmentation(tmp_path, algorithm):
  wilds_data.write_poverty(tmp_path)
  wilds_data.write_fmow(tmp_path)
  poverty = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  assert poverty.train_transform is wilds_augmentation.augment_poverty
  assert wilds.fmow(data_dir=tmp_path).train_transform is None
  for name in ("PovertyMap", "PovertyMap-C"):
    hparams = hparams_registry.default_hparams(algorithm, name)
    assert hparams["data_augmentation"] is True
  # WILDS augments no FMoW image: there is nothing to switch on.
  assert "data_augmentation" not in hparams_registry.default_hparams(
      algorithm, "FMoW")
  with pytest.raises(ValueError, match="Unknown hparams.*data_augmentation"):
    hparams_registry.check_hparams(algorithm, "FMoW",
                                   {"data_augmentation": True})


def test_poverty_map_evaluation_batches_are_the_stored_images(tmp_path):
  wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  images = tmp_path / wilds.POVERTY_DIR / "images"
  for domain in range(len(dataset.domains)):
    source = dataset.domains[domain]
    indices = np.arange(len(source))
    batches = list(input_pipeline.eval_batches(dataset, domain, indices,
                                               batch_size=4))
    served = np.concatenate([batch["image"] for batch in batches])
    stored = [np.moveaxis(np.load(images / f"landsat_poverty_img_{row}.npz")
                          ["x"], 0, -1) for row in source.rows]
    # Bit for bit: no flip and no jitter, though the dataset has a
    # training transform.
    np.testing.assert_array_equal(served, np.stack(stored))


def test_poverty_map_training_batches_are_augmented(tmp_path):
  wilds_data.write_poverty(tmp_path)
  dataset = wilds.poverty_map(data_dir=tmp_path, id_eval_size=6)
  augment = augmentation.training_augmentation(
      dataset, hparams_registry.default_hparams("ERM", "PovertyMap"))
  assert augment.transform is wilds_augmentation.augment_poverty
  assert not augment.in_evaluation
  splits = input_pipeline.split_domains(dataset, holdout_fraction=0.0, seed=0)
  iterator = input_pipeline.make_train_iterator(
      augment.dataset, range(dataset.num_train_domains), splits,
      batch_size=4, seed=3, num_workers=0, domains_per_step=5,
      transform=augment.transform)
  images = tmp_path / wilds.POVERTY_DIR / "images"
  flips, jittered = set(), 0
  for _ in range(3):
    for image in next(iterator)["image"].reshape(-1, 8, 8, 8):
      # The row is at a corner of every band, wherever the flips put it.
      corners = image[[0, 0, -1, -1], [0, -1, 0, -1], 7]
      row = int(corners[corners == np.round(corners)][0])
      stored = np.moveaxis(np.load(images / f"landsat_poverty_img_{row}.npz")
                           ["x"], 0, -1)
      # The bands past RGB are the stored ones, flipped in one of 4 ways.
      flipped = [(h, v) for h in (False, True) for v in (False, True)
                 if np.array_equal(image[..., 3:], stored[::-1 if v else 1,
                                                          ::-1 if h else 1,
                                                          3:])]
      assert len(flipped) == 1
      flips.add(flipped[0])
      jittered += not np.allclose(image[..., :3], stored[..., :3])
  # 60 images: all four flips occur, and the jitter changes the colours.
  assert len(flips) == 4 and jittered == 60


def _write_npz_version_2(path, array):
  """An .npz whose member has a version 2.0 header, as np.save writes for
  headers over 64 KiB."""
  with zipfile.ZipFile(path, "w") as archive, \
      archive.open("x.npy", "w") as member:
    np.lib.format.write_array(member, array, version=(2, 0))


@pytest.mark.parametrize("write", [
    lambda path, array: np.savez(path, x=array),
    lambda path, array: np.savez_compressed(path, x=array),
    _write_npz_version_2,
], ids=["stored", "compressed", "header_2_0"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
@pytest.mark.parametrize("order", ["C", "F"])
def test_npz_arrays_read_as_numpy_reads_them(tmp_path, write, dtype, order):
  array = np.asarray(np.random.default_rng(0).normal(size=(3, 5, 4)) * 100,
                     dtype=dtype, order=order)
  path = tmp_path / "image.npz"
  write(path, array)
  read = wilds._read_npz_array(path, "x")
  with np.load(path) as expected:
    assert read.dtype == expected["x"].dtype
    np.testing.assert_array_equal(read, expected["x"])
  np.testing.assert_array_equal(read, array)


def test_unreadable_npz_names_the_file_and_the_fault(tmp_path):
  np.savez(tmp_path / "other_key.npz", y=np.zeros(3))
  np.savez(tmp_path / "objects.npz", x=np.array([{}, None], dtype=object))
  (tmp_path / "text.npz").write_text("not a zip")
  whole = io.BytesIO()
  np.lib.format.write_array(whole, np.zeros(8))
  with zipfile.ZipFile(tmp_path / "short.npz", "w") as archive:
    archive.writestr("x.npy", whole.getvalue()[:-8])  # one float64 short
  for name, fault in [("other_key", "'x'"), ("objects", "Python objects"),
                      ("text", "not an .npz"), ("short", "header says 64")]:
    with pytest.raises(OSError, match=fault):
      wilds._read_npz_array(tmp_path / f"{name}.npz", "x")
  with pytest.raises(OSError, match="No such file"):
    wilds._read_npz_array(tmp_path / "missing.npz", "x")


def test_npz_headers_are_parsed_one_thread_at_a_time(tmp_path):
  # CPython before 3.11.8 and 3.12.2 can fail two threads that parse .npy
  # headers at once (python/cpython#106905); the reader serialises them.
  np.savez(tmp_path / "image.npz", x=np.arange(6.0))
  read = []
  reader = threading.Thread(
      target=lambda: read.append(wilds._read_npz_array(
          tmp_path / "image.npz", "x")))
  with wilds._NPY_HEADER_LOCK:
    reader.start()
    reader.join(timeout=0.5)
    assert reader.is_alive() and not read
  reader.join()
  np.testing.assert_array_equal(read[0], np.arange(6.0))
