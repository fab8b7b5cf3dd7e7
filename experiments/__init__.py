"""DomainBed experiments with PGrad (see experiments/README.md).

Modules that moved keep their old paths as signposts, `MOVED`: ``python -m``
an old path prints the command with the new one and exits with status 2, and
importing an old path raises `ImportError` naming the new one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import shlex
import sys
import types

# Old module path -> new module path.
MOVED = {
    "experiments.augmentation": "experiments.data.photo_augmentation",
    "experiments.color_jitter": "experiments.data.color_jitter",
    "experiments.datasets": "experiments.data.datasets",
    "experiments.digit_datasets": "experiments.data.digit_datasets",
    "experiments.input_pipeline": "experiments.data.pipeline",
    "experiments.photo_datasets": "experiments.data.photo_datasets",
    "experiments.tasks": "experiments.data.tasks",
    "experiments.tfds_sources": "experiments.data.tfds_sources",
    "experiments.wilds": "experiments.data.wilds",
    "experiments.wilds_augmentation": "experiments.data.wilds_augmentation",
    "experiments.convergence": "experiments.runs.convergence",
    "experiments.records": "experiments.runs.records",
    "experiments.rerun": "experiments.runs.rerun",
    "experiments.study": "experiments.runs.study",
    "experiments.sweep": "experiments.runs.sweep",
    "experiments.algorithms.augmentation": "experiments.algorithms.mixing",
    "experiments.report": "experiments.analysis.report",
    "experiments.studies.digits_benchmarks": "benchmarks",
    "experiments.studies.digits_benchmarks.grad_accumulation":
        "benchmarks.grad_accumulation",
    "experiments.studies.digits_benchmarks.vmap_trials":
        "benchmarks.vmap_trials",
}


class _MovedLoader(importlib.abc.Loader):
  """Loads an old path of `MOVED`: as a program, a note of the new path."""

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
    return None  # The default module.

  def exec_module(self, module: types.ModuleType) -> None:
    name = module.__name__
    if module.__spec__.submodule_search_locations is not None:
      # An old package: importing its old modules says where they went.
      return
    raise ImportError(f"{name} moved: import {MOVED[name]}", name=name)

  def get_code(self, fullname: str) -> types.CodeType:
    """What ``python -m <old path>`` runs: runpy runs this code as
    ``__main__`` without importing the module."""
    command = shlex.join(["python", "-m", MOVED[fullname], *sys.argv[1:]])
    note = f"{fullname} moved: run {command}"
    return compile(f"import sys\nprint({note!r}, file=sys.stderr)\n"
                   "sys.exit(2)\n", f"<{fullname} moved>", "exec")


class _MovedFinder(importlib.abc.MetaPathFinder):
  """Finds the old paths of `MOVED`, ahead of the files a checkout made
  before the move may have left (``__pycache__`` folders)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target  # The old path alone says what it is.
    if fullname not in MOVED:
      return None
    is_package = any(old.startswith(fullname + ".") for old in MOVED)
    return importlib.machinery.ModuleSpec(fullname, _MovedLoader(),
                                          is_package=is_package)


sys.meta_path.insert(0, _MovedFinder())
