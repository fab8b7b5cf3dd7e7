"""A photo run's data: checked before training, recorded, refused changed.

The runs are `experiments.train`'s command, in this process, on a generated
PACS folder (DomainBed's layout) with DomainBed's MNIST CNN on 32x32 crops,
as tests/experiments/test_train_photos.py trains them. The TFDS dataset is
test_tfds_prepared.py's tiny DomainNet.
"""

import shutil

import tensorflow_datasets as tfds

from benchmarks import input_pipeline as input_benchmark
from experiments.data import datasets
from experiments.data import photo_datasets
from experiments.runs import records
from experiments import train
from test_photo_datasets import truncate_photo
from test_tfds_prepared import domainnet_dir  # pylint: disable=unused-import

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

  # The same data elsewhere are the same data.
  moved = data_dir.rename(tmp_path / "moved")
  status, err = _train(capsys, moved, run)
  assert (status, err) == (0, "Already finished.\n")

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
  check = photo_datasets.header_problems

  def check_then_damage(*args, **kwargs):
    problems = check(*args, **kwargs)
    for path in damaged:
      path.write_bytes(b"\0" * 64)
    return problems

  monkeypatch.setattr(photo_datasets, "header_problems", check_then_damage)
  # Read by a Grain worker process, the error crosses into the run's.
  status, err = _train(capsys, data_dir, tmp_path / "run", "--num_workers",
                       "1")
  assert status == 2
  assert "python -m experiments.train: error: Cannot read image " in err
  assert str(data_dir / "PACS") in err
  assert "Restore the file and rerun the same command" in err
  assert "Traceback" not in err


def test_a_tfds_dataset_is_known_by_its_versions_and_counts(domainnet_dir):
  dataset = datasets.get_dataset("DomainNet", data_dir=domainnet_dir)
  recorded = datasets.fingerprint(dataset)
  for name, source in zip(dataset.domain_names, dataset.domains):
    version = tfds.builder(f"domainnet/{name}", data_dir=str(domainnet_dir),
                           try_gcs=False).version
    assert recorded["domains"][name] == {
        "examples": len(source), "tfds": f"domainnet/{name}/{version}"}
