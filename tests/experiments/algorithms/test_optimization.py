"""Tests for experiments/algorithms/optimization.py: ERM++, SD, GroupDRO and
MLDG.

(ERM's update is every other algorithm's reference; test_algorithms.py
steps it.)
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import algorithms
from experiments import catalog
from experiments import models
from experiments import train
from experiments.training import steps as train_steps
from experiments.algorithms import optimization
import oracle
from test_algorithms import NUM_CLASSES, NUM_DOMAINS
from test_algorithms import algorithm_hparams, float64_batches
from test_algorithms import linear_net_theta, linear_featurizer_model
from test_algorithms import assert_resumes_bit_for_bit, linear_model
from test_algorithms import make_batches


def _head(params):
  return [np.asarray(params["head"][name][...], np.float64)
          for name in ("kernel", "bias")]


def _numpy_batches(batches):
  return {"image": np.asarray(batches["image"], np.float64),
          "label": np.asarray(batches["label"])}


def test_group_dro_matches_a_numpy_model_of_domainbed():
  network, params, stats = linear_model()
  # A large eta, so q moves far from uniform within three steps.
  hparams = {**algorithm_hparams("GroupDRO"), "groupdro_eta": 0.5,
             "lr": 0.01, "weight_decay": 0.01}
  algorithm = algorithms.build_algorithm("GroupDRO", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  np.testing.assert_array_equal(state.q, np.ones(NUM_DOMAINS))
  theta = _head(params)
  batch_list = [make_batches(step, (2, 2, 1)) for step in range(3)]
  losses = []
  for step, batches in enumerate(batch_list):
    params, stats, state, metrics = update(params, stats, state, batches,
                                           jax.random.PRNGKey(step))
    losses.append(metrics["loss"])
  want_theta, want_q, want_losses = oracle.group_dro(
      theta, [_numpy_batches(b) for b in batch_list], 0.01, 0.01, 0.5,
      NUM_CLASSES)
  assert np.abs(want_q - 0.5).max() > 0.01
  # float32 against float64, measured: q 6.4e-8 apart (5.8e-8 with
  # --xla_cpu_max_isa=SSE4_2), the losses 1.4e-7 relative, the params after
  # three Adam steps of 0.01 2.3e-7; about 10x margins.
  np.testing.assert_allclose(state.q, want_q, rtol=0, atol=6e-7)
  np.testing.assert_allclose(metrics["q"], want_q, rtol=0, atol=6e-7)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  for got, want in zip(_head(params), want_theta):
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)


@pytest.mark.parametrize("num_domains, n_meta_test",
                         [(2, 1), (3, 1), (3, 2), (5, 1), (5, 2)])
def test_meta_pairs_are_domainbeds_of_the_drawn_order(num_domains,
                                                      n_meta_test):
  for seed in range(5):
    key = jax.random.PRNGKey(seed)
    # The pairing's one draw: the domains' order.
    perm = list(np.asarray(jax.random.permutation(key, num_domains)))
    for rule, want in (
        ("meta_test_split", oracle.split_meta_train_test(perm, n_meta_test)),
        ("random_pairs", oracle.random_pairs_of_minibatches(perm))):
      train, test = algorithms.meta_pairs(key, num_domains, n_meta_test, rule)
      assert list(zip(np.asarray(train), np.asarray(test))) == want


@pytest.mark.parametrize("rule, n_meta_test", [
    ("meta_test_split", 1), ("meta_test_split", 2), ("random_pairs", 2)])
def test_mldg_matches_a_numpy_model_of_domainbed(rule, n_meta_test):
  num_domains = 3
  network, params, stats = linear_model()
  hparams = {**algorithm_hparams("MLDG"), "mldg_pairs": rule,
             "n_meta_test": n_meta_test, "mldg_beta": 0.7, "lr": 0.01,
             "weight_decay": 0.01}
  algorithm = algorithms.build_algorithm("MLDG", network, hparams,
                                         num_domains=num_domains)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  theta = _head(params)
  batch_list = [make_batches(step, (2, 2, 1), num_domains)
                for step in range(3)]
  pairs_list, objectives = [], []
  for step, batches in enumerate(batch_list):
    key = jax.random.PRNGKey(step)
    # Replay the update's draw: the pairs come from the second half of the
    # step's key.
    train, test = algorithms.meta_pairs(jax.random.split(key)[1], num_domains,
                                        n_meta_test, rule)
    pairs_list.append(list(zip(np.asarray(train), np.asarray(test))))
    params, stats, state, metrics = update(params, stats, state, batches, key)
    objectives.append(metrics["loss"])
  assert len(pairs_list[0]) == (3 if rule == "random_pairs"
                                else num_domains - n_meta_test)
  want_theta, want_objectives = oracle.mldg(
      theta, [_numpy_batches(b) for b in batch_list], pairs_list, 0.01, 0.01,
      0.7, NUM_CLASSES)
  # float32 against float64, measured: the objectives 2e-7 relative, the
  # params after three outer Adam steps (each through inner ones) 2.4e-7
  # apart; 10x margins.
  np.testing.assert_allclose(objectives, want_objectives, rtol=2e-6)
  for got, want, start in zip(_head(params), want_theta, theta):
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    assert np.abs(want - start).max() > 1e-3


@pytest.mark.parametrize("hparams, match", [
    ({"n_meta_test": 2}, "no meta-train domain.*n_meta_test below 2"),
    ({"mldg_pairs": "cyclic"}, "mldg_pairs must be one of"),
])
def test_mldg_rejects_pairings_it_cannot_make(hparams, match):
  network, _, _ = linear_model()
  with pytest.raises(ValueError, match=match):
    algorithms.build_algorithm(
        "MLDG", network, {**algorithm_hparams("MLDG"), **hparams},
        num_domains=NUM_DOMAINS)
  # DomainBed's earlier pairing needs no meta-test count.
  algorithms.build_algorithm(
      "MLDG", network, {**algorithm_hparams("MLDG"), "n_meta_test": 2,
                        "mldg_pairs": "random_pairs"},
      num_domains=NUM_DOMAINS)


def test_sd_matches_a_numpy_model_of_domainbed():
  hparams = {**algorithm_hparams("SD"), "sd_reg": 0.5, "lr": 0.01,
             "weight_decay": 0.01}
  with jax.enable_x64(True):
    network, params, stats = linear_featurizer_model(dtype=jnp.float64)
    algorithm = algorithms.build_algorithm("SD", network, hparams,
                                           num_domains=NUM_DOMAINS)
    update = jax.jit(algorithm.update)
    state = algorithm.init(params)
    theta = linear_net_theta(params)
    batch_list = float64_batches(5)
    objectives = []
    for step, batches in enumerate(batch_list):
      params, stats, state, metrics = update(params, stats, state, batches,
                                             jax.random.PRNGKey(step))
      objectives.append(metrics["loss"] + 0.5 * metrics["penalty"])
  want, want_objectives = oracle.sd(theta, batch_list, 0.01, 0.01, 0.5)
  # The objectives of params the central differences moved apart: measured
  # 3e-12 relative; 30x margin.
  np.testing.assert_allclose(objectives, want_objectives, rtol=1e-10)
  # Five Adam steps of 0.01 from central differences: measured 5e-11
  # apart; 10x margin.
  for got, expected, start in zip(linear_net_theta(params), want, theta):
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-10)
    assert np.abs(expected - start).max() > 1e-2


# ERM++: a featurizer whose BatchNorm trains (a bias-free linear map, whose
# BatchNorm takes the bias's place), so that its statistics are averaged and
# moved by the averaged network's own pass, as DomainBed's.
class NormalizedLinear(nnx.Module):
  """``x @ W`` then BatchNorm with PyTorch's running statistics, trained or
  frozen."""

  def __init__(self, *, rngs: nnx.Rngs, dtype=jnp.float64, frozen=False):
    self.linear = nnx.Linear(4, 3, use_bias=False, dtype=dtype,
                             param_dtype=dtype, rngs=rngs)
    norm = models.FrozenBatchNorm if frozen else models.BatchNorm
    self.norm = norm(3, unbiased_running_var=True, momentum=0.9, dtype=dtype,
                     param_dtype=dtype, rngs=rngs)
    self.num_features = 3

  def __call__(self, x, *, rngs=None):
    del rngs
    return self.norm(self.linear(x.reshape(x.shape[0], -1)))


def _erm_plus_plus_model(seed=0, dtype=jnp.float64, frozen=False):
  featurizer = NormalizedLinear(rngs=nnx.Rngs(seed), dtype=dtype,
                                frozen=frozen)
  model = models.Classifier(featurizer, NUM_CLASSES, rngs=nnx.Rngs(seed + 1),
                            dtype=dtype, param_dtype=dtype)
  # A BatchNorm that does not start at the identity.
  model.featurizer.norm.scale[...] = jnp.asarray([0.5, 1.5, 1.0], dtype)
  model.featurizer.norm.bias[...] = jnp.asarray([0.1, -0.2, 0.3], dtype)
  return algorithms.Network.split(model)


_ERM_PLUS_PLUS_PARAMS = (("featurizer", "linear", "kernel"),
                         ("featurizer", "norm", "scale"),
                         ("featurizer", "norm", "bias"),
                         ("head", "kernel"), ("head", "bias"))
_ERM_PLUS_PLUS_STATS = (("featurizer", "norm", "mean"),
                        ("featurizer", "norm", "var"))


def _arrays(state, paths):
  arrays = []
  for path in paths:
    leaf = state
    for key in path:
      leaf = leaf[key]
    arrays.append(np.asarray(leaf[...], np.float64))
  return arrays


def _numpy_forward(theta, buffers, images, train):
  """DomainBed's network on a NumPy ``theta = [W, scale, bias, W_h, b_h]``,
  with torch's BatchNorm (momentum 0.1, eps 1e-5, the unbiased variance in
  the running one). Returns ``(logits, buffers after the pass)``."""
  kernel, scale, bias, head_kernel, head_bias = theta
  z = np.asarray(images, np.float64).reshape(len(images), -1) @ kernel
  if train:
    mean, var = z.mean(0), z.var(0)
    buffers = [0.9 * buffers[0] + 0.1 * mean,
               0.9 * buffers[1] + 0.1 * z.var(0, ddof=1)]
  else:
    mean, var = buffers
  features = (z - mean) / np.sqrt(var + 1e-5) * scale + bias
  return features @ head_kernel + head_bias, buffers


class _NumpyLARS:
  """DomainBed's ``LARS`` (``lib/misc.py`` lines 533-566) on a list."""

  def __init__(self, lr, wd, theta, momentum=0.9, trust_coefficient=0.001):
    self.lr, self.wd, self.momentum, self.trust = (lr, wd, momentum,
                                                   trust_coefficient)
    self.mu = [np.zeros_like(t) for t in theta]

  def step(self, theta, grads):
    new = []
    for i, (p, dp) in enumerate(zip(theta, grads)):
      if p.ndim > 1:
        dp = dp + self.wd * p
        param_norm, update_norm = np.linalg.norm(p), np.linalg.norm(dp)
        q = (self.trust * param_norm / update_norm
             if param_norm > 0 and update_norm > 0 else 1.0)
        dp = dp * q
      self.mu[i] = self.mu[i] * self.momentum + dp
      new.append(p - self.lr * self.mu[i])
    return new


