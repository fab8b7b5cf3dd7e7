"""DomainBed's photo datasets: image folders and DomainNet.

``PACS``, ``VLCS``, ``OfficeHome`` and ``TerraIncognita`` are read from the
image folders DomainBed's download script writes (`image_folder_dataset`;
``catalog.FOLDER_DATASETS`` names each one's folder and domains), and
``DomainNet`` from TFDS ``domainnet/<domain>`` prepared beforehand
(``experiments.data.tfds_sources``). Photos are decoded when indexed
(`datasets.PhotoSource`).

A folder is checked whenever it is built, so before any training step
(`list_folder`): every domain the catalog names is there; every domain has
the same class folders, each with at least one image; and every image's
header reads. Names starting with ``.`` and ``__MACOSX`` (what macOS adds to
folders and zip files) are ignored, and so are files beside the domain
folders (OfficeHome's ``ImageInfo.csv``); any other folder, or any file
that is not an image by its extension, is a problem. All the problems found
are raised together, as one `datasets.DatasetProblemsError`, a usage error.

That check stays cheap on a big folder: it lists the folders and opens every
file with Pillow's lazy ``Image.open``, which reads its header only, in a
thread pool; it does not decode. Since truncated images load (below), a
file whose header reads is one training reads. ``python -m
experiments.data.datasets check`` decodes every image as well (`check_images`),
which also finds the truncated ones; it prints how long each pass took.

Damaged images are read as DomainBed reads them: truncated images load, with
what their file holds (Pillow's ``ImageFile.LOAD_TRUNCATED_IMAGES``, which
DomainBed's ``datasets.py`` sets at import; so does this module, which every
process decoding a folder's photos imports: Grain's worker processes import
it when they unpickle a `FolderSource`). A file that cannot be decoded during
training (damaged after the check) stops the run with a
`datasets.UnreadableImageError` naming it, a usage error: skipping it would
change what the batches of a ``(seed, step)`` hold, silently, and the run
would no longer be the one its configuration names. The run resumes from
its last checkpoint once the file is restored.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tqdm
from PIL import Image
from PIL import ImageFile

from experiments.data import datasets
from experiments.data import tfds_sources

# DomainBed's setting (domainbed/datasets.py at 05a8cc0, line 17).
ImageFile.LOAD_TRUNCATED_IMAGES = True

# torchvision's IMG_EXTENSIONS (torchvision/datasets/folder.py), the files
# DomainBed's ImageFolder reads.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm",
                              ".tif", ".tiff", ".webp"})
# Folders macOS adds when it copies or zips a folder.
SYSTEM_FOLDERS = frozenset({"__MACOSX"})

DOMAINNET_DOMAINS = (
    "clipart", "infograph", "painting", "quickdraw", "real", "sketch"
)


class FolderSource(datasets.PhotoSource):
  """A `datasets.PhotoSource` that reads photos from files when indexed."""

  def __init__(self, root: str | Path, files: Sequence[str],
               labels: Sequence[int], sizes: Sequence[int]):
    """Lists the files of one domain.

    Args:
      root: the domain's folder.
      files: one image file per example, relative to ``root``, as
        ``<class>/.../<image>`` with ``/`` separators.
      labels: the class index of each file.
      sizes: the size of each file in bytes, for `fingerprint`.
    """
    if not len(files) == len(labels) == len(sizes):
      raise ValueError(f"{len(files)} files for {len(labels)} labels and "
                       f"{len(sizes)} sizes.")
    self.root = Path(root)
    self.files = tuple(files)
    self.labels = np.asarray(labels, np.int32)
    self.sizes = np.asarray(sizes, np.int64)

  @property
  def paths(self) -> tuple[Path, ...]:
    """Every example's file."""
    return tuple(self.root / f for f in self.files)

  def __len__(self) -> int:
    return len(self.files)

  def read(self, index: int) -> Image.Image:
    path = self.root / self.files[index]
    try:
      with Image.open(path) as image:
        image.load()
        return image
    # A damaged file can make a decoder raise more than OSError.
    except Exception as err:  # pylint: disable=broad-exception-caught
      raise datasets.UnreadableImageError(
          f"Cannot read image {path} ({err}). The check before the run read "
          "its header, so it changed since or is damaged past it (`python -m "
          "experiments.data.datasets check` decodes every file). The run "
          "stops rather than train on other images than its steps draw. "
          "Restore the file and rerun the same command to go on from the "
          "run's last checkpoint, if any.") from None

  def label(self, index: int) -> np.int32:
    return self.labels[index]

  def fingerprint(self) -> dict[str, dict[str, int | str]]:
    """Per class folder: its files' number and bytes, and digests of their
    relative paths and of those with their sizes
    (`datasets.fingerprint`)."""
    by_class = {}
    for name, size in zip(self.files, self.sizes.tolist()):
      by_class.setdefault(name.split("/", 1)[0], []).append((name, size))
    return {
        name: {"files": len(files), "bytes": sum(s for _, s in files),
               "names": datasets.digest(n for n, _ in files),
               "sizes": datasets.digest(f"{n}\t{s}" for n, s in files)}
        for name, files in sorted(by_class.items())}


