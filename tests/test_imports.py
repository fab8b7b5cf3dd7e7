"""How the modules of experiments/ import each other, read from their source.

Every import counts, wherever it is: at the top of a module, inside a
function (imported when called, but still a dependency) and under
``if TYPE_CHECKING:`` (a dependency of the types). A registry's builders,
strings such as ``"experiments.models:resnet18"`` that it imports when it
first builds one, are not counted: naming a builder without importing it is
what lets the catalog stay below the modules it catalogues.

The modules are parsed, never imported, so that the test sees every import
without running any.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent

# The import cycles allowed, each as the modules around it: none since
# issue 47 removed the last. The test fails on any other cycle, and on one
# of these that is gone, so that the list only shrinks.
ALLOWED_CYCLES = {}
# The packages below the run: none imports the run's configuration, its
# command, its loop or the sweeps' modules.
LOWER_PACKAGES = ("data", "rundir", "models", "weights")
ABOVE_LOWER_PACKAGES = ("config", "train", "training", "runs")


def module_names(package_dir):
  """Every module of a package, by dotted name: its path below the package's
  parent, ``__init__.py`` naming its folder."""
  names = {}
  for path in sorted(package_dir.rglob("*.py")):
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    names[".".join(parts)] = path
  return names


def _module_of(name, modules):
  """The module of ``modules`` that importing ``name`` runs last: ``name``
  itself, or the package it is an attribute of."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def imports(module, path, modules):
  """The modules of ``modules`` that one module imports, anywhere in it.

  Args:
    module: the module's dotted name.
    path: its source file.
    modules: every module considered, by dotted name (`module_names`).

  Returns:
    The sorted names of the modules of ``modules`` it imports: for
    ``from package import name`` the module ``package.name`` where there is
    one, else ``package``; ``importlib.import_module`` of a string counts as
    an import of it.
  """
  # A package's relative imports start from itself, a module's from its
  # package; each further dot goes one package up.
  package = (module if path.name == "__init__.py"
             else module.rpartition(".")[0]).split(".")
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(_module_of(alias.name, modules) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module
      if node.level:
        base = ".".join([*package[:len(package) - node.level + 1],
                         *([node.module] if node.module else [])])
      found.update(_module_of(f"{base}.{alias.name}", modules)
                   for alias in node.names)
    elif (isinstance(node, ast.Call) and node.args
          and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and ast.unparse(node.func).endswith("import_module")):
      found.add(_module_of(node.args[0].value, modules))
  return sorted(found - {None, module})


def import_graph(package_dir):
  """``{module: the modules of the package it imports}`` for a package."""
  modules = module_names(package_dir)
  return {module: imports(module, path, modules)
          for module, path in modules.items()}


def cycles(graph):
  """Every import cycle of ``graph``: each simple cycle once, as the modules
  around it from the first in sorted order, sorted."""
  found = []

  def walk(start, path, on_path):
    for next_module in graph[path[-1]]:
      if next_module == start:
        found.append(tuple(path))
      # Only through modules after the start, so that each cycle is found
      # from its first module alone.
      elif next_module > start and next_module not in on_path:
        walk(start, [*path, next_module], on_path | {next_module})

  for start in sorted(graph):
    walk(start, [start], {start})
  return sorted(found)


def _canonical(cycle):
  """A cycle from its first module in sorted order."""
  first = cycle.index(min(cycle))
  return tuple(cycle[first:] + cycle[:first])


def _named(cycle):
  return " -> ".join([*cycle, cycle[0]])


def test_no_import_cycle_but_the_allowed_ones():
  found = cycles(import_graph(ROOT / "experiments"))
  allowed = {_canonical(cycle) for cycle in ALLOWED_CYCLES.values()}
  new = [_named(cycle) for cycle in found if cycle not in allowed]
  assert not new, "import cycles:\n" + "\n".join(new)
  gone = [name for name, cycle in ALLOWED_CYCLES.items()
          if _canonical(cycle) not in found]
  assert not gone, f"no longer cycles, out of ALLOWED_CYCLES with them: {gone}"


def lower_package_violations(graph):
  """``{module: what it imports that it must not}`` for the modules of
  `LOWER_PACKAGES` that import a module of `ABOVE_LOWER_PACKAGES` (or a
  module inside one of them)."""
  def within(module, names):
    return any(module == f"experiments.{name}"
               or module.startswith(f"experiments.{name}.")
               for name in names)

  found = {module: [imported for imported in imported_modules
                    if within(imported, ABOVE_LOWER_PACKAGES)]
           for module, imported_modules in graph.items()
           if within(module, LOWER_PACKAGES)}
  return {module: bad for module, bad in found.items() if bad}


def test_lower_packages_import_no_run_configuration_or_loop():
  graph = import_graph(ROOT / "experiments")
  # Every lower package is seen, so that none escapes the check by a move.
  for package in LOWER_PACKAGES:
    assert any(module == f"experiments.{package}"
               or module.startswith(f"experiments.{package}.")
               for module in graph), package
  found = lower_package_violations(graph)
  assert not found, "\n".join(f"{module} imports {', '.join(imported)}"
                              for module, imported in found.items())


def test_every_kind_of_import_and_cycle_is_seen(tmp_path):
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("from . import low\n")
  (package / "a.py").write_text("from pkg import b\nimport os\n")
  (package / "b.py").write_text(
      "def f():\n  from pkg.sub import low\n  import pkg.c\n")
  (package / "c.py").write_text(
      "from typing import TYPE_CHECKING\n"
      "if TYPE_CHECKING:\n  from pkg import a\n"
      "BUILDER = 'pkg.d:build'\n")
  (package / "d.py").write_text(
      "import importlib\nimportlib.import_module('pkg.sub.low')\n"
      "from pkg import a\n")
  (package / "sub" / "low.py").write_text(
      "from .. import d\nfrom ..b import f\nfrom pkg.sub import low\n")
  graph = import_graph(package)
  assert graph == {
      "pkg": [],
      "pkg.a": ["pkg.b"],
      "pkg.b": ["pkg.c", "pkg.sub.low"],
      "pkg.c": ["pkg.a"],  # Not pkg.d, its builder.
      "pkg.d": ["pkg.a", "pkg.sub.low"],
      "pkg.sub": ["pkg.sub.low"],
      "pkg.sub.low": ["pkg.b", "pkg.d"],
  }
  assert [_named(cycle) for cycle in cycles(graph)] == [
      "pkg.a -> pkg.b -> pkg.c -> pkg.a",
      "pkg.a -> pkg.b -> pkg.sub.low -> pkg.d -> pkg.a",
      "pkg.b -> pkg.sub.low -> pkg.b",
      "pkg.d -> pkg.sub.low -> pkg.d",
  ]


def test_a_lower_package_importing_the_run_is_seen():
  graph = {"experiments.data.datasets": ["experiments.catalog",
                                         "experiments.config"],
           "experiments.models": ["experiments.training.loop"],
           "experiments.rundir.checkpoints": ["experiments.rundir.claim",
                                              "experiments.training.steps"],
           "experiments.weights.convert": ["experiments.data.datasets"],
           "experiments.train": ["experiments.data.datasets"],
           "experiments.database": ["experiments.rundir.records"]}
  assert lower_package_violations(graph) == {
      "experiments.data.datasets": ["experiments.config"],
      "experiments.models": ["experiments.training.loop"],
      "experiments.rundir.checkpoints": ["experiments.training.steps"]}