def _numpy_erm_plus_plus(theta, buffers, batch_list, *, lr, linear_lr, wd,
                         linear_steps, lars, sma_start_iter, lrs=None):
  """DomainBed's ``ERMPlusPlus.update`` (lines 181-202) and its
  ``update_sma`` (``lib/misc.py`` lines 61-72) over several steps; ``lrs``
  maps updates to the full optimizer's learning rate after them, as
  ``set_lr`` sets it (line 231, ``scheduler.step``).

  Returns, after every step, ``(theta, buffers, sma_theta, sma_buffers)``.
  """
  optimizer = (_NumpyLARS if lars else oracle.TorchAdam)
  full = optimizer(lr, wd, theta)
  linear = optimizer(linear_lr, wd, theta[3:])  # network[1]: the head.
  sma_theta, sma_buffers = list(theta), list(buffers)  # deepcopy
  global_iter, sma_count, history = 0, 0, []
  for batches in batch_list:
    images = np.asarray(batches["image"], np.float64).reshape(-1, 4)
    labels = np.asarray(batches["label"]).reshape(-1)
    loss = lambda t: oracle.cross_entropy(
        _numpy_forward(t, buffers, images, True)[0], labels)
    # A step of 1e-5 balances the differences' truncation and rounding
    # errors, which Adam's normalisation magnifies in small gradients.
    grads = oracle.numerical_grad(loss, theta, step=1e-5)
    _, buffers = _numpy_forward(theta, buffers, images, True)
    if global_iter > linear_steps:
      theta = full.step(theta, grads)
    else:
      theta = theta[:3] + linear.step(theta[3:], grads[3:])
    global_iter += 1
    if lrs and global_iter in lrs:
      full.lr = lrs[global_iter]
    live = theta + buffers
    if global_iter >= sma_start_iter:
      sma_count += 1
      kept = sma_theta + sma_buffers
      averaged = [(k * sma_count + q) / (1.0 + sma_count)
                  for k, q in zip(kept, live)]
    else:
      averaged = [np.array(q) for q in live]
    sma_theta, sma_buffers = averaged[:5], averaged[5:]
    # freeze_bn is false: the averaged network's pass in train mode.
    _, sma_buffers = _numpy_forward(sma_theta, sma_buffers, images, True)
    history.append((theta, buffers, sma_theta, sma_buffers))
  return history


