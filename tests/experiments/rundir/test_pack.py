"""Tests for experiments/rundir/pack.py: a sweep's finished runs packed
into one file, the same bytes for the same runs, and read back as their
directories read."""

import gzip
import json
import shutil

from experiments.rundir import pack
from experiments.rundir import records
from test_records import MACHINE, STEPS, lines, make_run, results


def test_load_runs_skips_damaged_runs_and_says_why(tmp_path):
  good = make_run(tmp_path / "sweep" / "b")
  damaged = make_run(tmp_path / "sweep" / "a" / "nested")
  results(damaged).write_text("".join(reversed(lines(damaged))))
  empty = tmp_path / "sweep" / "c"  # Killed before its first record.
  empty.mkdir()
  results(empty).write_text('{"step"')
  found = pack.load_runs(tmp_path / "sweep")
  assert list(found.runs) == [good]
  assert [r["step"] for r in found.records] == list(STEPS)
  assert list(found.skipped) == [damaged]
  assert "is of step 4, after step 6" in found.skipped[damaged]


def make_finished(sweep_dir, name, steps=STEPS, acc=0.5):
  """A finished run as a study commits it: config, records and done."""
  run_dir = make_run(sweep_dir / name, steps=steps, checkpoints=None)
  lines = [{"step": s, "env0_in_acc": acc, "loss": 1 / 3 + s}
           for s in steps]
  results(run_dir).write_text("".join(json.dumps(r) + "\n" for r in lines))
  records.write_config(run_dir, {"args": {"name": name}, "hparams": {}})
  return run_dir


def test_a_pack_holds_every_finished_run_exactly_and_the_same_bytes(
    tmp_path):
  sweep = tmp_path / "sweep"
  b = make_finished(sweep, "b", acc=0.1)
  records.append_environment(b, MACHINE)
  a = make_finished(sweep, "a", steps=(1, 3))
  make_run(sweep / "unfinished", done=False)
  damaged = make_finished(sweep, "damaged")
  results(damaged).write_text("".join(reversed(lines(damaged))))
  path = {"lengths": {"length": 0.1}, "projections": {}, "projected_with": []}
  packed, skipped = pack.pack_runs(sweep, {"b": path})
  assert packed == ["a", "b"]
  assert list(skipped) == [damaged]
  assert "is of step 4, after step 6" in skipped[damaged]
  pack_file = sweep / pack.PACK_FILE
  data = pack_file.read_bytes()
  # No time stamp or file name in the gzip header: the same runs give the
  # same bytes.
  assert data[4:8] == b"\0\0\0\0" and data[3] == 0
  packed_lines = gzip.decompress(data).decode().splitlines()
  assert [json.loads(line)["run"] for line in packed_lines] == ["a", "b"]
  # A run without an environment file packs as before runs had one.
  assert packed_lines[0] == json.dumps(
      {"run": "a", "config": json.loads((a / records.CONFIG_FILE).read_text()),
       "records": records.read_run(a).records})
  found = pack.read_pack(sweep)
  assert list(found) == ["a", "b"]
  assert found["b"].records == records.read_run(b).records
  assert found["b"].config == json.loads((b / records.CONFIG_FILE).read_text())
  assert found["b"].trajectory == path and found["a"].trajectory is None
  assert found["b"].environment == [MACHINE] == records.read_environment(b)
  assert found["a"].environment is None

  # Packed again after the directories are gone: the same bytes.
  for run_dir in (a, b):
    shutil.rmtree(run_dir)
  assert pack.pack_runs(sweep, {})[0] == ["a", "b"]
  assert pack_file.read_bytes() == data
  # A packed run is finished, with its records, where no directory is.
  assert pack.packed_run(a).records == found["a"].records
  assert pack.finished_records(b) == found["b"].records
  assert pack.run_environment(b) == [MACHINE]
  assert pack.run_environment(a) is None
  assert pack.finished_records(sweep / "unfinished") is None
  assert pack.finished_records(sweep / "absent") is None


def test_a_run_directory_replaces_its_packed_run(tmp_path):
  sweep = tmp_path / "sweep"
  make_finished(sweep, "a")
  pack.pack_runs(sweep, {})
  # Trained again: the directory's records are the run's, done or not.
  shutil.rmtree(sweep / "a")
  again = make_run(sweep / "a", steps=(2,), checkpoints=None, done=False)
  assert pack.packed_run(again) is None
  assert pack.finished_records(again) is None
  found = pack.load_runs(sweep)
  assert found.runs == {again: records.read_run(again).records}
  # Finished, it replaces the packed run in the pack too.
  records.mark_done(again)
  records.write_config(again, {"args": {}, "hparams": {}})
  pack.pack_runs(sweep, {})
  assert [r["step"] for r in pack.read_pack(sweep)["a"].records] == [2]


def test_load_runs_reads_packs_at_any_depth_in_path_order(tmp_path):
  nested = tmp_path / "sweep" / "nested"
  make_finished(nested, "b")
  make_finished(nested, "d")
  pack.pack_runs(nested, {"d": {"lengths": {}}})
  for name in ("b", "d"):
    shutil.rmtree(nested / name)
  make_finished(tmp_path / "sweep", "a")
  c = make_finished(nested, "c")  # A directory beside the pack.
  found = pack.load_runs(tmp_path / "sweep")
  assert list(found.runs) == [tmp_path / "sweep" / "a", nested / "b", c,
                              nested / "d"]
  assert found.runs[nested / "b"] == pack.read_pack(nested)["b"].records
  assert found.trajectories == {nested / "d": {"lengths": {}}}
  assert found.skipped == {}
