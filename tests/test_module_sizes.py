"""The house rules on size: no module of experiments/ or pgrad_jax/ over
`MAX_MODULE_LINES` lines, no function over `MAX_FUNCTION_LINES`, its
docstring included.

A module past the limit holds more than one idea, a function past it more
than one step; the fix is to split them, not to raise the limits. The
modules are parsed, never imported.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ("experiments", "pgrad_jax")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def function_lengths(source):
  """Every function's lines, ``end_lineno - lineno + 1`` (its docstring
  included, its decorators not), by qualified name: ``Class.method``,
  ``outer.inner``."""
  lengths = {}

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      name = prefix
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                            ast.ClassDef)):
        name = f"{prefix}{child.name}"
        if not isinstance(child, ast.ClassDef):
          lengths[name] = child.end_lineno - child.lineno + 1
        name += "."
      visit(child, name)

  visit(ast.parse(source), "")
  return lengths


def oversized(root, packages=PACKAGES):
  """The modules and functions of ``packages`` under ``root`` past the
  limits.

  Returns:
    ``(modules, functions)``: ``{path: lines}`` of every module over
    `MAX_MODULE_LINES`, and ``{(path, name): lines}`` of every function over
    `MAX_FUNCTION_LINES`, paths relative to ``root`` in POSIX form.
  """
  modules, functions = {}, {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      name = path.relative_to(root).as_posix()
      source = path.read_text()
      if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
        modules[name] = lines
      functions.update(((name, function), lines) for function, lines
                       in function_lengths(source).items()
                       if lines > MAX_FUNCTION_LINES)
  return modules, functions


def test_no_module_or_function_past_the_limits():
  modules, functions = oversized(ROOT)
  assert not modules, (
      f"Modules over {MAX_MODULE_LINES} lines, to split into one idea "
      f"each: {modules}")
  assert not functions, (
      f"Functions over {MAX_FUNCTION_LINES} lines, to split: {functions}")


def test_the_limits_count_every_line_of_modules_and_functions(tmp_path):
  package = tmp_path / "experiments"
  (package / "sub").mkdir(parents=True)
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 2))
  # A function of exactly the limit: its def, docstring and body lines; a
  # method and a nested function one line longer.
  (package / "ok.py").write_text(
      f'def at_limit():\n  """Doc."""\n{body}\n')
  (package / "sub" / "long.py").write_text(
      f'class A:\n  def method(self):\n    """Doc."""\n'
      + "\n".join("  " + line for line in body.splitlines())
      + "\n    return 0\n"
      + f'def outer():\n  def inner():\n    """Doc."""\n'
      + "\n".join("  " + line for line in body.splitlines())
      + "\n    return 0\n  return inner\n"
      + "\n" * MAX_MODULE_LINES)
  modules, functions = oversized(tmp_path, ["experiments"])
  # The class's line, the method's, outer's, and the empty lines.
  assert modules == {"experiments/sub/long.py": 1 + (MAX_FUNCTION_LINES + 1)
                     + (MAX_FUNCTION_LINES + 3) + MAX_MODULE_LINES}
  assert functions == {
      ("experiments/sub/long.py", "A.method"): MAX_FUNCTION_LINES + 1,
      ("experiments/sub/long.py", "outer.inner"): MAX_FUNCTION_LINES + 1,
      ("experiments/sub/long.py", "outer"): MAX_FUNCTION_LINES + 3}
