"""DomainBed's training augmentation of photos, on Pillow and NumPy.

DomainBed (facebookresearch/DomainBed at b93c22a, ``domainbed/datasets.py``
lines 199-208) trains its photo datasets on ``augment_transform``::

    RandomResizedCrop(224, scale=(0.7, 1.0))
    RandomHorizontalFlip()
    ColorJitter(0.3, 0.3, 0.3, 0.3)
    RandomGrayscale()
    ToTensor()
    Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

on the PIL images that torchvision's ``ImageFolder`` decodes. This module
draws the same random parameters from the same distributions, with
torchvision's defaults for what DomainBed leaves out (pytorch/vision,
``torchvision/transforms/transforms.py`` at 6247d96):

* ``RandomResizedCrop.get_params``: up to 10 attempts, each drawing the crop's
  area as ``U(0.7, 1.0)`` of the image's and its aspect ratio ``w / h`` as
  ``exp(U(log 3/4, log 4/3))``, ``w = round(sqrt(area * ratio))``,
  ``h = round(sqrt(area / ratio))``; the first that fits is placed uniformly
  at random. If none fits, the central crop of the whole image clamped to
  the ratio range. The crop is then resized to 224x224 (bilinear).
* ``RandomHorizontalFlip``: with probability 0.5.
* ``ColorJitter``: brightness, contrast and saturation factors from
  ``U(0.7, 1.3)``, a hue shift from ``U(-0.3, 0.3)``, applied in a uniformly
  random order of the four (`experiments.data.color_jitter`).
* ``RandomGrayscale``: with probability 0.1 (torchvision's default ``p``),
  luma copied to all three channels.

and applies them as torchvision's PIL backend does
(``torchvision/transforms/_functional_pil.py`` at 08f6a9b), to the byte:
``Image.crop`` then ``Image.resize`` for the crop; ``ImageEnhance``'s
brightness, contrast and colour blends for the first three factors (here
`blend`, equal to Pillow's and computed outside the GIL); a shift of the hue
channel of Pillow's HSV image by ``uint8(255 * hue)`` levels (modulo 256);
``convert("L")`` for grayscale. ``ToTensor`` and ``Normalize`` come last,
in the training step: the augmented photos are uint8 bytes until then
(`experiments.training.steps.normalized`, equal to `datasets.normalize`).

The random draws come from a NumPy Generator rather than torch's and Python's
generators, so the same image gets other crops than in DomainBed, drawn from
the same distributions. The caller seeds the generator per (seed, step,
example), so a batch's augmentation is a function of them alone. Which
images are augmented, as in DomainBed: `training_augmentation`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from PIL import Image
from PIL import ImageEnhance

from experiments.data import color_jitter
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline

# RandomResizedCrop(224, scale=(0.7, 1.0)) with torchvision's default ratio.
CROP_SCALE = (0.7, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
CROP_ATTEMPTS = 10
FLIP_PROBABILITY = 0.5
# ColorJitter(0.3, 0.3, 0.3, 0.3): factors 1 +- 0.3, hue shift +-0.3.
JITTER = 0.3
GRAYSCALE_PROBABILITY = 0.1


class PhotoAugmentation(NamedTuple):
  """The random draws that augment one photo.

  Attributes:
    crop: ``(top, left, height, width)`` of the crop, in pixels.
    flip: whether the crop is flipped left to right.
    jitter: the colour jitter.
    grayscale: whether the result is made grey.
  """

  crop: tuple[int, int, int, int]
  flip: bool
  jitter: color_jitter.ColorJitter
  grayscale: bool


def draw_crop(
    width: int, height: int, rng: np.random.Generator
) -> tuple[int, int, int, int]:
  """``RandomResizedCrop.get_params`` with DomainBed's scale.

  Args:
    width: the image's width.
    height: the image's height.
    rng: the generator to draw from.

  Returns:
    ``(top, left, height, width)`` of the crop.
  """
  area = width * height
  log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
  for _ in range(CROP_ATTEMPTS):
    target_area = area * rng.uniform(*CROP_SCALE)
    ratio = math.exp(rng.uniform(*log_ratio))
    # Python's round, as torchvision's: halves go to the even neighbour.
    w = int(round(math.sqrt(target_area * ratio)))
    h = int(round(math.sqrt(target_area / ratio)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  # No attempt fitted: the central crop, clamped to the ratio range.
  image_ratio = width / height
  if image_ratio < CROP_RATIO[0]:
    w, h = width, int(round(width / CROP_RATIO[0]))
  elif image_ratio > CROP_RATIO[1]:
    w, h = int(round(height * CROP_RATIO[1])), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def draw(width: int, height: int, rng: np.random.Generator
         ) -> PhotoAugmentation:
  """Draws the augmentation of one ``width x height`` photo.

  In the order of DomainBed's transforms: the crop, the flip, the colour
  jitter's order and then its four factors (as torchvision's
  ``ColorJitter.get_params``), the grayscale.
  """
  crop = draw_crop(width, height, rng)
  flip = bool(rng.random() < FLIP_PROBABILITY)
  jitter = color_jitter.draw(rng, JITTER, JITTER)
  grayscale = bool(rng.random() < GRAYSCALE_PROBABILITY)
  return PhotoAugmentation(crop, flip, jitter, grayscale)


def blend(degenerate: int | np.ndarray, pixels: np.ndarray,
          factor: float) -> np.ndarray:
  """Pillow's ``Image.blend(degenerate, image, factor)`` of uint8 pixels.

  ``ImageEnhance``'s adjustments are this blend with a "degenerate" image:
  black, the mean grey level, or the luma. Pillow computes
  ``degenerate + factor * (image - degenerate)`` in float32 per byte and
  truncates it into [0, 255] (``libImaging/Blend.c``); so does this, in
  NumPy operations that release the GIL where Pillow's loop holds it, so
  that threads augment in parallel. A single level's 256 results are
  computed once, into a table that the pixels index.

  Args:
    degenerate: one grey level for the whole image, or uint8 pixels of the
      same shape as ``pixels``.
    pixels: uint8 pixels.
    factor: 0 gives ``degenerate``, 1 ``pixels``.

  Returns:
    The blended uint8 pixels.
  """
  if np.ndim(degenerate) == 0:
    base = np.float32(degenerate)
    levels = np.arange(256, dtype=np.float32)
    table = np.clip(base + np.float32(factor) * (levels - base), 0, 255)
    return np.take(table.astype(np.uint8), pixels)
  base = degenerate.astype(np.float32)
  out = pixels.astype(np.float32)
  np.subtract(out, base, out=out)
  np.multiply(out, np.float32(factor), out=out)
  np.add(out, base, out=out)
  return np.clip(out, 0, 255, out=out).astype(np.uint8)


def adjust_brightness(pixels: np.ndarray, factor: float) -> np.ndarray:
  """``ImageEnhance.Brightness``: a blend with black."""
  return blend(0, pixels, factor)


def adjust_contrast(pixels: np.ndarray, factor: float) -> np.ndarray:
  """``ImageEnhance.Contrast``: a blend with the mean of the image's luma,
  rounded to an integer level."""
  luma = np.asarray(Image.fromarray(pixels).convert("L"))
  return blend(int(luma.mean(dtype=np.float64) + 0.5), pixels, factor)


def adjust_saturation(pixels: np.ndarray, factor: float) -> np.ndarray:
  """``ImageEnhance.Color``: a blend with the image's own luma."""
  return blend(grayscale(pixels), pixels, factor)


