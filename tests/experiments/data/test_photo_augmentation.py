"""Tests for experiments/data/photo_augmentation.py: DomainBed's photo
augmentation.

The draws are checked against the distributions torchvision defines them by,
the adjustments against Pillow (which torchvision calls) or float64 NumPy.
Statistical bounds are 4.5 standard errors of the measured statistic, or the
Dvoretzky-Kiefer-Wolfowitz bound at the same level for whole distributions:
a correct draw breaks one with probability about 1e-5, a wrong parameter
(another scale, a ratio uniform instead of log-uniform, p = 0.5 for
grayscale) by several times the bound.
"""

import colorsys
import itertools
import math

import numpy as np
import pytest
from PIL import Image
from PIL import ImageEnhance

from experiments.data import photo_augmentation as augmentation
from experiments.data import color_jitter
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline

DRAWS = 20_000
# DKW: P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2) = 2e-5 at this eps.
DKW_EPS = math.sqrt(math.log(2 / 2e-5) / (2 * DRAWS))
SIGMAS = 4.5


def _sigma_bound(p: float, n: int) -> float:
  return SIGMAS * math.sqrt(p * (1 - p) / n)


def _photo(rng, height=37, width=45):
  """A smooth random photo: gradients and blobs, as JPEG photos are."""
  y, x = np.mgrid[0:height, 0:width] / max(height, width)
  base = rng.uniform(0, 255, 3) + 200 * (x[..., None] * rng.uniform(-1, 1, 3)
                                         + y[..., None] * rng.uniform(-1, 1, 3))
  noise = rng.normal(0, 25, (height, width, 3))
  return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.fixture(name="draws", scope="module")
def fixture_draws():
  """DRAWS augmentations of a 227x227 photo (PACS's size)."""
  rng = np.random.default_rng(0)
  return [augmentation.draw(227, 227, rng) for _ in range(DRAWS)]


def _crop_distribution(scale_low, ratio_low, ratio_high):
  """The CDFs of an accepted crop's area fraction ``s`` and log aspect ratio
  ``t`` on a large square image, where rounding to pixels is negligible.

  An attempt draws ``s ~ U(scale_low, 1)`` and ``t ~ U(log ratio_low, log
  ratio_high)``; it fits iff ``w = sqrt(s r) <= 1`` and ``h = sqrt(s / r) <=
  1`` (sides in units of the image's), i.e. ``s <= exp(-|t|)``. The accepted
  draw is uniform on that region; its marginals, integrated in float64.
  """
  a, b = math.log(ratio_low), math.log(ratio_high)
  s_grid = np.linspace(scale_low, 1, 20001)
  t_grid = np.linspace(a, b, 20001)
  # Widths of the region at each s (in t) and at each t (in s).
  width_t = np.clip(np.minimum(b, -np.log(s_grid)) - np.maximum(
      a, np.log(s_grid)), 0, None)
  width_s = np.clip(np.exp(-np.abs(t_grid)) - scale_low, 0, None)

  def cdf(grid, width):
    steps = np.diff(grid) * (width[1:] + width[:-1]) / 2
    cumulative = np.concatenate([[0], np.cumsum(steps)])
    return lambda x: np.interp(x, grid, cumulative / cumulative[-1])

  return cdf(s_grid, width_t), cdf(t_grid, width_s)


def test_crop_area_and_aspect_ratio_follow_random_resized_crop():
  side = 100_000  # Pixels: rounding moves s and t by ~1e-5.
  rng = np.random.default_rng(1)
  crops = np.array([augmentation.draw_crop(side, side, rng)
                    for _ in range(DRAWS)], np.float64)
  heights, widths = crops[:, 2], crops[:, 3]
  scales = heights * widths / side**2
  log_ratios = np.log(widths / heights)
  scale_cdf, ratio_cdf = _crop_distribution(0.7, 3 / 4, 4 / 3)
  for values, cdf in ((scales, scale_cdf), (log_ratios, ratio_cdf)):
    values = np.sort(values)
    empirical = np.arange(1, DRAWS + 1) / DRAWS
    assert np.max(np.abs(empirical - cdf(values))) < DKW_EPS
  # Both ends of both ranges are reached.
  assert scales.min() < 0.71 and scales.max() > 0.99
  assert np.log(3 / 4) < log_ratios.min() < np.log(3 / 4) + 0.01
  assert np.log(4 / 3) - 0.01 < log_ratios.max() < np.log(4 / 3)


