"""Tests for experiments/algorithms/optimization.py: SD, GroupDRO and MLDG.

(ERM's update is every other algorithm's reference; test_algorithms.py
steps it.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import algorithms
import oracle
from test_algorithms import NUM_CLASSES, NUM_DOMAINS
from test_algorithms import algorithm_hparams, float64_batches
from test_algorithms import linear_net_theta, linear_featurizer_model
from test_algorithms import linear_model, make_batches


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
