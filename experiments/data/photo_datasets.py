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
header reads. A class folder's images are read at any depth, symlinked
folders followed, as torchvision's ``ImageFolder`` (DomainBed's reader) reads
them; a symlink loop, which ``ImageFolder`` would walk until the path grew
too long, and a broken symlink are problems. Names starting with ``.``,
``__MACOSX`` (what macOS adds to folders and zip files), ``Thumbs.db`` and
``desktop.ini`` (what Windows adds) are ignored, and so are files beside the
domain folders (OfficeHome's ``ImageInfo.csv``); any other folder beside
them, file beside the class folders (which ``ImageFolder`` would drop) or
file that is not an image by its extension is a problem. All the problems
found are raised together, as one `datasets.DatasetProblemsError`, a usage
error.

That check stays cheap on a big folder: it lists the folders and reads every
file once, in a thread pool (`read_files`), hashing its bytes (the run's
fingerprint holds each class's digest of them, so that an image changed in
place is told apart: `FolderSource.fingerprint`) and parsing its header
from them with Pillow's lazy ``Image.open``; it does not decode. Since
truncated images load (below), a file whose header reads is one training
reads. ``python -m experiments.data.check`` decodes every image as well
(``check.check_images``), which also finds the truncated ones, and names
the images of more than 8 bits a channel that ``convert("RGB")`` clips
(16-bit grayscale PNGs); it prints how long each pass took.

Damaged images are read as DomainBed reads them: truncated images load, with
what their file holds (Pillow's ``ImageFile.LOAD_TRUNCATED_IMAGES``, which
DomainBed's ``datasets.py`` sets at import; so does this module, which every
process decoding a folder's photos imports: Grain's worker processes import
it when they unpickle a `FolderSource`). A file that cannot be decoded during
training (damaged after the check) stops the run with a
`datasets.UnreadableImageError` naming it (exit status 2): skipping it would
change what the batches of a ``(seed, step)`` hold, silently, and the run
would no longer be the one its configuration names. The run resumes from
its last checkpoint once the file is restored.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import os
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
# What macOS (in copies and zip files) and Windows (thumbnails, folder
# settings) add to folders, lower-cased: Windows's names are of any case.
SYSTEM_NAMES = frozenset({"__macosx", "thumbs.db", "desktop.ini"})
# Image modes of more than 8 bits a channel, which Pillow's convert("RGB")
# clips to 255 (16-bit grayscale PNGs open as I;16); 16-bit RGB PNGs open
# as RGB, scaled.
CLIPPED_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N", "F"})

DOMAINNET_DOMAINS = (
    "clipart", "infograph", "painting", "quickdraw", "real", "sketch"
)


class FolderSource(datasets.PhotoSource):
  """A `datasets.PhotoSource` that reads photos from files when indexed."""

  def __init__(self, root: str | Path, files: Sequence[str],
               labels: Sequence[int], sizes: Sequence[int],
               contents: Sequence[str]):
    """Lists the files of one domain.

    Args:
      root: the domain's folder.
      files: one image file per example, relative to ``root``, as
        ``<class>/.../<image>`` with ``/`` separators.
      labels: the class index of each file.
      sizes: the size of each file in bytes, for `fingerprint`.
      contents: a digest of each file's bytes, for `fingerprint`.
    """
    if not len(files) == len(labels) == len(sizes) == len(contents):
      raise ValueError(f"{len(files)} files for {len(labels)} labels, "
                       f"{len(sizes)} sizes and {len(contents)} contents.")
    self.root = Path(root)
    self.files = tuple(files)
    self.labels = np.asarray(labels, np.int32)
    self.sizes = np.asarray(sizes, np.int64)
    # Per class, kept rather than the files' digests, which the worker
    # processes would each be sent.
    by_class = {}
    for name, content in zip(self.files, contents):
      by_class.setdefault(name.split("/", 1)[0], []).append(
          f"{name}\t{content}")
    self._contents = {name: datasets.digest(lines)
                      for name, lines in by_class.items()}

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
          "experiments.data.check` decodes every file). The run "
          "stops rather than train on other images than its steps draw. "
          "Restore the file and rerun the same command to go on from the "
          "run's last checkpoint, if any.") from None

  def label(self, index: int) -> np.int32:
    return self.labels[index]

  def fingerprint(self) -> dict[str, dict[str, int | str]]:
    """Per class folder: its files' number and bytes, and digests of their
    relative paths, of those with their sizes, and of those with their
    bytes' digests (`datasets.fingerprint`).

    The contents tell an image changed in place apart, sizes and names
    unchanged; copied to another disk (other times, the same bytes), the
    data are the same data. Runs recorded before contents were have none,
    and are checked on names and sizes only (`records.fingerprint_changes`).
    """
    by_class = {}
    for name, size in zip(self.files, self.sizes.tolist()):
      by_class.setdefault(name.split("/", 1)[0], []).append((name, size))
    return {
        name: {"files": len(files), "bytes": sum(s for _, s in files),
               "names": datasets.digest(n for n, _ in files),
               "sizes": datasets.digest(f"{n}\t{s}" for n, s in files),
               "contents": self._contents[name]}
        for name, files in sorted(by_class.items())}


