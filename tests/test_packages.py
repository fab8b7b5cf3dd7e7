"""How experiments/ and benchmarks/ depend on each other, and their names.

The benchmarks import the experiments, never the reverse, and no two modules
of the two packages share a file name, so that a module's name says which it
is.
"""

import ast
import collections
import fnmatch
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).parent.parent
# A registry's builder, "module:attribute", which it imports when it builds.
_BUILDER = re.compile(r"(\w+(?:\.\w+)*):\w+")


def imported_modules(path):
  """The modules a Python file imports: by import statements, by
  ``importlib.import_module`` of a string, and as the builders its strings
  name."""
  modules = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      modules.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      modules.add(node.module)
      modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    elif (isinstance(node, ast.Call) and node.args
          and isinstance(node.args[0], ast.Constant)
          and ast.unparse(node.func).endswith("import_module")):
      modules.add(node.args[0].value)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and (builder := _BUILDER.fullmatch(node.value))):
      modules.add(builder.group(1))
  return modules


def benchmark_imports(path):
  """The modules of benchmarks/ that a Python file imports."""
  return sorted(module for module in imported_modules(path)
                if module == "benchmarks" or module.startswith("benchmarks."))


def test_experiments_import_no_benchmark():
  found = {str(path.relative_to(ROOT)): benchmark_imports(path)
           for path in sorted((ROOT / "experiments").rglob("*.py"))}
  assert {path: modules for path, modules in found.items() if modules} == {}


def test_every_kind_of_import_is_seen(tmp_path):
  module = tmp_path / "module.py"
  module.write_text("import benchmarks.memory\n"
                    "from benchmarks import common\n"
                    "from experiments import catalog\n"
                    "import os.path\n"
                    "importlib.import_module('benchmarks.end_to_end')\n"
                    "BUILDER = 'benchmarks.step_time:main'\n"
                    "MESSAGE = 'the benchmarks: step_time and memory'\n"
                    "NAMED = 'benchmarks.batch_norm_variance'\n")
  assert benchmark_imports(module) == [
      "benchmarks", "benchmarks.common", "benchmarks.end_to_end",
      "benchmarks.memory", "benchmarks.step_time"]


def test_no_two_modules_share_a_name():
  paths = collections.defaultdict(list)
  for package in ("experiments", "benchmarks"):
    for path in sorted((ROOT / package).rglob("*.py")):
      if path.name != "__init__.py":
        paths[path.name].append(str(path.relative_to(ROOT)))
  assert {name: found for name, found in paths.items() if len(found) > 1
          } == {}


def packaged(root, include):
  """The packages (folders with an ``__init__.py``) of ``root`` whose dotted
  names match one of setuptools' ``include`` patterns, as its
  ``packages.find`` chooses them."""
  names = [".".join(path.parent.relative_to(root).parts)
           for path in root.rglob("__init__.py")]
  return sorted(name for name in names
                if any(fnmatch.fnmatchcase(name, pattern)
                       for pattern in include))


def test_the_wheel_packages_the_library_alone():
  # The experiments and the benchmarks run from a checkout. (.ci/run lists
  # the built wheel too.)
  setuptools = tomllib.loads(
      (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  assert packaged(ROOT, setuptools["packages"]["find"]["include"]) == [
      "pgrad_jax", "pgrad_jax._src"]
  assert setuptools["package-data"] == {"pgrad_jax": ["py.typed"]}
  assert (ROOT / "pgrad_jax" / "py.typed").is_file()


def test_packaged_matches_setuptools_patterns(tmp_path):
  for package in ("lib", "lib/sub", "libx", "other/lib"):
    (tmp_path / package).mkdir(parents=True)
    (tmp_path / package / "__init__.py").write_text("")
  assert packaged(tmp_path, ["lib", "lib.*"]) == ["lib", "lib.sub"]
