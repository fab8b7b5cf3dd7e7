import os
import shutil
import sys
import tempfile

import pytest

# The tests import their NumPy oracle as a sibling module.
sys.path.insert(0, os.path.dirname(__file__))


_CACHE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
  """Shares one JAX compilation cache among all the processes of a run.

  The end-to-end tests start many ``python -m experiments.train`` processes
  (and the workers of ``-n auto``) that compile the same small programs; with
  the cache they compile each once. It is set before the workers start, so
  they and every subprocess inherit it, and removed when the run ends. A
  cache the caller set is used as it is.
  """
  if hasattr(config, "workerinput") or _CACHE in os.environ:
    return
  config.jax_cache_dir = tempfile.mkdtemp(prefix="pgrad_jax_tests_cache_")
  os.environ.update({_CACHE: config.jax_cache_dir,
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})


def pytest_unconfigure(config):
  if getattr(config, "jax_cache_dir", None):
    shutil.rmtree(config.jax_cache_dir, ignore_errors=True)


def _uses_module_fixture(item: pytest.Item) -> bool:
  info = getattr(item, "_fixtureinfo", None)
  return info is not None and any(
      d.scope == "module" for defs in info.name2fixturedefs.values()
      for d in defs)


def pytest_collection_modifyitems(items):
  """Starts the longest test modules first.

  pytest-xdist (``--dist loadscope``) gives each worker whole modules, so a
  module-scoped fixture (a reference run, a subprocess on simulated devices)
  is built once. The modules with such fixtures go first, then those with
  ``slow`` tests, so that no long module is left for the end while the other
  worker idles.
  """
  def modules(has):
    return {item.nodeid.split("::")[0] for item in items if has(item)}

  with_fixtures = modules(_uses_module_fixture)
  with_slow = modules(lambda item: item.get_closest_marker("slow"))
  items.sort(key=lambda item: (item.nodeid.split("::")[0] not in with_fixtures,
                               item.nodeid.split("::")[0] not in with_slow))
