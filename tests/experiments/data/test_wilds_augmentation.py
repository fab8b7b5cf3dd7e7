"""Tests for experiments/data/wilds_augmentation.py: PovertyMap's training
augmentation against its definitions, in float64 NumPy and Python's
colorsys."""

import colorsys
import itertools

import numpy as np
import pytest

from experiments.data import color_jitter
from experiments.data import wilds_augmentation as aug

# Draws of the statistical tests, from fixed seeds. Each checks a rate or a
# mean within 5 standard errors of its definition: a correct transform fails
# one such check for about one seed in 1.7 million, and a wrong rate (e.g. a
# flip rate of 0.45 or 0.55, 14 standard errors away) for every seed.
NUM_DRAWS = 20_000
STANDARD_ERRORS = 5
# Colour values in [0, 1] computed by other formulas in float64 (colorsys's
# six sectors, the tests' own luma): they differ by rounding, at most 2.2e-15
# (10 ulps of 1) measured over 10,000 pixels and 9 hue shifts. 1e-14 leaves a
# margin of 4.5; a wrong formula or constant is off by 1e-4 or more.
FLOAT64_ATOL = 1e-14


def _rate_is(observed, probability, count=NUM_DRAWS):
  error = np.sqrt(probability * (1 - probability) / count)
  return abs(np.mean(observed) - probability) < STANDARD_ERRORS * error


@pytest.fixture(name="draws", scope="module")
def fixture_draws():
  rng = np.random.default_rng(0)
  return [aug.draw(rng) for _ in range(NUM_DRAWS)]


def test_flips_are_independent_fair_coins(draws):
  horizontal = np.array([d.flip_horizontal for d in draws])
  vertical = np.array([d.flip_vertical for d in draws])
  assert _rate_is(horizontal, 0.5) and _rate_is(vertical, 0.5)
  assert _rate_is(horizontal & vertical, 0.25)


@pytest.mark.parametrize("name", ["brightness", "contrast", "saturation"])
def test_jitter_factors_are_uniform_on_0_2_to_1_8(draws, name):
  factors = np.array([getattr(d.jitter, name) for d in draws])
  # ColorJitter(0.8): U(1 - 0.8, 1 + 0.8), mean 1, standard deviation
  # 1.6 / sqrt(12).
  assert factors.min() >= 0.2 and factors.max() <= 1.8
  # The extremes are reached: P(no draw within 0.01 of an end) = e^-125.
  assert factors.min() < 0.21 and factors.max() > 1.79
  error = 1.6 / np.sqrt(12 * NUM_DRAWS)
  assert abs(factors.mean() - 1.0) < STANDARD_ERRORS * error
  # A quarter of the draws in each quarter of the range.
  quarters = np.floor((factors - 0.2) / 0.4)
  for quarter in range(4):
    assert _rate_is(quarters == quarter, 0.25)


def test_hue_shift_is_uniform_on_minus_0_1_to_0_1(draws):
  shifts = np.array([d.jitter.hue for d in draws])
  assert shifts.min() >= -0.1 and shifts.max() <= 0.1
  assert shifts.min() < -0.099 and shifts.max() > 0.099
  error = 0.2 / np.sqrt(12 * NUM_DRAWS)
  assert abs(shifts.mean()) < STANDARD_ERRORS * error
  assert _rate_is(shifts < 0, 0.5)


def test_jitter_order_is_a_uniform_permutation(draws):
  orders = np.array([d.jitter.order for d in draws])
  assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
  # Every adjustment is at every position a quarter of the time.
  for adjustment, position in itertools.product(range(4), range(4)):
    assert _rate_is(orders[:, position] == adjustment, 0.25), (adjustment,
                                                              position)


def _rgb(seed=0, size=6):
  """An RGB image in [0, 1], with grey pixels and pure hues among them."""
  rgb = np.random.default_rng(seed).uniform(size=(size, size, 3))
  rgb[0, 0] = 0.3  # Grey.
  rgb[0, 1] = [0.0, 0.0, 0.0]
  rgb[0, 2] = [1.0, 0.0, 0.0]
  rgb[0, 3] = [0.2, 0.7, 0.7]  # Green and blue tie for the largest.
  return rgb