def test_crops_of_a_pacs_photo_lie_inside_it_uniformly_placed(draws):
  crops = np.array([d.crop for d in draws])
  tops, lefts, heights, widths = crops.T
  assert np.all((tops >= 0) & (lefts >= 0))
  assert np.all((tops + heights <= 227) & (lefts + widths <= 227))
  # Rounding each side to a pixel moves the area by at most half a pixel
  # per side: (s * 227 + 0.5)... bounded by 0.5 (h + w) / 227^2 < 0.0045.
  scales = heights * widths / 227**2
  assert scales.min() >= 0.7 - 0.0045 and scales.max() <= 1
  ratios = widths / heights
  # w / h of sides rounded by half a pixel: within 0.5 (1/h + r/h) of r.
  assert ratios.min() >= 3 / 4 - 0.01 and ratios.max() <= 4 / 3 + 0.01
  # The offset is uniform on 0..(227 - side): mean 1/2 of the slack, and
  # variance (n + 2) / (12 n) of it for n + 1 places.
  for offsets, sides in ((tops, heights), (lefts, widths)):
    slack = 227 - sides
    moving = slack > 0
    fraction = offsets[moving] / slack[moving]
    spread = np.sqrt(np.mean((slack[moving] + 2) / (12 * slack[moving])))
    assert abs(fraction.mean() - 0.5) < SIGMAS * spread / np.sqrt(
        moving.sum())
    assert np.any(offsets[moving] == 0)
    assert np.any(offsets[moving] == slack[moving])


