"""Tests for experiments/data/tfds_sources.py."""

import pytest

from experiments.data import datasets


@pytest.mark.parametrize(
    "name, tfds_name",
    [("RotatedMNIST", "mnist"), ("ColoredMNIST", "mnist"),
     ("DomainNet", "domainnet/sketch")],
)
def test_missing_tfds_data_raises_dataset_not_found(tmp_path, name, tfds_name):
  with pytest.raises(datasets.DatasetNotFoundError) as info:
    datasets.get_dataset(name, data_dir=tmp_path)
  assert isinstance(info.value, FileNotFoundError)
  message = str(info.value)
  assert name in message and tfds_name in message
  assert str(tmp_path) in message
  assert "download_and_prepare" in message
  # Nothing was downloaded.
  assert not list(tmp_path.rglob("*.array_record*"))