def _erm_plus_plus(network, hparams, sma_start_iter):
  return optimization.erm_plus_plus(network, hparams,
                                    num_domains=NUM_DOMAINS, seed=0,
                                    sma_start_iter=sma_start_iter)


def _erm_plus_plus_hparams(linear_steps, lars, **extra):
  """The float64 comparisons' hparams: LARS steps matrices by lr times a
  thousandth of their norm, so it gets larger rates."""
  hparams = {**algorithm_hparams("ERMPlusPlus"), "lr": 0.05,
             "linear_lr": 0.02, "weight_decay": 0.01,
             "linear_steps": linear_steps, "lars": lars, **extra}
  if lars:
    hparams.update(lr=2.0, linear_lr=1.0)
  return hparams


def _float64_batches(steps):
  """``steps`` batches of 2 domains x 2 examples, their floats in float64
  (under ``jax.enable_x64``)."""
  return [jax.tree.map(lambda x: x.astype(jnp.float64)
                       if x.dtype == jnp.float32 else x,
                       make_batches(step, (2, 2, 1)))
          for step in range(steps)]


@pytest.mark.parametrize("lars", [False, True])
def test_erm_plus_plus_matches_a_numpy_model_of_domainbed(lars):
  # Three updates of the probe (linear_steps + 1), then four of the full
  # optimizer; the average holds more than the latest network from update
  # 4 on: the networks after updates 3 to 7 at the end.
  steps, linear_steps, start = 7, 2, 4
  hparams = _erm_plus_plus_hparams(linear_steps, lars)
  with jax.enable_x64(True):
    network, params, stats = _erm_plus_plus_model()
    algorithm = _erm_plus_plus(network, hparams, start)
    update = jax.jit(algorithm.update)
    evaluated = jax.jit(algorithm.evaluated)
    state = algorithm.init(params)
    batch_list = _float64_batches(steps)
    theta = _arrays(params, _ERM_PLUS_PLUS_PARAMS)
    buffers = _arrays(stats, _ERM_PLUS_PLUS_STATS)
    # Before any update the evaluated network is the network itself.
    for got, want in zip(evaluated(params, stats, state), (params, stats)):
      for got_leaf, want_leaf in zip(jax.tree.leaves(got),
                                     jax.tree.leaves(want)):
        np.testing.assert_array_equal(got_leaf, want_leaf)
    got_history, probe = [], []
    for step, batches in enumerate(batch_list):
      params, stats, state, metrics = update(params, stats, state, batches,
                                             jax.random.PRNGKey(step))
      sma_params, sma_stats = evaluated(params, stats, state)
      got_history.append(
          (_arrays(params, _ERM_PLUS_PLUS_PARAMS),
           _arrays(stats, _ERM_PLUS_PLUS_STATS),
           _arrays(sma_params, _ERM_PLUS_PLUS_PARAMS),
           _arrays(sma_stats, _ERM_PLUS_PLUS_STATS)))
      probe.append(float(metrics["linear_probe"]))
    images = batch_list[0]["image"].reshape(-1, 2, 2, 1)
    logits, _ = network.logits(sma_params, sma_stats, images, train=False)
  want_history = _numpy_erm_plus_plus(
      theta, buffers, batch_list, lr=hparams["lr"],
      linear_lr=hparams["linear_lr"], wd=0.01, linear_steps=linear_steps,
      lars=lars, sma_start_iter=start)
  assert probe == [1.0] * (linear_steps + 1) + [0.0] * (
      steps - linear_steps - 1)
  # The probe leaves the featurizer as it was, and the full optimizer
  # moves it.
  for want in want_history[:linear_steps + 1]:
    for got, initial in zip(want[0][:3], theta[:3]):
      np.testing.assert_array_equal(got, initial)
  assert not np.allclose(want_history[-1][0][0], theta[0])
  # float64 against float64 with central-difference gradients, measured: at
  # most 2.8e-11 apart with Adam, 8.1e-11 with LARS (params of order 1).
  for got, want in zip(got_history, want_history):
    for got_arrays, want_arrays in zip(got, want):
      for got_array, want_array in zip(got_arrays, want_arrays):
        np.testing.assert_allclose(got_array, want_array, rtol=0, atol=1e-9)
  # The average is not the latest network, and evaluation runs it.
  assert not np.allclose(got_history[-1][2][3], got_history[-1][0][3])
  want_logits, _ = _numpy_forward(want_history[-1][2], want_history[-1][3],
                                  np.asarray(images).reshape(-1, 4), False)
  np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("lars", [False, True])
