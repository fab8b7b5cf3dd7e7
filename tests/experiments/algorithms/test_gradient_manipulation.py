"""Tests for experiments/algorithms/gradient_manipulation.py: Fish, Fishr,
ANDMask, SANDMask, IGA, RSC."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import models
import oracle
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS, Flatten
from test_algorithms import algorithm_hparams, make_batches, train_linear_net


def _numpy_head_variances(params, images, labels):
  """Per-domain variance of per-example CE gradients of a linear head."""
  features = np.asarray(images, np.float64).reshape(NUM_DOMAINS, BATCH, -1)
  kernel = np.asarray(params["head"]["kernel"][...], np.float64)
  bias = np.asarray(params["head"]["bias"][...], np.float64)
  logits = features @ kernel + bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  residual = probs - np.eye(NUM_CLASSES)[np.asarray(labels)]
  # d CE / d kernel = feature (outer) residual; d CE / d bias = residual.
  grads = np.concatenate([
      (features[..., :, None] * residual[..., None, :]).reshape(
          NUM_DOMAINS, BATCH, -1),
      residual], axis=-1)
  return grads.var(axis=1)


def _numpy_penalty(variances):
  return np.mean((variances - variances.mean(axis=0)) ** 2)


def test_fishr_penalty_matches_numpy_per_example_gradients():
  image_shape = (2, 2, 1)
  model = models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**algorithm_hparams("Fishr"), "lambda": 10.0, "ema": 0.9}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)

  # First step: the moving average starts at zero, so its corrected value
  # is the variance itself.
  batches = make_batches(seed=0, image_shape=image_shape)
  var1 = _numpy_head_variances(params, batches["image"], batches["label"])
  params, stats, state, metrics = update(params, stats, state, batches,
                                         jax.random.PRNGKey(0))
  np.testing.assert_allclose(metrics["penalty"], _numpy_penalty(var1),
                             rtol=1e-4)
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + 10.0 * metrics["penalty"], rtol=1e-5)

  # Second step: (0.9 * 0.1 * var1 + 0.1 * var2) / 0.1.
  batches = make_batches(seed=1, image_shape=image_shape)
  var2 = _numpy_head_variances(params, batches["image"], batches["label"])
  _, _, _, metrics = update(params, stats, state, batches,
                            jax.random.PRNGKey(1))
  np.testing.assert_allclose(
      metrics["penalty"], _numpy_penalty(0.9 * var1 + var2), rtol=1e-4)


def test_fishr_penalty_is_off_before_the_anneal_step():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**algorithm_hparams("Fishr"), "penalty_anneal_iters": 5}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), make_batches(),
      jax.random.PRNGKey(0))
  assert metrics["penalty"] > 0
  np.testing.assert_allclose(metrics["loss"], metrics["nll"])


def _numpy_fish(theta, batch_list, lr, meta_lr, wd, placement):
  """DomainBed's Fish.update, float64, over several outer steps.

  The inner Adam's state carries across outer steps (DomainBed reloads
  ``optimizer_inner_state``); domains are visited in their fixed order.
  ``placement="outer"`` instead decays the meta step:
  ``theta -= meta_lr * ((theta - inner) + wd * theta)``.
  """
  adam = oracle.TorchAdam(lr, wd if placement == "inner" else 0.0, theta)
  for batches in batch_list:
    inner = theta
    for images, labels in zip(batches["image"], batches["label"]):
      _, grads = oracle.linear_head_loss_grad(inner, images,
                                              np.asarray(labels), NUM_CLASSES)
      inner = adam.step(inner, grads)
    outer_wd = wd if placement == "outer" else 0.0
    theta = tuple(t - meta_lr * ((t - i) + outer_wd * t)
                  for t, i in zip(theta, inner))
  return theta


@pytest.mark.parametrize("placement", ["inner", "outer"])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_fish_weight_decay_matches_a_numpy_model_of_domainbed(
    placement, num_steps):
  image_shape = (2, 2, 1)
  model = models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  # A large decay, so the two placements differ by far more than float32
  # rounding.
  hparams = {**algorithm_hparams("Fish"), "weight_decay": 0.1, "lr": 0.05,
             "fish_weight_decay": placement}
  assert hparams["fish_order"] == "fixed" and hparams["meta_lr"] == 0.5
  algorithm = algorithms.build_algorithm("Fish", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  batch_list = [make_batches(seed, image_shape) for seed in range(num_steps)]
  theta = (np.asarray(params["head"]["kernel"][...], np.float64),
           np.asarray(params["head"]["bias"][...], np.float64))
  state = algorithm.init(params)
  for step, batches in enumerate(batch_list):
    params, stats, state, _ = update(params, stats, state, batches,
                                     jax.random.PRNGKey(step))

  expected = _numpy_fish(theta, batch_list, 0.05, 0.5, 0.1, placement)
  other = _numpy_fish(theta, batch_list, 0.05, 0.5, 0.1,
                      {"inner": "outer", "outer": "inner"}[placement])
  for got, want, wrong in zip(
      (params["head"]["kernel"][...], params["head"]["bias"][...]),
      expected, other):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - wrong).max() > 1e-3


@pytest.mark.parametrize("hparams, match", [
    ({"fish_weight_decay": "meta"}, "fish_weight_decay"),
    ({"fish_order": "shuffled"}, "fish_order"),
])
def test_fish_rejects_unknown_options(hparams, match):
  network, _, _ = algorithms.Network.split(
      models.Classifier(Flatten(4), NUM_CLASSES, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=match):
    algorithms.build_algorithm("Fish", network,
                               {**algorithm_hparams("Fish"), **hparams},
                               num_domains=NUM_DOMAINS)


def test_fish_random_order_visits_the_domains_in_another_order():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  ends = {}
  for order in ("fixed", "random"):
    algorithm = algorithms.build_algorithm(
        "Fish", network, {**algorithm_hparams("Fish"), "fish_order": order},
        num_domains=NUM_DOMAINS, seed=1)
    update = jax.jit(algorithm.update)
    p, s, state = params, stats, algorithm.init(params)
    for step in range(4):
      p, s, state, _ = update(p, s, state, make_batches(step),
                              jax.random.PRNGKey(step))
    ends[order] = np.asarray(p["head"]["kernel"][...])
  assert np.abs(ends["fixed"] - ends["random"]).max() > 1e-6


# The DomainBed references below train a linear featurizer and head for 5
# Adam steps of lr 0.01 with weight decay 0.01, three domains of 6 images:
# the params move by about 0.05. float32 against float64, measured: at
# most 4.2e-7 apart for every algorithm; atol 4e-6 is a 10x margin and an
# 1e-4 of the move.
LR, WD, ATOL = 0.01, 0.01, 4e-6


def _assert_matches(got, want, start, wrong=None):
  for g, w, s in zip(got, want, start):
    np.testing.assert_allclose(g, w, rtol=0, atol=ATOL)
  assert max(np.abs(w - s).max() for w, s in zip(want, start)) > 1e-2
  if wrong is not None:  # The rule's detail shows at this tolerance.
    assert max(np.abs(w - x).max() for w, x in zip(want, wrong)) > 100 * ATOL


# tau = 1 keeps the entries whose three domains agree on the sign; 0.3 also
# those where two of three agree (|mean sign| = 1/3): all of them.
@pytest.mark.parametrize("tau, other_tau", [(1.0, 0.3), (0.3, 1.0)])
def test_andmask_matches_a_numpy_model_of_domainbed(tau, other_tau):
  theta, batch_list, got, _, metrics = train_linear_net(
      "ANDMask", {"lr": LR, "weight_decay": WD, "tau": tau})
  want, other = (oracle.masked_gradients(
      theta, batch_list, LR, WD, lambda g: oracle.and_mask_direction(g, t),
      NUM_CLASSES) for t in (tau, other_tau))
  _assert_matches(got, want[0], theta, other[0])
  losses = want[1]
  np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)


# Gradients of about 0.1 vary by about 0.01 over the domains: k = 10
# saturates the tanh into ANDMask's hard mask; these keep it soft.
@pytest.mark.parametrize("tau, k", [(0.5, 1e-3), (0.2, 1e-2)])
def test_sandmask_matches_a_numpy_model_of_domainbed(tau, k):
  theta, batch_list, got, _, _ = train_linear_net(
      "SANDMask", {"lr": LR, "weight_decay": WD, "tau": tau, "k": k})
  want, _ = oracle.masked_gradients(
      theta, batch_list, LR, WD,
      lambda g: oracle.sand_mask_direction(g, tau, k), NUM_CLASSES)
  hard, _ = oracle.masked_gradients(
      theta, batch_list, LR, WD, lambda g: oracle.and_mask_direction(g, tau),
      NUM_CLASSES)
  _assert_matches(got, want, theta, hard)


def test_sandmask_at_domainbeds_default_tau_masks_everything():
  # |mean sign| <= 1 = tau: tanh(...) <= 0 everywhere, so the mask is 0 and
  # DomainBed's SANDMask at its defaults takes no step (weight decay 0).
  theta, _, got, _, _ = train_linear_net("SANDMask", {"lr": LR, "tau": 1.0},
                                         num_steps=1)
  for g, t in zip(got, theta):
    np.testing.assert_array_equal(g, t.astype(np.float32))


@pytest.mark.parametrize("mask_fn", [
    lambda g: algorithms.and_mask(g, 0.5),
    lambda g: algorithms.sand_mask(g, 0.5, 10.0),
])
def test_masks_of_agreeing_and_of_silent_domains_are_domainbeds(mask_fn):
  # One domain: the variance is NaN (SANDMask: 1e-17, its mask 1 in effect);
  # identical domains: a zero variance against a full agreement (inf * 0.5
  # -> tanh 1); all-zero gradients: a zero direction, never NaN.
  one = jnp.array([[0.5, -2.0, 0.0]])
  same = jnp.array([[0.5, -2.0, 3.0]] * 3)
  zeros = jnp.zeros((3, 4))
  np.testing.assert_allclose(mask_fn(one), [0.5 * 1.5, -2.0 * 1.5, 0.0],
                             rtol=1e-6)
  np.testing.assert_allclose(mask_fn(same), same[0], rtol=1e-6)
  np.testing.assert_array_equal(mask_fn(zeros), np.zeros(4))


def test_iga_matches_a_numpy_model_of_domainbed():
  # A penalty of 10 keeps the gradient of the 5 steps within Adam's
  # normalised range; DomainBed's 1000 only scales it.
  theta, batch_list, got, _, metrics = train_linear_net(
      "IGA", {"lr": LR, "weight_decay": WD, "penalty": 10.0})
  want, losses, penalties = oracle.iga(theta, batch_list, LR, WD, 10.0,
                                       NUM_CLASSES)
  erm, _, _ = oracle.iga(theta, batch_list, LR, WD, 0.0, NUM_CLASSES)
  _assert_matches(got, want, theta, erm)
  np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
  np.testing.assert_allclose([m["penalty"] for m in metrics], penalties,
                             rtol=1e-5)


@pytest.mark.parametrize("q", [0.0, 100 / 3, 50.0, 60.0, 200 / 3, 90.0, 100.0])
@pytest.mark.parametrize("n", [1, 2, 4, 6, 7, 12])
def test_numpy_percentile_is_numpys_to_the_bit(q, n):
  # float32 positions of jnp.percentile differ from NumPy's float64 ones
  # where (n - 1) q / 100 is an integer: q = 60, n = 6 and q = 200 / 3, n = 4
  # among these.
  x = np.random.default_rng(n).normal(size=(3, n)).astype(np.float32)
  x[1] = np.round(x[1])  # Ties.
  got = jax.jit(algorithms.numpy_percentile, static_argnums=1)(x, q)
  np.testing.assert_array_equal(got[:, 0], np.percentile(x, q, axis=1))


def test_rsc_matches_a_numpy_model_of_domainbed():
  hparams = {"lr": LR, "weight_decay": WD}
  theta, batch_list, got, _, metrics = train_linear_net("RSC", hparams)
  want, losses = oracle.rsc(theta, batch_list, LR, WD, 1 / 3, 1 / 3,
                            NUM_CLASSES)
  # Muting fewer features (the 90th percentile) trains otherwise.
  other, _ = oracle.rsc(theta, batch_list, LR, WD, 0.1, 1 / 3, NUM_CLASSES)
  _assert_matches(got, want, theta, other)
  np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