def _ignored(name: str) -> bool:
  return name.startswith(".") or name in SYSTEM_FOLDERS


def _is_image(name: str) -> bool:
  return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


@dataclasses.dataclass(frozen=True)
class FolderListing:
  """A folder dataset's files, as `list_folder` finds them.

  Attributes:
    root: the dataset's folder.
    domains: the domains found, in the catalog's order.
    classes: every class folder with images in any domain, sorted.
    images: per domain, per class, the image files (relative to the
      domain's folder, ``/``-separated) and their sizes, sorted.
    problems: what is wrong, one sentence each.
  """

  root: Path
  domains: tuple[str, ...]
  classes: tuple[str, ...]
  images: Mapping[str, Mapping[str, list[tuple[str, int]]]]
  problems: list[str]

  def paths(self) -> list[Path]:
    """Every image file, domain by domain, class by class."""
    return [self.root / d / name for d in self.domains
            for files in self.images[d].values() for name, _ in files]


def _walk_class(folder: Path, class_name: str,
                others: list[Path]) -> list[tuple[str, int]]:
  """A class folder's images, at any depth, with their sizes; its other
  files go to ``others``."""
  found = []
  for parent, dirs, names in os.walk(folder):
    dirs[:] = sorted(d for d in dirs if not _ignored(d))
    relative = Path(parent).relative_to(folder).as_posix()
    prefix = class_name if relative == "." else f"{class_name}/{relative}"
    for name in sorted(names):
      if _ignored(name):
        continue
      path = Path(parent, name)
      if _is_image(name):
        found.append((f"{prefix}/{name}", path.stat().st_size))
      else:
        others.append(path)
  return sorted(found)


def list_folder(root: Path, domains: Sequence[str]) -> FolderListing:
  """Lists ``<root>/<domain>/<class>/<image>`` and what is wrong with it.

  Reads the directories and the files' sizes, not the files.

  Args:
    root: the dataset's folder; it exists.
    domains: the domain folders it must have.

  Returns:
    The listing; its ``problems`` say what is missing or unexpected.
  """
  problems, others = [], []
  entries = {p.name: p for p in root.iterdir() if not _ignored(p.name)}
  missing = [d for d in domains if d not in entries or not entries[d].is_dir()]
  if missing:
    problems.append(
        f"domain folder{'s' if len(missing) > 1 else ''} missing: "
        f"{', '.join(str(root / d) for d in missing)} (the domains are "
        f"{', '.join(domains)})")
  extra = sorted(n for n, p in entries.items()
                 if p.is_dir() and n not in domains)
  if extra:
    problems.append(
        f"unexpected folder{'s' if len(extra) > 1 else ''}, not a domain: "
        f"{', '.join(str(root / n) for n in extra)} (the domains are "
        f"{', '.join(domains)})")
  present = tuple(d for d in domains if d not in missing)
  images = {}
  for domain in present:
    by_class = {}
    for entry in sorted((root / domain).iterdir()):
      if _ignored(entry.name):
        continue
      if entry.is_dir():
        by_class[entry.name] = _walk_class(entry, entry.name, others)
      else:
        others.append(entry)
    images[domain] = by_class
  # The classes are the class folders with images, in any domain.
  classes = tuple(sorted({name for by_class in images.values()
                          for name, files in by_class.items() if files}))
  for domain in present:
    for name, files in images[domain].items():
      if not files:
        problems.append(f"class folder {root / domain / name} has no images")
    problems.extend(f"{root / domain} has no class folder {name!r}, which "
                    "other domains have" for name in classes
                    if name not in images[domain])
  if present and not classes:
    problems.append(f"the domain folders of {root} hold no class folders")
  problems.extend(f"not an image (by its extension): {path}"
                  for path in others)
  return FolderListing(root, present, classes, images, problems)


