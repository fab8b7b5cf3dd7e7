"""Tests for experiments/algorithms/invariance.py: IRM, VREx, IB_ERM, CORAL
and MMD."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import models
import oracle
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS
from test_algorithms import NormalizedPixels
from test_algorithms import algorithm_hparams, linear_net_theta
from test_algorithms import float64_batches, linear_featurizer_model
from test_algorithms import linear_model, make_batches


def _numpy_irm_penalty(logits, labels):
  """float64 IRMv1 penalty per domain: d(risk of s * logits)/ds at s = 1."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  # d CE(s z, y) / ds = sum_c (softmax(s z)_c - onehot_c) z_c.
  slope = ((probs - np.eye(logits.shape[-1])[np.asarray(labels)]) * logits
           ).sum(-1)
  return slope[:, ::2].mean(1) * slope[:, 1::2].mean(1)


def _numpy_coral_penalty(features):
  features = np.asarray(features, np.float64)
  n = len(features)
  total, pairs = 0.0, 0
  for i in range(n):
    for j in range(i + 1, n):
      x, y = features[i], features[j]
      cov_x = np.cov(x, rowvar=False)  # Unbiased, 1 / (b - 1).
      cov_y = np.cov(y, rowvar=False)
      total += (np.mean((x.mean(0) - y.mean(0)) ** 2)
                + np.mean((cov_x - cov_y) ** 2))
      pairs += 1
  return total / pairs


def _numpy_logits(params, images):
  x = np.asarray(images, np.float64).reshape(images.shape[0],
                                             images.shape[1], -1)
  return (x @ np.asarray(params["head"]["kernel"][...], np.float64)
          + np.asarray(params["head"]["bias"][...], np.float64))


@pytest.mark.parametrize("anneal, weight", [(500, 1.0), (0, 100.0)])
def test_irm_penalty_matches_numpy(anneal, weight):
  network, params, stats = linear_model()
  hparams = {**algorithm_hparams("IRM"), "irm_lambda": 100.0,
             "irm_penalty_anneal_iters": anneal}
  algorithm = algorithms.build_algorithm("IRM", network, hparams,
                                         num_domains=NUM_DOMAINS)
  batches = make_batches(seed=2, image_shape=(2, 2, 1))
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
  expected = _numpy_irm_penalty(_numpy_logits(params, batches["image"]),
                                batches["label"])
  assert np.all(expected != 0)
  np.testing.assert_allclose(metrics["penalty"], expected.mean(), rtol=1e-4)
  # Before the anneal step the weight is 1, after it irm_lambda.
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + weight * metrics["penalty"], rtol=1e-5)


# The penalties are jitted, as the updates run them: compiled once, rather
# than op by op, each op compiled on its own.


def test_irm_penalty_of_regression_matches_numpy():
  outputs = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 1))
  targets = jax.random.normal(jax.random.PRNGKey(1), (2, 6))
  z = np.asarray(outputs, np.float64)[..., 0]
  y = np.asarray(targets, np.float64)
  # d (s z - y)^2 / ds = 2 (s z - y) z at s = 1.
  slope = 2 * (z - y) * z
  np.testing.assert_allclose(
      jax.jit(algorithms.irm_penalty)(outputs, targets),
      slope[:, ::2].mean(1) * slope[:, 1::2].mean(1), rtol=1e-5)


