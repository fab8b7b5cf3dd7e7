"""A run's data: checked before training, recorded, refused changed.

The photo runs are `experiments.train`'s command, in this process, on a
generated PACS folder (DomainBed's layout) with DomainBed's MNIST CNN on
32x32 crops, as tests/experiments/test_train_photos.py trains them.
"""

import shutil

import pytest

from benchmarks import input_pipeline as input_benchmark
from experiments import errors
from experiments.data import datasets
from experiments.data import photo_datasets
from experiments.rundir import records
from experiments import train
from test_photo_datasets import truncate_photo

FLAGS = ["--dataset", "PACS", "--algorithm", "ERM", "--model", "mnist_cnn",
         "--steps", "2", "--checkpoint_freq", "2",
         "--hparams", '{"batch_size": 2, "image_size": 32}',
         "--eval_examples", "4", "--eval_batch_size", "8",
         "--loss_examples", "4"]


def _write_pacs(data_dir):
  """PACS's four domains, two classes, five 40x40 photos each."""
  return input_benchmark.write_photo_folder(
      data_dir, classes=("dog", "horse"), per_class=5, size=40)


def _train(capsys, data_dir, output_dir, *flags):
  """``python -m experiments.train`` on PACS: its exit status and stderr."""
  status = train.main([*FLAGS, "--data_dir", str(data_dir), "--output_dir",
                       str(output_dir), *flags])
  return status, capsys.readouterr().err


def test_folder_mistakes_stop_a_run_before_any_work(tmp_path, capsys):
  data_dir = _write_pacs(tmp_path / "data")
  root = data_dir / "PACS"
  shutil.rmtree(root / "cartoon")
  (root / "__MACOSX" / "photo").mkdir(parents=True)  # Ignored.
  garbage = root / "photo" / "dog" / "3.jpg"
  garbage.write_bytes(b"<html>not found</html>")
  status, err = _train(capsys, data_dir, tmp_path / "run", "--num_workers",
                       "0")
  assert status == 2
  assert f"PACS in {root} has 2 problems" in err
  assert f"domain folder missing: {root / 'cartoon'}" in err
  assert f"not an image: {garbage}" in err
  assert "__MACOSX" not in err.split("\n  - ", 1)[1].split("Hidden")[0]
  assert "Traceback" not in err
  assert not (tmp_path / "run").exists()


def test_truncated_photos_train_and_the_run_is_bound_to_its_data(
    tmp_path, capsys):
  data_dir = _write_pacs(tmp_path / "data")
  # Every photo is cut short: every batch reads truncated files, here (read
  # by worker processes: test_photo_datasets.py).
  for path in (data_dir / "PACS").rglob("*.jpg"):
    truncate_photo(path)
  run = tmp_path / "run"
  status, err = _train(capsys, data_dir, run, "--num_workers", "0")
  assert status == 0, err
  assert records.is_done(run)
  assert (run / records.DATASET_FILE).exists()

  # The same data elsewhere are the same data: moved, or copied (the
  # files' times new, their bytes the same).
  copied = tmp_path / "copied"
  shutil.copytree(data_dir, copied)
  status, err = _train(capsys, copied, run)
  assert (status, err) == (0, "Already finished.\n")
  moved = data_dir.rename(tmp_path / "moved")
  status, err = _train(capsys, moved, run)
  assert (status, err) == (0, "Already finished.\n")

  # An image changed in place, its name and size kept, is other data.
  edited = copied / "PACS" / "cartoon" / "horse" / "2.jpg"
  data = bytearray(edited.read_bytes())
  data[-3] ^= 0xFF
  edited.write_bytes(bytes(data))
  status, err = _train(capsys, copied, run)
  assert status == 2
  assert "Already finished." not in err
  assert ("records them): cartoon/horse: one or more of its 5 files changed "
          "in place (the same names and sizes). Train it again") in err

  # Changed data are refused, finished or not, saying what changed.
  shutil.copy(moved / "PACS" / "photo" / "dog" / "0.jpg",
              moved / "PACS" / "photo" / "dog" / "new.jpg")
  (moved / "PACS" / "sketch" / "horse" / "1.jpg").unlink()
  for done in (True, False):
    if not done:  # Killed after its last checkpoint: it would resume.
      (run / records.DONE_FILE).unlink()
    status, err = _train(capsys, moved, run)
    assert status == 2
    assert "Already finished." not in err and "Resuming" not in err
    assert (f"{run} was trained on other data than it is given now "
            f"({run / records.DATASET_FILE} records them): photo/dog: 1 "
            "file added (5 -> 6); sketch/horse: 1 file removed (5 -> 4). "
            "Train it again on these data with the same command and "
            "--overwrite, or pass another --output_dir.") in err
    assert "Traceback" not in err


