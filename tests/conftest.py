import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

# The tests import their helpers and each other's fixtures by module name
# (oracle, wilds_data, test_train, ...), whichever folder of tests/ holds
# them: every folder with tests is on the path, so that a module finds them
# whether or not pytest collects their folder in the same run. Test modules'
# names are unique across tests/ (pytest refuses two of one name).
_TESTS = pathlib.Path(__file__).parent
sys.path[:0] = sorted({str(path.parent)
                       for path in _TESTS.glob("*/**/test_*.py")})

# Fixtures, and the script that writes some of them with PyTorch, which the
# tests do not need: nothing there to collect, doctests included.
collect_ignore = ["data"]


_CACHE = "JAX_COMPILATION_CACHE_DIR"

# The tests' programs are tiny and run a few times each, so compiling them is
# most of the suite's time. XLA:CPU compiles them about 3x faster with its
# elemental emitters instead of the fusion emitters and without LLVM's
# optimisations (measured on the algorithm step tests: 55 against 17
# CPU-seconds), and another 5-10% faster as one LLVM module instead of
# modules split for parallel code generation, which only adds work when the
# cores are all busy running tests. The programs compute the same operations,
# only slower, which no test measures. Speed belongs to benchmarks/, which
# run without these flags.
FAST_COMPILE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",
                          "--xla_backend_optimization_level=0",
                          "--xla_cpu_parallel_codegen_split_count=1")


def _xla_accepts(flags: str) -> bool:
  """Whether this jaxlib's XLA starts with ``flags`` (it aborts on unknown
  flags, and a flag may be gone in a later release)."""
  probe = subprocess.run(
      [sys.executable, "-c",
       "import jax; jax.numpy.zeros(1).block_until_ready()"],
      env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
      capture_output=True, check=False)
  return probe.returncode == 0


# pytest-xdist's hook is tryfirst too; this one, registered later, runs first.
@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Runs the tests on a worker per core where pytest-xdist is installed.

  Unless the command line says otherwise (``-n 0``: one process; ``--dist``),
  this is ``-n auto --dist loadscope --no-loadscope-reorder``: each worker
  runs whole modules, so that a module-scoped fixture is built once, in the
  order `pytest_collection_modifyitems` gives them. The options are set here
  rather than in pyproject.toml's ``addopts`` because pytest refuses options
  of a plugin that is not installed: the library's tests also run with only
  ``pip install -e . pytest``, in one process.
  """
  if (hasattr(config, "workerinput")
      or not config.pluginmanager.hasplugin("xdist")):
    return
  if config.option.numprocesses is None:
    config.option.numprocesses = "auto"
  if config.option.dist == "no":
    config.option.dist = "loadscope"
    config.option.loadscopereorder = False


def pytest_configure(config):
  """Sets up the environment that every process of a test run shares.

  * One JAX compilation cache: the end-to-end tests start many
    ``python -m experiments.train`` processes (and the workers of
    ``-n auto``) that compile the same small programs; with the cache they
    compile each once. It is removed when the run ends; a cache the caller
    set is used as it is.
  * `FAST_COMPILE_XLA_FLAGS`, where this XLA knows them, before the
    caller's own ``XLA_FLAGS`` (so that the caller's win, e.g.
    ``--xla_cpu_max_isa=AVX2`` to compile as for a CPU without AVX-512).

  Both are set before the workers start, so they and every subprocess
  inherit them (the tests that start subprocesses pass ``os.environ`` on,
  changing only the device count).
  """
  if hasattr(config, "workerinput"):
    return
  flags = " ".join(FAST_COMPILE_XLA_FLAGS + (os.environ.get("XLA_FLAGS", ""),))
  if _xla_accepts(flags):
    os.environ["XLA_FLAGS"] = flags.strip()
  if _CACHE in os.environ:
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
  ``slow`` tests, then the others by their number of tests, most first, so
  that no long module is left for the end while the other worker idles (a
  75-test module run last kept one of two workers idle for 37 s).
  """
  def module(item):
    return item.nodeid.split("::")[0]

  def modules(has):
    return {module(item) for item in items if has(item)}

  with_fixtures = modules(_uses_module_fixture)
  with_slow = modules(lambda item: item.get_closest_marker("slow"))
  sizes = collections.Counter(map(module, items))
  items.sort(key=lambda item: (module(item) not in with_fixtures,
                               module(item) not in with_slow,
                               -sizes[module(item)]))
