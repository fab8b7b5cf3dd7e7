"""Tests for experiments/search_space.py: a space's declarations."""

import pytest

from experiments import entries
from experiments import search_space


@pytest.mark.parametrize("wilds", [None, "PovertyMap"])
def test_a_space_keeps_the_declared_order_and_fixes_wilds_values(wilds):
  algorithm = entries.AlgorithmEntry(name="A", builder="builtins:dict")
  dataset = entries.DatasetEntry(name="D", builder="builtins:dict",
                                 domains=("a", "b"), wilds=wilds)
  space = search_space.SearchSpace(algorithm, dataset)
  space.add_wilds("groups", 3, search_space.POSITIVE_INT)
  space.add("rate", 1.0, search_space.POSITIVE,
            search_space.log_uniform(-1, 1), wilds=2.0)
  space.add("width", 5, search_space.POSITIVE_INT,
            search_space.int_log_uniform(0, 3))
  space.update("rate", default=1.5)
  with pytest.raises(ValueError, match="'width' is declared twice"):
    space.add("width", 6, search_space.POSITIVE_INT)
  hparams = space.hparams()
  if wilds is None:
    assert list(hparams) == ["rate", "width"]
    assert [h.default for h in hparams.values()] == [1.5, 5]
    assert hparams["rate"].search.description == "10^U(-1, 1)"
  else:
    # WILDS's values, or the defaults, unsearched; WILDS's own last.
    assert list(hparams) == ["rate", "width", "groups"]
    assert [h.default for h in hparams.values()] == [2.0, 5, 3]
    assert all(h.search is None for h in hparams.values())