def test_erm_plus_plus_auto_lr_steps_at_the_learning_rate_it_is_set(lars):
  # The probe takes updates 1-3; the loop sets the full optimizer's
  # learning rate after updates 4 and 5, as DomainBed's set_lr does at an
  # evaluation; the probe's stays linear_lr.
  steps, linear_steps, start = 7, 2, 4
  hparams = _erm_plus_plus_hparams(linear_steps, lars, auto_lr=True)
  lrs = {4: hparams["lr"] * 0.1, 5: hparams["lr"] * 0.01}
  with jax.enable_x64(True):
    network, params, stats = _erm_plus_plus_model()
    algorithm = _erm_plus_plus(network, hparams, start)
    update = jax.jit(algorithm.update)
    set_learning_rate = jax.jit(algorithm.set_learning_rate)
    state = algorithm.init(params)
    theta = _arrays(params, _ERM_PLUS_PLUS_PARAMS)
    buffers = _arrays(stats, _ERM_PLUS_PLUS_STATS)
    batch_list = _float64_batches(steps)
    got = []
    for step, batches in enumerate(batch_list):
      params, stats, state, _ = update(params, stats, state, batches,
                                       jax.random.PRNGKey(step))
      if step + 1 in lrs:
        state = set_learning_rate(state, jnp.asarray(lrs[step + 1]))
      got.append(_arrays(params, _ERM_PLUS_PLUS_PARAMS))
  kwargs = dict(lr=hparams["lr"], linear_lr=hparams["linear_lr"], wd=0.01,
                linear_steps=linear_steps, lars=lars, sma_start_iter=start)
  want = [h[0] for h in _numpy_erm_plus_plus(theta, buffers, batch_list,
                                             lrs=lrs, **kwargs)]
  constant = [h[0] for h in _numpy_erm_plus_plus(theta, buffers, batch_list,
                                                 **kwargs)]
  # As the constant-rate model's tolerance (measured above).
  for got_arrays, want_arrays in zip(got, want):
    for got_array, want_array in zip(got_arrays, want_arrays):
      np.testing.assert_allclose(got_array, want_array, rtol=0, atol=1e-9)
  # The rates set move the params elsewhere than the constant one.
  assert not np.allclose(want[-1][0], constant[-1][0], rtol=0, atol=1e-6)


