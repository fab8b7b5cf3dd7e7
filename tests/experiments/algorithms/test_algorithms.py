"""Tests for experiments/algorithms/ (its interface and what all its
algorithms share) and experiments/hparams_registry.py.

The shared models and batches here serve the per-category tests,
tests/experiments/algorithms/test_<category>.py.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from experiments import algorithms
from experiments import catalog
from experiments import config as config_lib
from experiments import hparams_registry
from experiments import models
from experiments.training import steps as train_steps

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


class LinearFeaturizer(nnx.Module):
  """A linear map of the pixels: the simplest featurizer with parameters."""

  def __init__(self, in_features: int, num_features: int, *, rngs: nnx.Rngs,
               dtype=jnp.float32):
    self.linear = nnx.Linear(in_features, num_features, dtype=dtype,
                             param_dtype=dtype, rngs=rngs)
    self.num_features = num_features

  def __call__(self, x, *, rngs=None):
    del rngs
    return self.linear(x.reshape(x.shape[0], -1))


def make_batches(seed=0, image_shape=(4, 4, 1), num_domains=NUM_DOMAINS,
                 batch=BATCH):
  """Normal images; the labels cycle through the classes."""
  images = jax.random.normal(jax.random.PRNGKey(seed),
                             (num_domains, batch) + image_shape)
  labels = jnp.arange(num_domains * batch).reshape(num_domains, batch)
  return {"image": images, "label": labels % NUM_CLASSES}


def algorithm_hparams(name):
  hparams = hparams_registry.default_hparams(name, "RotatedDigits")
  if name == "Fishr":
    hparams["penalty_anneal_iters"] = 0  # Penalise from the first step.
  if name == "IRM":
    hparams["irm_penalty_anneal_iters"] = 0
  if name == "VREx":
    hparams["vrex_penalty_anneal_iters"] = 0
  if name == "IB_ERM":
    hparams["ib_penalty_anneal_iters"] = 0
  if name == "MLDG":
    hparams["n_meta_test"] = 1  # One of the NUM_DOMAINS = 2 domains.
  if name == "SANDMask":
    # At DomainBed's default tau = 1 the mask is 0 everywhere: no step.
    hparams["tau"] = 0.5
  return hparams


def linear_model(num_features=4, seed=0):
  model = models.Classifier(Flatten(num_features), NUM_CLASSES,
                            rngs=nnx.Rngs(seed))
  return algorithms.Network.split(model)


def takes_context(name):
  """Whether ``name``'s model is ARM's, whose featurizer sees one more
  channel."""
  return bool(catalog.ALGORITHMS[name].model_options.get("context_net"))


def build_model(name, featurizer, *, in_channels=1, seed=1,
                dtype=jnp.float32):
  """``name``'s model on ``featurizer``: with ARM's context network (the
  featurizer then takes ``in_channels + 1``), SagNet's style head or MTL's
  domain embedding if the catalog says so."""
  kwargs = dict(rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
  options = catalog.ALGORITHMS[name].model_options
  if takes_context(name):
    return models.ContextClassifier(featurizer, NUM_CLASSES, in_channels,
                                    **kwargs)
  if options.get("style_head"):
    return models.StyleClassifier(featurizer, NUM_CLASSES, **kwargs)
  if options.get("domain_embedding"):
    return models.EmbeddingClassifier(featurizer, NUM_CLASSES, **kwargs)
  return models.Classifier(featurizer, NUM_CLASSES, **kwargs)


def linear_featurizer_model(seed=0, dtype=jnp.float32, style_head=False):
  """A `LinearFeaturizer` of 2x2 images to 3 features and a linear head (and
  SagNet's style head, with ``style_head``), for the NumPy models of
  oracle.py."""
  model_class = models.StyleClassifier if style_head else models.Classifier
  model = model_class(
      LinearFeaturizer(4, 3, rngs=nnx.Rngs(seed), dtype=dtype), NUM_CLASSES,
      rngs=nnx.Rngs(seed + 1), dtype=dtype, param_dtype=dtype)
  return algorithms.Network.split(model)


def float64_batches(steps, image_shape=(2, 2, 1)):
  """`make_batches` of every step in float64; step 1's labels lack the last
  class (which CDANN's class balance counts as DomainBed's does)."""
  batch_list = [jax.tree.map(lambda x: x.astype(jnp.float64)
                             if x.dtype == jnp.float32 else x,
                             make_batches(step, image_shape))
                for step in range(steps)]
  batch_list[1]["label"] = batch_list[1]["label"] % (NUM_CLASSES - 1)
  return batch_list


def linear_net_theta(params):
  """A `LinearFeaturizer` model's params as ``oracle.linear_net`` takes
  them: ``[W_f, b_f, W_h, b_h]`` in float64."""
  return [np.asarray(leaf[...], np.float64) for leaf in (
      params["featurizer"]["linear"]["kernel"],
      params["featurizer"]["linear"]["bias"], params["head"]["kernel"],
      params["head"]["bias"])]


def linear_net_model(name, num_features=4):
  """``name``'s model (`build_model`) on a `LinearFeaturizer` of 4x4 images."""
  return build_model(name, LinearFeaturizer(16, num_features,
                                            rngs=nnx.Rngs(0)))


def train_linear_net(name, hparams, num_steps=5, num_domains=3,
                     num_features=4, batch_list=None):
  """``num_steps`` updates of ``name`` on `linear_net_model`, step ``i`` on
  ``make_batches(i)`` (or ``batch_list[i]``) with key ``PRNGKey(i)``.

  Returns:
    ``(theta before, batches, params after, state after, metrics of every
    step)``, the thetas as `linear_net_theta`.
  """
  network, params, stats = algorithms.Network.split(
      linear_net_model(name, num_features))
  algorithm = algorithms.build_algorithm(
      name, network, {**algorithm_hparams(name), **hparams},
      num_domains=num_domains)
  update = jax.jit(algorithm.update)
  theta = linear_net_theta(params)
  state = algorithm.init(params)
  if batch_list is None:
    batch_list = [make_batches(step, num_domains=num_domains)
                  for step in range(num_steps)]
  metrics = []
  for step, batches in enumerate(batch_list):
    params, stats, state, step_metrics = update(params, stats, state, batches,
                                                jax.random.PRNGKey(step))
    metrics.append(step_metrics)
  return theta, batch_list, linear_net_theta(params), state, metrics


@pytest.mark.parametrize("name", list(catalog.ALGORITHMS))
def test_every_algorithm_takes_a_finite_step(name):
  # 4x4 images of one channel, and ARM's context channel.
  pixels = 16 * (1 + takes_context(name))
  model = build_model(name, TinyFeaturizer(pixels, rngs=nnx.Rngs(0)))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(name, network,
                                         algorithm_hparams(name),
                                         num_domains=NUM_DOMAINS)
  new_params, new_stats, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), make_batches(),
      jax.random.PRNGKey(1))

  assert np.isfinite(metrics["loss"])
  for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    assert old.shape == new.shape and np.all(np.isfinite(new))
  assert any(not np.array_equal(old, new) for old, new in
             zip(jax.tree.leaves(params), jax.tree.leaves(new_params)))
  # BatchNorm's running mean starts at zero; the training passes move it,
  # except MLDG's, whose passes are of DomainBed's throw-away copies.
  moved = np.any(new_stats["featurizer"]["norm"]["mean"][...] != 0)
  assert moved == (name != "MLDG")
  if "eigenvalues" in metrics:
    eigenvalues = np.asarray(metrics["eigenvalues"])
    np.testing.assert_allclose(eigenvalues.sum(), 1.0, rtol=1e-5)
    assert np.all(np.diff(eigenvalues) <= 0)


