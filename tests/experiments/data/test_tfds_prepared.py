"""The datasets read from TFDS, on tiny TFDS datasets prepared here.

The fixtures prepare small ``mnist`` and ``domainnet/<domain>`` datasets in a
temporary data_dir with tfds's own writer (array_record files, dataset_info.json
and features.json, in the layout ``download_and_prepare`` leaves), so the
loaders under test open them through the registered tfds builders exactly as
they would open the real data. Neither network nor TensorFlow is needed.
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from experiments.data import datasets
from experiments.data import digit_datasets
from experiments.data import photo_datasets

NUM_MNIST = 36  # Divisible by the 6 rotated and the 3 coloured domains.
NUM_MNIST_TRAIN = 24
# Each digit has a flat 8x8 centre block of its own grey level, so that it can
# be recognised after any rotation about the centre.
BLOCK = slice(10, 18)
BLOCK_BASE, BLOCK_STEP = 100, 4
DOMAINNET_CLASSES = 345


class _FromArrays:
  """Generates a builder's splits from arrays instead of downloads."""

  arrays: dict[str, tuple[np.ndarray, np.ndarray]]

  def _split_generators(self, dl_manager):
    del dl_manager
    return {
        split: self._generate(split, images, labels)
        for split, (images, labels) in self.arrays.items()
    }

  def _generate(self, split, images, labels):
    for k, (image, label) in enumerate(zip(images, labels)):
      # tfds PNG-encodes PIL images with PIL; NumPy arrays would need TF.
      pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
      yield f"{split}_{k:04d}", {"image": pil, "label": int(label)}


# Subclasses keep the registered builders' names, versions, configs and
# features, so that tfds.builder("mnist") etc. find what they write.
class _TinyMnist(
    _FromArrays, tfds.image_classification.MNIST, skip_registration=True
):
  name = "mnist"


class _TinyDomainnet(
    _FromArrays, tfds.image_classification.Domainnet, skip_registration=True
):
  name = "domainnet"


def _prepare(builder_cls, data_dir, arrays, config=None):
  builder = builder_cls(
      data_dir=str(data_dir), config=config, file_format="array_record"
  )
  builder.arrays = arrays
  # Otherwise tfds asks GCS whether it hosts the dataset before writing.
  download_config = tfds.download.DownloadConfig(try_download_gcs=False)
  builder.download_and_prepare(download_config=download_config)
  return builder


def _mnist_arrays():
  rng = np.random.default_rng(123)
  # A background of 1..60 keeps every pixel non-zero (see the colour test).
  images = rng.integers(1, 61, (NUM_MNIST, 28, 28, 1), dtype=np.uint8)
  for i in range(NUM_MNIST):
    images[i, BLOCK, BLOCK] = BLOCK_BASE + BLOCK_STEP * i
  labels = rng.integers(0, 10, NUM_MNIST)
  return images, labels


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
  """A data_dir with a prepared 36-example ``mnist`` (24 train, 12 test)."""
  data_dir = tmp_path_factory.mktemp("tfds_mnist")
  images, labels = _mnist_arrays()
  n = NUM_MNIST_TRAIN
  _prepare(
      _TinyMnist,
      data_dir,
      {"train": (images[:n], labels[:n]), "test": (images[n:], labels[n:])},
  )
  return data_dir


def _digit_id(image: np.ndarray) -> int:
  """Which written digit a loaded (28, 28) image in [0, 1] shows."""
  level = image[14, 14] * 255.0
  digit = int(round((level - BLOCK_BASE) / BLOCK_STEP))
  assert 0 <= digit < NUM_MNIST
  assert abs(level - (BLOCK_BASE + BLOCK_STEP * digit)) < 1e-3
  return digit


def _source_ids(data_dir) -> np.ndarray:
  """The written digit ids in the order tfds serves train+test."""
  builder = tfds.builder("mnist", data_dir=str(data_dir), try_gcs=False)
  source = builder.as_data_source(split="train+test")
  return np.array([_digit_id(source[k]["image"][..., 0] / 255.0)
                   for k in range(len(source))])


def test_prepared_mnist_is_where_the_registered_builder_looks(mnist_dir):
  builder = tfds.builder("mnist", data_dir=str(mnist_dir), try_gcs=False)
  assert type(builder) is tfds.image_classification.MNIST
  assert builder.is_prepared()
  version_dir = mnist_dir / "mnist" / str(builder.version)
  for name in ("dataset_info.json", "features.json"):
    assert (version_dir / name).is_file()
  assert list(version_dir.glob("mnist-train.array_record-*"))
  assert list(version_dir.glob("mnist-test.array_record-*"))
  assert builder.info.splits["train"].num_examples == NUM_MNIST_TRAIN
  assert builder.info.splits["test"].num_examples == NUM_MNIST - NUM_MNIST_TRAIN


