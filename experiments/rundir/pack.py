"""A sweep's finished runs packed into one file, and read back.

The pack and what each of its lines holds are described in
`experiments.rundir` (its "Packed runs").
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.rundir import records

# A sweep's packed runs (`pack_runs`), beside their directories.
PACK_FILE = "runs.jsonl.gz"

Record = records.Record


@dataclasses.dataclass(frozen=True)
class SweepRecords:
  """The runs found under a directory, by `load_runs`.

  Attributes:
    runs: every run with records, directory or packed, to its records, in
      path order.
    skipped: every run directory whose records are damaged, to why.
    trajectories: every packed run's ``trajectory`` (`PackedRun`), by its
      path.
  """

  runs: dict[Path, list[Record]]
  skipped: dict[Path, str]
  trajectories: dict[Path, dict[str, Any]]

  @property
  def records(self) -> list[Record]:
    """Every run's records, run after run."""
    return [record for run in self.runs.values() for record in run]


def load_runs(input_dir: str | Path) -> SweepRecords:
  """Reads and checks (`records.read_run`) every run below a directory, at
  any depth, and every packed run (`read_pack`).

  A run is a directory holding a results file, or a run of a ``PACK_FILE``
  whose directory holds none (`packed_run`). An unfinished run's records
  are read as far as they go; a run without any is left out.

  Args:
    input_dir: the directory, typically a sweep's output directory.

  Returns:
    The runs and the damaged runs skipped.
  """
  runs, skipped, trajectories = {}, {}, {}
  for path in sorted(Path(input_dir).rglob(records.RESULTS_FILE)):
    try:
      found = records.read_run(path.parent).records
    except records.DamagedRunError as e:
      skipped[path.parent] = str(e)
      continue
    if found:
      runs[path.parent] = found
  for pack in sorted(Path(input_dir).rglob(PACK_FILE)):
    for name, packed in read_pack(pack.parent).items():
      run_dir = pack.parent / name
      if not (run_dir / records.RESULTS_FILE).exists():
        runs[run_dir] = packed.records
        if packed.trajectory is not None:
          trajectories[run_dir] = packed.trajectory
  return SweepRecords(dict(sorted(runs.items())), skipped, trajectories)


@dataclasses.dataclass(frozen=True)
class PackedRun:
  """A finished run as its sweep's ``PACK_FILE`` holds it.

  Attributes:
    config: its config.json.
    records: its records.
    trajectory: what the claims read of its params snapshots
      (`experiments.analysis.claims.ProjectedPath`); None where it saved
      none.
    environment: its `records.ENVIRONMENT_FILE`'s entries; None for a run from
      before runs recorded them.
  """

  config: dict[str, Any]
  records: list[Record]
  trajectory: dict[str, Any] | None = None
  environment: list[Any] | None = None


def finished_run_dirs(sweep_dir: str | Path) -> list[Path]:
  """The directories right under ``sweep_dir`` of finished runs
  (`records.is_done`), in name order."""
  sweep_dir = Path(sweep_dir)
  if not sweep_dir.is_dir():
    return []
  return sorted(path for path in sweep_dir.iterdir() if records.is_done(path))


@functools.lru_cache(maxsize=4)
def _read_pack_file(path: Path, stamp: tuple[int, int]
                    ) -> dict[str, PackedRun]:
  """The runs of a ``PACK_FILE``; cached while its ``stamp`` (modification
  time and size) holds, since a sweep's every run looks itself up."""
  del stamp  # The cache's key only.
  packed = {}
  with gzip.open(path, "rt", encoding="utf-8") as lines:
    for line in lines:
      run = json.loads(line)
      packed[run["run"]] = PackedRun(run["config"], run["records"],
                                     run.get("trajectory"),
                                     run.get("environment"))
  return packed