def _ignored(name: str) -> bool:
  return name.startswith(".") or name.lower() in SYSTEM_NAMES


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


def _stat_problem(path: Path) -> tuple[int | None, str | None]:
  """``path``'s size, or why it cannot be read: a broken symlink (dangling,
  or a loop of links to files), which torchvision lists and then fails to
  open."""
  try:
    return path.stat().st_size, None
  except OSError as e:
    if path.is_symlink():
      return None, (f"broken symlink: {path} -> {os.readlink(path)} "
                    f"({e.strerror})")
    return None, f"unreadable: {path} ({e.strerror})"


def _walk_class(folder: Path, class_name: str, others: list[Path],
                problems: list[str]) -> list[tuple[str, int]]:
  """A class folder's images, at any depth, with their sizes, as
  torchvision's ``ImageFolder`` finds them: symlinked folders are followed
  (``make_dataset``'s ``os.walk(followlinks=True)``). Its other files go to
  ``others``; a symlink loop, a broken symlink or a folder that cannot be
  listed, to ``problems``."""
  found = []
  # The real folders from the class folder down to each folder walked: a
  # link to one of them or to a folder above them is a loop, which
  # ImageFolder would walk until the path were too long.
  above = {str(folder): (os.path.realpath(folder),)}

  def unlisted(error: OSError) -> None:
    problems.append(f"cannot list folder {error.filename} ({error.strerror})")

  for parent, dirs, names in os.walk(folder, onerror=unlisted,
                                     followlinks=True):
    chain = above.pop(parent)
    kept = []
    for name in sorted(d for d in dirs if not _ignored(d)):
      path = os.path.join(parent, name)
      real = os.path.realpath(path)
      if any(os.path.commonpath([real, r]) == real for r in chain):
        problems.append(f"symlink loop: {path} leads back to {real}, a "
                        "folder above it")
      else:
        above[path] = (*chain, real)
        kept.append(name)
    dirs[:] = kept
    relative = Path(parent).relative_to(folder).as_posix()
    prefix = class_name if relative == "." else f"{class_name}/{relative}"
    for name in sorted(names):
      if _ignored(name):
        continue
      path = Path(parent, name)
      size, problem = _stat_problem(path)
      if problem is not None:
        problems.append(problem)
      elif _is_image(name):
        found.append((f"{prefix}/{name}", size))
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
  problems, others, beside = [], [], []
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
        by_class[entry.name] = _walk_class(entry, entry.name, others,
                                           problems)
      elif (problem := _stat_problem(entry)[1]) is not None:
        problems.append(problem)
      else:
        beside.append(entry)
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
  problems.extend(f"a file beside the class folders, which ImageFolder does "
                  f"not read: {path}" for path in beside)
  problems.extend(f"not an image (by its extension): {path}"
                  for path in others)
  return FolderListing(root, present, classes, images, problems)


