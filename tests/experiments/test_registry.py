"""Tests for experiments/registry.py: named entries, built on first use."""

import dataclasses

import pytest

from experiments import registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape(registry.Entry):
  sides: int = 0


def _registry():
  shapes = registry.Registry("shape", Shape)
  shapes.register("square", "builtins:dict", options={"kind": "square"},
                  sides=4)
  shapes.register("triangle", lambda **kwargs: ("triangle", kwargs), sides=3)
  return shapes


def test_entries_keep_their_facts_and_order():
  shapes = _registry()
  assert list(shapes) == ["square", "triangle"]
  assert [entry.sides for entry in shapes.values()] == [4, 3]
  assert isinstance(shapes["square"], Shape)
  assert shapes["square"].name == "square"


def test_in_order_follows_registration_then_the_alphabet():
  shapes = _registry()
  assert shapes.in_order(["triangle", "hexagon", "square", "circle",
                          "triangle"]) == ["square", "triangle", "circle",
                                           "hexagon"]
  assert shapes.in_order([]) == []


def test_build_imports_a_named_builder_and_binds_the_options():
  shapes = _registry()
  assert shapes["square"].build(size=2) == {"kind": "square", "size": 2}
  assert shapes["triangle"].build(size=1) == ("triangle", {"size": 1})


def test_an_unknown_name_lists_the_known_ones():
  shapes = _registry()
  with pytest.raises(registry.UnknownNameError) as error:
    shapes["circle"]  # pylint: disable=pointless-statement
  # Both a KeyError (a missing key) and a ValueError (a bad argument).
  assert isinstance(error.value, KeyError)
  assert isinstance(error.value, ValueError)
  assert str(error.value) == (
      "Unknown shape 'circle'; known: square, triangle.")
  assert "circle" not in shapes and shapes.get("circle") is None


def test_registering_a_name_twice_is_refused():
  shapes = _registry()
  with pytest.raises(ValueError, match="Shape 'square' is already registered"):
    shapes.register("square", "builtins:dict", sides=5)
  assert shapes["square"].sides == 4