def _header_problem(path: Path) -> str | None:
  """Why ``path``'s image header does not read, or None when it does."""
  try:
    with Image.open(path):
      return None
  except Image.UnidentifiedImageError:
    return f"not an image: {path}"
  # A damaged file can make a decoder raise more than OSError.
  except Exception as err:  # pylint: disable=broad-exception-caught
    return f"unreadable: {path} ({err})"


def _in_threads(function: Callable[[Path], Any], paths: Sequence[Path],
                progress: str | None = None) -> list[Any]:
  """``[function(p) for p in paths]``, in a thread pool; with a progress
  bar labelled ``progress`` if given."""
  with concurrent.futures.ThreadPoolExecutor() as pool, tqdm.tqdm(
      total=len(paths), desc=progress, unit="file", disable=progress is None,
      dynamic_ncols=True) as bar:
    results = []
    for result in pool.map(function, paths):
      results.append(result)
      bar.update()
    return results


def header_problems(paths: Sequence[Path]) -> list[str]:
  """The files among ``paths`` whose header does not read, one sentence
  each, in order; Pillow's lazy ``Image.open`` reads the headers, in
  threads."""
  return [p for p in _in_threads(_header_problem, paths) if p is not None]


def folder_root(name: str, folder: str, domains: Sequence[str],
                data_dir: str | Path | None) -> Path:
  """The dataset's folder under ``data_dir``.

  Raises:
    datasets.DatasetNotFoundError: it does not exist.
  """
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
  return root


def problems_message(name: str, root: Path, problems: Sequence[str]) -> str:
  """The message of a folder's `datasets.DatasetProblemsError`."""
  return (f"{name} in {root} has {len(problems)} problem"
          f"{'s' if len(problems) > 1 else ''}; fix "
          f"{'them' if len(problems) > 1 else 'it'} and run again:\n"
          + "".join(f"  - {p}\n" for p in problems)
          + f"Hidden entries (.*) and __MACOSX are ignored. `python -m "
          f"experiments.data.datasets check --dataset {name} --data_dir "
          f"{root.parent}` also decodes every image and counts them.")