def _header_problem(path: Path, data: bytes) -> str | None:
  """Why the image header of ``path``, whose bytes are ``data``, does not
  read, or None when it does."""
  try:
    with Image.open(io.BytesIO(data)):
      return None
  except Image.UnidentifiedImageError:
    return f"not an image: {path}"
  # A damaged file can make a decoder raise more than OSError.
  except Exception as err:  # pylint: disable=broad-exception-caught
    return f"unreadable: {path} ({err})"


def in_threads(function: Callable[[Path], Any], paths: Sequence[Path],
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


def read_file(path: Path) -> tuple[str | None, str]:
  """Why ``path``'s image header does not read (or None), and a digest of
  its bytes (the first 16 hex digits of their SHA-256): one read of the
  file for both."""
  try:
    data = path.read_bytes()
  except OSError as e:
    return f"unreadable: {path} ({e.strerror})", ""
  return (_header_problem(path, data),
          hashlib.sha256(data).hexdigest()[:16])


def read_files(paths: Sequence[Path]) -> tuple[list[str], list[str]]:
  """The files among ``paths`` whose header does not read, one sentence
  each, in order, and every file's digest (`read_file`); in threads, where
  reading and hashing release the GIL."""
  found = in_threads(read_file, paths)
  return ([problem for problem, _ in found if problem is not None],
          [content for _, content in found])


def folder_root(name: str, folder: str, domains: Sequence[str],
                data_dir: str | Path | None) -> Path:
  """The dataset's folder under ``data_dir``.

  Raises:
    datasets.DatasetNotFoundError: it does not exist.
  """
  root = Path(datasets.DEFAULT_FOLDER_DATA_DIR if data_dir is None
              else data_dir) / folder
  if not root.is_dir():
    given = root.parent
    # The dataset's folder itself given: by its name, or by its domains.
    itself = given.name == folder or any((given / d).is_dir()
                                          for d in domains)
    raise datasets.DatasetNotFoundError(
        f"{name} not found: {root} is not a directory. " + (
            f"{given} is {name}'s folder itself: give the folder that holds "
            f"{folder}, --data_dir {given.parent}." if itself else
            f"Download it with DomainBed's script (python -m "
            f"domainbed.scripts.download --data_dir <data_dir>), or put it "
            f"there as {folder}/<domain>/<class>/<image>, the domains being "
            f"{', '.join(domains)}."))
  return root


def problems_message(name: str, root: Path, problems: Sequence[str]) -> str:
  """The message of a folder's `datasets.DatasetProblemsError`."""
  return (f"{name} in {root} has {len(problems)} problem"
          f"{'s' if len(problems) > 1 else ''}; fix "
          f"{'them' if len(problems) > 1 else 'it'} and run again:\n"
          + "".join(f"  - {p}\n" for p in problems)
          + f"Hidden entries (.*), __MACOSX, Thumbs.db and desktop.ini are "
          f"ignored. `python -m "
          f"experiments.data.check --dataset {name} --data_dir "
          f"{root.parent}` also decodes every image and counts them.")


def image_folder_dataset(
    *, name: str, folder: str, domains: Sequence[str],
    data_dir: str | Path | None = None, seed: int = 0
) -> datasets.MultiDomainDataset:
  """Reads ``<data_dir>/<folder>/<domain>/<class>/<image>`` folders.

  The domains are the catalog's, in its order; the classes are the sorted
  class folders, which every domain must have. The folder is checked first
  (`list_folder`, and every image's header, read with its bytes' digest:
  `read_files`); images are decoded only when indexed.

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
  paths = listing.paths()
  unreadable, contents = read_files(paths)
  problems = listing.problems + unreadable
  if problems:
    raise datasets.DatasetProblemsError(
        problems_message(name, root, problems))
  content = dict(zip(paths, contents))
  sources = tuple(
      FolderSource(
          root / domain,
          [f for c in listing.classes for f, _ in listing.images[domain][c]],
          [k for k, c in enumerate(listing.classes)
           for _ in listing.images[domain][c]],
          [s for c in listing.classes for _, s in listing.images[domain][c]],
          [content[root / domain / f] for c in listing.classes
           for f, _ in listing.images[domain][c]])
      for domain in domains)
  return datasets.MultiDomainDataset(
      name=name,
      domain_names=tuple(domains),
      domains=sources,
      num_classes=len(listing.classes),
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
