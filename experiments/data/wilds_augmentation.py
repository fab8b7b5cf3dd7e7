"""PovertyMap's training augmentation: flips and colour jitter, as in WILDS 1.x.

WILDS keeps its training transforms in its ``examples/`` folder, not in the
``wilds`` package. From v1.0.0 to v1.2.2, ``examples/transforms.py`` augments
PovertyMap's training images (v1.2.2, ``initialize_poverty_transform``, lines
99-116; v1.1.0, ``initialize_poverty_train_transform``, lines 89-103) with::

    RandomHorizontalFlip(), RandomVerticalFlip(),
    ColorJitter(brightness=0.8, contrast=0.8, saturation=0.8, hue=0.1)

on the visible bands, turned from the stored blue-green-red order to RGB and
back. Fish (YugeTen/fish at 333efa2, ``src/models/poverty.py`` lines 16-31),
whose WILDS protocol the PGrad paper follows, copies that transform. WILDS
2.0.0 no longer applies it by default: its ``"poverty"`` transform composes no
step for training (``examples/transforms.py`` lines 44-48 and 77-83), and
flips and jitter remain only inside its RandAugment variant (lines 272-307),
for the algorithms that ask for it (``examples/configs/algorithm.py``).

This module applies the 1.x transform with two corrections, each as WILDS
2.0.0's own code does it:

* The flips move all eight bands together. WILDS 1.x flips only the three
  bands it jitters, which no longer line up with the other five; 2.0.0 flips
  the whole image (``examples/transforms.py`` lines 299-300).
* The jitter works on reflectances in [0, 1]: the RGB bands un-normalised
  with WILDS's per-band means and standard deviations
  (``wilds/datasets/poverty_dataset.py`` lines 71-95), as 2.0.0's
  ``poverty_rgb_color_transform`` does (lines 246-270), and normalised again
  afterwards (2.0.0 means to, but its ``normalize_rgb_in_poverty_ms_img``
  returns its input, line 259). WILDS 1.x hands the normalised values to
  ``ToPILImage``, which multiplies them by 255 and casts to uint8, wrapping
  every value outside [0, 1].

The jitter is torchvision's ``ColorJitter`` on float images
(``torchvision/transforms/transforms.py`` at 6247d96, ``ColorJitter``;
``torchvision/transforms/_functional_tensor.py`` at b52f7a7): factors
``U(0.2, 1.8)`` for brightness, contrast and saturation and a hue shift
``U(-0.1, 0.1)``, applied in a uniformly random order, each clipping the
image to [0, 1]:

* brightness ``f``: ``f * x``;
* contrast ``f``: ``f * x + (1 - f) * m``, ``m`` the image's mean luma;
* saturation ``f``: ``f * x + (1 - f) * luma(x)``, per pixel;
* hue ``h``: the hue of HSV turned by ``h`` (modulo 1).

Luma is ``0.2989 R + 0.587 G + 0.114 B``. Reflectances outside [0, 1] are
clipped into it first, the range those definitions hold on.

Every random draw comes from the NumPy Generator the caller passes, seeded
per (seed, step, example), so an example's augmentation is a function of
those alone and a resumed run draws the same.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from experiments.data import color_jitter
from experiments.data import datasets

# The bands of PovertyMap's images, in their stored order
# (wilds/datasets/poverty_dataset.py, BAND_ORDER, line 13).
BANDS = ("BLUE", "GREEN", "RED", "SWIR1", "SWIR2", "TEMP1", "NIR",
         "NIGHTLIGHTS")
# The stored bands of red, green and blue, in that order.
RGB_BANDS = (2, 1, 0)
# WILDS's normalisation of red, green and blue (poverty_dataset.py,
# _MEANS_2009_17 and _STD_DEVS_2009_17).
RGB_MEAN = np.array([0.104145, 0.088619, 0.059183])
RGB_STD = np.array([0.051458, 0.031880, 0.022926])
_RGB_MEAN, _RGB_STD = RGB_MEAN[:, None, None], RGB_STD[:, None, None]
FLIP_PROBABILITY = 0.5
# ColorJitter(brightness=0.8, contrast=0.8, saturation=0.8, hue=0.1).
JITTER = 0.8
HUE_JITTER = 0.1
# torchvision's luma weights of red, green and blue (rgb_to_grayscale).
LUMA_WEIGHTS = np.array([0.2989, 0.587, 0.114])


class PovertyAugmentation(NamedTuple):
  """The random draws that augment one PovertyMap image.

  Attributes:
    flip_horizontal: whether the image is flipped left to right.
    flip_vertical: whether the image is flipped top to bottom.
    jitter: the colour jitter of the RGB bands.
  """

  flip_horizontal: bool
  flip_vertical: bool
  jitter: color_jitter.ColorJitter


def draw(rng: np.random.Generator) -> PovertyAugmentation:
  """Draws the augmentation of one image: the flips, in WILDS's order, then
  the jitter's order and its four factors (``ColorJitter.get_params``)."""
  flip_horizontal = bool(rng.random() < FLIP_PROBABILITY)
  flip_vertical = bool(rng.random() < FLIP_PROBABILITY)
  return PovertyAugmentation(flip_horizontal, flip_vertical,
                             color_jitter.draw(rng, JITTER, HUE_JITTER))


def luma(rgb: np.ndarray) -> np.ndarray:
  """The ``(H, W)`` luma of ``(3, H, W)`` RGB planes."""
  return np.tensordot(LUMA_WEIGHTS, rgb, axes=1)


