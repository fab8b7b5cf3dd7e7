"""Tests for experiments/algorithms.py and experiments/hparams_registry.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import catalog
from experiments import hparams_registry
from experiments import models

NUM_DOMAINS, BATCH, NUM_CLASSES = 2, 6, 3


class TinyFeaturizer(nnx.Module):
  """Linear -> BatchNorm (train mode) -> ReLU, so updated stats show."""

  def __init__(self, in_features: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(in_features, 5, rngs=rngs)
    self.norm = nnx.BatchNorm(5, rngs=rngs)
    self.num_features = 5

  def __call__(self, x, *, rngs=None):
    del rngs
    return nnx.relu(self.norm(self.linear(x.reshape(x.shape[0], -1))))


class Flatten(nnx.Module):
  """A featurizer without parameters: the pixels are the features."""

  def __init__(self, num_features: int):
    self.num_features = num_features

  def __call__(self, x, *, rngs=None):
    del rngs
    return x.reshape(x.shape[0], -1)


def _batches(seed=0, image_shape=(4, 4, 1)):
  images = jax.random.normal(jax.random.PRNGKey(seed),
                             (NUM_DOMAINS, BATCH) + image_shape)
  labels = jnp.arange(NUM_DOMAINS * BATCH).reshape(NUM_DOMAINS, BATCH)
  return {"image": images, "label": labels % NUM_CLASSES}


def _hparams(name):
  hparams = hparams_registry.default_hparams(name, "RotatedDigits")
  if name == "Fishr":
    hparams["penalty_anneal_iters"] = 0  # Penalise from the first step.
  if name == "IRM":
    hparams["irm_penalty_anneal_iters"] = 0
  return hparams


@pytest.mark.parametrize("name", list(catalog.ALGORITHMS))
def test_every_algorithm_takes_a_finite_step(name):
  model = models.Classifier(TinyFeaturizer(16, rngs=nnx.Rngs(0)), NUM_CLASSES,
                            rngs=nnx.Rngs(1))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(name, network, _hparams(name),
                                         num_domains=NUM_DOMAINS)
  new_params, new_stats, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), _batches(), jax.random.PRNGKey(1))

  assert np.isfinite(metrics["loss"])
  for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    assert old.shape == new.shape and np.all(np.isfinite(new))
  assert any(not np.array_equal(old, new) for old, new in
             zip(jax.tree.leaves(params), jax.tree.leaves(new_params)))
  # BatchNorm's running mean starts at zero; the training passes move it.
  assert np.any(new_stats["featurizer"]["norm"]["mean"][...] != 0)
  if "eigenvalues" in metrics:
    eigenvalues = np.asarray(metrics["eigenvalues"])
    np.testing.assert_allclose(eigenvalues.sum(), 1.0, rtol=1e-5)
    assert np.all(np.diff(eigenvalues) <= 0)


class NormalizedPixels(nnx.Module):
  """BatchNorm straight on the pixels: its statistics depend on data only."""

  def __init__(self, num_features: int, *, rngs: nnx.Rngs):
    self.norm = nnx.BatchNorm(num_features, momentum=0.9, rngs=rngs)
    self.num_features = num_features

  def __call__(self, x, *, rngs=None):
    del rngs
    return self.norm(x.reshape(x.shape[0], -1))


def _numpy_running_stats(chunks):
  """float64 BatchNorm running mean/var after train passes over ``chunks``."""
  mean, var = np.zeros(16), np.ones(16)
  for chunk in chunks:
    x = np.asarray(chunk, np.float64).reshape(len(chunk), -1)
    mean = 0.9 * mean + 0.1 * x.mean(0)
    var = 0.9 * var + 0.1 * x.var(0)
  return mean, var


@pytest.mark.parametrize("name, hparams, chunks", [
    # ERM: one forward pass over all domains' examples.
    ("ERM", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    # PGrad-F with B = 2: round i visits domains 0, 1 on their chunk i.
    ("PGrad-F", {"B": 2},
     lambda x: [x[d, 3 * i:3 * (i + 1)] for i in range(2) for d in range(2)]),
])
def test_trained_batchnorm_follows_every_forward_pass(name, hparams, chunks):
  model = models.Classifier(NormalizedPixels(16, rngs=nnx.Rngs(0)),
                            NUM_CLASSES, rngs=nnx.Rngs(1))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(
      name, network, {**_hparams(name), **hparams}, num_domains=NUM_DOMAINS)
  batches = _batches()
  state = algorithm.init(params)
  _, new_stats, new_state, _ = jax.jit(algorithm.update)(
      params, stats, state, batches, jax.random.PRNGKey(1))
  mean, var = _numpy_running_stats(chunks(batches["image"]))
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["mean"][...],
                             mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["var"][...],
                             var, rtol=1e-5, atol=1e-6)
  # The statistics are not kept in the algorithm's state.
  assert (jax.tree.structure(new_state) == jax.tree.structure(state))


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
  hparams = {**_hparams("Fishr"), "lambda": 10.0, "ema": 0.9}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)

  # First step: the moving average starts at zero, so its corrected value
  # is the variance itself.
  batches = _batches(seed=0, image_shape=image_shape)
  var1 = _numpy_head_variances(params, batches["image"], batches["label"])
  params, stats, state, metrics = update(params, stats, state, batches,
                                         jax.random.PRNGKey(0))
  np.testing.assert_allclose(metrics["penalty"], _numpy_penalty(var1),
                             rtol=1e-4)
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + 10.0 * metrics["penalty"], rtol=1e-5)

  # Second step: (0.9 * 0.1 * var1 + 0.1 * var2) / 0.1.
  batches = _batches(seed=1, image_shape=image_shape)
  var2 = _numpy_head_variances(params, batches["image"], batches["label"])
  _, _, _, metrics = update(params, stats, state, batches,
                            jax.random.PRNGKey(1))
  np.testing.assert_allclose(
      metrics["penalty"], _numpy_penalty(0.9 * var1 + var2), rtol=1e-4)


def test_fishr_penalty_is_off_before_the_anneal_step():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  hparams = {**_hparams("Fishr"), "penalty_anneal_iters": 5}
  algorithm = algorithms.build_algorithm("Fishr", network, hparams,
                                         num_domains=NUM_DOMAINS)
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), _batches(), jax.random.PRNGKey(0))
  assert metrics["penalty"] > 0
  np.testing.assert_allclose(metrics["loss"], metrics["nll"])


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_mixup_mixes_every_chunk_with_the_same_chunk_of_another_domain(
    num_chunks):
  batches = _batches()
  # Label = domain, so the partner domain can be read off "mix_label".
  batches["label"] = jnp.repeat(jnp.arange(NUM_DOMAINS)[:, None], BATCH, 1)
  mixed = jax.jit(algorithms.mixup, static_argnums=(2, 3))(
      batches, jax.random.PRNGKey(3), 0.2, num_chunks)
  images = np.asarray(batches["image"])
  size = BATCH // num_chunks
  for chunk in range(num_chunks):
    part = slice(chunk * size, (chunk + 1) * size)
    partners = np.asarray(mixed["mix_label"][:, part])
    weights = np.asarray(mixed["mix_weight"][:, part])
    # One partner and one weight per (domain, chunk); partners form a cycle.
    assert np.all(partners == partners[:, :1])
    assert np.all(weights == weights[:, :1])
    assert sorted(partners[:, 0]) == list(range(NUM_DOMAINS))
    for d in range(NUM_DOMAINS):
      partner, weight = partners[d, 0], weights[d, 0]
      assert partner != d and 0.0 <= weight <= 1.0
      np.testing.assert_allclose(
          mixed["image"][d, part],
          weight * images[d, part] + (1 - weight) * images[partner, part],
          rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(mixed["label"], batches["label"])


def test_registry():
  assert {"ERM", "PGrad", "PGrad-F", "PGrad-B", "PGrad-BMix", "PGradParallel",
          "Fish", "Fishr", "MixUp", "IRM", "CORAL"} <= set(catalog.ALGORITHMS)
  with pytest.raises(ValueError, match="already registered"):
    catalog.ALGORITHMS.register("ERM", algorithms.erm)
  with pytest.raises(ValueError, match="Unknown algorithm"):
    algorithms.build_algorithm("SGD", None, {}, num_domains=2)


@pytest.mark.parametrize("dataset, model, lr, batch", [
    ("RotatedDigits", "mnist_cnn", 1e-3, 63),
    ("PACS", "resnet50", 5e-5, 33),
    ("DomainNet", "resnet50", 5e-5, 24),
])
def test_pgrad_b_defaults_follow_the_paper(dataset, model, lr, batch):
  hparams = hparams_registry.default_hparams("PGrad-B", dataset)
  assert catalog.DATASETS[dataset].model == model
  assert hparams["lr"] == lr and hparams["outer_lr"] == 0.1
  assert hparams["k"] == 4 and hparams["B"] == 3
  assert hparams["batch_size"] == batch and hparams["weight_decay"] == 0.0


def test_random_hparams_are_seeded_and_in_range():
  assert (hparams_registry.random_hparams("Fishr", "PACS", 0)
          == hparams_registry.default_hparams("Fishr", "PACS"))
  draws = [hparams_registry.random_hparams("Fishr", "PACS", seed)
           for seed in range(1, 30)]
  assert draws[0] == hparams_registry.random_hparams("Fishr", "PACS", 1)
  assert draws[0] != hparams_registry.random_hparams("Fishr", "PACS", 1, 1)
  for hparams in draws:
    assert 1e-5 <= hparams["lr"] <= 10**-3.5
    assert 10 <= hparams["lambda"] <= 1e4
    assert 0.9 <= hparams["ema"] <= 0.99
    assert hparams["resnet_dropout"] in (0.0, 0.1, 0.5)
  pgrad = hparams_registry.random_hparams("PGrad-B", "PACS", 7)
  assert pgrad["lr"] == 5e-5 and pgrad["batch_size"] == 33
  assert 1e-6 <= pgrad["weight_decay"] <= 1e-4


@pytest.mark.parametrize("dataset", ["RotatedDigits", "PACS", "DomainNet"])
def test_every_draw_is_allowed_and_bad_values_name_their_range(dataset):
  for name in catalog.ALGORITHMS:
    for seed in range(6):
      hparams_registry.check_hparams(
          name, dataset, hparams_registry.random_hparams(name, dataset, seed))
  fishr = hparams_registry.default_hparams("Fishr", dataset)
  for key, value, allowed in [
      ("ema", 1.0, r"a number in \[0, 1\)"), ("lambda", -1.0, "a number >= 0"),
      ("lr", 0, "a number > 0"), ("lr", float("nan"), "a number > 0"),
      ("lr", "1e-3", "a number > 0"), ("batch_size", 8.0, "an integer >= 1"),
      ("penalty_anneal_iters", True, "an integer >= 0")]:
    with pytest.raises(ValueError,
                       match=rf"hparam '{key}' must be {allowed}, got"):
      hparams_registry.check_hparams("Fishr", dataset,
                                     {**fishr, key: value})
  # Integers are numbers; the edges of closed ranges are allowed.
  hparams_registry.check_hparams("Fishr", dataset,
                                 {**fishr, "lr": 1, "ema": 0, "lambda": 0})
def _numpy_linear_head_grad(theta, images, labels):
  """float64 mean cross-entropy gradient of a linear head on the pixels.

  ``theta`` is ``(kernel (F, C), bias (C,))``; returns the same pair.
  """
  kernel, bias = theta
  features = np.asarray(images, np.float64).reshape(len(labels), -1)
  logits = features @ kernel + bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  residual = (probs - np.eye(NUM_CLASSES)[np.asarray(labels)]) / len(labels)
  return features.T @ residual, residual.sum(0)


class _TorchAdam:
  """float64 ``torch.optim.Adam(lr, weight_decay=wd)`` on a tuple of arrays.

  PyTorch adds ``wd * param`` to the gradient before the moments.
  """

  def __init__(self, lr, wd, theta):
    self.lr, self.wd, self.count = lr, wd, 0
    self.mu = [np.zeros_like(t) for t in theta]
    self.nu = [np.zeros_like(t) for t in theta]

  def step(self, theta, grads):
    self.count += 1
    new = []
    for i, (t, g) in enumerate(zip(theta, grads)):
      g = g + self.wd * t
      self.mu[i] = 0.9 * self.mu[i] + 0.1 * g
      self.nu[i] = 0.999 * self.nu[i] + 0.001 * g**2
      mu_hat = self.mu[i] / (1 - 0.9**self.count)
      nu_hat = self.nu[i] / (1 - 0.999**self.count)
      new.append(t - self.lr * mu_hat / (np.sqrt(nu_hat) + 1e-8))
    return tuple(new)


def _numpy_fish(theta, batch_list, lr, meta_lr, wd, placement):
  """DomainBed's Fish.update, float64, over several outer steps.

  The inner Adam's state carries across outer steps (DomainBed reloads
  ``optimizer_inner_state``); domains are visited in their fixed order.
  ``placement="outer"`` instead decays the meta step:
  ``theta -= meta_lr * ((theta - inner) + wd * theta)``.
  """
  adam = _TorchAdam(lr, wd if placement == "inner" else 0.0, theta)
  for batches in batch_list:
    inner = theta
    for images, labels in zip(batches["image"], batches["label"]):
      inner = adam.step(inner, _numpy_linear_head_grad(inner, images, labels))
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
  hparams = {**_hparams("Fish"), "weight_decay": 0.1, "lr": 0.05,
             "fish_weight_decay": placement}
  assert hparams["fish_order"] == "fixed" and hparams["meta_lr"] == 0.5
  algorithm = algorithms.build_algorithm("Fish", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  batch_list = [_batches(seed, image_shape) for seed in range(num_steps)]
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
    algorithms.build_algorithm("Fish", network, {**_hparams("Fish"), **hparams},
                               num_domains=NUM_DOMAINS)


def test_fish_random_order_visits_the_domains_in_another_order():
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  ends = {}
  for order in ("fixed", "random"):
    algorithm = algorithms.build_algorithm(
        "Fish", network, {**_hparams("Fish"), "fish_order": order},
        num_domains=NUM_DOMAINS, seed=1)
    update = jax.jit(algorithm.update)
    p, s, state = params, stats, algorithm.init(params)
    for step in range(4):
      p, s, state, _ = update(p, s, state, _batches(step),
                              jax.random.PRNGKey(step))
    ends[order] = np.asarray(p["head"]["kernel"][...])
  assert np.abs(ends["fixed"] - ends["random"]).max() > 1e-6


def test_variants_fix_their_hparams_over_the_base_search_space():
  variants = {name: entry for name, entry in catalog.ALGORITHMS.items()
              if entry.variant_of}
  assert set(variants) == {"PGrad-k1", "PGrad-k2", "PGrad-kall",
                           "PGrad-Bottom"}
  for name, entry in variants.items():
    base, fixed = entry.variant_of, entry.fixed_hparams
    defaults = hparams_registry.default_hparams(name, "RotatedDigits")
    assert defaults == {**hparams_registry.default_hparams(
        base, "RotatedDigits"), **fixed}
    for seed in (1, 2):
      draw = hparams_registry.random_hparams(name, "RotatedDigits", seed)
      base_draw = hparams_registry.random_hparams(base, "RotatedDigits", seed)
      assert draw == {**base_draw, **fixed}


def _one_pgrad_update(hparams):
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(
      "PGrad-F", network, {**_hparams("PGrad"), **hparams},
      num_domains=NUM_DOMAINS)
  new_params, _, _, _ = algorithm.update(
      params, stats, algorithm.init(params), _batches(), jax.random.PRNGKey(0))
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(new_params)])


def test_k_all_keeps_every_component_of_the_trajectory():
  every = _one_pgrad_update({"k": "all", "B": 2, "batch_size": BATCH})
  np.testing.assert_allclose(
      every, _one_pgrad_update({"k": NUM_DOMAINS * 2, "B": 2}), rtol=1e-6)
  assert np.abs(every - _one_pgrad_update({"k": 1, "B": 2})).max() > 1e-6


@pytest.mark.parametrize("k", [0, "some", 2.5])
def test_pgrad_rejects_a_bad_k(k):
  with pytest.raises(ValueError, match="k must be"):
    _one_pgrad_update({"k": k})
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


def _linear_model(num_features=4, seed=0):
  model = models.Classifier(Flatten(num_features), NUM_CLASSES,
                            rngs=nnx.Rngs(seed))
  return algorithms.Network.split(model)


def _numpy_logits(params, images):
  x = np.asarray(images, np.float64).reshape(images.shape[0],
                                             images.shape[1], -1)
  return (x @ np.asarray(params["head"]["kernel"][...], np.float64)
          + np.asarray(params["head"]["bias"][...], np.float64))


@pytest.mark.parametrize("anneal, weight", [(500, 1.0), (0, 100.0)])
def test_irm_penalty_matches_numpy(anneal, weight):
  network, params, stats = _linear_model()
  hparams = {**_hparams("IRM"), "irm_lambda": 100.0,
             "irm_penalty_anneal_iters": anneal}
  algorithm = algorithms.build_algorithm("IRM", network, hparams,
                                         num_domains=NUM_DOMAINS)
  batches = _batches(seed=2, image_shape=(2, 2, 1))
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
  expected = _numpy_irm_penalty(_numpy_logits(params, batches["image"]),
                                batches["label"])
  assert np.all(expected != 0)
  np.testing.assert_allclose(metrics["penalty"], expected.mean(), rtol=1e-4)
  # Before the anneal step the weight is 1, after it irm_lambda.
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + weight * metrics["penalty"], rtol=1e-5)


def test_irm_penalty_of_regression_matches_numpy():
  outputs = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 1))
  targets = jax.random.normal(jax.random.PRNGKey(1), (2, 6))
  z = np.asarray(outputs, np.float64)[..., 0]
  y = np.asarray(targets, np.float64)
  # d (s z - y)^2 / ds = 2 (s z - y) z at s = 1.
  slope = 2 * (z - y) * z
  np.testing.assert_allclose(
      algorithms.irm_penalty(outputs, targets),
      slope[:, ::2].mean(1) * slope[:, 1::2].mean(1), rtol=1e-5)


def test_irm_restarts_adam_at_the_anneal_step():
  network, params, stats = _linear_model()
  hparams = {**_hparams("IRM"), "irm_penalty_anneal_iters": 2}
  algorithm = algorithms.build_algorithm("IRM", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  adam_counts = []
  for step in range(4):
    params, stats, state, _ = update(params, stats, state,
                                     _batches(step, (2, 2, 1)),
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
  np.testing.assert_allclose(algorithms.coral_penalty(features),
                             _numpy_coral_penalty(features), rtol=1e-5)
  assert algorithms.coral_penalty(features[:1]) == 0


def test_coral_objective_penalises_the_featurizer_outputs():
  network, params, stats = _linear_model()
  hparams = {**_hparams("CORAL"), "mmd_gamma": 0.5}
  algorithm = algorithms.build_algorithm("CORAL", network, hparams,
                                         num_domains=NUM_DOMAINS)
  batches = _batches(seed=3, image_shape=(2, 2, 1))
  _, _, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
  features = np.asarray(batches["image"]).reshape(NUM_DOMAINS, BATCH, -1)
  np.testing.assert_allclose(metrics["penalty"],
                             _numpy_coral_penalty(features), rtol=1e-5)
  np.testing.assert_allclose(
      metrics["loss"], metrics["nll"] + 0.5 * metrics["penalty"], rtol=1e-5)


@pytest.mark.parametrize("name", ["IRM", "CORAL"])
def test_penalised_algorithms_lower_the_loss(name):
  network, params, stats = _linear_model(16)
  # IRM in its warm-up, where the penalty weighs 1.
  hparams = {**_hparams(name), "lr": 1e-2, "irm_penalty_anneal_iters": 500}
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  # A fixed batch whose labels a linear head can fit.
  batches = _batches(seed=4)
  losses, nlls = [], []
  for step in range(60):
    params, stats, state, metrics = update(params, stats, state, batches,
                                           jax.random.PRNGKey(step))
    losses.append(float(metrics["loss"]))
    nlls.append(float(metrics["nll"]))
  # CORAL's penalty of these parameter-free features is a constant.
  assert losses[-1] < losses[0] and nlls[-1] < 0.5 * nlls[0]


def test_irm_and_coral_hparams_follow_domainbed():
  irm = hparams_registry.default_hparams("IRM", "PACS")
  assert irm["irm_lambda"] == 100.0 and irm["irm_penalty_anneal_iters"] == 500
  assert hparams_registry.default_hparams("CORAL", "PACS")["mmd_gamma"] == 1.0
  for seed in range(1, 20):
    irm = hparams_registry.random_hparams("IRM", "PACS", seed)
    assert 0.1 <= irm["irm_lambda"] <= 1e5
    assert 1 <= irm["irm_penalty_anneal_iters"] <= 1e4
    assert 0.1 <= hparams_registry.random_hparams(
        "CORAL", "PACS", seed)["mmd_gamma"] <= 10


@pytest.mark.parametrize("dataset, model, lr, outer_lr", [
    ("PovertyMap", "resnet18", 1e-3, 0.1),
    ("PovertyMap-C", "resnet18", 1e-3, 0.1),
    ("FMoW", "densenet121", 1e-4, 0.01),
])
def test_wilds_defaults_follow_the_paper_and_wilds(dataset, model, lr,
                                                   outer_lr):
  assert catalog.DATASETS[dataset].model == model
  hparams = hparams_registry.default_hparams("PGrad", dataset)
  assert hparams["lr"] == lr and hparams["outer_lr"] == outer_lr
  assert hparams["outer_lr_per_domain"] and hparams["weight_decay"] == 0.0
  # WILDS's 64 images from 8 domains per step; BatchNorm trained.
  assert hparams["domains_per_step"] == 8 and hparams["batch_size"] == 8
  assert hparams["bn_mode"] == "train"
  assert hparams_registry.default_hparams("PGrad-B", dataset)[
      "batch_size"] == 9
  # No search on WILDS: every draw is the default.
  assert hparams_registry.random_hparams("IRM", dataset, 3) == (
      hparams_registry.default_hparams("IRM", dataset))
  assert hparams_registry.default_hparams("IRM", dataset)["irm_lambda"] == 1.0


@pytest.mark.parametrize("num_domains", [2, 4])
def test_outer_lr_per_domain_divides_the_outer_step(num_domains):
  model = models.Classifier(Flatten(16), NUM_CLASSES, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  images = jax.random.normal(jax.random.PRNGKey(5),
                             (num_domains, BATCH, 4, 4, 1))
  batches = {"image": images,
             "label": jnp.arange(num_domains * BATCH).reshape(
                 num_domains, BATCH) % NUM_CLASSES}
  steps = []
  for per_domain in (False, True):
    hparams = {**_hparams("PGrad"), "outer_lr_per_domain": per_domain}
    algorithm = algorithms.build_algorithm("PGrad", network, hparams,
                                           num_domains=num_domains)
    new_params, *_ = jax.jit(algorithm.update)(
        params, stats, algorithm.init(params), batches, jax.random.PRNGKey(0))
    steps.append(jax.tree.map(lambda new, old: new - old, new_params, params))
  # gamma = c / n-hat: the same direction, 1 / n-hat as long (up to the
  # float32 rounding of new - old for params of order 1).
  for full, scaled in zip(jax.tree.leaves(steps[0]), jax.tree.leaves(steps[1])):
    assert np.abs(full).max() > 1e-4
    np.testing.assert_allclose(scaled, full / num_domains, rtol=1e-4,
                               atol=1e-7)
