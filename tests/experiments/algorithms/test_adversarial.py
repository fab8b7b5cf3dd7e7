"""Tests for experiments/algorithms/adversarial.py: DANN, CDANN and
SagNet."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import algorithms
import oracle
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS
from test_algorithms import algorithm_hparams, linear_net_theta
from test_algorithms import float64_batches, linear_featurizer_model
from test_algorithms import linear_model, make_batches


def _dann_hparams(d_steps):
  return {**algorithm_hparams("DANN"), "d_steps_per_g_step": d_steps,
          "grad_penalty": 0.5, "lambda": 0.7, "beta1": 0.5, "lr_g": 0.01,
          "lr_d": 0.02, "weight_decay_g": 0.01, "weight_decay_d": 0.02,
          "mlp_width": 5, "mlp_depth": 3, "mlp_dropout": 0.0}


def test_dann_alternates_as_domainbed():
  # update_count % (1 + d) < d trains the discriminator (the count starts
  # at 1).
  kinds = lambda d: [bool(algorithms.dann_step_kind(count, d))
                     for count in range(1, 7)]
  assert kinds(1) == [False, True, False, True, False, True]
  assert kinds(2) == [True, False, True, True, False, True]


def _mlp_arrays(disc_params):
  """A `models.MLP`'s params as NumPy ``[W_1, b_1, ..., W_L, b_L]``, and
  CDANN's (``{"mlp", "class_embeddings"}``) with the embeddings last."""
  if "class_embeddings" in disc_params:
    return _mlp_arrays(disc_params["mlp"]) + [
        np.asarray(disc_params["class_embeddings"]["embedding"][...])]
  return [np.asarray(layer[name][...])
          for layer in disc_params["layers"].values()
          for name in ("kernel", "bias")]


@pytest.mark.parametrize("name", ["DANN", "CDANN"])
@pytest.mark.parametrize("d_steps", [1, 2])
def test_dann_matches_a_numpy_model_of_domainbed(name, d_steps):
  # In float64 throughout, so that any part computed in float32 (as the
  # discriminator once was, 2e-4 off after four steps) stands out of the
  # float64 noise.
  conditional = name == "CDANN"
  with jax.enable_x64(True):
    network, params, stats = linear_featurizer_model(dtype=jnp.float64)
    hparams = _dann_hparams(d_steps)
    algorithm = algorithms.build_algorithm(name, network, hparams,
                                           num_domains=NUM_DOMAINS, seed=3)
    update = jax.jit(algorithm.update)
    state = algorithm.init(params)
    assert {x.dtype for x in jax.tree.leaves((state.disc_params,
                                              state.disc_opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)} == {np.dtype("float64")}
    generator = linear_net_theta(params)
    discriminator = _mlp_arrays(state.disc_params)
    assert [w.shape for w in discriminator[:6:2]] == [(3, 5), (5, 5), (5, 2)]
    # CDANN's embeddings, one per class, start at N(0, 1) as PyTorch's.
    assert len(discriminator) == 6 + conditional
    if conditional:
      assert discriminator[-1].shape == (NUM_CLASSES, 3)
    batch_list = float64_batches(5)
    for step, batches in enumerate(batch_list):
      # The losses of the networks the step starts from (the generator's
      # loss and the discriminator's with its gradient penalty).
      want_losses = oracle.dann_losses(
          linear_net_theta(params), _mlp_arrays(state.disc_params),
          batches["image"], np.asarray(batches["label"]), 0.5, conditional)
      params, stats, state, metrics = update(params, stats, state, batches,
                                             jax.random.PRNGKey(step))
      # float64 against float64: measured 4e-16 relative; 1e-13 leaves
      # room for other summation orders, far below the 2e-7 of a float32
      # discriminator.
      np.testing.assert_allclose(
          [metrics["loss"], metrics["disc_loss"], metrics["penalty"]],
          want_losses, rtol=1e-13)
  want_generator, want_discriminator = oracle.dann(
      generator, discriminator, batch_list, hparams, conditional)
  assert int(state.count) == 5
  # Five Adam steps of 0.01-0.02 from the oracle's central differences,
  # whose rounding (1e-16 / step 1e-6) is the noise here: measured 3e-10 to
  # 1.6e-9 apart (1e-11 at step 1e-4), against 2e-4 with the discriminator
  # in float32. Both networks moved, CDANN's embeddings too.
  for got, want, start in zip(
      linear_net_theta(params) + _mlp_arrays(state.disc_params),
      want_generator + want_discriminator, generator + discriminator):
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-9)
    assert np.abs(want - start).max() > 1e-3