@pytest.mark.parametrize("width, height, crop", [
    # Wider than 4:3 at any scale >= 0.7: no attempt fits; the fallback is
    # the central crop of the full height at the widest ratio, 4:3.
    (300, 100, (0, (300 - 133) // 2, 100, 133)),
    # Taller than 3:4: the full width at the tallest ratio.
    (100, 300, ((300 - 133) // 2, 0, 133, 100)),
])
def test_crop_falls_back_to_the_central_crop_within_the_ratio_range(
    width, height, crop):
  rng = np.random.default_rng(2)
  assert {augmentation.draw_crop(width, height, rng)
          for _ in range(50)} == {crop}


def test_flip_and_grayscale_rates(draws):
  flips = np.mean([d.flip for d in draws])
  greys = np.mean([d.grayscale for d in draws])
  assert abs(flips - 0.5) < _sigma_bound(0.5, DRAWS)
  assert abs(greys - 0.1) < _sigma_bound(0.1, DRAWS)


def test_jitter_factors_are_uniform_on_their_ranges(draws):
  for name, low, high in (("brightness", 0.7, 1.3), ("contrast", 0.7, 1.3),
                          ("saturation", 0.7, 1.3), ("hue", -0.3, 0.3)):
    values = np.sort([getattr(d.jitter, name) for d in draws])
    assert low <= values[0] < low + 0.01 and high - 0.01 < values[-1] < high
    uniform_cdf = (values - low) / (high - low)
    empirical = np.arange(1, DRAWS + 1) / DRAWS
    assert np.max(np.abs(empirical - uniform_cdf)) < DKW_EPS, name


def test_jitter_order_is_a_uniformly_random_permutation(draws):
  counts = {order: 0 for order in itertools.permutations(range(4))}
  for d in draws:
    counts[d.jitter.order] += 1
  assert len(counts) == 24
  for order, count in counts.items():
    assert abs(count / DRAWS - 1 / 24) < _sigma_bound(1 / 24, DRAWS), order


@pytest.mark.parametrize("adjust, enhancer", [
    (augmentation.adjust_brightness, ImageEnhance.Brightness),
    (augmentation.adjust_contrast, ImageEnhance.Contrast),
    (augmentation.adjust_saturation, ImageEnhance.Color),
])
def test_colour_adjustments_equal_pillows(adjust, enhancer):
  # torchvision's PIL backend is ImageEnhance; equal to the byte.
  rng = np.random.default_rng(3)
  for _ in range(5):
    pixels = _photo(rng)
    for factor in rng.uniform(0.5, 1.5, 8):
      expected = np.asarray(enhancer(Image.fromarray(pixels)).enhance(factor))
      np.testing.assert_array_equal(adjust(pixels, factor), expected)


def test_hue_turns_the_colour_wheel_by_the_factor():
  # Against float64 HSV (colorsys): Pillow's HSV holds 256 hue levels, and
  # both of its conversions truncate, so a pixel may be off by two hue
  # levels, 2 * 6 * 255 / 256 < 12 grey levels at full saturation, plus a
  # level of S and V; on average far less.
  rng = np.random.default_rng(4)
  pixels = _photo(rng, 24, 24)
  for hue in (0.3, -0.3, 0.1, -0.05, 0.0):
    shift = int(hue * 255) % 256 / 256  # torchvision's uint8(255 h) levels.
    expected = np.array([
        [colorsys.hsv_to_rgb((h + shift) % 1, s, v) for h, s, v in (
            colorsys.rgb_to_hsv(*(p / 255)) for p in row)]
        for row in pixels]) * 255
    error = np.abs(augmentation.adjust_hue(pixels, hue) - expected)
    assert error.max() < 13 and error.mean() < 1.5, hue
  # A third of a turn takes pure red to pure green.
  red = np.zeros((2, 2, 3), np.uint8)
  red[..., 0] = 255
  np.testing.assert_array_equal(
      augmentation.adjust_hue(red, 1 / 3)[0, 0], [0, 255, 0])


def test_grayscale_is_the_luma_in_every_channel():
  rng = np.random.default_rng(5)
  pixels = _photo(rng)
  grey = augmentation.grayscale(pixels)
  luma = pixels.astype(np.float64) @ [0.299, 0.587, 0.114]
  for channel in range(3):
    # Pillow rounds a fixed-point luma: within one level.
    assert np.max(np.abs(grey[..., channel] - luma)) <= 1


def test_normalize_is_torchvisions_to_tensor_and_normalize():
  pixels = np.arange(256 * 3, dtype=np.int64).reshape(16, 16, 3) % 256
  pixels = pixels.astype(np.uint8)
  expected = (pixels / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
  got = datasets.normalize(pixels)
  assert got.dtype == np.float32
  # Its table holds the float32 arithmetic's every value.
  np.testing.assert_array_equal(
      got, (pixels.astype(np.float32) / 255 - datasets.IMAGENET_MEAN)
      / datasets.IMAGENET_STD)
  # float32 rounding of values up to 2.7 in magnitude.
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def _identity_jitter(crop, flip):
  return augmentation.PhotoAugmentation(
      crop=crop, flip=flip,
      jitter=color_jitter.ColorJitter(order=(0, 1, 2, 3), brightness=1.0,
                                      contrast=1.0, saturation=1.0, hue=0.0),
      grayscale=False)


@pytest.mark.parametrize("flip", [False, True])
def test_apply_crops_where_drawn_and_flips_left_to_right(flip):
  rng = np.random.default_rng(6)
  pixels = _photo(rng, 40, 50)
  top, left, side = 7, 11, 24
  # Cropped to the output's size: no resampling. With factors 1 the blends
  # are exact; the hue's HSV round trip moves levels by a few.
  out = augmentation.apply(Image.fromarray(pixels),
                           _identity_jitter((top, left, side, side), flip),
                           size=side)
  expected = pixels[top:top + side, left:left + side]
  if flip:
    expected = expected[:, ::-1]
  assert out.dtype == np.uint8
  levels = out.astype(np.int64)
  np.testing.assert_allclose(levels, expected, atol=13)
  mirrored = expected[:, ::-1]
  assert np.abs(levels - mirrored).mean() > 10 * np.abs(
      levels - expected).mean()


def test_apply_resizes_the_crop_bilinearly():
  rng = np.random.default_rng(7)
  pixels = _photo(rng, 60, 80)
  crop = (5, 9, 45, 52)
  out = augmentation.apply(Image.fromarray(pixels),
                           _identity_jitter(crop, False), size=32)
  resized = np.asarray(Image.fromarray(pixels[5:50, 9:61]).resize(
      (32, 32), Image.Resampling.BILINEAR))
  assert out.shape == (32, 32, 3) and out.dtype == np.uint8
  np.testing.assert_allclose(out.astype(np.int64), resized, atol=13)


def test_augment_photo_is_a_function_of_its_generator():
  rng = np.random.default_rng(8)
  example = {"image": _photo(rng, 50, 60), "label": np.int32(3)}
  first = augmentation.augment_photo(example, np.random.default_rng([1, 2]))
  again = augmentation.augment_photo(example, np.random.default_rng([1, 2]))
  other = augmentation.augment_photo(example, np.random.default_rng([1, 3]))
  np.testing.assert_array_equal(first["image"], again["image"])
  assert not np.array_equal(first["image"], other["image"])
  assert first["image"].shape == (224, 224, 3)
  assert first["label"] == 3
  small = augmentation.augment_photo(example, np.random.default_rng(0),
                                     size=16)
  assert small["image"].shape == (16, 16, 3)


def _photo_dataset(tmp_path):
  """PACS's four domains of two classes, three 40x50 JPEGs each."""
  rng = np.random.default_rng(9)
  for domain in ("art_painting", "cartoon", "photo", "sketch"):
    for name in ("dog", "horse"):
      folder = tmp_path / "PACS" / domain / name
      folder.mkdir(parents=True)
      for i in range(3):
        Image.fromarray(_photo(rng, 40, 50)).save(folder / f"{i}.jpg")
  return datasets.resized(datasets.get_dataset("PACS", data_dir=tmp_path), 16)


def test_training_augmentation_follows_the_hparam_and_the_dataset(tmp_path):
  dataset = _photo_dataset(tmp_path)
  assert augmentation.training_augmentation(
      dataset, {"data_augmentation": False}) is None
  augment = augmentation.training_augmentation(
      dataset, {"data_augmentation": True})
  assert augment.in_evaluation
  example = augment.dataset.domains[1][4]
  assert example["image"].dtype == np.uint8
  assert example["image"].shape == (40, 50, 3)  # As stored.
  augmented = augment.transform(example, np.random.default_rng(0))
  assert augmented["image"].shape == (16, 16, 3)  # The dataset's size.
  digits = datasets.get_dataset("RotatedDigits")
  with pytest.raises(ValueError, match="data_augmentation to false"):
    augmentation.training_augmentation(digits, {"data_augmentation": True})


def _batches(iterator, count):
  return [next(iterator) for _ in range(count)]


def test_augmented_batches_are_a_function_of_seed_step_and_example(
    tmp_path):
  dataset = _photo_dataset(tmp_path)
  augment = augmentation.training_augmentation(
      dataset, {"data_augmentation": True})
  splits = input_pipeline.split_domains(dataset, seed=0)

  def batches(seed=0, workers=0, start_step=0, count=3):
    return _batches(input_pipeline.make_train_iterator(
        augment.dataset, [0, 1], splits, batch_size=5, seed=seed,
        start_step=start_step, num_workers=workers,
        transform=augment.transform), count)

  reference = batches()
  for other in (batches(workers=2), [None] + batches(start_step=1, count=2)):
    for want, got in zip(reference, other):
      if got is not None:
        np.testing.assert_array_equal(got["image"], want["image"])
        np.testing.assert_array_equal(got["label"], want["label"])
  first = reference[0]["image"]
  assert first.shape == (2, 5, 16, 16, 3)
  # Every example draws its own augmentation: with 4 training examples per
  # domain and 5 draws, some example repeats, augmented differently.
  flat = first.reshape(10, -1)
  assert len({row.tobytes() for row in flat}) == 10
  assert not np.array_equal(batches(seed=1)[0]["image"], first)
  # Unaugmented, the same draws are photo_to_array's images (built here, not
  # by the worker process that the iterator starts by default).
  plain = next(input_pipeline.make_train_iterator(
      dataset, [0, 1], splits, batch_size=5, seed=0, num_workers=0))
  np.testing.assert_array_equal(plain["label"], reference[0]["label"])
  assert not np.allclose(plain["image"], first)


def test_augmented_evaluation_is_a_function_of_seed_step_and_example(
    tmp_path):
  dataset = _photo_dataset(tmp_path)
  augment = augmentation.training_augmentation(
      dataset, {"data_augmentation": True})
  indices = np.array([4, 0, 3])

  def images(step, workers=1, batch_size=2):
    return np.concatenate([b["image"] for b in input_pipeline.eval_batches(
        augment.dataset, 1, indices, batch_size=batch_size,
        num_workers=workers, transform=augment.transform, seed=0,
        step=step)])

  reference = images(step=10)
  np.testing.assert_array_equal(images(step=10, workers=0, batch_size=3),
                                reference)
  assert not np.array_equal(images(step=20), reference)
  # Each example's draw depends on the example, not on its place.
  single = np.concatenate([b["image"] for b in input_pipeline.eval_batches(
      augment.dataset, 1, indices[1:2], transform=augment.transform, seed=0,
      step=10)])
  np.testing.assert_array_equal(single[0], reference[1])
