"""Tests for experiments/data/tasks.py."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from experiments import algorithms
from experiments import hparams_registry
from experiments import models
from experiments.data import tasks
from experiments.data import wilds
from test_algorithms import Flatten


def test_mixed_cross_entropy_weights_the_two_labels():
  logits = jnp.array([[2.0, 0.0, -1.0]])
  batch = {"label": jnp.array([0]), "mix_label": jnp.array([2]),
           "mix_weight": jnp.array([0.3])}
  log_probs = np.asarray(jax.nn.log_softmax(logits))[0]
  np.testing.assert_allclose(
      tasks.example_loss(logits, batch),
      [-(0.3 * log_probs[0] + 0.7 * log_probs[2])], rtol=1e-6)


def test_float_labels_are_regressed_with_squared_error():
  outputs = jnp.array([[1.5], [-2.0]])
  batch = {"label": jnp.array([0.5, 1.0])}
  np.testing.assert_allclose(tasks.example_loss(outputs, batch), [1.0, 9.0])
  np.testing.assert_allclose(tasks.predictions(outputs, batch["label"]),
                             [1.5, -2.0])
  with pytest.raises(ValueError, match="num_classes=1"):
    tasks.example_loss(jnp.zeros((2, 3)), batch)


def _regression_data(seed=0, size=40):
  rng = np.random.default_rng(seed)
  labels = rng.normal(size=size)
  predicted = labels + rng.normal(scale=0.8, size=size)
  groups = rng.integers(0, 2, size=size)
  return predicted, labels, groups


def _scipy_pearson(x, y):
  """SciPy's Pearson correlation, the independent reference. Imported here:
  importing scipy.stats takes about a second, which every test worker would
  pay while collecting."""
  import scipy.stats  # pylint: disable=import-outside-toplevel
  return scipy.stats.pearsonr(x, y)[0]


def test_pearson_and_mse_match_scipy_and_numpy():
  predicted, labels, _ = _regression_data()
  np.testing.assert_allclose(tasks.pearson(predicted, labels),
                             _scipy_pearson(predicted, labels),
                             rtol=1e-12)
  np.testing.assert_allclose(tasks.mean_squared_error(predicted, labels),
                             np.mean((predicted - labels) ** 2), rtol=1e-12)
  assert tasks.pearson(np.ones(5), np.arange(5.0)) == 0.0


def test_worst_group_pearson_is_the_lower_of_urban_and_rural():
  predicted, labels, groups = _regression_data(1)
  per_group = [_scipy_pearson(predicted[groups == g],
                               labels[groups == g]) for g in (0, 1)]
  assert per_group[0] != per_group[1]
  metrics = tasks.split_metrics(predicted, labels, groups)
  np.testing.assert_allclose(metrics["worst_r"], min(per_group), rtol=1e-12)
  np.testing.assert_allclose(metrics["r"],
                             _scipy_pearson(predicted, labels),
                             rtol=1e-12)
  assert set(metrics) == {"mse", "r", "worst_r"}


def test_accuracy_and_worst_region_accuracy():
  labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
  predicted = np.array([0, 1, 0, 0, 1, 2, 1, 1])
  regions = np.array([0, 0, 0, 1, 1, 1, 2, 2])
  # Region 0: 2/3, region 1: 3/3, region 2: 1/2.
  metrics = tasks.split_metrics(predicted, labels, regions)
  assert metrics == {"acc": 6 / 8, "worst_acc": 0.5}
  with pytest.raises(ValueError, match="worst_group"):
    tasks.worst_group("mse", predicted, labels, regions)


def _wilds_worst_region_accuracy(predicted, labels, regions):
  """WILDS 2.0.0's ``acc_worst_region`` (``fmow_dataset.py``, ``eval``): the
  lowest accuracy over the regions with examples, skipping "Other" (-1
  here); 0 when no region is left (``utils.minimum``'s empty value)."""
  accuracies = [np.mean(predicted[regions == region]
                        == labels[regions == region])
                for region in range(len(wilds.FMOW_REGIONS))
                if np.any(regions == region)]
  return min(accuracies) if accuracies else 0.0


# FMoW's groups: the five regions and -1, "Other" (a country in no region).
FMOW_GROUPS = [-1, *range(len(wilds.FMOW_REGIONS))]


@pytest.mark.parametrize("wrong_group", FMOW_GROUPS)
def test_worst_region_accuracy_leaves_out_other(wrong_group):
  # Four examples per group; predictions wrong on three of one group only.
  regions = np.repeat(FMOW_GROUPS, 4)
  labels = np.arange(len(regions)) % 7
  predicted = labels.copy()
  wrong = np.flatnonzero(regions == wrong_group)[:3]
  predicted[wrong] = (labels[wrong] + 1) % 7
  metrics = tasks.split_metrics(predicted, labels, regions)
  # "Other" still counts in the average accuracy.
  assert metrics["acc"] == 1 - 3 / len(regions)
  expected = 1.0 if wrong_group == -1 else 0.25
  assert metrics["worst_acc"] == expected
  assert metrics["worst_acc"] == _wilds_worst_region_accuracy(
      predicted, labels, regions)


def test_worst_region_accuracy_without_a_region_is_wilds_zero():
  labels = np.array([0, 1, 2])
  metrics = tasks.split_metrics(labels, labels, np.full(3, -1))
  assert metrics == {"acc": 1.0, "worst_acc": 0.0}


def _wilds_worst_r(predicted, labels, groups):
  """WILDS 2.0.0's PovertyMap ``r_wg`` (``standard_group_eval`` with
  ``PearsonCorrelation``): SciPy's r of every urban/rural group with
  examples, the lowest of those that are defined (``utils.minimum`` drops
  NaN, SciPy's r of a constant input)."""
  per_group = []
  for group in np.unique(groups):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # SciPy warns of a constant input.
      per_group.append(_scipy_pearson(predicted[groups == group],
                                      labels[groups == group]))
  return np.nanmin(per_group)


@pytest.mark.parametrize("group", [0, 1])
def test_worst_r_is_the_group_whose_predictions_are_off(group):
  rng = np.random.default_rng(group)
  labels = rng.normal(size=40)
  groups = np.arange(40) % 2
  # Exact predictions (r = 1) except on one group.
  predicted = labels.copy()
  off = groups == group
  predicted[off] += rng.normal(scale=0.8, size=off.sum())
  metrics = tasks.split_metrics(predicted, labels, groups)
  expected = _scipy_pearson(predicted[off], labels[off])
  assert expected < 0.95
  np.testing.assert_allclose(metrics["worst_r"], expected, rtol=1e-12)
  np.testing.assert_allclose(metrics["worst_r"],
                             _wilds_worst_r(predicted, labels, groups),
                             rtol=1e-12)


@pytest.mark.parametrize("group", [0, 1])
def test_worst_r_skips_a_group_of_constant_predictions(group):
  # WILDS's r of a constant prediction is NaN, which its worst group skips:
  # the worst group is then the other one.
  predicted, labels, _ = _regression_data(2)
  groups = np.arange(len(labels)) % 2
  predicted[groups == group] = 0.1  # 0.1 has no exact mean: no shortcut.
  other = groups != group
  metrics = tasks.split_metrics(predicted, labels, groups)
  expected = _scipy_pearson(predicted[other], labels[other])
  np.testing.assert_allclose(metrics["worst_r"], expected, rtol=1e-12)
  np.testing.assert_allclose(metrics["worst_r"],
                             _wilds_worst_r(predicted, labels, groups),
                             rtol=1e-12)


def test_worst_r_skips_a_group_of_one_example():
  # SciPy's r of one example raises, and so does WILDS's eval; here its r is
  # undefined like a constant group's, and skipped.
  predicted, labels, _ = _regression_data(3, size=9)
  groups = np.array([1] + [0] * 8)
  metrics = tasks.split_metrics(predicted, labels, groups)
  np.testing.assert_allclose(
      metrics["worst_r"], _scipy_pearson(predicted[1:], labels[1:]),
      rtol=1e-12)


def test_pearson_of_a_constant_prediction_is_zero():
  # SciPy (and WILDS's r_all) give NaN; 0 keeps selection on r well defined.
  labels = np.arange(5.0)
  assert tasks.pearson(np.full(5, 0.1), labels) == 0.0
  assert tasks.pearson(labels, np.full(5, 0.1)) == 0.0
  assert tasks.pearson(np.ones(1), np.ones(1)) == 0.0


@pytest.mark.parametrize("name", ["PGrad", "PGrad-B"])
def test_pgrad_lowers_the_mse_of_synthetic_regression_domains(name):
  num_domains, batch, num_features = 3, 12, 4
  rng = np.random.default_rng(0)
  weights = rng.normal(size=num_features)
  # Every domain shifts its inputs; the target is the same linear function.
  images = (rng.normal(size=(num_domains, batch, num_features))
            + rng.normal(size=(num_domains, 1, num_features)))
  targets = images @ weights + 0.05 * rng.normal(size=(num_domains, batch))
  batches = {"image": jnp.asarray(images, jnp.float32).reshape(
                 num_domains, batch, 2, 2, 1),
             "label": jnp.asarray(targets, jnp.float32)}
  model = models.Classifier(Flatten(num_features), 1, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**hparams_registry.default_hparams(name, "RotatedDigits"),
             "lr": 5e-2, "outer_lr": 0.5}
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=num_domains)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)

  def mse(params):
    outputs, _ = network.logits(params, stats, batches["image"].reshape(
        -1, 2, 2, 1), train=False)
    return tasks.mean_squared_error(
        tasks.predictions(outputs, batches["label"].reshape(-1)),
        np.asarray(targets).reshape(-1))

  before = mse(params)
  for step in range(60):
    params, stats, state, metrics = update(params, stats, state, batches,
                                           jax.random.PRNGKey(step))
  assert np.isfinite(metrics["loss"])
  assert mse(params) < 0.1 * before
