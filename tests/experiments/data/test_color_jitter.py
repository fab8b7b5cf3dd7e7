"""Tests for experiments/data/color_jitter.py: ColorJitter's draws and order.

The distributions of the draws are tested with each augmentation's ranges
in test_photo_augmentation.py and test_wilds_augmentation.py.
"""

import itertools

import numpy as np
import pytest

from experiments.data import color_jitter


def test_draw_takes_the_order_then_the_factors_from_the_generator():
  # get_params's order of draws: a resumed run redraws the same jitter only
  # if the generator is read in this order.
  jitter = color_jitter.draw(np.random.default_rng(9), 0.4, 0.2)
  rng = np.random.default_rng(9)
  order = tuple(int(i) for i in rng.permutation(4))
  factors = rng.uniform(0.6, 1.4, 3)
  hue = rng.uniform(-0.2, 0.2)
  assert jitter == (order, *factors, hue)
  assert all(type(value) is float for value in jitter[1:])


def test_draw_keeps_to_its_ranges():
  rng = np.random.default_rng(0)
  for _ in range(200):
    jitter = color_jitter.draw(rng, 0.25, 0.05)
    assert sorted(jitter.order) == [0, 1, 2, 3]
    assert all(0.75 <= f <= 1.25 for f in jitter[1:4])
    assert -0.05 <= jitter.hue <= 0.05


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_apply_runs_every_adjustment_once_in_the_drawn_order(order):
  calls = []

  def adjustment(name):
    def adjust(image, factor):
      calls.append((name, factor))
      return image + [len(calls)]
    return adjust

  jitter = color_jitter.ColorJitter(order, 0.5, 0.75, 1.25, -0.125)
  jittered = color_jitter.apply(
      jitter, [], brightness=adjustment("brightness"),
      contrast=adjustment("contrast"), saturation=adjustment("saturation"),
      hue=adjustment("hue"))
  # Each adjustment gets the image the one before it returned.
  assert jittered == [1, 2, 3, 4]
  names = ["brightness", "contrast", "saturation", "hue"]
  assert calls == [(names[i], jitter[1 + i]) for i in order]
