"""The run directory's records: what a killed run leaves is recognised, and
every other damage (truncated, corrupted or reordered records, a deleted
checkpoint) is refused, naming the file and what is wrong."""

import doctest
import json

import pytest

from experiments.rundir import records
from test_model_selection import make_record

STEPS = (2, 4, 6)


def make_run(run_dir, steps=STEPS, checkpoints=STEPS[-2:], done=True):
  """A run directory as training leaves it: a record per step, Orbax's step
  directories for ``checkpoints`` (None: no checkpoint directory), and
  ``done``."""
  run_dir.mkdir(parents=True)
  for step in steps:
    records.append_record(run_dir, {"step": step, "env0_in_acc": step / 10})
  if checkpoints is not None:
    (run_dir / records.CHECKPOINT_DIR).mkdir()
    for step in checkpoints:
      (run_dir / records.CHECKPOINT_DIR / str(step)).mkdir()
  if done:
    records.mark_done(run_dir)
  return run_dir


def results(run_dir):
  return run_dir / records.RESULTS_FILE


def lines(run_dir):
  return results(run_dir).read_text().splitlines(keepends=True)


def test_doctests():
  assert doctest.testmod(records).failed == 0


def test_a_finished_run_reads_whole(tmp_path):
  run_dir = make_run(tmp_path / "run")
  run = records.read_run(run_dir)
  assert [r["step"] for r in run.records] == list(STEPS)
  assert run.checkpoint_step == STEPS[-1]
  assert run.unsaved == 0 and run.torn_bytes == 0
  assert run.checkpointed == run.records
  assert records.is_done(run_dir)
  assert not (run_dir / f"{records.DONE_FILE}.partial").exists()


def test_what_a_killed_run_leaves_is_recognised_and_cut_off(tmp_path):
  # Killed after appending step 6's record, before checkpointing it, and
  # then while appending the next: a record after the checkpoint and a torn
  # last line.
  run_dir = make_run(tmp_path / "run", checkpoints=STEPS[:2], done=False)
  kept = "".join(lines(run_dir)[:2])
  with results(run_dir).open("a") as f:
    f.write('{"step": 8, "env0_in')
  run = records.read_run(run_dir)
  assert [r["step"] for r in run.records] == list(STEPS)
  assert run.unsaved == 1 and run.torn_bytes == len('{"step": 8, "env0_in')
  assert [r["step"] for r in run.checkpointed] == list(STEPS[:2])

  dropped = records.keep_checkpointed(run)
  assert len(dropped) == 2
  assert f"record of step 6 from {results(run_dir)}" in dropped[0]
  assert "cut short (20 bytes)" in dropped[1]
  # The kept bytes are the file's own, not rewritten.
  assert results(run_dir).read_text() == kept
  again = records.read_run(run_dir)
  assert (again.unsaved, again.torn_bytes) == (0, 0)
  assert records.keep_checkpointed(again) == []


def test_a_checkpoint_given_overrides_the_listing(tmp_path):
  run_dir = make_run(tmp_path / "run", checkpoints=None, done=False)
  run = records.read_run(run_dir, checkpoint_step=4)
  assert run.checkpoint_step == 4 and run.unsaved == 1
  # Without a checkpoint directory the records are checked alone.
  assert records.read_run(run_dir).unsaved == 0


def test_a_run_copied_without_checkpoints_reads_whole(tmp_path):
  # As the committed study: records and done, no checkpoints.
  run_dir = make_run(tmp_path / "run", checkpoints=None)
  assert len(records.read_run(run_dir).records) == len(STEPS)


def _refusal(run_dir, **kwargs):
  with pytest.raises(records.DamagedRunError) as raised:
    records.read_run(run_dir, **kwargs)
  message = str(raised.value)
  assert str(results(run_dir)) in message
  return message


def test_a_truncated_finished_run_is_refused(tmp_path):
  run_dir = make_run(tmp_path / "run")
  data = results(run_dir).read_bytes()
  results(run_dir).write_bytes(data[:len(data) - 5])
  assert "a finished run" in _refusal(run_dir)
  assert "last line is cut short" in _refusal(run_dir)


