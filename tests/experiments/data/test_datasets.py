"""Tests for experiments/data/datasets.py."""

import numpy as np
import pytest

from experiments import catalog
from experiments.data import datasets


def test_registry_knows_all_datasets():
  assert set(catalog.DATASETS) >= {
      "RotatedDigits", "ColoredDigits", "RotatedMNIST", "ColoredMNIST",
      "DomainNet", "PACS", "VLCS", "OfficeHome", "TerraIncognita",
      "RotatedMNIST5k", "ColoredMNIST5k",
  }


def test_unknown_dataset_lists_known_names():
  with pytest.raises(ValueError, match="RotatedDigits.*PACS"):
    datasets.get_dataset("NoSuchDataset")


def test_registering_a_dataset_twice_is_refused():
  with pytest.raises(ValueError, match="already registered"):
    catalog.DATASETS.register("RotatedDigits", lambda **_: None)


def test_resized_samples_a_linear_image_at_the_new_pixel_centres():
  rows, cols = np.mgrid[:28, :28].astype(np.float32)
  image = (rows + 2 * cols)[None, ..., None] / 100
  ds = datasets.MultiDomainDataset(
      "Fake", ("a",), (datasets.ArraySource(image, np.array([7])),), 10,
      (28, 28, 1))
  small = datasets.resized(ds, 14)
  assert small.input_shape == (14, 14, 1) and small.name == "Fake"
  np.testing.assert_array_equal(small.domains[0].labels, [7])
  # Output pixel i covers input pixels 2i and 2i + 1: its centre is 2i + 0.5.
  # A linear image is reproduced there, away from the border.
  centre = 2 * np.arange(14) + 0.5
  expected = (centre[:, None] + 2 * centre[None, :]) / 100
  np.testing.assert_allclose(small.domains[0].images[0, 1:-1, 1:-1, 0],
                             expected[1:-1, 1:-1], rtol=1e-5)
  assert datasets.resized(ds, 28) is ds
  with pytest.raises(ValueError, match="image_size"):
    datasets.resized(ds, 0)


def test_decoded_photos_refuses_images_in_memory():
  ds = datasets.MultiDomainDataset(
      "Fake", ("a",), (datasets.ArraySource(np.zeros((1, 4, 4, 1)), [0]),), 2,
      (4, 4, 1))
  with pytest.raises(ValueError, match="not a dataset of photos"):
    datasets.decoded_photos(ds)


def test_fingerprint_of_arrays_is_their_count_and_labels():
  dataset = datasets.get_dataset("ColoredDigits", seed=0)
  recorded = datasets.fingerprint(dataset)
  assert recorded["dataset"] == "ColoredDigits"
  assert list(recorded["domains"]) == list(dataset.domain_names)
  for name, source in zip(dataset.domain_names, dataset.domains):
    assert recorded["domains"][name]["examples"] == len(source)
  # The same arguments, the same data; another deal, other labels.
  assert datasets.fingerprint(
      datasets.get_dataset("ColoredDigits", seed=0)) == recorded
  other = datasets.fingerprint(datasets.get_dataset("ColoredDigits", seed=1))
  assert all(other["domains"][d]["labels"] != recorded["domains"][d]["labels"]
             for d in dataset.domain_names)
  # Resizing keeps what it records: a run records the data it was given.
  assert datasets.fingerprint(datasets.resized(dataset, 14)) == recorded