def image_folder_dataset(
    *, name: str, folder: str, domains: Sequence[str],
    data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """Reads ``<data_dir>/<folder>/<domain>/<class>/<image>`` folders.

  The domains are the catalog's, in its order; the classes are the sorted
  class folders, which every domain must have. The folder is checked first
  (`list_folder`, and every image's header); images are decoded only when
  indexed.

  Args:
    name: the dataset's name.
    folder: the dataset's folder under ``data_dir``.
    domains: the domain folders DomainBed's download script writes.
    data_dir: the folder holding ``folder``; ``None`` means ``./data``.
    seed: unused; the domains are real.

  Returns:
    The dataset, with photos transformed by `datasets.photo_to_array`.

  Raises:
    datasets.DatasetNotFoundError: the dataset's folder does not exist.
    datasets.DatasetProblemsError: the folder has problems; the message
      lists them all.
  """
  del seed
  root = folder_root(name, folder, domains, data_dir)
  listing = list_folder(root, domains)
  problems = listing.problems + header_problems(listing.paths())
  if problems:
    raise datasets.DatasetProblemsError(
        problems_message(name, root, problems))
  sources = tuple(
      FolderSource(
          root / domain,
          [f for c in listing.classes for f, _ in listing.images[domain][c]],
          [k for k, c in enumerate(listing.classes)
           for _ in listing.images[domain][c]],
          [s for c in listing.classes for _, s in listing.images[domain][c]])
      for domain in domains)
  return datasets.MultiDomainDataset(
      name=name,
      domain_names=tuple(domains),
      domains=sources,
      num_classes=len(listing.classes),
      input_shape=(datasets.PHOTO_SIZE, datasets.PHOTO_SIZE, 3),
  )


def _decode_problem(path: Path) -> str | None:
  """Why ``path`` does not decode to RGB as training decodes it, or None."""
  try:
    with Image.open(path) as image:
      image.convert("RGB")
      return None
  # A damaged file can make a decoder raise more than OSError.
  except Exception as err:  # pylint: disable=broad-exception-caught
    return f"{path} ({err})"


@dataclasses.dataclass(frozen=True)
class FolderCheck:
  """What `check_images` found.

  Attributes:
    listing: the folder's listing; its ``problems`` are the folder's.
    unreadable: the files that are not images or do not decode, one
      sentence each.
    truncated: the files that decode only as truncated images, which
      training reads (`ImageFile.LOAD_TRUNCATED_IMAGES`), as DomainBed does.
    seconds: how long each pass took: ``"listing and headers"`` (what
      every training run does first) and ``"decoding"``.
  """

  listing: FolderListing
  unreadable: list[str]
  truncated: list[str]
  seconds: dict[str, float]

  @property
  def problems(self) -> list[str]:
    """What stops training on the folder: everything but truncation."""
    return self.listing.problems + self.unreadable

  def summary(self) -> str:
    """Images per class and domain, the truncated files, the problems and
    the passes' times, as lines of text."""
    listing = self.listing
    counts = [[len(listing.images[d].get(c, ())) for d in listing.domains]
              for c in listing.classes]
    total = sum(map(sum, counts))
    lines = [f"{listing.root}: {len(listing.domains)} domains, "
             f"{len(listing.classes)} classes, {total} image files."]
    rows = [["class", *listing.domains]]
    rows += [[c, *map(str, row)] for c, row in zip(listing.classes, counts)]
    rows.append(["all", *map(str, np.sum(counts, 0, dtype=int).tolist()
                              if counts else [0] * len(listing.domains))])
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines += ["  ".join([row[0].ljust(widths[0])] + [
        cell.rjust(width) for cell, width in zip(row[1:], widths[1:])])
              for row in rows]
    if self.truncated:
      lines.append(f"{len(self.truncated)} truncated, which training reads "
                   "as DomainBed does (LOAD_TRUNCATED_IMAGES):")
      lines += [f"  {path}" for path in self.truncated]
    problems = self.problems
    lines.append(f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
                 + (", which stop training:" if problems else "."))
    lines += [f"  - {problem}" for problem in problems]
    lines.append(
        f"Listing and headers (what training does first): "
        f"{self.seconds['listing and headers']:.2f} s; decoding: "
        f"{self.seconds['decoding']:.2f} s; for {total} images.")
    return "\n".join(lines)


def check_images(root: Path, domains: Sequence[str],
                 progress: bool = False) -> FolderCheck:
  """`list_folder`, then reads every header, then decodes every image.

  Each image is decoded twice at most: strictly, then, if that fails, as
  training decodes it, with ``ImageFile.LOAD_TRUNCATED_IMAGES``; an image
  that decodes only so is truncated. The setting is the process's, so this
  must not run beside training in one process.

  Args:
    root: the dataset's folder; it exists.
    domains: the domain folders it must have.
    progress: show progress bars.

  Returns:
    What was found.
  """
  start = time.perf_counter()
  listing = list_folder(root, domains)
  paths = listing.paths()
  headers = _in_threads(_header_problem, paths,
                        "headers" if progress else None)
  listed = time.perf_counter()
  unreadable = [problem for problem in headers if problem is not None]
  readable = [p for p, problem in zip(paths, headers) if problem is None]
  ImageFile.LOAD_TRUNCATED_IMAGES = False
  try:
    failed = [p for p, problem in zip(readable, _in_threads(
        _decode_problem, readable, "decoding" if progress else None))
              if problem is not None]
  finally:
    ImageFile.LOAD_TRUNCATED_IMAGES = True
  truncated = []
  for path in failed:
    problem = _decode_problem(path)
    if problem is None:
      truncated.append(str(path))
    else:
      unreadable.append(f"unreadable: {problem}")
  return FolderCheck(listing, unreadable, truncated, {
      "listing and headers": listed - start,
      "decoding": time.perf_counter() - listed})


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

  def fingerprint(self) -> dict[str, int | str]:
    """The number of examples and the TFDS dataset's name and version
    (`datasets.fingerprint`): a prepared TFDS dataset does not change."""
    info = self.source.dataset_info
    return {"examples": len(self), "tfds": f"{info.full_name}"}


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