def test_records_truncated_before_the_checkpoint_are_refused(tmp_path):
  # Cut at a line's end: whole lines, but step 6's checkpoint has none.
  run_dir = make_run(tmp_path / "run", done=False)
  results(run_dir).write_text("".join(lines(run_dir)[:1]))
  assert ("no record of step 6, its last checkpoint's (it ends at step 2)"
          in _refusal(run_dir))


def test_a_corrupted_line_is_refused(tmp_path):
  run_dir = make_run(tmp_path / "run")
  corrupted = lines(run_dir)
  corrupted[1] = corrupted[1][:10] + "\x00" + corrupted[1][11:]
  results(run_dir).write_text("".join(corrupted))
  assert "line 2 is not JSON" in _refusal(run_dir)
  results(run_dir).write_text('{"step": 2}\n["not", "a", "record"]\n')
  assert "line 2 has no step" in _refusal(run_dir)


def test_reordered_records_are_refused(tmp_path):
  run_dir = make_run(tmp_path / "run")
  reordered = lines(run_dir)
  reordered[0], reordered[1] = reordered[1], reordered[0]
  results(run_dir).write_text("".join(reordered))
  assert "line 2 is of step 2, after step 4" in _refusal(run_dir)
  # A record written twice is out of order too.
  results(run_dir).write_text("".join(lines(run_dir)[:1] * 2))
  assert "line 2 is of step 4, after step 4" in _refusal(run_dir)


def test_a_deleted_checkpoint_is_refused(tmp_path):
  # The last checkpoint of a finished run is its last record's.
  run_dir = make_run(tmp_path / "run")
  (run_dir / records.CHECKPOINT_DIR / "6").rmdir()
  assert "it is done, yet its last record (step 6) has no checkpoint" in (
      _refusal(run_dir))
  # An unfinished run checkpoints every record before writing the next.
  run_dir = make_run(tmp_path / "unfinished", checkpoints=STEPS, done=False)
  for step in ("4", "6"):
    (run_dir / records.CHECKPOINT_DIR / step).rmdir()
  assert "2 records (steps 4 to 6) come after its last checkpoint (step 2)" in (
      _refusal(run_dir))
  assert "an unfinished run" in _refusal(run_dir)


def test_done_without_records_is_refused(tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  records.mark_done(run_dir)
  assert "done, yet holds no record" in _refusal(run_dir)


# An entry of an environment file (`environment.describe`), and another
# machine's.
MACHINE = {"processor": "AMD EPYC 7B13", "processor_features": ["avx2"],
           "cores": 2, "backend": "cpu", "devices": {"kind": "cpu", "count": 1},
           "jax": "0.7.0", "jaxlib": "0.7.0", "python": "3.12.3",
           "xla_flags": None}
OTHER_MACHINE = {**MACHINE, "processor": "Intel(R) Xeon(R) Platinum 8481C",
                 "processor_features": ["avx2", "avx512f"]}


def test_append_record_writes_one_json_line(tmp_path):
  records.append_record(tmp_path, {"step": 1, "x": [1.5]})
  records.append_record(tmp_path, {"step": 2})
  assert [json.loads(line) for line in lines(tmp_path)] == [
      {"step": 1, "x": [1.5]}, {"step": 2}]


def test_trajectory_files_by_step(tmp_path):
  for step in (10, 0, 5):
    path = records.trajectory_file(tmp_path, step)
    path.parent.mkdir(exist_ok=True)
    path.write_text("")
  # A snapshot being written is not one yet.
  (tmp_path / records.TRAJECTORY_DIR / "0000015.partial.npy").write_text("")
  found = records.trajectory_files(tmp_path)
  assert list(found) == [0, 5, 10]
  assert found[5].name == "0000005.npy"
  assert records.trajectory_files(tmp_path / "none") == {}


def test_the_final_line_counts_steps_in_words():
  record = make_record("RotatedDigits", "ERM", 0, 0, 0, 1,
                       in_accs=[0.5] * 6, out_accs=[0.5] * 6,
                       domains=[f"{15 * i}°" for i in range(6)])
  assert "after 1 step (the last step's" in records.final_line(record, "r")
  record["step"] = 2
  assert "after 2 steps (the last" in records.final_line(record, "r")


def test_env_keys_round_trip():
  for key in (("in", "acc"), ("out", "worst_r"), ("in", "examples")):
    assert records.parse_env_key(records.env_key(12, *key)) == (12, *key)
  assert records.parse_env_key("env0_test_acc") is None


def test_config_and_done_are_written_whole(tmp_path):
  records.write_config(tmp_path, {"args": {"seed": 1}, "hparams": {}})
  records.mark_done(tmp_path)
  assert (tmp_path / records.CONFIG_FILE).read_text() == (
      '{\n  "args": {\n    "seed": 1\n  },\n  "hparams": {}\n}\n')
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      records.CONFIG_FILE, records.DONE_FILE]


