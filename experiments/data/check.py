"""Checks a dataset as training does before its first step:
``python -m experiments.data.check --dataset PACS --data_dir ~/data``.

A folder dataset (``catalog.FOLDER_DATASETS``) is listed and its headers
and digests read, as training does first, and then every image is decoded
too (`check_images`); the command prints the images per
domain and class, the damaged files and those whose values training clips
(16-bit grayscale PNGs). Other datasets (arrays, TFDS records, WILDS's
files) are checked by building them, and their examples per domain are
printed. The exit status is 2 when training would refuse the data or the
command line is wrong, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from PIL import ImageFile

from experiments import catalog
from experiments import errors
from experiments.data import datasets
from experiments.data import photo_datasets


def _decode(path: Path) -> tuple[str | None, str | None]:
  """Why ``path`` does not decode to RGB as training decodes it (or None),
  and its image mode if it opens."""
  mode = None
  try:
    with Image.open(path) as image:
      mode = image.mode
      image.convert("RGB")
      return None, mode
  # A damaged file can make a decoder raise more than OSError.
  except Exception as err:  # pylint: disable=broad-exception-caught
    return f"{path} ({err})", mode


def _display_width(text: str) -> int:
  """The columns a terminal gives ``text``: East Asian wide characters take
  2, combining ones none."""
  return sum(0 if unicodedata.combining(c) else
             2 if unicodedata.east_asian_width(c) in "WF" else 1
             for c in text)


def _pad(text: str, width: int, right: bool = False) -> str:
  """``text`` padded with spaces to ``width`` display columns."""
  spaces = " " * (width - _display_width(text))
  return spaces + text if right else text + spaces


@dataclasses.dataclass(frozen=True)
class FolderCheck:
  """What `check_images` found.

  Attributes:
    listing: the folder's listing; its ``problems`` are the folder's.
    unreadable: the files that are not images or do not decode, one
      sentence each.
    truncated: the files that decode only as truncated images, which
      training reads (``ImageFile.LOAD_TRUNCATED_IMAGES``), as DomainBed
      does.
    clipped: the images of more than 8 bits a channel
      (``photo_datasets.CLIPPED_MODES``), to their modes, which training
      reads clipped to 255, as DomainBed does.
    seconds: how long each pass took: ``"listing and reading"`` (what
      every training run does first: ``photo_datasets.read_files``) and
      ``"decoding"``.
  """

  listing: photo_datasets.FolderListing
  unreadable: list[str]
  truncated: list[str]
  clipped: dict[str, str]
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
    widths = [max(_display_width(row[k]) for row in rows)
              for k in range(len(rows[0]))]
    lines += ["  ".join([_pad(row[0], widths[0])] + [
        _pad(cell, width, right=True)
        for cell, width in zip(row[1:], widths[1:])]) for row in rows]
    if self.truncated:
      lines.append(f"{len(self.truncated)} truncated, which training reads "
                   "as DomainBed does (LOAD_TRUNCATED_IMAGES):")
      lines += [f"  {path}" for path in self.truncated]
    if self.clipped:
      one = len(self.clipped) == 1
      modes = sorted(set(self.clipped.values()))
      lines.append(
          f"{len(self.clipped)} image{'' if one else 's'} of more than 8 bits "
          f"(mode{'' if len(modes) == 1 else 's'} {', '.join(modes)}), whose "
          'values above 255 convert("RGB") clips to 255 when training reads '
          f"{'it' if one else 'them'}, as in DomainBed:")
      lines += [f"  {path}" for path in self.clipped]
    problems = self.problems
    one = len(problems) == 1
    lines.append(f"{len(problems)} problem{'' if one else 's'}"
                 + ((", which stops training:" if one
                     else ", which stop training:") if problems else "."))
    lines += [f"  - {problem}" for problem in problems]
    lines.append(
        f"Listing, headers and digests (what training does first): "
        f"{self.seconds['listing and reading']:.2f} s; decoding: "
        f"{self.seconds['decoding']:.2f} s; for {total} images.")
    return "\n".join(lines)


def check_images(root: Path, domains: Sequence[str],
                 progress: bool = False) -> FolderCheck:
  """``photo_datasets.list_folder``, then reads every file as training does
  (``photo_datasets.read_files``), then decodes every image.

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
  listing = photo_datasets.list_folder(root, domains)
  paths = listing.paths()
  headers = [problem for problem, _ in photo_datasets.in_threads(
      photo_datasets.read_file, paths, "reading" if progress else None)]
  listed = time.perf_counter()
  unreadable = [problem for problem in headers if problem is not None]
  readable = [p for p, problem in zip(paths, headers) if problem is None]
  ImageFile.LOAD_TRUNCATED_IMAGES = False
  try:
    decoded = photo_datasets.in_threads(_decode, readable,
                                        "decoding" if progress else None)
  finally:
    ImageFile.LOAD_TRUNCATED_IMAGES = True
  clipped = {str(p): mode for p, (_, mode) in zip(readable, decoded)
             if mode in photo_datasets.CLIPPED_MODES}
  truncated = []
  for path, (problem, _) in zip(readable, decoded):
    if problem is None:
      continue
    problem, _ = _decode(path)
    if problem is None:
      truncated.append(str(path))
    else:
      unreadable.append(f"unreadable: {problem}")
  return FolderCheck(listing, unreadable, truncated, clipped, {
      "listing and reading": listed - start,
      "decoding": time.perf_counter() - listed})


def check(name: str, data_dir: str | None) -> int:
  """Prints what is in the dataset ``name`` under ``data_dir``.

  Returns:
    The exit status: 2 when training would refuse the data, 0 otherwise.

  Raises:
    datasets.DatasetNotFoundError: the dataset's files are missing.
    errors.UsageError: training would refuse the data as they are
      (``datasets.DatasetProblemsError``, say).
  """
  if name not in catalog.FOLDER_DATASETS:
    # Arrays, TFDS records and WILDS's files are checked by building them.
    dataset = datasets.get_dataset(name, data_dir=data_dir)
    print(f"{name}: {dataset.num_classes} classes; examples per domain: "
          + ", ".join(f"{d} {len(s)}" for d, s in zip(dataset.domain_names,
                                                     dataset.domains)))
    return 0
  folder, domains = catalog.FOLDER_DATASETS[name]
  found = check_images(
      photo_datasets.folder_root(name, folder, domains, data_dir), domains,
      progress=True)
  print(found.summary())
  return 2 if found.problems else 0


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m experiments.data.check --dataset NAME --data_dir DIR``.

  Returns:
    The exit status: 0 when training can read the dataset, 2 when it cannot
    (after the problems) or the command line is wrong.
  """
  parser = argparse.ArgumentParser(
      prog="python -m experiments.data.check",
      description="Checks a dataset as training does before its first step, "
      "and decodes every image of a folder dataset.")
  parser.add_argument("--dataset", required=True,
                      choices=list(catalog.DATASETS))
  parser.add_argument("--data_dir", default=None,
                      help="the folder holding the dataset, as for training")
  args = parser.parse_args(argv)
  try:
    return check(args.dataset, args.data_dir)
  except (datasets.DatasetNotFoundError, errors.UsageError) as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