@pytest.mark.parametrize("seed", [0, 3])
def test_rotated_mnist_reads_the_prepared_records(mnist_dir, seed):
  images, labels = _mnist_arrays()
  ds = datasets.get_dataset("RotatedMNIST", data_dir=mnist_dir, seed=seed)
  assert ds.name == "RotatedMNIST"
  assert ds.domain_names == ("0°", "15°", "30°", "45°", "60°", "75°")
  assert ds.num_classes == 10
  assert ds.input_shape == (28, 28, 1)
  assert [len(d) for d in ds.domains] == [NUM_MNIST // 6] * 6

  order = _source_ids(mnist_dir)
  parts = digit_datasets._deal(NUM_MNIST, 6, seed)
  # The deal shuffles: it is not the plain round robin of the source order.
  assert not np.array_equal(parts[0], np.arange(0, NUM_MNIST, 6))
  seen = []
  for domain, part in zip(ds.domains, parts):
    ids = []
    for k in range(len(domain)):
      element = domain[k]
      assert element["image"].dtype == np.float32
      assert element["image"].shape == (28, 28, 1)
      assert element["label"].dtype == np.int32
      digit = _digit_id(element["image"][..., 0])
      assert element["label"] == labels[digit]
      ids.append(digit)
    # Round-robin dealing of the shuffled train+test examples.
    np.testing.assert_array_equal(ids, order[part])
    seen += ids
  assert sorted(seen) == list(range(NUM_MNIST))

  # Domain "0°" holds the written pixels unchanged; the others are rotated.
  for domain, angle in zip(ds.domains, digit_datasets.ROTATION_ANGLES):
    for k in range(len(domain)):
      image = domain[k]["image"][..., 0]
      written = images[_digit_id(image), ..., 0] / np.float32(255.0)
      if angle == 0:
        np.testing.assert_allclose(image, written, atol=1e-6)
      else:
        assert not np.allclose(image, written, atol=0.05)
        assert (image[0, 0], image[-1, -1]) == (0.0, 0.0)  # Empty corners.


def test_rotated_mnist_seed_changes_the_deal(mnist_dir):
  first, second = (
      datasets.get_dataset("RotatedMNIST", data_dir=mnist_dir, seed=seed)
      for seed in (0, 1)
  )
  ids = [
      sorted(_digit_id(ds.domains[0][k]["image"][..., 0])
             for k in range(len(ds.domains[0])))
      for ds in (first, second)
  ]
  assert ids[0] != ids[1]


def test_colored_mnist_reads_the_prepared_records(mnist_dir):
  images, labels = _mnist_arrays()
  seed = 1
  ds = datasets.get_dataset("ColoredMNIST", data_dir=mnist_dir, seed=seed)
  assert ds.name == "ColoredMNIST"
  assert ds.domain_names == ("+90%", "+80%", "-90%")
  assert ds.num_classes == 2
  assert ds.input_shape == (28, 28, 2)
  assert [len(d) for d in ds.domains] == [NUM_MNIST // 3] * 3

  seen = []
  envs = digit_datasets.COLOR_ENVIRONMENTS.values()
  for i, (domain, env) in enumerate(zip(ds.domains, envs)):
    digits, binary, colors = [], [], []
    for k in range(len(domain)):
      element = domain[k]
      image = element["image"]
      assert image.dtype == np.float32 and image.shape == (28, 28, 2)
      # The background is never zero, so exactly one channel is lit.
      lit = np.flatnonzero(image.max(axis=(0, 1)) > 0)
      assert len(lit) == 1
      grey = image[..., lit[0]]
      digit = _digit_id(grey)
      np.testing.assert_allclose(
          grey, images[digit, ..., 0] / np.float32(255.0), atol=1e-6
      )
      digits.append(digit)
      binary.append(element["label"])
      colors.append(lit[0])
    # The documented recipe, on the digit labels that were written.
    rng = np.random.default_rng([seed, i + 1])
    expected = (labels[digits] < 5) ^ (
        rng.random(len(digits)) < digit_datasets.COLOR_LABEL_NOISE
    )
    np.testing.assert_array_equal(binary, expected.astype(np.int32))
    np.testing.assert_array_equal(
        colors, expected ^ (rng.random(len(digits)) < env)
    )
    seen += digits
  assert sorted(seen) == list(range(NUM_MNIST))


def _domainnet_arrays(d: int) -> dict[str, tuple[list, np.ndarray]]:
  """Flat-colour photos of assorted sizes; the colour names the photo."""
  rng = np.random.default_rng(d)
  splits = {}
  for split, count in (("train", 3 + d % 2), ("test", 2)):
    photos = []
    for k in range(count):
      colour = (40 * d, 50 * k, 200 if split == "train" else 100)
      shape = (int(rng.integers(5, 30)), int(rng.integers(5, 30)), 3)
      photos.append(np.full(shape, colour, np.uint8))
    labels = rng.integers(0, DOMAINNET_CLASSES, count)
    labels[0] = DOMAINNET_CLASSES - 1  # The largest label survives too.
    splits[split] = (photos, labels)
  return splits


@pytest.fixture(scope="module")
def domainnet_dir(tmp_path_factory):
  """A data_dir with every DomainNet domain prepared, a few photos each."""
  data_dir = tmp_path_factory.mktemp("tfds_domainnet")
  for d, domain in enumerate(photo_datasets.DOMAINNET_DOMAINS):
    _prepare(_TinyDomainnet, data_dir, _domainnet_arrays(d), config=domain)
  return data_dir


def test_domainnet_reads_the_prepared_records(domainnet_dir):
  ds = datasets.get_dataset("DomainNet", data_dir=domainnet_dir)
  assert ds.name == "DomainNet"
  assert ds.domain_names == photo_datasets.DOMAINNET_DOMAINS
  assert ds.num_classes == DOMAINNET_CLASSES
  assert ds.input_shape == (224, 224, 3)
  for d, (name, source) in enumerate(zip(ds.domain_names, ds.domains)):
    version = tfds.builder(
        f"domainnet/{name}", data_dir=str(domainnet_dir), try_gcs=False
    ).version
    assert (domainnet_dir / "domainnet" / name / str(version)).is_dir()
    assert isinstance(source, photo_datasets.TfdsPhotoSource)
    written = {
        tuple(int(c) for c in photo[0, 0]): label
        for photos, labels in _domainnet_arrays(d).values()
        for photo, label in zip(photos, labels)
    }
    assert len(source) == len(written)
    read = {}
    for k in range(len(source)):
      element = source[k]
      image = element["image"]
      assert image.dtype == np.float32 and image.shape == (224, 224, 3)
      assert element["label"].dtype == np.int32
      # A flat photo stays flat; undo the ImageNet normalisation.
      pixel = image[0, 0] * datasets.IMAGENET_STD + datasets.IMAGENET_MEAN
      np.testing.assert_allclose(
          image, np.broadcast_to(image[0, 0], image.shape), atol=1e-5
      )
      colour = tuple(int(c) for c in np.round(pixel * 255.0))
      np.testing.assert_allclose(pixel * 255.0, colour, atol=1e-3)
      read[colour] = int(element["label"])
    assert read == written


def test_a_tfds_dataset_is_known_by_its_versions_and_counts(domainnet_dir):
  dataset = datasets.get_dataset("DomainNet", data_dir=domainnet_dir)
  recorded = datasets.fingerprint(dataset)
  for name, source in zip(dataset.domain_names, dataset.domains):
    version = tfds.builder(f"domainnet/{name}", data_dir=str(domainnet_dir),
                           try_gcs=False).version
    assert recorded["domains"][name] == {
        "examples": len(source), "tfds": f"domainnet/{name}/{version}"}


def test_domainnet_names_only_the_unprepared_domains(tmp_path):
  for d, domain in enumerate(photo_datasets.DOMAINNET_DOMAINS):
    if domain in ("real", "sketch"):
      _prepare(_TinyDomainnet, tmp_path, _domainnet_arrays(d), config=domain)
  assert tfds.builder(
      "domainnet/real", data_dir=str(tmp_path), try_gcs=False
  ).is_prepared()
  with pytest.raises(datasets.DatasetNotFoundError) as info:
    datasets.get_dataset("DomainNet", data_dir=tmp_path)
  message = str(info.value)
  for domain in ("clipart", "infograph", "painting", "quickdraw"):
    assert f"domainnet/{domain}" in message
  assert "domainnet/real" not in message
  assert "domainnet/sketch" not in message


def test_mnist_prepared_under_another_version_is_not_found(tmp_path):
  """Only the registered builder's version directory counts as prepared."""
  images, labels = _mnist_arrays()

  class OtherVersion(_TinyMnist, skip_registration=True):
    name = "mnist"  # tfds names every subclass after itself otherwise.
    VERSION = tfds.core.Version("0.0.1")
    SUPPORTED_VERSIONS = []
    RELEASE_NOTES = {}

  _prepare(OtherVersion, tmp_path, {"train": (images, labels)})
  assert (tmp_path / "mnist" / "0.0.1" / "dataset_info.json").is_file()
  with pytest.raises(datasets.DatasetNotFoundError, match="not prepared"):
    datasets.get_dataset("RotatedMNIST", data_dir=tmp_path)