def adjust_hue(pixels: np.ndarray, hue: float) -> np.ndarray:
  """Turns the colour wheel of an RGB image by ``hue`` (in [-0.5, 0.5]).

  As torchvision's PIL backend: Pillow's 8-bit HSV hue channel is shifted by
  ``uint8(255 * hue)`` levels, modulo 256; that cast truncates toward zero
  and wraps negative shifts (NumPy 1's, on which DomainBed ran).
  """
  hsv = np.array(Image.fromarray(pixels).convert("HSV"))
  hsv[..., 0] += np.uint8(int(hue * 255) % 256)  # Wraps modulo 256.
  return np.asarray(Image.fromarray(hsv, "HSV").convert("RGB"))


def grayscale(pixels: np.ndarray) -> np.ndarray:
  """Pillow's luma (``convert("L")``) in all three channels."""
  return np.asarray(Image.fromarray(pixels).convert("L").convert("RGB"))


def apply(image: Image.Image, augmentation: PhotoAugmentation,
          size: int = datasets.PHOTO_SIZE) -> np.ndarray:
  """Augments an RGB photo as DomainBed's ``augment_transform`` does.

  Args:
    image: an RGB Pillow image.
    augmentation: its draws, from `draw`.
    size: the side of the square result.

  Returns:
    The uint8 ``(size, size, 3)`` pixels, not yet normalised: batches cross
    to the device as bytes, and the training step normalises them
    (`experiments.training.steps.normalized`, equal to `datasets.normalize`).
  """
  top, left, height, width = augmentation.crop
  pixels = np.asarray(image.crop((left, top, left + width, top + height))
                      .resize((size, size), Image.Resampling.BILINEAR))
  if augmentation.flip:
    pixels = pixels[:, ::-1]
  # Contiguous, so each adjustment reads it fast (their results are).
  pixels = color_jitter.apply(
      augmentation.jitter, np.ascontiguousarray(pixels),
      brightness=adjust_brightness, contrast=adjust_contrast,
      saturation=adjust_saturation, hue=adjust_hue)
  if augmentation.grayscale:
    pixels = grayscale(pixels)
  return pixels