def _blend(image: np.ndarray, other: np.ndarray | float,
           factor: float) -> np.ndarray:
  blended = factor * image
  blended += (1.0 - factor) * other
  # np.clip, without its overhead.
  return np.minimum(np.maximum(blended, 0.0, out=blended), 1.0, out=blended)


def adjust_brightness(rgb: np.ndarray, factor: float) -> np.ndarray:
  """Scales ``(3, H, W)`` RGB in [0, 1] by ``factor``, clipped to [0, 1]."""
  return _blend(rgb, 0.0, factor)


def adjust_contrast(rgb: np.ndarray, factor: float) -> np.ndarray:
  """Moves ``(3, H, W)`` RGB in [0, 1] away from (``factor`` > 1) or
  towards its mean luma, clipped to [0, 1]."""
  return _blend(rgb, luma(rgb).mean(), factor)


def adjust_saturation(rgb: np.ndarray, factor: float) -> np.ndarray:
  """Moves ``(3, H, W)`` RGB in [0, 1] away from (``factor`` > 1) or
  towards its own luma, pixel by pixel, clipped to [0, 1]."""
  return _blend(rgb, luma(rgb), factor)


def rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
  """``(3, H, W)`` RGB in [0, 1] to hue, saturation and value in [0, 1].

  The hue is in turns; grey pixels get hue and saturation 0. Where two
  channels tie for the largest, red comes before green before blue.
  """
  r, g, b = rgb
  value = np.maximum(np.maximum(r, g), b)
  chroma = value - np.minimum(np.minimum(r, g), b)
  grey = chroma == 0
  # Grey pixels divide by 1 instead of 0; their hue is set to 0 below.
  inverse_chroma = 1.0 / np.where(grey, 1.0, chroma)
  saturation = chroma / np.where(grey, 1.0, value)
  sixths = np.where(value == r, (g - b) * inverse_chroma,
                    np.where(value == g, 2.0 + (b - r) * inverse_chroma,
                             4.0 + (r - g) * inverse_chroma))
  hue = np.divide(sixths, 6.0, out=sixths)
  hue += hue < 0  # From (-1/6, 5/6] to [0, 1).
  hue[grey] = 0.0
  return np.stack([hue, saturation, value])


# hsv_to_rgb's offsets of red, green and blue, in sixths of a turn.
_HSV_OFFSETS = np.array([5.0, 3.0, 1.0])[:, None, None]


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
  """``(3, H, W)`` hue (in turns), saturation and value in [0, 1] to RGB.

  Channel ``c`` is ``v - v s clip(min(k, 4 - k), 0, 1)`` with ``k`` its
  offset plus the hue in sixths, modulo 6: the six sectors of the colour
  wheel in one formula.
  """
  hue, saturation, value = hsv
  sixths = 6.0 * hue + _HSV_OFFSETS
  np.subtract(sixths, 6.0, out=sixths, where=sixths >= 6.0)  # k < 12.
  weight = np.minimum(sixths, 4.0 - sixths, out=sixths)
  np.minimum(np.maximum(weight, 0.0, out=weight), 1.0, out=weight)
  weight *= value * saturation
  return np.subtract(value, weight, out=weight)


def adjust_hue(rgb: np.ndarray, shift: float) -> np.ndarray:
  """Turns the hue of ``(3, H, W)`` RGB in [0, 1] by ``shift`` (modulo 1)."""
  if not -0.5 <= shift <= 0.5:
    raise ValueError(f"A hue shift is in [-0.5, 0.5], got {shift}.")
  hsv = rgb_to_hsv(rgb)
  hue = hsv[0]
  hue += shift
  # Modulo 1, for a hue in [-0.5, 1.5).
  hue -= hue >= 1.0
  hue += hue < 0.0
  return hsv_to_rgb(hsv)


def apply(image: np.ndarray, augmentation: PovertyAugmentation) -> np.ndarray:
  """Augments a normalised ``(H, W, 8)`` PovertyMap image.

  Args:
    image: the image as stored, channels-last, bands in `BANDS` order.
    augmentation: its draws, from `draw`.

  Returns:
    A new float32 ``(H, W, 8)`` image: flipped, its RGB bands jittered as
    reflectances and normalised again, the other bands only flipped.
  """
  if image.ndim != 3 or image.shape[-1] != len(BANDS):
    raise ValueError("A PovertyMap image is (H, W, 8) with bands "
                     f"{BANDS}, got shape {image.shape}.")
  if augmentation.flip_horizontal:
    image = image[:, ::-1]
  if augmentation.flip_vertical:
    image = image[::-1]
  # Colour planes (3, H, W): contiguous, so each operation is fast.
  rgb = np.ascontiguousarray(np.moveaxis(image[..., RGB_BANDS], -1, 0),
                             np.float64)
  reflectance = np.clip(rgb * _RGB_STD + _RGB_MEAN, 0.0, 1.0)
  jittered = color_jitter.apply(
      augmentation.jitter, reflectance, brightness=adjust_brightness,
      contrast=adjust_contrast, saturation=adjust_saturation, hue=adjust_hue)
  augmented = np.array(image, np.float32)
  augmented[..., RGB_BANDS] = np.moveaxis(
      (jittered - _RGB_MEAN) / _RGB_STD, 0, -1)
  return augmented


def augment_poverty(example: datasets.Element,
                    rng: np.random.Generator) -> datasets.Element:
  """PovertyMap's training transform of one example, a per-example transform
  of `pipeline.make_train_iterator`.

  Args:
    example: ``{"image": float32 (H, W, 8), ...}`` as `wilds.poverty_map`
      serves it.
    rng: the generator of this example's draws.

  Returns:
    The example with its image augmented; its other entries unchanged.
  """
  return {**example, "image": apply(example["image"], draw(rng))}