def test_dann_dropout_draws_from_the_step_key():
  network, params, stats = linear_featurizer_model()
  hparams = {**_dann_hparams(1), "mlp_dropout": 0.5}
  algorithm = algorithms.build_algorithm("DANN", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  losses = [float(update(params, stats, state, make_batches(0, (2, 2, 1)),
                         jax.random.PRNGKey(key))[3]["disc_loss"])
            for key in (0, 0, 1)]
  assert losses[0] == losses[1] != losses[2]


def test_cdann_refuses_regression_targets():
  network, params, stats = linear_featurizer_model()
  algorithm = algorithms.build_algorithm("CDANN", network, _dann_hparams(1),
                                         num_domains=NUM_DOMAINS)
  batches = make_batches(0, (2, 2, 1))
  batches["label"] = batches["label"].astype(jnp.float32)
  with pytest.raises(ValueError, match="train DANN instead"):
    algorithm.update(params, stats, algorithm.init(params), batches,
                     jax.random.PRNGKey(0))


def _style(params):
  return [np.asarray(params["style_head"][name][...], np.float64)
          for name in ("kernel", "bias")]


def test_sagnet_matches_a_numpy_model_of_domainbed():
  hparams = {**algorithm_hparams("SagNet"), "sag_w_adv": 0.5, "lr": 0.01,
             "weight_decay": 0.01}
  with jax.enable_x64(True):
    network, params, stats = linear_featurizer_model(
        dtype=jnp.float64, style_head=True)
    algorithm = algorithms.build_algorithm("SagNet", network, hparams,
                                           num_domains=NUM_DOMAINS)
    update = jax.jit(algorithm.update)
    state = algorithm.init(params)
    theta, style = linear_net_theta(params), _style(params)
    batch_list = float64_batches(5)
    draws_list, history = [], []
    for step, batches in enumerate(batch_list):
      key = jax.random.PRNGKey(step)
      draws_list.append([
          (np.asarray(draws.alpha), np.asarray(draws.perm)) for draws in
          algorithms.sagnet_draws(key, NUM_DOMAINS * BATCH, jnp.float64)])
      params, stats, state, metrics = update(params, stats, state, batches,
                                             key)
      history.append((metrics["loss"], metrics["loss_s"],
                      metrics["loss_adv"]))
    # The featurizer's Adam steps twice an update, the others once.
    assert [int(opt_state.inner_state[1][0].count) for opt_state in state] == [
        10, 5, 5]
  want_theta, want_style, want_history = oracle.sagnet(
      theta, style, batch_list, draws_list, 0.01, 0.01, 0.5)
  # The losses of params the central differences moved apart: measured
  # 2e-11 relative; 25x margin.
  np.testing.assert_allclose(history, want_history, rtol=5e-10)
  # Fifteen Adam steps of 0.01 from central differences: measured 6e-11
  # apart; 15x margin. All three networks moved.
  for got, expected, start in zip(linear_net_theta(params) + _style(params),
                                  want_theta + want_style, theta + style):
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)
    assert np.abs(expected - start).max() > 1e-2


def test_sagnet_randomizes_style_and_content_as_domainbed():
  features = jax.random.normal(jax.random.PRNGKey(0), (6, 5)) * 2 + 1
  draws = algorithms.sagnet_draws(jax.random.PRNGKey(1), 6, jnp.float32)[0]
  for what in ("style", "content"):
    want = oracle.sagnet_randomize(np.asarray(features, np.float64),
                                   np.asarray(draws.alpha, np.float64),
                                   np.asarray(draws.perm), what)
    # float32 against float64: measured 9e-7 relative; 5x margin.
    np.testing.assert_allclose(
        jax.jit(algorithms.sagnet_randomize, static_argnums=2)(
            features, draws, what), want, rtol=5e-6, atol=5e-6)
  # A content randomisation passes gradients to the example's own mean and
  # variance only: its permuted normalised features are held constant.
  grads = jax.grad(lambda f: algorithms.sagnet_randomize(
      f, draws, "content")[0].sum())(features)
  assert np.all(np.asarray(grads)[1:] == 0)


def test_sagnet_needs_its_style_network():
  network, params, _ = linear_model()
  algorithm = algorithms.build_algorithm("SagNet", network,
                                         algorithm_hparams("SagNet"),
                                         num_domains=NUM_DOMAINS)
  with pytest.raises(ValueError, match="style_head=True"):
    algorithm.init(params)
