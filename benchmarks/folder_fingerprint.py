"""What the check before a folder run costs, with and without its content
digests, per file and for a listing of DomainNet's size.

Before every run (and every resume, and every rerun of a finished one), a
folder dataset is listed (``photo_datasets.list_folder``) and every file is
read once (``photo_datasets.read_files``): its image header, and a digest
of its bytes, which the run's fingerprint holds so that an image changed in
place is told apart. Before the digests, that pass opened each file with
Pillow's lazy ``Image.open`` only, which reads its first kilobytes. This
times the three passes on a generated folder in DomainBed's layout:

* ``listing``: the folders listed and every file's size read;
* ``headers``: each header read, nothing else (the pass before digests);
* ``headers and digests``: each file read whole, its header parsed and its
  bytes hashed (SHA-256), as runs do now.

Every file is a copy of one photo-like JPEG (``--size`` pixels a side) with
its index appended after the image's end, so that every file's bytes differ
and each costs what that photo costs to read and hash. The files are read
from the page cache (just written); from a cold disk each pass also waits
for the disk. The passes run in the thread pool training uses
(``photo_datasets.in_threads``), round-robin over ``--repeats`` rounds;
the median round is reported, per file, and multiplied out to
``--extrapolate_to`` files (586,575: DomainNet's six domains), which assumes
a cost linear in the number of files of this size.

Run ``python -m benchmarks.folder_fingerprint --help`` for the flags.
"""

import argparse
import io
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.input_pipeline import PACS_DOMAINS, synthetic_photo
from experiments.data import photo_datasets

DOMAINNET_FILES = 586_575


def write_folder(root: Path, files: int, size: int) -> int:
  """Writes ``files`` JPEGs under ``root/PACS/<domain>/<class>/``, 100 to a
  class folder; returns one file's size in bytes (they differ by a few)."""
  buffer = io.BytesIO()
  synthetic_photo(np.random.default_rng(0), size).save(buffer, "JPEG",
                                                       quality=90)
  photo = buffer.getvalue()
  per_domain = -(-files // len(PACS_DOMAINS))
  for index in range(files):
    domain, k = divmod(index, per_domain)
    folder = root / "PACS" / PACS_DOMAINS[domain] / f"class{k // 100:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{k % 100}.jpg").write_bytes(photo + str(index).encode())
  return len(photo)


def _header_only(path: Path) -> None:
  with Image.open(path):
    pass


def measure(root: Path, repeats: int) -> dict[str, list[float]]:
  """Seconds of each pass, per round."""
  listing = photo_datasets.list_folder(root / "PACS", PACS_DOMAINS)
  assert not listing.problems, listing.problems
  paths = listing.paths()
  # The thread pool of read_files, for the pass before digests.
  in_threads = photo_datasets.in_threads
  passes = {
      "listing": lambda: photo_datasets.list_folder(root / "PACS",
                                                    PACS_DOMAINS),
      "headers": lambda: in_threads(_header_only, paths),
      "headers and digests": lambda: photo_datasets.read_files(paths),
  }
  seconds = {name: [] for name in passes}
  for _ in range(repeats):
    for name, run in passes.items():
      start = time.perf_counter()
      run()
      seconds[name].append(time.perf_counter() - start)
  return seconds


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--files", type=int, default=40_000,
                      help="Files in the generated folder.")
  parser.add_argument("--size", type=int, default=64,
                      help="Side of the generated JPEG (PACS's: 227).")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--extrapolate_to", type=int, default=DOMAINNET_FILES)
  parser.add_argument("--out", default=None, help="A JSON file for results.")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    file_bytes = write_folder(Path(tmp), args.files, args.size)
    seconds = measure(Path(tmp), args.repeats)
  result = {"files": args.files, "file_bytes": file_bytes,
            "repeats": args.repeats, "seconds": seconds, "per_file_us": {},
            f"extrapolated_s_for_{args.extrapolate_to}_files": {}}
  print(f"{args.files} files of {file_bytes / 1024:.1f} KiB, median of "
        f"{args.repeats} rounds:")
  for name, rounds in seconds.items():
    median = statistics.median(rounds)
    per_file = median / args.files
    result["per_file_us"][name] = per_file * 1e6
    result[f"extrapolated_s_for_{args.extrapolate_to}_files"][name] = (
        per_file * args.extrapolate_to)
    print(f"  {name:20s} {median:7.2f} s  {per_file * 1e6:7.1f} us a file  "
          f"{per_file * args.extrapolate_to:7.1f} s for "
          f"{args.extrapolate_to:,} files")
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
  main()