def test_erm_plus_plus_resumes_bit_for_bit_across_its_switches(tmp_path):
  # Checkpointed after update 1, in the probe; resumed, update 2 is the
  # probe's last, update 3 the full optimizer's first and the average's
  # start.
  hparams = {**algorithm_hparams("ERMPlusPlus"), "linear_steps": 1,
             "lr": 0.01, "linear_lr": 0.01}
  network, params, stats = _erm_plus_plus_model(dtype=jnp.float32)
  algorithm = _erm_plus_plus(network, hparams, 3)
  update = jax.jit(algorithm.update)

  def train(state, steps):
    for step in steps:
      state = train_steps.TrainState(state.step + 1, *update(
          state.params, state.stats, state.algorithm_state,
          make_batches(step, (2, 2, 1)), jax.random.PRNGKey(step))[:3])
    return state

  start = train_steps.TrainState(jnp.zeros((), jnp.int32), params, stats,
                              algorithm.init(params))
  uninterrupted = assert_resumes_bit_for_bit(tmp_path, train, start, 1, 5)
  average = uninterrupted.algorithm_state.average
  assert int(average.updates) == 5 and int(average.count) == 4
  assert not np.array_equal(average.average["params"]["head"]["kernel"][...],
                            uninterrupted.params["head"]["kernel"][...])