def read_pack(sweep_dir: str | Path) -> dict[str, PackedRun]:
  """The runs packed in ``sweep_dir`` (`pack_runs`), by directory name; none
  without a ``PACK_FILE``. The result is shared: do not change it."""
  path = Path(sweep_dir) / PACK_FILE
  try:
    stat = path.stat()
  except FileNotFoundError:
    return {}
  return _read_pack_file(path.resolve(), (stat.st_mtime_ns, stat.st_size))


def packed_run(run_dir: str | Path) -> PackedRun | None:
  """The run as its sweep's pack holds it, where its directory holds no
  results file (a directory that does is the run); otherwise None."""
  run_dir = Path(run_dir)
  if (run_dir / records.RESULTS_FILE).exists():
    return None
  return read_pack(run_dir.parent).get(run_dir.name)


def finished_records(run_dir: str | Path) -> list[Record] | None:
  """The records of a finished run, packed (`packed_run`) or in its
  directory (`records.is_done`, checked by `records.read_run`); None for a
  run not finished."""
  packed = packed_run(run_dir)
  if packed is not None:
    return packed.records
  if not records.is_done(run_dir):
    return None
  return records.read_run(run_dir).records


def run_environment(run_dir: str | Path) -> list[Any] | None:
  """Where the run trained (`records.ENVIRONMENT_FILE`'s entries), packed
  (`packed_run`) or in its directory; None for a run without them."""
  packed = packed_run(run_dir)
  if packed is not None:
    return packed.environment
  return records.read_environment(run_dir)


def pack_runs(sweep_dir: str | Path,
              trajectories: Mapping[str, Mapping[str, Any]]
              ) -> tuple[list[str], dict[Path, str]]:
  """Writes the finished runs of ``sweep_dir`` to its ``PACK_FILE``, whole.

  The runs are those already packed and every finished run directory
  right under ``sweep_dir`` (`finished_run_dirs`), a directory replacing a
  packed run of its name; each with its config, its records and, where it
  has one, its `records.ENVIRONMENT_FILE`. The file is the same, byte for
  byte, for the same runs: lines in name order, gzip without a time stamp or
  file name.

  Args:
    sweep_dir: the sweep's directory.
    trajectories: by run name, what the claims read of a run directory's
      params snapshots (`experiments.analysis.claims.ProjectedPath`); a
      packed run that no directory replaces keeps its own.

  Returns:
    The names of the runs packed, and the finished run directories left
    out, to why: their records are damaged or they have no config.json.
  """
  sweep_dir = Path(sweep_dir)
  runs = {name: {"config": packed.config, "records": packed.records,
                 "trajectory": packed.trajectory,
                 "environment": packed.environment}
          for name, packed in read_pack(sweep_dir).items()}
  skipped = {}
  for run_dir in finished_run_dirs(sweep_dir):
    config = run_dir / records.CONFIG_FILE
    if not config.exists():
      skipped[run_dir] = f"it has no {records.CONFIG_FILE}"
      continue
    try:
      found = records.read_run(run_dir).records
    except records.DamagedRunError as e:
      skipped[run_dir] = str(e)
      continue
    runs[run_dir.name] = {"config": json.loads(config.read_text()),
                          "records": found,
                          "trajectory": trajectories.get(run_dir.name),
                          "environment": records.read_environment(run_dir)}
  lines = []
  for name, run in sorted(runs.items()):
    line = {"run": name, "config": run["config"]}
    # Only where the run has one: a run without keeps the line it had
    # before runs recorded where they trained, byte for byte.
    if run["environment"] is not None:
      line["environment"] = run["environment"]
    line["records"] = run["records"]
    if run["trajectory"] is not None:
      line["trajectory"] = run["trajectory"]
    lines.append(json.dumps(line) + "\n")
  # GzipFile's header is the same on every Python (gzip.compress's names
  # the operating system on some).
  compressed = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", compresslevel=9,
                     fileobj=compressed, mtime=0) as f:
    f.write("".join(lines).encode())
  records.write_whole(sweep_dir / PACK_FILE, compressed.getvalue())
  return sorted(runs), skipped
