"""Tests for experiments/data/check.py: ``python -m experiments.data.check``."""

import re
import shlex
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
from PIL import Image

from experiments.data import check
from experiments.data import datasets
from test_photo_datasets import truncate_photo
from test_photo_datasets import write_folder_dataset


def test_check_decodes_counts_and_tells_truncated_from_unreadable(
    tmp_path, capsys):
  write_folder_dataset(tmp_path)
  root = tmp_path / "PACS"
  truncated = root / "photo" / "dog" / "0.jpg"
  truncate_photo(truncated)
  flags = ["--dataset", "PACS", "--data_dir", str(tmp_path)]
  assert check.main(flags) == 0
  out, err = capsys.readouterr()
  assert f"{root}: 4 domains, 2 classes, 24 image files." in out
  assert re.search(r"dog +3 +3 +3 +3\n", out)
  assert "1 truncated, which training reads" in out
  assert f"  {truncated}\n0 problems." in out
  assert "Listing, headers and digests (what training does first):" in out
  assert "decoding: 100%" in err  # The progress bar.
  # A file whose header reads but whose data do not decode even leniently
  # cannot be made here: Pillow's decoders pad what they lack. One whose
  # header is garbage stops training.
  garbage = root / "sketch" / "horse" / "2.jpg"
  garbage.write_bytes(b"\xff\xd8 cut")
  assert check.main(flags) == 2
  out, _ = capsys.readouterr()
  assert "1 problem, which stops training:" in out
  assert re.search(r"horse +3 +3 +3 +3\n", out)  # Files, read or not.
  assert f"  - not an image: {garbage}" in out


def test_the_command_that_a_folders_problems_name_checks_it(tmp_path, capsys):
  write_folder_dataset(tmp_path)
  garbage = tmp_path / "PACS" / "photo" / "horse" / "1.jpg"
  garbage.write_bytes(b"not a JPEG at all")
  with pytest.raises(datasets.DatasetProblemsError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path)
  command = shlex.split(re.search(r"`(python -m [^`]*)`",
                                  str(e.value)).group(1))
  assert command[:3] == ["python", "-m", "experiments.data.check"]
  assert check.main(command[3:]) == 2
  assert f"  - not an image: {garbage}" in capsys.readouterr().out


def test_check_of_a_missing_dataset_is_a_usage_error(tmp_path, capsys):
  assert check.main(["--dataset", "VLCS", "--data_dir", str(tmp_path)]) == 2
  assert f"VLCS not found: {tmp_path / 'VLCS'}" in capsys.readouterr().err


def test_the_program_says_a_users_mistake_without_a_traceback(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.data.check", "--dataset", "VLCS",
       "--data_dir", str(tmp_path)],
      capture_output=True, text=True, check=False)
  assert (result.returncode, result.stdout) == (2, "")
  assert result.stderr.startswith(
      "python -m experiments.data.check: error: VLCS not found: "
      f"{tmp_path / 'VLCS'}")
  assert "Traceback" not in result.stderr


def test_the_old_check_command_names_the_new_one_and_fails():
  # Up to 0.1.0 the check was `python -m experiments.data.datasets check`; a
  # script still running it must not pass without a check.
  result = subprocess.run(
      [sys.executable, "-m", "experiments.data.datasets", "check",
       "--dataset", "VLCS"], capture_output=True, text=True, check=False)
  assert (result.returncode, result.stdout) == (2, "")
  assert "python -m experiments.data.check" in result.stderr
  assert "Traceback" not in result.stderr


def test_check_of_an_array_dataset_counts_its_domains(capsys):
  assert check.main(["--dataset", "ColoredDigits"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("ColoredDigits: 2 classes; examples per domain: +90%")


def test_check_lists_dangling_symlinks_as_problems(tmp_path, capsys):
  write_folder_dataset(tmp_path)
  gone = tmp_path / "PACS" / "cartoon" / "horse" / "gone.jpg"
  gone.symlink_to(tmp_path / "nowhere.jpg")
  (tmp_path / "PACS" / "cartoon" / "gone").symlink_to(tmp_path / "no folder")
  assert check.main(["--dataset", "PACS", "--data_dir", str(tmp_path)]) == 2
  out = capsys.readouterr().out
  assert "2 problems, which stop training:" in out
  assert f"  - broken symlink: {gone} -> " in out


def test_check_names_the_images_whose_values_training_clips(tmp_path, capsys):
  write_folder_dataset(tmp_path)
  deep = tmp_path / "PACS" / "art_painting" / "dog" / "deep.png"
  Image.fromarray(np.array([[0, 100, 255, 256, 4000, 65535]],
                           np.uint16)).save(deep)
  assert check.main(["--dataset", "PACS", "--data_dir", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert ("1 image of more than 8 bits (mode I;16), whose values above 255 "
          'convert("RGB") clips to 255 when training reads it, as in '
          f"DomainBed:\n  {deep}\n") in out


def _display_width(text):
  """Columns a terminal gives ``text``: 2 for East Asian wide characters."""
  return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1
             for c in text)


def test_check_table_aligns_wide_class_names(tmp_path, capsys):
  classes = ("dog", "狗狗", "chien")
  write_folder_dataset(tmp_path, classes=classes)
  assert check.main(["--dataset", "PACS", "--data_dir", str(tmp_path)]) == 0
  lines = capsys.readouterr().out.splitlines()
  table = lines[1:1 + 1 + len(classes) + 1]
  assert [line.split()[0] for line in table] == [
      "class", *sorted(classes), "all"]
  # Counts are right-aligned: every row ends where the header's does.
  assert len({_display_width(line) for line in table}) == 1, table