def test_irm_restarts_adam_at_the_anneal_step():
  network, params, stats = linear_model()
  hparams = {**algorithm_hparams("IRM"), "irm_penalty_anneal_iters": 2}
  algorithm = algorithms.build_algorithm("IRM", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  adam_counts = []
  for step in range(4):
    params, stats, state, _ = update(params, stats, state,
                                     make_batches(step, (2, 2, 1)),
                                     jax.random.PRNGKey(step))
    adam_counts.append(int(state.opt_state[1][0].count))
  # Steps 0 and 1 count 1, 2; step 2 starts afresh.
  assert adam_counts == [1, 2, 1, 2]
  assert int(state.count) == 4


@pytest.mark.parametrize("num_domains", [2, 3])
def test_coral_penalty_matches_numpy(num_domains):
  features = jax.random.normal(jax.random.PRNGKey(num_domains),
                               (num_domains, 5, 3))
  features = features * jnp.arange(1.0, num_domains + 1)[:, None, None]
  coral_penalty = jax.jit(algorithms.coral_penalty)
  np.testing.assert_allclose(coral_penalty(features),
                             _numpy_coral_penalty(features), rtol=1e-5)
  assert coral_penalty(features[:1]) == 0


def test_coral_objective_penalises_the_featurizer_outputs():
  network, params, stats = linear_model()
  hparams = {**algorithm_hparams("CORAL"), "mmd_gamma": 0.5}
  algorithm = algorithms.build_algorithm("CORAL", network, hparams,
                                         num_domains=NUM_DOMAINS)
  batches = make_batches(seed=3, image_shape=(2, 2, 1))
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
  features = np.asarray(batches["image"]).reshape(NUM_DOMAINS, BATCH, -1)
  np.testing.assert_allclose(metrics["penalty"],
                             _numpy_coral_penalty(features), rtol=1e-5)
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + 0.5 * metrics["penalty"], rtol=1e-5)


@pytest.mark.parametrize("name", ["IRM", "CORAL"])
def test_penalised_algorithms_lower_the_loss(name):
  network, params, stats = linear_model(16)
  # IRM in its warm-up, where the penalty weighs 1.
  hparams = {**algorithm_hparams(name), "lr": 1e-2,
             "irm_penalty_anneal_iters": 500}
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  # A fixed batch whose labels a linear head can fit.
  batches = make_batches(seed=4)
  losses, nlls = [], []
  for step in range(60):
    params, stats, state, metrics = update(params, stats, state, batches,
                                           jax.random.PRNGKey(step))
    losses.append(float(metrics["loss"]))
    nlls.append(float(metrics["nll"]))
  # CORAL's penalty of these parameter-free features is a constant.
  assert losses[-1] < losses[0] and nlls[-1] < 0.5 * nlls[0]


@pytest.mark.parametrize("num_domains", [1, 2, 3])
def test_mmd_penalty_matches_numpy(num_domains):
  # Features of norm ~0.3: the kernels of every bandwidth matter.
  features = 0.1 * jax.random.normal(jax.random.PRNGKey(num_domains),
                                     (num_domains, 5, 3))
  features = features + jnp.arange(num_domains)[:, None, None] * 0.05
  penalty = jax.jit(algorithms.mmd_penalty)(features)
  if num_domains == 1:
    assert penalty == 0
    return
  expected = oracle.mmd_penalty(features)
  assert expected > 1e-2
  # float32 against float64: measured 9e-7 relative; 10x margin.
  np.testing.assert_allclose(penalty, expected, rtol=1e-5)


@pytest.mark.parametrize("name, penalty", [
    ("MMD", oracle.mmd_penalty), ("CORAL", _numpy_coral_penalty)])
def test_feature_matching_normalizes_every_domain_where_batchnorm_trains(
    name, penalty):
  # BatchNorm on the pixels: a pass per domain normalizes every domain with
  # its own statistics, one pass over the pooled domains with theirs.
  model = models.Classifier(NormalizedPixels(16, rngs=nnx.Rngs(0)),
                            NUM_CLASSES, rngs=nnx.Rngs(1))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**algorithm_hparams(name), "mmd_gamma": 0.5}
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=NUM_DOMAINS)
  batches = make_batches(seed=5)
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
  x = np.asarray(batches["image"], np.float64).reshape(NUM_DOMAINS, BATCH, -1)
  normalize = lambda x, axes: ((x - x.mean(axes, keepdims=True))
                               / np.sqrt(x.var(axes, keepdims=True) + 1e-5))
  per_domain, pooled = normalize(x, 1), normalize(x, (0, 1))
  # float32 against float64: measured 4e-8 relative; 1e-6 leaves room for
  # float32 rounding. The pooled features' penalty is off by 11% (MMD) and
  # 70% (CORAL).
  np.testing.assert_allclose(metrics["penalty"], penalty(per_domain),
                             rtol=1e-6)
  assert abs(penalty(pooled) / penalty(per_domain) - 1) > 0.05