def _files(count, names="n", sizes="s", total=100):
  """A group of files of a fingerprint, as a folder's class is."""
  return {"files": count, "bytes": total, "names": names, "sizes": sizes}


FINGERPRINT = {"dataset": "PACS", "domains": {
    "art_painting": {"dog": _files(3), "horse": _files(4)},
    "cartoon": {"dog": _files(5), "horse": _files(6)},
    "digits": {"examples": 10, "labels": "abc"}}}


def test_a_run_accepts_the_data_it_recorded_or_none(tmp_path):
  records.check_fingerprint(tmp_path, FINGERPRINT)  # No file: an old run.
  records.write_fingerprint(tmp_path, FINGERPRINT)
  assert json.loads((tmp_path / records.DATASET_FILE).read_text()) == (
      FINGERPRINT)
  records.check_fingerprint(tmp_path, FINGERPRINT)
  # --overwrite deletes it with the run's other files.
  assert records.DATASET_FILE in records.RUN_FILES


def test_a_run_refuses_other_data_naming_what_changed(tmp_path):
  records.write_fingerprint(tmp_path, FINGERPRINT)
  domains = FINGERPRINT["domains"]
  changed = {"dataset": "PACS", "domains": {
      "art_painting": {"dog": _files(5), "horse": _files(3)},
      "cartoon": {"dog": _files(5, names="m"),
                  "horse": _files(6, sizes="t", total=90)},
      "digits": {"examples": 10, "labels": "abd"},
      "photo": domains["cartoon"]}}
  with pytest.raises(records.DatasetChangedError) as e:
    records.check_fingerprint(tmp_path, changed)
  assert str(e.value) == (
      f"{tmp_path} was trained on other data than it is given now "
      f"({tmp_path / records.DATASET_FILE} records them): "
      "art_painting/dog: 2 files added (3 -> 5); "
      "art_painting/horse: 1 file removed (4 -> 3); "
      "cartoon/dog: one or more of its 5 files renamed or replaced; "
      "cartoon/horse: one or more of its 6 files resized (100 -> 90 "
      "bytes); "
      "digits/labels: abc -> abd; domain photo: new")
  fewer = {"dataset": "PACS", "domains": {"cartoon": domains["cartoon"]}}
  assert records.fingerprint_changes(FINGERPRINT, fewer) == [
      "domain art_painting: gone", "domain digits: gone"]


def test_contents_changed_in_place_are_named_and_old_records_lack_them():
  recorded = {"dog": {**_files(3), "contents": "c"}}
  edited = {"dog": {**_files(3), "contents": "d"}}
  assert records.fingerprint_changes(recorded, edited, "photo") == [
      "photo/dog: one or more of its 3 files changed in place (the same "
      "names and sizes)"]
  # A run recorded before contents were: compared on what it holds.
  assert records.fingerprint_changes({"dog": _files(3)}, edited, "photo") == []
  assert records.fingerprint_changes(
      {"dog": _files(3)}, {"dog": {**_files(5), "contents": "d"}},
      "photo") == ["photo/dog: 2 files added (3 -> 5)"]


def test_a_long_list_of_changes_is_cut_short(tmp_path):
  records.write_fingerprint(tmp_path, {"dataset": "X", "domains": {}})
  many = {f"d{i}": {"examples": i} for i in range(12)}
  with pytest.raises(records.DatasetChangedError,
                     match=r": domain d0: new; .*domain d5: new; and 4 more$"):
    records.check_fingerprint(tmp_path, {"dataset": "X", "domains": many})


