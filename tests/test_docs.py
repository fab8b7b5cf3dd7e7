"""Every relative link and image in the documentation resolves, and every
command runs a module that is there.

The documentation is README.md, docs/*.md and experiments/README.md. A
relative link must name a file or folder of the repository, and a `#anchor`
must name a heading of its target, spelled as GitHub spells heading anchors.
A ``python -m`` command of the repository's own modules, there, in the
results' reports or in a module's docstring, must name a module file, or a
package with a ``__main__.py``; a dotted name of them in a code span there
(`experiments.runs.sweep`, `pgrad_jax.gram`) must name a module, a package or
a name that its module defines or imports.
"""

import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).parent.parent

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
# [text](target) and ![alt](target), with an optional "title".
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?"
                          r"(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]*)\"", re.I)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
_MODULE_COMMAND = re.compile(
    r"python -m\s+((?:pgrad_jax|experiments|benchmarks)(?:\.\w+)*)")
_DOTTED_NAME = re.compile(r"`((?:pgrad_jax|experiments|benchmarks)(?:\.\w+)+)`")


def documentation():
  """The markdown files whose links must resolve."""
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
          ROOT / "experiments" / "README.md", ROOT / "results" / "README.md"]


def without_code(text):
  """The text with fenced blocks and code spans blanked out."""
  return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_slug(heading):
  """The anchor GitHub gives a heading (its github-slugger rule).

  The rendered text, lower-cased, keeping letters, digits, marks, spaces,
  hyphens and underscores; each space becomes a hyphen.
  """
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # link -> text
  text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
  kept = "".join(
      c for c in text
      if c in " -_" or unicodedata.category(c)[0] in "LNM")
  return kept.replace(" ", "-")


def anchors(path):
  """The heading anchors of a markdown file; repeats get -1, -2, ..."""
  seen = {}
  result = set()
  for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
    slug = github_slug(heading.strip())
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    result.add(slug if count == 0 else f"{slug}-{count}")
  return result


def link_targets(text):
  """The targets of the inline, reference and HTML links of markdown text."""
  text = without_code(text)
  return [*_INLINE_LINK.findall(text), *_REFERENCE.findall(text),
          *_HTML.findall(text)]


def broken_links(path):
  """The relative links of one markdown file that do not resolve, and why."""
  broken = []
  for target in link_targets(path.read_text()):
    if not target or _SCHEME.match(target):
      continue
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    if not resolved.exists():
      broken.append(f"{target}: no such file")
    elif anchor and resolved.suffix == ".md" and anchor not in anchors(
        resolved):
      broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
  return broken