def _luma(rgb):
  return 0.2989 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]


def _planes(rgb):
  """(H, W, 3) pixels to the module's (3, H, W) planes."""
  return np.ascontiguousarray(np.moveaxis(rgb, -1, 0))


def _pixels(planes):
  return np.moveaxis(planes, 0, -1)


@pytest.mark.parametrize("factor", [0.2, 0.7, 1.8])
def test_brightness_contrast_and_saturation_follow_their_definitions(factor):
  rgb = _rgb()
  np.testing.assert_allclose(
      _pixels(aug.adjust_brightness(_planes(rgb), factor)),
      np.clip(factor * rgb, 0, 1), rtol=0, atol=FLOAT64_ATOL)
  mean_luma = np.mean(_luma(rgb))
  np.testing.assert_allclose(
      _pixels(aug.adjust_contrast(_planes(rgb), factor)),
      np.clip(factor * rgb + (1 - factor) * mean_luma, 0, 1), rtol=0,
      atol=FLOAT64_ATOL)
  np.testing.assert_allclose(
      _pixels(aug.adjust_saturation(_planes(rgb), factor)),
      np.clip(factor * rgb + (1 - factor) * _luma(rgb)[..., None], 0, 1),
      rtol=0, atol=FLOAT64_ATOL)


def _colorsys_hue(rgb, shift):
  out = np.empty_like(rgb)
  for index in np.ndindex(rgb.shape[:-1]):
    h, s, v = colorsys.rgb_to_hsv(*rgb[index])
    out[index] = colorsys.hsv_to_rgb((h + shift) % 1.0, s, v)
  return out


@pytest.mark.parametrize("shift", [-0.1, -0.03, 0.0, 0.05, 0.1])
def test_hue_turns_the_colour_wheel_as_colorsys(shift):
  rgb = _rgb(1)
  hsv = _pixels(aug.rgb_to_hsv(_planes(rgb)))
  expected_hsv = np.array([colorsys.rgb_to_hsv(*p) for p in rgb.reshape(-1, 3)])
  np.testing.assert_allclose(hsv.reshape(-1, 3), expected_hsv, rtol=0,
                             atol=FLOAT64_ATOL)
  np.testing.assert_allclose(_pixels(aug.hsv_to_rgb(_planes(hsv))), rgb,
                             rtol=0, atol=FLOAT64_ATOL)
  turned = _pixels(aug.adjust_hue(_planes(rgb), shift))
  np.testing.assert_allclose(turned, _colorsys_hue(rgb, shift), rtol=0,
                             atol=FLOAT64_ATOL)
  # Grey stays grey; pure red turns into orange or magenta.
  np.testing.assert_array_equal(turned[0, 0], rgb[0, 0])
  if shift:
    assert not np.allclose(turned[0, 2], [1.0, 0.0, 0.0])


RGB_MEAN = np.array([0.104145, 0.088619, 0.059183])
RGB_STD = np.array([0.051458, 0.031880, 0.022926])


def _poverty_image(seed=0, size=8, clipped=False):
  """A normalised (size, size, 8) image whose RGB bands are reflectances in
  [0, 0.6], or, if ``clipped``, also outside [0, 1]."""
  rng = np.random.default_rng(seed)
  image = rng.normal(size=(size, size, 8))
  reflectance = rng.uniform(-0.2 if clipped else 0.0, 1.2 if clipped else 0.6,
                            size=(size, size, 3))
  image[..., [2, 1, 0]] = (reflectance - RGB_MEAN) / RGB_STD
  return image.astype(np.float32)


