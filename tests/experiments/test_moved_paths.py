"""Tests for experiments/__init__.py: the old paths of modules that moved."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import experiments

REPO = pathlib.Path(__file__).resolve().parents[2]


def module_file(name):
  """Where the module ``name`` would be: its file, or its package's
  ``__init__.py``."""
  path = REPO / name.replace(".", "/")
  return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@pytest.mark.parametrize("old", ["experiments.sweep", "experiments.report",
                                 "experiments.algorithms.augmentation",
                                 "experiments.studies.digits_benchmarks."
                                 "vmap_trials"])
def test_running_an_old_path_prints_the_new_command(old):
  result = subprocess.run(
      [sys.executable, "-m", old, "launch", "--output_dir", "my runs"],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert (result.returncode, result.stdout, result.stderr) == (
      2, "", f"{old} moved: run python -m {experiments.MOVED[old]} launch "
      "--output_dir 'my runs'\n")


def test_importing_an_old_path_names_the_new_one():
  with pytest.raises(ImportError) as error:
    # pylint: disable-next=import-outside-toplevel,unused-import
    from experiments import sweep
  assert str(error.value) == (
      "experiments.sweep moved: import experiments.runs.sweep")
  old = "experiments.studies.digits_benchmarks.grad_accumulation"
  with pytest.raises(ImportError) as error:
    importlib.import_module(old)
  assert str(error.value) == f"{old} moved: import benchmarks.grad_accumulation"


@pytest.mark.parametrize("old", sorted(experiments.MOVED))
def test_an_old_path_has_no_module_and_its_new_path_has_one(old):
  assert not module_file(old).exists()
  assert module_file(experiments.MOVED[old]).is_file()