def test_a_photo_damaged_after_the_check_stops_the_run_naming_it(
    tmp_path, capsys, monkeypatch):
  # The files turn bad once the check before training has read them.
  data_dir = _write_pacs(tmp_path / "data")
  damaged = sorted((data_dir / "PACS").rglob("*.jpg"))
  check = photo_datasets.read_files

  def check_then_damage(*args, **kwargs):
    found = check(*args, **kwargs)
    for path in damaged:
      path.write_bytes(b"\0" * 64)
    return found

  monkeypatch.setattr(photo_datasets, "read_files", check_then_damage)
  # Read by a Grain worker process, the error crosses into the run's.
  status, err = _train(capsys, data_dir, tmp_path / "run", "--num_workers",
                       "1")
  assert status == 2
  assert "python -m experiments.train: error: Cannot read image " in err
  assert str(data_dir / "PACS") in err
  assert "Restore the file and rerun the same command" in err
  assert "Traceback" not in err


def test_a_symlinked_dangling_image_stops_a_run_before_any_work(
    tmp_path, capsys):
  data_dir = _write_pacs(tmp_path / "data")
  gone = data_dir / "PACS" / "photo" / "dog" / "gone.jpg"
  gone.symlink_to(tmp_path / "elsewhere.jpg")
  status, err = _train(capsys, data_dir, tmp_path / "run", "--num_workers",
                       "0")
  assert status == 2
  assert (f"  - broken symlink: {gone} -> {tmp_path / 'elsewhere.jpg'} (No "
          "such file or directory)") in err
  assert "Traceback" not in err
  assert not (tmp_path / "run").exists()


def test_a_run_recorded_before_contents_is_checked_on_names_and_sizes(
    tmp_path):
  # dataset.json of a run from before runs recorded the files' contents.
  data_dir = _write_pacs(tmp_path / "data")
  current = datasets.fingerprint(datasets.get_dataset("PACS",
                                                      data_dir=data_dir))
  old = {"dataset": "PACS", "domains": {
      domain: {name: {k: v for k, v in group.items() if k != "contents"}
               for name, group in classes.items()}
      for domain, classes in current["domains"].items()}}
  run = tmp_path / "run"
  run.mkdir()
  records.write_fingerprint(run, old)
  train.check_run_data(run, current)  # Accepted.
  for name in ("0.jpg", "1.jpg"):
    (data_dir / "PACS" / "photo" / "dog" / name).unlink()
  changed = datasets.fingerprint(datasets.get_dataset("PACS",
                                                      data_dir=data_dir))
  with pytest.raises(errors.UsageError,
                     match=r"photo/dog: 2 files removed \(5 -> 3\)"):
    train.check_run_data(run, changed)


def test_a_run_on_other_data_is_a_usage_error_naming_the_way_out(tmp_path):
  run_data = datasets.fingerprint(datasets.get_dataset("ColoredDigits"))
  train.check_run_data(tmp_path, run_data)  # An old run: accepted.
  records.write_fingerprint(tmp_path, run_data)
  train.check_run_data(tmp_path, run_data)
  other = datasets.fingerprint(datasets.get_dataset("ColoredDigits", seed=3))
  with pytest.raises(errors.UsageError,
                     match=r"\+80%/labels: .*--overwrite, or pass another "
                     "--output_dir"):
    train.check_run_data(tmp_path, other)