def _reference(image, augmentation):
  """The augmentation of ``image`` by its definition, in float64."""
  image = np.asarray(image, np.float64)
  if augmentation.flip_horizontal:
    image = np.flip(image, axis=1)
  if augmentation.flip_vertical:
    image = np.flip(image, axis=0)
  rgb = np.clip(image[..., [2, 1, 0]] * RGB_STD + RGB_MEAN, 0, 1)
  jitter = augmentation.jitter
  for adjustment in jitter.order:
    factor = [jitter.brightness, jitter.contrast, jitter.saturation,
              jitter.hue][adjustment]
    if adjustment == 0:
      rgb = np.clip(factor * rgb, 0, 1)
    elif adjustment == 1:
      rgb = np.clip(factor * rgb + (1 - factor) * np.mean(_luma(rgb)), 0, 1)
    elif adjustment == 2:
      rgb = np.clip(factor * rgb + (1 - factor) * _luma(rgb)[..., None], 0,
                    1)
    else:
      rgb = _colorsys_hue(rgb, factor)
  result = image.copy()
  result[..., [2, 1, 0]] = (rgb - RGB_MEAN) / RGB_STD
  return result


@pytest.mark.parametrize("clipped", [False, True])
def test_augmented_image_follows_the_definition(clipped):
  # Reflectances outside [0, 1] are clipped into it before the jitter.
  image = _poverty_image(clipped=clipped)
  before = image.copy()
  rng = np.random.default_rng(3)
  for _ in range(24):
    augmentation = aug.draw(rng)
    augmented = aug.apply(image, augmentation)
    assert augmented.dtype == np.float32 and augmented.shape == image.shape
    expected = _reference(image, augmentation)
    # The result is float32: its rounding is below 2^-24 of the largest
    # normalised value, (1 - 0.059) / 0.022926 = 41 (blue's reflectance 1),
    # 2.5e-6.
    np.testing.assert_allclose(augmented, expected, rtol=0, atol=3e-6,
                               err_msg=str(augmentation))
    # The five bands that are not jittered are only flipped, exactly.
    np.testing.assert_array_equal(augmented[..., 3:],
                                  expected[..., 3:].astype(np.float32))
  np.testing.assert_array_equal(image, before)  # The input is not changed.


def test_flips_move_every_band_together():
  image = _poverty_image(1)
  jitter_off = color_jitter.ColorJitter(
      order=(0, 1, 2, 3), brightness=1.0, contrast=1.0, saturation=1.0,
      hue=0.0)
  for horizontal, vertical in itertools.product([False, True], repeat=2):
    augmented = aug.apply(
        image, aug.PovertyAugmentation(horizontal, vertical, jitter_off))
    expected = image[:, ::-1] if horizontal else image
    expected = expected[::-1] if vertical else expected
    # Without jitter the RGB bands only pass through reflectance and back.
    np.testing.assert_allclose(augmented, expected, rtol=0, atol=3e-6)


def test_flip_rate_of_augmented_images():
  # Read the flips back from the bands that are not jittered.
  image = _poverty_image(2, size=4)
  rng = np.random.default_rng(4)
  flipped = []
  for _ in range(4000):
    bands = aug.augment_poverty({"image": image}, rng)["image"][..., 3:]
    flipped.append([np.array_equal(bands, image[:, ::-1, 3:]) or
                    np.array_equal(bands, image[::-1, ::-1, 3:]),
                    np.array_equal(bands, image[::-1, :, 3:]) or
                    np.array_equal(bands, image[::-1, ::-1, 3:])])
  flipped = np.array(flipped)
  assert _rate_is(flipped[:, 0], 0.5, 4000)
  assert _rate_is(flipped[:, 1], 0.5, 4000)


def test_augmentation_is_a_function_of_the_generator():
  example = {"image": _poverty_image(), "label": np.float32(0.5),
             "group": np.int32(1)}
  first = aug.augment_poverty(example, np.random.default_rng([7, 1, 2]))
  again = aug.augment_poverty(example, np.random.default_rng([7, 1, 2]))
  other = aug.augment_poverty(example, np.random.default_rng([7, 1, 3]))
  np.testing.assert_array_equal(first["image"], again["image"])
  assert not np.array_equal(first["image"], other["image"])
  assert first["label"] == example["label"]
  assert first["group"] == example["group"]


def test_wrong_bands_are_refused():
  with pytest.raises(ValueError, match=r"\(H, W, 8\)"):
    aug.apply(np.zeros((4, 4, 3), np.float32),
              aug.draw(np.random.default_rng(0)))
