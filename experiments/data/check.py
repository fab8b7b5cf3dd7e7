"""Checks a dataset as training does before its first step:
``python -m experiments.data.check --dataset PACS --data_dir ~/data``.

A folder dataset (``catalog.FOLDER_DATASETS``) is listed and its headers
and digests read, as training does first, and then every image is decoded
too (``photo_datasets.check_images``); the command prints the images per
domain and class, the damaged files and those whose values training clips
(16-bit grayscale PNGs). Other datasets (arrays, TFDS records, WILDS's
files) are checked by building them, and their examples per domain are
printed. The exit status is 2 when training would refuse the data or the
command line is wrong, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from experiments import catalog
from experiments import errors
from experiments.data import datasets
from experiments.data import photo_datasets


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
  found = photo_datasets.check_images(
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