def assert_resumes_bit_for_bit(tmp_path, train, start, checkpoint_at,
                               steps):
  """Checks that ``train(start, range(steps))`` equals training to
  ``checkpoint_at``, a checkpoint saved and restored as the training loop
  does (Orbax), then training on; returns the uninterrupted state."""
  uninterrupted = train(start, range(steps))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", train(start, range(checkpoint_at)))
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(
      tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                       start))
  resumed = train(restored, range(checkpoint_at, steps))
  assert jax.tree.structure(resumed) == jax.tree.structure(uninterrupted)
  for got, want in zip(jax.tree.leaves(resumed),
                       jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(got, want)
  return uninterrupted


# Algorithms with state beyond one Adam's, with hparams that use it around
# the resume after step 2: VREx's and IB_ERM's update count, whose anneal
# step (2) restarts Adam after the resume; CDANN's count, which picks the
# step kind, its discriminator, class embeddings and their Adam; SagNet's
# three Adams. SD's is ERM's Adam.
@pytest.mark.parametrize("name, hparams", [
    ("VREx", {"vrex_penalty_anneal_iters": 2}),
    ("IB_ERM", {"ib_penalty_anneal_iters": 2}),
    ("CDANN", {"d_steps_per_g_step": 2, "mlp_width": 8}),
    ("SagNet", {}),
    ("SD", {}),
])
def test_a_checkpointed_state_resumes_bit_for_bit(name, hparams, tmp_path):
  model = build_model(name, TinyFeaturizer(16, rngs=nnx.Rngs(0)))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(
      name, network, {**algorithm_hparams(name), **hparams},
      num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)

  def train(state, steps):
    for step in steps:
      state = train_steps.TrainState(state.step + 1, *update(
          state.params, state.stats, state.algorithm_state,
          make_batches(step), jax.random.PRNGKey(step))[:3])
    return state

  start = train_steps.TrainState(jnp.zeros((), jnp.int32), params, stats,
                              algorithm.init(params))
  uninterrupted = assert_resumes_bit_for_bit(tmp_path, train, start, 2, 5)
  assert not np.array_equal(uninterrupted.params["head"]["kernel"][...],
                            params["head"]["kernel"][...])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", list(catalog.ALGORITHMS))
def test_every_algorithm_keeps_to_the_models_dtype(name, dtype):
  # With float64 enabled, so that JAX's default dtype is float64: state made
  # in the default dtype, or in float32, shows in one of the two models.
  # The update's dtypes are those of its trace, which jax.eval_shape gives
  # without compiling it (as jax.jit would, to the same output types).
  with jax.enable_x64(True):
    pixels = 16 * (1 + takes_context(name))
    model = build_model(name, LinearFeaturizer(pixels, 5, rngs=nnx.Rngs(0),
                                               dtype=dtype), dtype=dtype)
    network, params, stats = algorithms.Network.split(model)
    algorithm = algorithms.build_algorithm(name, network,
                                           algorithm_hparams(name),
                                           num_domains=NUM_DOMAINS)
    batches = make_batches()
    batches["image"] = batches["image"].astype(dtype)
    state = algorithm.init(params)
    outputs = jax.eval_shape(algorithm.update, params, stats, state,
                             batches, jax.random.PRNGKey(1))
  # The rollouts' pgrad_jax keeps its diagnostics (state and metrics) in
  # float32 (docs/api.md).
  rollout = name.startswith("PGrad") or name == "Fish"
  diagnostics = ("eigenvalues", "ref_norm", "loss", "losses")

  def checked(path, leaf):
    field = getattr(path[-1], "name", getattr(path[-1], "key", None))
    return (jnp.issubdtype(leaf.dtype, jnp.floating)
            and not (rollout and field in diagnostics))

  floating = {leaf.dtype for path, leaf in
              jax.tree_util.tree_leaves_with_path((state, outputs))
              if checked(path, leaf)}
  assert floating == {jnp.dtype(dtype)}


class NormalizedPixels(nnx.Module):
  """BatchNorm straight on the pixels: its statistics depend on data only."""

  def __init__(self, num_features: int, *, rngs: nnx.Rngs):
    self.norm = nnx.BatchNorm(num_features, momentum=0.9, rngs=rngs)
    self.num_features = num_features

  def __call__(self, x, *, rngs=None):
    del rngs
    return self.norm(x.reshape(x.shape[0], -1))


def numpy_running_stats(chunks):
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
    # GroupDRO, MMD and CORAL: one pass per domain, in order, as DomainBed's
    # loops.
    ("GroupDRO", {}, lambda x: [x[0], x[1]]),
    ("MMD", {}, lambda x: [x[0], x[1]]),
    ("CORAL", {}, lambda x: [x[0], x[1]]),
    # IRM, VREx, IB_ERM, SD and CDANN: one pass over all domains, as
    # DomainBed's.
    ("IRM", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    ("VREx", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    ("IB_ERM", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    ("SD", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    ("CDANN", {}, lambda x: [x.reshape(-1, 4, 4, 1)]),
    # SagNet: three passes over all domains (content, style, adversary).
    ("SagNet", {}, lambda x: [x.reshape(-1, 4, 4, 1)] * 3),
])
def test_trained_batchnorm_follows_every_forward_pass(name, hparams, chunks):
  model = build_model(name, NormalizedPixels(16, rngs=nnx.Rngs(0)), seed=1)
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(
      name, network, {**algorithm_hparams(name), **hparams},
      num_domains=NUM_DOMAINS)
  batches = make_batches()
  state = algorithm.init(params)
  _, new_stats, new_state, _ = jax.jit(algorithm.update)(
      params, stats, state, batches, jax.random.PRNGKey(1))
  mean, var = numpy_running_stats(chunks(batches["image"]))
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["mean"][...],
                             mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["var"][...],
                             var, rtol=1e-5, atol=1e-6)
  # The statistics are not kept in the algorithm's state.
  assert (jax.tree.structure(new_state) == jax.tree.structure(state))

def test_registry():
  assert {"ERM", "PGrad", "PGrad-F", "PGrad-B", "PGrad-BMix", "PGradParallel",
          "Fish", "Fishr", "MixUp", "IRM", "CORAL", "ANDMask", "SANDMask",
          "IGA", "RSC", "SelfReg", "MTL"} <= set(catalog.ALGORITHMS)
  with pytest.raises(ValueError, match="already registered"):
    catalog.ALGORITHMS.register("ERM", algorithms.erm)
  with pytest.raises(ValueError, match="Unknown algorithm"):
    algorithms.build_algorithm("SGD", None, {}, num_domains=2)


# The paper's B = 3, and B = 2 on DomainNet (section 5.1).
@pytest.mark.parametrize("dataset, model, lr, chunks, batch", [
    ("RotatedDigits", "mnist_cnn", 1e-3, 3, 63),
    ("PACS", "resnet50", 5e-5, 3, 33),
    ("DomainNet", "resnet50", 5e-5, 2, 24),
])
def test_pgrad_b_defaults_follow_the_paper(dataset, model, lr, chunks, batch):
  hparams = hparams_registry.default_hparams("PGrad-B", dataset)
  assert catalog.DATASETS[dataset].model == model
  assert hparams["lr"] == lr and hparams["outer_lr"] == 0.1
  assert hparams["k"] == 4 and hparams["B"] == chunks
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


# DomainBed's algorithm-specific hparams (hparams_registry.py at b93c22a1):
# name -> (default on the digits, default on photos, the search's range).
DOMAINBED_HPARAMS = {
    "MMD": {"mmd_gamma": (1.0, 1.0, (0.1, 10))},
    "VREx": {"vrex_lambda": (10.0, 10.0, (0.1, 1e5)),
             "vrex_penalty_anneal_iters": (500, 500, (1, 1e4))},
    "IB_ERM": {"ib_lambda": (100.0, 100.0, (0.1, 1e5)),
               "ib_penalty_anneal_iters": (500, 500, (1, 1e4))},
    "SD": {"sd_reg": (0.1, 0.1, (1e-5, 0.1))},
    "SagNet": {"sag_w_adv": (0.1, 0.1, (1e-2, 10))},
    "GroupDRO": {"groupdro_eta": (1e-2, 1e-2, (1e-3, 1e-1))},
    "MLDG": {"mldg_beta": (1.0, 1.0, (0.1, 10)),
             "n_meta_test": (2, 2, (1, 2))},
    "ARM": {"batch_size": (64, 8, None)},
    "DANN": {"lambda": (1.0, 1.0, (1e-2, 1e2)),
             "weight_decay_d": (0.0, 0.0, (1e-6, 1e-2)),
             "d_steps_per_g_step": (1, 1, (1, 7)),
             "grad_penalty": (0.0, 0.0, (1e-2, 10)),
             "beta1": (0.5, 0.5, (0.0, 0.5)),
             "mlp_width": (256, 256, (64, 1023)),
             "mlp_depth": (3, 3, (3, 5)),
             "mlp_dropout": (0.0, 0.0, (0.0, 0.5)),
             "lr_g": (1e-3, 5e-5, None), "lr_d": (1e-3, 5e-5, None),
             "weight_decay_g": (0.0, 0.0, None)},
    "ANDMask": {"tau": (1.0, 1.0, (0.5, 1.0))},
    "SANDMask": {"tau": (1.0, 1.0, (0.0, 1.0)), "k": (10.0, 10.0, (1e-3, 1e5))},
    "IGA": {"penalty": (1000.0, 1000.0, (10.0, 1e5))},
    "RSC": {"rsc_f_drop_factor": (1 / 3, 1 / 3, (0.0, 0.5)),
            "rsc_b_drop_factor": (1 / 3, 1 / 3, (0.0, 0.5))},
    "MTL": {"mtl_ema": (0.99, 0.99, (0.5, 1.0))},
}
# DomainBed's DANN block is CDANN's too.
DOMAINBED_HPARAMS["CDANN"] = DOMAINBED_HPARAMS["DANN"]


@pytest.mark.parametrize("name", list(DOMAINBED_HPARAMS))
@pytest.mark.parametrize("dataset", ["RotatedDigits", "ColoredDigits", "PACS"])
def test_the_compared_baselines_take_domainbeds_hparams(name, dataset,
                                                        capsys):
  small = catalog.DATASETS[dataset].small_images
  defaults = hparams_registry.default_hparams(name, dataset)
  for key, (digits, photos, _) in DOMAINBED_HPARAMS[name].items():
    assert defaults[key] == (digits if small else photos), key
    assert type(defaults[key]) is type(digits), key
  # A DomainBed --hparams JSON of them works unchanged.
  config_lib.Config(dataset=dataset, algorithm=name, hparams=json.dumps(
      {key: value[1] for key, value in DOMAINBED_HPARAMS[name].items()})
                    ).resolve().hyperparameters()
  for seed in range(1, 30):
    draw = hparams_registry.random_hparams(name, dataset, seed)
    for key, (default, _, bounds) in DOMAINBED_HPARAMS[name].items():
      assert type(draw[key]) is type(default), key
      if bounds:
        assert bounds[0] <= draw[key] <= bounds[1], (key, draw[key])
  if name == "ARM" and not small:
    # Its support sets, 8 images, are not searched on photos.
    assert {hparams_registry.random_hparams(name, dataset, seed)["batch_size"]
            for seed in range(1, 30)} == {8}
  if name in ("DANN", "CDANN"):
    # The generator's and discriminator's rates are drawn as lr is, apart.
    draws = [hparams_registry.random_hparams(name, dataset, seed)
             for seed in range(1, 30)]
    low, high = (10**-4.5, 10**-2.5) if small else (1e-5, 10**-3.5)
    assert all(low <= d[k] <= high for d in draws for k in ("lr_g", "lr_d"))
    assert len({(d["lr_g"], d["lr_d"], d["lr"]) for d in draws}) == 29
  with pytest.raises(SystemExit) as exit_info:
    config_lib.parse_args(["--list_hparams", "--algorithm", name,
                           "--dataset", dataset])
  assert exit_info.value.code == 0
  listed = capsys.readouterr().out
  for key in DOMAINBED_HPARAMS[name]:
    assert f"\n{key} " in listed, key


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


# Their masks and partners are by class, which regression targets lack.
@pytest.mark.parametrize("name", ["RSC", "SelfReg"])
def test_class_label_algorithms_refuse_regression_targets(name):
  model = models.Classifier(Flatten(16), 1, rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm(name, network,
                                         algorithm_hparams(name),
                                         num_domains=NUM_DOMAINS)
  batches = make_batches()
  batches["label"] = batches["label"].astype(jnp.float32)
  with pytest.raises(ValueError, match="needs class labels"):
    algorithm.update(params, stats, algorithm.init(params), batches,
                     jax.random.PRNGKey(0))