def test_an_environment_is_appended_only_where_it_changed(tmp_path):
  assert records.read_environment(tmp_path) is None  # A run from before.
  assert records.append_environment(tmp_path, MACHINE)
  path = tmp_path / records.ENVIRONMENT_FILE
  assert json.loads(path.read_text()) == [MACHINE]
  # Resumed on the same machine: nothing added, nothing rewritten (its
  # features given as a tuple, as JSON reads them back a list).
  before = path.stat().st_mtime_ns, path.read_bytes()
  assert not records.append_environment(
      tmp_path, {**MACHINE, "processor_features": ("avx2",)})
  assert (path.stat().st_mtime_ns, path.read_bytes()) == before
  # Resumed elsewhere, then back: each change of machine is an entry.
  assert records.append_environment(tmp_path, OTHER_MACHINE)
  assert records.append_environment(tmp_path, MACHINE)
  assert records.read_environment(tmp_path) == [MACHINE, OTHER_MACHINE,
                                                MACHINE]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      records.ENVIRONMENT_FILE]
  # --overwrite deletes it with the run's other files.
  assert records.ENVIRONMENT_FILE in records.RUN_FILES


def test_a_run_trained_before_it_recorded_environments_starts_with_null(
    tmp_path):
  assert records.append_environment(tmp_path, MACHINE, unrecorded_before=True)
  assert records.read_environment(tmp_path) == [None, MACHINE]
  # Only a file begun now says so: one that exists recorded every process.
  other = tmp_path / "other"
  other.mkdir()
  records.append_environment(other, MACHINE)
  assert records.append_environment(other, OTHER_MACHINE,
                                    unrecorded_before=True)
  assert records.read_environment(other) == [MACHINE, OTHER_MACHINE]


def test_an_environment_is_written_whole_or_not_at_all(tmp_path,
                                                       monkeypatch):
  records.append_environment(tmp_path, MACHINE)
  before = (tmp_path / records.ENVIRONMENT_FILE).read_bytes()

  def killed(self, target):
    raise KeyboardInterrupt

  # Interrupted before the new file replaces the old one: the old one
  # stays whole.
  monkeypatch.setattr(type(tmp_path), "replace", killed)
  with pytest.raises(KeyboardInterrupt):
    records.append_environment(tmp_path, OTHER_MACHINE)
  assert (tmp_path / records.ENVIRONMENT_FILE).read_bytes() == before
  monkeypatch.undo()
  records.append_environment(tmp_path, OTHER_MACHINE)
  assert records.read_environment(tmp_path) == [MACHINE, OTHER_MACHINE]
  assert not (tmp_path / f"{records.ENVIRONMENT_FILE}.partial").exists()


def test_a_divergence_is_told_by_the_losses_that_are_not_finite():
  record = make_record("RotatedDigits", "PGrad-B", 0, 0, 0, 1,
                       in_accs=[0.5] * 6, out_accs=[0.5] * 6)
  record.update({"step": 300, "loss": 0.5, "num_skipped": 0,
                 **{records.env_key(i, "in", "loss"): 0.5 for i in range(6)}})
  assert records.divergence_warning(record) is None
  # Updates that were not finite, skipped: the model is whole.
  record.update(loss=float("nan"), num_skipped=4)
  assert records.divergence_warning(record) == (
      "Warning: the training loss was not finite in some steps up to step "
      "300; 4 updates were skipped so far, the params kept. Try a lower lr "
      "(--hparams).")
  # The model's own losses: its params are gone.
  record[records.env_key(2, "in", "loss")] = float("inf")
  record[records.env_key(4, "in", "loss")] = float("nan")
  assert records.divergence_warning(record).startswith(
      "Warning: the model diverged: after 300 steps its loss is not finite "
      "on 2 of its 6 domains")
  # As JSON writes and reads them back.
  assert records.divergence_warning(json.loads(json.dumps(record))) == (
      records.divergence_warning(record))


def test_the_final_line_of_an_averaging_run_gives_both_models():
  record = {"args": {"test_envs": [1], "averaging": "swad"}, "step": 40,
            "domains": ["a", "b"], "env1_in_acc": 0.25,
            "averaged_env1_in_acc": 0.625}
  line = records.final_line(record, "r")
  assert ("in splits; no model selection): b (env1) 0.2500; its averaged "
          "weights' (--averaging swad): b (env1) 0.6250. Run directory: r"
          in line), line
  # SWAD's records before the last have no averaged metrics.
  del record["averaged_env1_in_acc"]
  assert "averaged" not in records.final_line(record, "r")