@pytest.mark.parametrize("path", documentation(),
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
  assert path.exists()
  assert broken_links(path) == []


@pytest.mark.parametrize("heading, slug", [
    # Anchors as github.com renders them for these headings.
    ("The paper's claims", "the-papers-claims"),
    ("WILDS: PovertyMap and FMoW", "wilds-povertymap-and-fmow"),
    ("DenseNet-121 at 224 px (WILDS FMoW)", "densenet-121-at-224-px-wilds-fmow"),
    ("`MultiSteps` and `apply_if_finite`", "multisteps-and-apply_if_finite"),
    ("Gradient accumulation on XLA:CPU", "gradient-accumulation-on-xlacpu"),
    ("The converged study of the 8×8 digits", "the-converged-study-of-the-88-digits"),
    ("Results on the [digits](x.md)", "results-on-the-digits"),
])
def test_github_slug(heading, slug):
  assert github_slug(heading) == slug


def test_a_broken_link_or_anchor_is_reported(tmp_path):
  (tmp_path / "other.md").write_text("# Title\n\n## Same\n\n## Same\n")
  (tmp_path / "image.png").write_bytes(b"")
  page = tmp_path / "page.md"
  page.write_text(
      "# Page\n\n"
      "[fine](other.md#same-1) [fine](#page) ![fine](image.png) "
      "[web](https://example.com/missing.md)\n"
      "[missing](nothing.md) ![missing](nothing.png) [bad](other.md#same-2)\n"
      "[bad](#nowhere)\n\n[ref]: gone/\n\n"
      "`[code](not-a-link.md)`\n\n```\n[code](not-a-link.md)\n```\n")
  assert broken_links(page) == [
      "nothing.md: no such file",
      "nothing.png: no such file",
      "other.md#same-2: no heading #same-2 in other.md",
      "#nowhere: no heading #nowhere in page.md",
      "gone/: no such file",
  ]


def commands_without_a_module(path, root=ROOT):
  """The modules that ``python -m`` commands of a file run, of those under
  ``root``, that have no file there (a module's, or a package's
  ``__main__.py``)."""
  def runnable(name):
    where = root / name.replace(".", "/")
    return (where.with_suffix(".py").is_file()
            or (where / "__main__.py").is_file())
  return [name for name in _MODULE_COMMAND.findall(path.read_text())
          if not runnable(name)]


@pytest.mark.parametrize(
    "path",
    [*documentation(), *sorted(ROOT.glob("results/*/*.md")),
     *sorted(ROOT.glob("experiments/**/*.py")),
     *sorted(ROOT.glob("benchmarks/*.py")), ROOT / ".ci" / "run"],
    ids=lambda path: str(path.relative_to(ROOT)))
def test_every_command_runs_a_module_that_is_there(path):
  assert commands_without_a_module(path) == []


def test_a_command_of_a_missing_module_is_reported(tmp_path):
  (tmp_path / "experiments" / "runs").mkdir(parents=True)
  (tmp_path / "experiments" / "runs" / "sweep.py").write_text("")
  (tmp_path / "experiments" / "weights").mkdir()
  (tmp_path / "experiments" / "weights" / "__main__.py").write_text("")
  page = tmp_path / "page.md"
  page.write_text("python -m experiments.runs.sweep list\n"
                  "`python -m\nexperiments.sweep list` python -m pip\n"
                  "python -m experiments.runs launch\n"
                  "python -m experiments.weights fetch resnet50\n")
  assert commands_without_a_module(page, tmp_path) == [
      "experiments.sweep", "experiments.runs"]


def dotted_names_not_there(path, root=ROOT):
  """The dotted names of the repository's modules in a file's code spans
  (`experiments.runs.sweep`, `pgrad_jax.gram`) that name neither a module or
  package under ``root`` nor a name that one defines or imports."""
  def there(name):
    where = root / name.replace(".", "/")
    if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file():
      return True
    module, _, attribute = name.rpartition(".")
    where = root / module.replace(".", "/")
    source = (where.with_suffix(".py") if where.with_suffix(".py").is_file()
              else where / "__init__.py")
    if not source.is_file():
      return False
    defined = re.compile(
        rf"^(?:(?:class|def) {attribute}\b|{attribute}\s*[:=]"
        rf"|(?:from \S+ )?import .*\b{attribute}\b)", re.M)
    return defined.search(source.read_text()) is not None
  return [name for name in _DOTTED_NAME.findall(path.read_text())
          if not there(name)]


@pytest.mark.parametrize("path", documentation(),
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_every_dotted_name_is_there(path):
  assert dotted_names_not_there(path) == []


def test_a_dotted_name_not_there_is_reported(tmp_path):
  (tmp_path / "experiments" / "runs").mkdir(parents=True)
  (tmp_path / "experiments" / "__init__.py").write_text("")
  (tmp_path / "experiments" / "runs" / "__init__.py").write_text("")
  (tmp_path / "experiments" / "runs" / "sweep.py").write_text(
      "from x import launch\n\nclass Grid:\n  pass\n\nDEFAULT = 1\n")
  page = tmp_path / "page.md"
  page.write_text("`experiments.runs` `experiments.runs.sweep` "
                  "`experiments.runs.sweep.Grid` `experiments.runs.sweep.launch` "
                  "`experiments.runs.sweep.DEFAULT` `experiments.sweep` "
                  "`experiments.runs.sweep.grid` `experiments.runs.study.main` "
                  "experiments.nowhere\n")
  assert dotted_names_not_there(page, tmp_path) == [
      "experiments.sweep", "experiments.runs.sweep.grid",
      "experiments.runs.study.main"]