def augment_photo(example: datasets.Element, rng: np.random.Generator,
                  size: int = datasets.PHOTO_SIZE) -> datasets.Element:
  """DomainBed's training transform of one example, an
  `input_pipeline.Transform`.

  Args:
    example: ``{"image": uint8 (h, w, 3), ...}``, a photo as decoded
      (`datasets.decoded_photos`).
    rng: the generator of this example's draws.
    size: the side of the result.

  Returns:
    The example with its image augmented: uint8 ``(size, size, 3)``
    pixels, normalised in the training step (`apply`).
  """
  image = Image.fromarray(example["image"])
  return {**example,
          "image": apply(image, draw(image.width, image.height, rng), size)}


class Augmentation(NamedTuple):
  """How a run augments the examples of its training domains.

  Attributes:
    dataset: the dataset whose examples ``transform`` takes (the photos as
      decoded, for DomainBed's augmentation).
    transform: the per-example transform.
    in_evaluation: whether the training domains' evaluation splits go through
      ``transform`` too, as DomainBed's do; the test domains' never do.
  """

  dataset: datasets.MultiDomainDataset
  transform: input_pipeline.Transform
  in_evaluation: bool


def training_augmentation(
    dataset: datasets.MultiDomainDataset, hparams: Mapping[str, Any]
) -> Augmentation | None:
  """The augmentation of a run, where its ``data_augmentation`` hparam asks
  for one.

  * Photos (DomainBed's datasets): `augment_photo`. DomainBed gives every
    training domain's images ``augment_transform``
    (``domainbed/datasets.py`` lines 213-220 at b93c22a) and only then splits
    each domain into its "in" and "out" parts (``domainbed/scripts/train.py``
    lines 119-139), which it also evaluates through that dataset (lines
    161-165): a training domain's images are augmented in its training
    batches and in the evaluation of both of its splits, a test domain's
    never.
  * WILDS: the dataset's own ``train_transform``
    (`experiments.data.wilds_augmentation`), for the training batches only, as
    WILDS's examples apply it.

  Args:
    dataset: the run's dataset (resized to its ``image_size``).
    hparams: the run's hyperparameters.

  Returns:
    The augmentation, or None where the run has none.

  Raises:
    ValueError: ``data_augmentation`` is on for a dataset without one.
  """
  if not hparams.get("data_augmentation"):
    return None
  if datasets.is_photo_dataset(dataset):
    return Augmentation(
        datasets.decoded_photos(dataset),
        functools.partial(augment_photo, size=dataset.input_shape[0]),
        in_evaluation=True)
  transform = getattr(dataset, "train_transform", None)
  if transform is None:
    raise ValueError(f"{dataset.name} has no training augmentation; set "
                     "the hparam data_augmentation to false.")
  return Augmentation(dataset, transform, in_evaluation=False)