def test_the_training_loop_evaluates_erm_plus_plus_average(tmp_path, capsys,
                                                          monkeypatch):
  # The same run twice: with the average from update 2 on, and never
  # averaging (the MNIST CNN has no BatchNorm, so that average is the
  # network). Training is the same; the evaluations differ.
  def run(name, start):
    entry = dataclasses.replace(catalog.ALGORITHMS["ERMPlusPlus"], name=name,
                                options={"sma_start_iter": start})
    monkeypatch.setitem(catalog.ALGORITHMS, name, entry)
    assert train.main([
        "--algorithm", name, "--steps", "4", "--checkpoint_freq", "2",
        "--test_envs", "0", "--eval_examples", "16", "--loss_examples", "16",
        "--num_workers", "0", "--output_dir", str(tmp_path / name),
        "--hparams", '{"batch_size": 4, "cnn_width": 8, "image_size": 8, '
        '"linear_steps": 2}']) == 0, capsys.readouterr().err
    lines = (tmp_path / name / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]

  averaged, latest = run("ERMPlusPlus-2", 2), run("ERMPlusPlus-never", 10**9)
  # Updates 1-3 step the probe, update 4 the full optimizer.
  assert [r["linear_probe"] for r in averaged] == [1.0, 0.5]
  for got, want in zip(averaged, latest):
    assert got["loss"] == want["loss"]
  assert averaged[-1]["env0_in_loss"] != latest[-1]["env0_in_loss"]


@pytest.mark.parametrize("lars", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_erm_plus_plus_in_bfloat16_with_trained_or_frozen_batchnorm(
    frozen, lars):
  hparams = {**algorithm_hparams("ERMPlusPlus"), "linear_steps": 0,
             "lars": lars}
  network, params, stats = _erm_plus_plus_model(dtype=jnp.bfloat16,
                                                frozen=frozen)
  algorithm = _erm_plus_plus(network, hparams, 2)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  for step in range(3):
    params, stats, state, metrics = update(
        params, stats, state,
        jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                     if x.dtype == jnp.float32 else x,
                     make_batches(step, (2, 2, 1))),
        jax.random.PRNGKey(step))
    assert np.isfinite(float(metrics["loss"]))
  sma_params, sma_stats = algorithm.evaluated(params, stats, state)
  # The params and their average keep the model's dtype, the statistics
  # theirs (float32: models.statistics_dtype).
  for tree, dtype in ((params, jnp.bfloat16), (sma_params, jnp.bfloat16),
                      (sma_stats, jnp.float32)):
    for leaf in jax.tree.leaves(tree):
      assert leaf.dtype == dtype and np.all(np.isfinite(
          np.asarray(leaf, np.float32)))
  initial = _erm_plus_plus_model(dtype=jnp.bfloat16, frozen=frozen)[2]
  for got, want in zip(jax.tree.leaves(sma_stats), jax.tree.leaves(initial)):
    # Frozen statistics are averaged to themselves, exactly (DomainBed's
    # frozen buffers never change); trained ones move.
    assert np.array_equal(got, want) == frozen
