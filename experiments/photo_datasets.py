"""DomainBed's photo datasets: image folders and DomainNet.

``PACS``, ``VLCS``, ``OfficeHome`` and ``TerraIncognita`` are read from the
image folders DomainBed's download script writes (`image_folder_dataset`;
``catalog.FOLDER_DATASETS`` names each one's folder and domains), and
``DomainNet`` from TFDS ``domainnet/<domain>`` prepared beforehand
(``experiments.tfds_sources``). Photos are decoded when indexed
(`datasets.PhotoSource`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from experiments import datasets
from experiments import tfds_sources

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png"})

DOMAINNET_DOMAINS = (
    "clipart", "infograph", "painting", "quickdraw", "real", "sketch"
)


class FolderSource(datasets.PhotoSource):
  """A `datasets.PhotoSource` that reads photos from files when indexed."""

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


def _list_images(folder: Path) -> list[Path]:
  return sorted(
      p for p in folder.rglob("*")
      if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
  )


def image_folder_dataset(
    *, name: str, folder: str, domains: Sequence[str],
    data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
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
    The dataset, with photos transformed by `datasets.photo_to_array`.

  Raises:
    datasets.DatasetNotFoundError: the dataset's folder does not exist.
    ValueError: a domain has no images, or lacks a class.
  """
  del seed
  root = Path(datasets.DEFAULT_FOLDER_DATA_DIR if data_dir is None
              else data_dir) / folder
  if not root.is_dir():
    raise datasets.DatasetNotFoundError(
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
  return datasets.MultiDomainDataset(
      name=name,
      domain_names=tuple(d.name for d in domain_dirs),
      domains=domains,
      num_classes=len(classes),
      input_shape=(datasets.PHOTO_SIZE, datasets.PHOTO_SIZE, 3),
  )


class TfdsPhotoSource(datasets.PhotoSource):
  """A `datasets.PhotoSource` over a tfds data source of ``image``/``label``
  records."""

  def __init__(self, source: Sequence[Mapping[str, Any]]):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def read(self, index: int) -> Image.Image:
    return Image.fromarray(self.source[index]["image"])

  def label(self, index: int) -> np.int32:
    return np.int32(self.source[index]["label"])


def domainnet(
    *, data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """DomainNet from TFDS ``domainnet/<domain>``: 6 domains, 345 classes."""
  del seed  # Real domains; nothing to randomise.
  sources = tfds_sources.prepared_sources(
      "DomainNet", [f"domainnet/{d}" for d in DOMAINNET_DOMAINS], data_dir
  )
  domains = tuple(TfdsPhotoSource(s) for s in sources)
  return datasets.MultiDomainDataset(
      name="DomainNet",
      domain_names=DOMAINNET_DOMAINS,
      domains=domains,
      num_classes=345,
      input_shape=(datasets.PHOTO_SIZE, datasets.PHOTO_SIZE, 3),
  )