def test_mmd_update_matches_a_numpy_model_of_domainbed():
  network, params, stats = linear_featurizer_model()
  hparams = {**algorithm_hparams("MMD"), "mmd_gamma": 0.5, "lr": 0.01,
             "weight_decay": 0.01}
  algorithm = algorithms.build_algorithm("MMD", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  theta = linear_net_theta(params)
  state = algorithm.init(params)
  adam = oracle.TorchAdam(0.01, 0.01, theta)
  for step in range(3):
    batches = make_batches(step, (2, 2, 1))
    x = np.asarray(batches["image"], np.float64).reshape(NUM_DOMAINS, BATCH, 4)
    labels = np.asarray(batches["label"]).reshape(-1)

    def objective(theta, x=x, labels=labels):
      w_f, b_f, w_h, b_h = theta
      features = x @ w_f + b_f
      nll = oracle.cross_entropy(features.reshape(-1, 3) @ w_h + b_h, labels)
      return nll + 0.5 * oracle.mmd_penalty(features)

    params, stats, state, metrics = update(params, stats, state, batches,
                                           jax.random.PRNGKey(step))
    # Features of squared norm up to 14: measured 3e-7 relative (2e-5
    # without exact self-distances, see mmd_penalty); 10x margin.
    np.testing.assert_allclose(metrics["loss"], objective(theta), rtol=3e-6)
    theta = adam.step(theta, oracle.numerical_grad(objective, theta))
  # Three Adam steps of 0.01 from float32 gradients: measured 2e-7 apart;
  # 10x margin.
  for got, want in zip(linear_net_theta(params), theta):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


# name -> (the hparams of its weight and anneal step, its weight before the
# anneal step, its oracle's terms).
ANNEALED = {
    "VREx": ("vrex_lambda", "vrex_penalty_anneal_iters", 1.0,
             oracle.vrex_terms),
    "IB_ERM": ("ib_lambda", "ib_penalty_anneal_iters", 0.0,
               oracle.ib_erm_terms),
}


@pytest.mark.parametrize("name", list(ANNEALED))
@pytest.mark.parametrize("anneal", [0, 2])
def test_annealed_penalties_match_numpy_models_of_domainbed(name, anneal):
  weight_name, anneal_name, warmup_weight, terms = ANNEALED[name]
  hparams = {**algorithm_hparams(name), weight_name: 3.0, anneal_name: anneal,
             "lr": 0.01, "weight_decay": 0.01}
  with jax.enable_x64(True):
    network, params, stats = linear_featurizer_model(dtype=jnp.float64)
    algorithm = algorithms.build_algorithm(name, network, hparams,
                                           num_domains=NUM_DOMAINS)
    update = jax.jit(algorithm.update)
    state = algorithm.init(params)
    theta = linear_net_theta(params)
    batch_list = float64_batches(5)
    adam_counts = []
    for step, batches in enumerate(batch_list):
      risk, penalty, *last_nll = terms(linear_net_theta(params), batches)
      params, stats, state, metrics = update(params, stats, state, batches,
                                             jax.random.PRNGKey(step))
      adam_counts.append(int(state.opt_state[1][0].count))
      # float64 against float64: measured 3e-15 relative; 1e-13 leaves room
      # for other summation orders.
      np.testing.assert_allclose(metrics["penalty"], penalty, rtol=1e-13)
      weight = 3.0 if step >= anneal else warmup_weight
      np.testing.assert_allclose(metrics["loss"], risk + weight * penalty,
                                 rtol=1e-13)
      # VREx's nll is its last domain's risk, as DomainBed's.
      np.testing.assert_allclose(metrics["nll"], (last_nll or [risk])[0],
                                 rtol=1e-13)
  # Adam restarts at the anneal step (at step 0 it is fresh anyway).
  assert adam_counts == ([1, 2, 1, 2, 3] if anneal == 2 else [1, 2, 3, 4, 5])
  want, _ = oracle.annealed_penalty(
      theta, batch_list, terms, 0.01, 0.01, 3.0, warmup_weight, anneal)
  # Five Adam steps of 0.01 from central differences, whose rounding is the
  # noise: measured 3e-11 apart; 15x margin.
  for got, expected, start in zip(linear_net_theta(params), want, theta):
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-10)
    assert np.abs(expected - start).max() > 1e-2
