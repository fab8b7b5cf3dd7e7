"""The public API, ``pgrad_jax/__init__.py``: what importing it needs, its
version, and that docs/api.md and the site's API reference document every
name it exports."""

import dataclasses
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pgrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
API_REFERENCE = ROOT / "docs" / "api_reference.md"


def normalized(distribution: str) -> str:
  """A distribution's name as PEP 503 compares them."""
  return re.sub(r"[-_.]+", "-", distribution).lower()


def requirement_name(requirement: str) -> str:
  return normalized(re.match(r"[A-Za-z0-9._-]+", requirement).group())


def required_distributions(distribution: str) -> set[str]:
  """``distribution`` and what it requires, recursively, without extras."""
  found, pending = set(), [distribution]
  while pending:
    name = normalized(pending.pop())
    if name in found:
      continue
    found.add(name)
    try:
      requirements = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue  # An optional requirement that is not installed.
    pending += [requirement_name(req) for req in requirements
                if "extra ==" not in req]
  return found


def extras_only_modules() -> set[str]:
  """The installed top-level modules of the distributions that only
  pgrad_jax's extras require: Flax, Orbax, Grain, TensorFlow, pytest..."""
  extras = {requirement_name(req)
            for req in importlib.metadata.requires("pgrad_jax")
            if "extra ==" in req}
  extras -= required_distributions("pgrad_jax")
  return {module for module, distributions
          in importlib.metadata.packages_distributions().items()
          if extras & set(map(normalized, distributions))}


def test_import_needs_none_of_the_extras():
  # A fresh interpreter, so that only what `import pgrad_jax` itself imports
  # counts, not what the tests or the interpreter's start-up did.
  code = ("import json, sys; before = set(sys.modules); import pgrad_jax; "
          "print(json.dumps(sorted(set(sys.modules) - before)))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True)
  imported = {name.partition(".")[0] for name in json.loads(proc.stdout)}
  forbidden = extras_only_modules() | {"experiments", "benchmarks"}
  if importlib.util.find_spec("flax") is not None:
    assert "flax" in forbidden  # The extras' modules are found where installed.
  assert imported & forbidden == set()
  assert {"jax", "optax", "pgrad_jax"} <= imported


def code_words(markdown: str) -> set[str]:
  """The identifiers written as code (code spans and fenced blocks)."""
  fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.M | re.S)
  spans = re.findall(r"`([^`]+)`",
                     re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S))
  return set(re.findall(r"\w+", " ".join(fenced + spans)))


def undocumented(markdown: str) -> list[str]:
  """The exported names, and fields of exported types, that ``markdown``
  never writes as code."""
  words = code_words(markdown)
  missing = []
  for name in pgrad_jax.__all__:
    exported = getattr(pgrad_jax, name)
    if dataclasses.is_dataclass(exported):
      fields = [field.name for field in dataclasses.fields(exported)]
    else:
      fields = list(getattr(exported, "_fields", ()))  # A NamedTuple's.
    missing += [name] if name not in words else []
    missing += [f"{name}.{field}" for field in fields if field not in words]
  return missing


def test_api_doc_names_every_export_and_its_fields():
  assert undocumented(API.read_text()) == []


def test_an_undocumented_export_is_reported():
  # Every word the real page writes as code, less two: `Rollout` then
  # appears only in prose and inside another name, which do not count.
  kept = sorted(code_words(API.read_text()) - {"Rollout", "eigenvalues"})
  text = " ".join(f"`{word}`" for word in kept) + " Rollout `RolloutOptions`"
  assert undocumented(text) == ["PGradState.eigenvalues",
                                "PrincipalGradient.eigenvalues", "Rollout"]


def test_version_is_the_installed_distributions():
  assert pgrad_jax.__version__ == importlib.metadata.version("pgrad_jax")


def autodoc_names(markdown: str) -> list[str]:
  """The names that the autodoc directives of a page document."""
  return re.findall(r"^\.\. auto\w+:: pgrad_jax\.(\w+)$", markdown, re.M)


def test_api_reference_documents_every_export_once():
  names = autodoc_names(API_REFERENCE.read_text())
  assert sorted(names) == sorted(pgrad_jax.__all__)


def test_an_export_missing_from_the_reference_is_seen():
  assert autodoc_names(".. autofunction:: pgrad_jax.pgrad\n"
                       "   .. autoclass:: pgrad_jax.Rollout\n"
                       ".. autoclass:: pgrad_jax.PGradState\n") == [
                           "pgrad", "PGradState"]
