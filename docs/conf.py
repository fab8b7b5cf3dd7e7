"""Sphinx configuration of the library's site: ``sphinx-build -W docs OUT``.

The pages are Markdown (MyST). The site is the library's: the README's
Quick start, method and Performance sections (included, not copied),
design.md, api.md, scaling.md and the API reference generated from the
docstrings. The experiments' pages (study.md, testing.md, wilds.md) stay
on the repository.
"""

import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).parent
ROOT = DOCS.parent
# The library as the checkout holds it, whether or not it is installed.
sys.path.insert(0, str(ROOT))

import pgrad_jax  # pylint: disable=wrong-import-position

project = "pgrad_jax"
author = "The pgrad_jax authors"
copyright = "The pgrad_jax authors"  # pylint: disable=redefined-builtin
release = version = pgrad_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "study.md", "testing.md", "wilds.md",
                    "*.png"]

# GitHub's heading anchors (#model-state-batchnorm-statistics), which the
# pages' links use, down to ####.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # principal=PrincipalOptions(), not its repr.
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = f"pgrad_jax {version}"
html_theme_options = {"show_toc_level": 2}

# The pages are written for the repository, where the README's sections are
# README.md#anchors and its links are relative to the root. On the site those
# sections are pages of their own (their included text keeps one copy of
# every number), so the links are rewritten to where the site has them.
README_SECTIONS = {
    "quick-start": "quickstart.md",
    "the-method-in-six-steps": "method.md",
    "performance": "performance.md",
}
_LINK = re.compile(r"(\]\()([^)\s#]*)(#[^)\s]*)?(\))")


def site_link(target: str, anchor: str, source: pathlib.Path) -> str:
  """A link of ``source`` (README.md or a page) as a page of docs/ writes it."""
  if not target or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
    return target + anchor
  path = (source.parent / target).resolve()
  if path == ROOT / "README.md" and anchor[1:] in README_SECTIONS:
    return README_SECTIONS[anchor[1:]]
  if path.parent == DOCS:
    return path.name + anchor
  # Anything else of the repository (benchmark results) is a download.
  return f"../{path.relative_to(ROOT).as_posix()}{anchor}"


def rewrite_links(text: str, source: pathlib.Path) -> str:
  return _LINK.sub(
      lambda m: m[1] + site_link(m[2], m[3] or "", source) + m[4], text)


def on_source_read(app, docname, content):
  del app
  content[0] = rewrite_links(content[0], DOCS / f"{docname}.md")


def on_include_read(app, relative_path, parent_docname, content):
  del app, parent_docname
  content[0] = rewrite_links(content[0], (DOCS / relative_path).resolve())


def setup(app):
  app.connect("source-read", on_source_read)
  app.connect("include-read", on_include_read)
