"""Tests for experiments/photo_datasets.py."""

import re

import numpy as np
import pytest
from PIL import Image

from experiments import datasets
from experiments import photo_datasets

COLOURS = {"dog": (200, 30, 30), "horse": (20, 180, 90)}


def _write_folder_dataset(
    root, domains=("art", "photo"), classes=("dog", "horse")
):
  """Writes 3 small flat-colour JPEGs per class and domain under root/PACS."""
  for d in domains:
    for c in classes:
      folder = root / "PACS" / d / c
      folder.mkdir(parents=True)
      for k in range(3):
        Image.new("RGB", (20 + k, 30), COLOURS[c]).save(folder / f"{k}.jpg")


def test_folder_dataset_reads_domains_classes_and_normalises(tmp_path):
  _write_folder_dataset(tmp_path)
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  assert ds.name == "PACS"
  assert ds.domain_names == ("art", "photo")
  assert ds.num_classes == 2
  assert ds.input_shape == (224, 224, 3)
  for source in ds.domains:
    assert isinstance(source, photo_datasets.FolderSource)
    assert len(source) == 6
    np.testing.assert_array_equal(source.labels, [0, 0, 0, 1, 1, 1])
    for k in range(len(source)):
      element = source[k]
      class_name = ("dog", "horse")[element["label"]]
      assert source.paths[k].parent.name == class_name
      assert element["image"].shape == (224, 224, 3)
      assert element["image"].dtype == np.float32
      expected = np.array(COLOURS[class_name]) / 255 - (0.485, 0.456, 0.406)
      expected /= (0.229, 0.224, 0.225)
      # JPEG may shift a flat colour by a couple of levels.
      np.testing.assert_allclose(
          element["image"], np.broadcast_to(expected, (224, 224, 3)),
          atol=0.05,
      )


def test_photos_read_as_stored_and_resized_on_reading(tmp_path):
  _write_folder_dataset(tmp_path)
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  decoded = datasets.decoded_photos(ds)
  small = datasets.resized(ds, 16)
  assert small.input_shape == (16, 16, 3) and ds.input_shape == (224, 224, 3)
  for d, source in enumerate(ds.domains):
    for k in range(len(source)):
      # As stored: the file's own size (20 + k % 3 wide), uint8 RGB.
      stored = decoded.domains[d][k]
      assert stored["image"].dtype == np.uint8
      assert stored["image"].shape == (30, 20 + k % 3, 3)
      assert stored["label"] == source.labels[k]
      with Image.open(source.paths[k]) as image:
        np.testing.assert_array_equal(stored["image"],
                                      np.asarray(image.convert("RGB")))
      # Read at 16x16: the stored photo resized bilinearly, normalised.
      resized = np.asarray(Image.fromarray(stored["image"]).resize(
          (16, 16), Image.Resampling.BILINEAR), np.float64)
      expected = (resized / 255 - (0.485, 0.456, 0.406)) / (0.229, 0.224,
                                                             0.225)
      np.testing.assert_allclose(small.domains[d][k]["image"], expected,
                                 atol=1e-6)
      assert source[k]["image"].shape == (224, 224, 3)  # Not resized.


def test_folder_dataset_corrupt_image_error_names_the_file(tmp_path):
  _write_folder_dataset(tmp_path)
  corrupt = tmp_path / "PACS" / "photo" / "horse" / "1.jpg"
  corrupt.write_bytes(np.random.default_rng(0).bytes(300))
  source = datasets.get_dataset("PACS", data_dir=tmp_path).domains[1]
  index = source.paths.index(corrupt)
  with pytest.raises(OSError, match=re.escape(str(corrupt))):
    source[index]


def test_folder_dataset_class_missing_from_a_domain(tmp_path):
  _write_folder_dataset(tmp_path, domains=("art",))
  _write_folder_dataset(tmp_path, domains=("photo",), classes=("dog",))
  with pytest.raises(ValueError, match="'photo'.*horse"):
    datasets.get_dataset("PACS", data_dir=tmp_path)


def test_folder_dataset_empty_domain(tmp_path):
  _write_folder_dataset(tmp_path)
  (tmp_path / "PACS" / "sketch" / "dog").mkdir(parents=True)
  with pytest.raises(ValueError, match="sketch"):
    datasets.get_dataset("PACS", data_dir=tmp_path)


@pytest.mark.parametrize(
    "name, dir_name",
    [("PACS", "PACS"), ("VLCS", "VLCS"), ("OfficeHome", "office_home"),
     ("TerraIncognita", "terra_incognita")],
)
def test_missing_folder_dataset_raises_dataset_not_found(
    tmp_path, name, dir_name
):
  with pytest.raises(
      datasets.DatasetNotFoundError, match=re.escape(str(tmp_path / dir_name))
  ):
    datasets.get_dataset(name, data_dir=tmp_path)
