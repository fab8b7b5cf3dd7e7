"""The random draws of torchvision's ``ColorJitter``, and their order.

``ColorJitter.get_params`` (pytorch/vision,
``torchvision/transforms/transforms.py`` at 6247d96) draws a uniformly
random order of the four colour adjustments, then the brightness, contrast
and saturation factors from ``U(1 - j, 1 + j)`` and the hue shift from
``U(-h, h)``; ``forward`` applies the adjustments in that order.

Both training augmentations jitter colours so:
`experiments.data.photo_augmentation` on uint8 photos, as torchvision's PIL
backend does, and `experiments.data.wilds_augmentation` on float
reflectances, as its tensor backend does. Each brings its own adjustments;
this module holds what they share, and imports neither Pillow nor a dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

# The colour adjustments, as numbered in `ColorJitter.order`.
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)


class ColorJitter(NamedTuple):
  """The colour jitter of one image.

  Attributes:
    order: the adjustments in the order applied, a permutation of
      ``(BRIGHTNESS, CONTRAST, SATURATION, HUE)``.
    brightness: the brightness factor.
    contrast: the contrast factor.
    saturation: the saturation factor.
    hue: the hue shift, in turns of the colour wheel.
  """

  order: tuple[int, int, int, int]
  brightness: float
  contrast: float
  saturation: float
  hue: float


def draw(rng: np.random.Generator, factor_jitter: float,
         hue_jitter: float) -> ColorJitter:
  """``ColorJitter(factor_jitter, factor_jitter, factor_jitter,
  hue_jitter).get_params``: the order, then the four factors.

  Args:
    rng: the generator to draw from.
    factor_jitter: the factors are drawn from ``U(1 - factor_jitter, 1 +
      factor_jitter)``.
    hue_jitter: the hue shift is drawn from ``U(-hue_jitter, hue_jitter)``.

  Returns:
    The draws.
  """
  order = tuple(int(i) for i in rng.permutation(4))
  brightness, contrast, saturation = rng.uniform(
      1 - factor_jitter, 1 + factor_jitter, 3)
  hue = rng.uniform(-hue_jitter, hue_jitter)
  return ColorJitter(order, float(brightness), float(contrast),
                     float(saturation), float(hue))


def apply(
    jitter: ColorJitter,
    image: np.ndarray,
    *,
    brightness: Callable[[np.ndarray, float], np.ndarray],
    contrast: Callable[[np.ndarray, float], np.ndarray],
    saturation: Callable[[np.ndarray, float], np.ndarray],
    hue: Callable[[np.ndarray, float], np.ndarray],
) -> np.ndarray:
  """Applies the four adjustments to ``image`` in ``jitter.order``.

  Args:
    jitter: the draws, from `draw`.
    image: the pixels, in the layout and dtype the adjustments take.
    brightness: ``brightness(image, factor)``, the adjusted image.
    contrast: likewise.
    saturation: likewise.
    hue: ``hue(image, shift)``, the adjusted image.

  Returns:
    The jittered image.
  """
  adjustments = {BRIGHTNESS: (brightness, jitter.brightness),
                 CONTRAST: (contrast, jitter.contrast),
                 SATURATION: (saturation, jitter.saturation),
                 HUE: (hue, jitter.hue)}
  for adjustment in jitter.order:
    adjust, factor = adjustments[adjustment]
    image = adjust(image, factor)
  return image
