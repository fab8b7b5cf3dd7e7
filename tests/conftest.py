import os
import sys

import pytest

# The tests import their NumPy oracle as a sibling module.
sys.path.insert(0, os.path.dirname(__file__))


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
