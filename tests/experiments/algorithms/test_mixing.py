"""Tests for experiments/algorithms/mixing.py: MixUp, ARM, SelfReg, MTL."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from experiments import algorithms
from experiments import models
from experiments import train
from experiments.training import steps as train_steps
import oracle
from test_algorithms import BATCH, NUM_CLASSES, NUM_DOMAINS, Flatten
from test_algorithms import NormalizedPixels, numpy_running_stats
from test_algorithms import algorithm_hparams, linear_model, make_batches
from test_algorithms import linear_net_model, train_linear_net


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_mixup_mixes_every_chunk_with_the_same_chunk_of_another_domain(
    num_chunks):
  batches = make_batches()
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


def test_mixup_passes_every_pair_in_domainbeds_order_where_batchnorm_trains():
  # BatchNorm on the pixels: a pass per mixed pair normalizes each with its
  # own statistics, and the running statistics follow the passes in order.
  num_domains = 3
  model = models.Classifier(NormalizedPixels(16, rngs=nnx.Rngs(0)),
                            NUM_CLASSES, rngs=nnx.Rngs(1))
  network, params, stats = algorithms.Network.split(model)
  hparams = algorithm_hparams("MixUp")
  algorithm = algorithms.build_algorithm("MixUp", network, hparams,
                                         num_domains=num_domains)
  batches = make_batches(seed=6, num_domains=num_domains)
  key = jax.random.PRNGKey(2)
  _, new_stats, _, metrics = jax.jit(algorithm.update)(
      params, stats, algorithm.init(params), batches, key)
  # The mix the step drew (`base.gradient_algorithm` hands the objective
  # the second half of its key), its pairs in DomainBed's order. Jitted, as
  # in the step: op by op, its Beta sampler alone compiles dozens of
  # programs.
  mixed = jax.jit(algorithms.mixup, static_argnums=2)(
      batches, jax.random.split(key)[1], hparams["mixup_alpha"])
  order = np.argsort(np.asarray(mixed["mix_pass"][:, 0]))
  assert list(order) != list(range(num_domains))  # The order shows.
  passes = {name: np.asarray(mixed[name])[order]
            for name in ("image", "label", "mix_label", "mix_weight")}
  x = passes["image"].astype(np.float64).reshape(num_domains, BATCH, -1)
  features = ((x - x.mean(1, keepdims=True))
              / np.sqrt(x.var(1, keepdims=True) + 1e-5)).reshape(-1, 16)
  logits = (features @ np.asarray(params["head"]["kernel"][...], np.float64)
            + np.asarray(params["head"]["bias"][...], np.float64))
  log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  nll = lambda labels: -log_probs[np.arange(len(logits)), labels.ravel()]
  weight = passes["mix_weight"].ravel()
  want = np.mean(weight * nll(passes["label"])
                 + (1 - weight) * nll(passes["mix_label"]))
  # float32 against float64: measured 3e-8 relative (1e-7 with the passes
  # in domain order); 1e-6 leaves room for float32 rounding. One pass over
  # the pooled pairs is 5% off.
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
  mean, var = numpy_running_stats(list(passes["image"]))
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["mean"][...],
                             mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_stats["featurizer"]["norm"]["var"][...],
                             var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("support_size, count", [
    (8, 150),  # 64 / 8: sets of 8, then one set of the last 22.
    (5, 150),  # 64 % 5: every loader batch is one set.
    (11, 150),  # 64 % 11, but the last batch of 22 is two sets of 11.
    (8, 136),  # The padding (from 136 to 150) belongs to no set.
])
def test_support_context_follows_domainbeds_predict(support_size, count):
  maps = jax.random.normal(jax.random.PRNGKey(support_size), (150, 2, 2, 1))
  got = jax.jit(algorithms.support_context, static_argnums=(1, 3))(
      maps, support_size, count, algorithms.ARM_EVAL_BATCH)
  want = oracle.arm_contexts(np.asarray(maps[:count], np.float64),
                             support_size, algorithms.ARM_EVAL_BATCH)
  # Means of at most 64 float32 values: measured 1e-7 apart; 10x margin.
  np.testing.assert_allclose(got[:count], want, rtol=0, atol=1e-6)
  assert np.all(np.isfinite(got))


ARM_IMAGE, ARM_BATCH = (3, 3, 1), 8


def _arm_model():
  model = models.ContextClassifier(Flatten(3 * 3 * 2), NUM_CLASSES, 1,
                                   rngs=nnx.Rngs(0))
  return algorithms.Network.split(model)


def _context_net(params):
  """The context network's params as `oracle.context_maps` takes them."""
  context = params["context_net"]
  arrays = lambda layer, names: [np.asarray(layer[n][...], np.float64)
                                 for n in names]
  return ([tuple(arrays(context["convs"][k], ("kernel", "bias"))
                 + arrays(context["norms"][k], ("scale", "bias")))
           for k in range(2)]
          + [tuple(arrays(context["convs"][2], ("kernel", "bias")))])


def _running(stats):
  return [[np.asarray(stats["context_net"]["norms"][k][name][...],
                      np.float64) for name in ("mean", "var")]
          for k in range(2)]


def test_arm_matches_a_numpy_model_of_domainbed():
  network, params, stats = _arm_model()
  hparams = {**algorithm_hparams("ARM"), "batch_size": ARM_BATCH,
             "lr": 0.01, "weight_decay": 0.01}
  algorithm = algorithms.build_algorithm("ARM", network, hparams,
                                         num_domains=NUM_DOMAINS)
  update = jax.jit(algorithm.update)
  state = algorithm.init(params)
  theta = [np.asarray(params["head"][name][...], np.float64)
           for name in ("kernel", "bias")]
  context_net, running = _context_net(params), _running(stats)
  batch_list = [make_batches(step, ARM_IMAGE, batch=ARM_BATCH)
                for step in range(3)]
  for step, batches in enumerate(batch_list):
    params, stats, state, _ = update(params, stats, state, batches,
                                     jax.random.PRNGKey(step))
  want_theta, running = oracle.arm(theta, context_net, running, batch_list,
                                   0.01, 0.01, NUM_CLASSES)
  # The context network keeps its initial weights, as DomainBed's.
  for got, want in zip(jax.tree.leaves(_context_net(params)),
                       jax.tree.leaves(context_net)):
    np.testing.assert_array_equal(got, want)
  # float32 against float64, measured: the params after three Adam steps of
  # 0.01 2.2e-7 apart, the running statistics (up to 0.8) 1.3e-7; 10x
  # margins.
  for got, want, start in zip(
      [params["head"][name][...] for name in ("kernel", "bias")], want_theta,
      theta):
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    assert np.abs(want - start).max() > 1e-3
  for got, want in zip(jax.tree.leaves(_running(stats)),
                       jax.tree.leaves(running)):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)

  # Evaluation adapts to DomainBed's batches of 64 of the real images: 64
  # in sets of 8, then one set of the last 6; the padding joins none.
  images = jax.random.normal(jax.random.PRNGKey(9), (72,) + ARM_IMAGE)
  outputs = jax.jit(algorithm.predict)(params, stats, images, 70)
  want_outputs, _ = oracle.arm_logits(
      [np.asarray(params["head"][name][...], np.float64)
       for name in ("kernel", "bias")], context_net, running, images[:70],
      ARM_BATCH, algorithms.ARM_EVAL_BATCH, train=False)
  # Logits up to 2: measured 2e-7 apart; 10x margin.
  np.testing.assert_allclose(outputs[:70], want_outputs, rtol=0, atol=3e-6)
  # The training loop's evaluation step predicts by it.
  eval_step = train_steps.make_eval_step(network, algorithm.predict)
  predictions, _ = eval_step(params, stats, images, jnp.zeros(72, jnp.int32),
                             70)
  np.testing.assert_array_equal(predictions[:70],
                                np.argmax(want_outputs, axis=1))


def test_arm_needs_its_context_network():
  network, params, _ = linear_model()
  algorithm = algorithms.build_algorithm("ARM", network,
                                         algorithm_hparams("ARM"),
                                         num_domains=NUM_DOMAINS)
  with pytest.raises(ValueError, match="context_net=True"):
    algorithm.init(params)


def test_arm_trains_and_evaluates_through_the_training_loop(tmp_path):
  record = train.claim_and_train(train.resolve_run([
      "--dataset", "RotatedDigits", "--algorithm", "ARM", "--test_envs", "0",
      "--steps", "4", "--checkpoint_freq", "2", "--eval_examples", "70",
      "--eval_batch_size", "72", "--output_dir", str(tmp_path / "run"),
      "--hparams", '{"image_size": 8, "cnn_width": 8, "batch_size": 8}']))
  assert np.isfinite(record["loss"])
  assert 0 <= record["env0_in_acc"] <= 1
  with np.load(tmp_path / "run" / "final_params.npz") as saved:
    # The context network (its BatchNorm statistics trained) is saved, and
    # the featurizer's first conv takes the image and the context.
    assert saved["stats/context_net/norms/0/mean"].any()
    assert saved["params/featurizer/convs/0/kernel"].shape[2] == 2


# SelfReg's and MTL's DomainBed references train a linear featurizer of 4
# features and a linear head for 5 Adam steps of lr 0.01 with weight decay
# 0.01, three domains of 6 images: the params move by about 0.05. float32
# against float64, measured: SelfReg's at most 4.0e-7 apart, MTL's 4.2e-7,
# MTL's embeddings (up to 0.55) 3.6e-7; atol 4e-6 is a 10x margin and an
# 1e-4 of the move.
LR, WD, ATOL = 0.01, 0.01, 4e-6


def _steps_keys(num_steps):
  """Every step's ``(data key, draw key)``, as the updates split them."""
  return [jax.random.split(jax.random.PRNGKey(step))
          for step in range(num_steps)]


def test_selfreg_draws_shuffle_within_classes():
  labels = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 2, 0, 0, 2])
  draws = jax.jit(algorithms.selfreg_draws, static_argnums=2)(
      jax.random.PRNGKey(0), labels, jnp.float32)
  ordered = np.asarray(labels)[np.asarray(draws.order)]
  assert list(ordered) == sorted(np.asarray(labels))
  # The sort is stable.
  for c in range(3):
    assert list(np.flatnonzero(np.asarray(labels)[draws.order] == c)) == (
        list(range(list(ordered).index(c), list(ordered).index(c)
                   + (ordered == c).sum())))
  for shuffle in (draws.first, draws.second):
    shuffle = np.asarray(shuffle)
    assert sorted(shuffle) == list(range(len(labels)))
    np.testing.assert_array_equal(ordered[shuffle], ordered)
  assert not np.array_equal(draws.first, draws.second)
  assert 0 < draws.lam < 1 and draws.lam.dtype == jnp.float32


@pytest.mark.parametrize("confident", [False, True])
def test_selfreg_matches_a_numpy_model_of_domainbed(confident):
  batch_list = [make_batches(step, num_domains=3) for step in range(5)]
  if confident:
    # Larger images labelled by the initial model's predictions: its
    # cross-entropy starts below 1, where it weighs the regularisers
    # (``min(ce, 1)``, a constant); with random labels it stays above.
    model = linear_net_model("SelfReg")
    for batches in batch_list:
      batches["image"] = 4 * batches["image"]
      batches["label"] = jnp.argmax(
          model(batches["image"].reshape(-1, 4, 4, 1)), axis=-1).reshape(
              batches["label"].shape)
  theta, batch_list, got, state, metrics = train_linear_net(
      "SelfReg", {"lr": LR, "weight_decay": WD}, batch_list=batch_list)
  draws_list = []
  for (_, draw_key), batches in zip(_steps_keys(5), batch_list):
    draws = algorithms.selfreg_draws(draw_key, batches["label"].reshape(-1),
                                     jnp.float32)
    draws_list.append(tuple(np.asarray(d) for d in draws[:3])
                      + (float(draws.lam),))
  projection = [[np.asarray(a, np.float64) for a in layer]
                for layer in state.projection]
  assert [p[0].shape for p in projection] == [(4, 8), (8, 8), (8, 4)]
  want, losses, scales = oracle.selfreg(theta, projection, batch_list,
                                        draws_list, LR, WD, NUM_CLASSES)
  assert (max(scales) < 1) == confident
  for g, w, start in zip(got, want, theta):
    np.testing.assert_allclose(g, w, rtol=0, atol=ATOL)
    assert np.abs(w - start).max() > 1e-2
  # The loss, its regularisers included.
  np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)


def _mtl_noise(batch_list, num_features):
  return [np.asarray(jax.random.normal(
      noise_key, batches["label"].shape + (num_features,)), np.float64)
          for (_, noise_key), batches in zip(_steps_keys(len(batch_list)),
                                             batch_list)]


@pytest.mark.parametrize("ema", [0.99, 0.9])
def test_mtl_matches_a_numpy_model_of_domainbed(ema):
  theta, batch_list, got, state, metrics = train_linear_net(
      "MTL", {"lr": LR, "weight_decay": WD, "mtl_ema": ema})
  noise = _mtl_noise(batch_list, 4)
  want, embeddings, losses = oracle.mtl(theta, batch_list, noise, LR, WD,
                                        ema, NUM_CLASSES)
  for g, w, start in zip(got, want, theta):
    np.testing.assert_allclose(g, w, rtol=0, atol=ATOL)
    assert np.abs(w - start).max() > 1e-2
  np.testing.assert_allclose(state.embeddings, embeddings, rtol=0, atol=ATOL)
  # The other weighting of the average, the usual one, is far off.
  _, swapped, _ = oracle.mtl(theta, batch_list, noise, LR, WD, 1 - ema,
                             NUM_CLASSES)
  assert np.abs(swapped - embeddings).max() > 1e-2
  np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)


def test_mtl_predicts_with_noise_in_place_of_the_embedding():
  # DomainBed's .normal_() at evaluation too; here from a fixed key, so
  # the same images are predicted alike twice.
  model = models.EmbeddingClassifier(Flatten(16), NUM_CLASSES,
                                     rngs=nnx.Rngs(0))
  network, params, stats = algorithms.Network.split(model)
  algorithm = algorithms.build_algorithm("MTL", network,
                                         algorithm_hparams("MTL"),
                                         num_domains=NUM_DOMAINS, seed=3)
  images = make_batches()["image"][0]
  outputs = jax.jit(algorithm.predict)(params, stats, images, 6)
  np.testing.assert_array_equal(
      outputs, jax.jit(algorithm.predict)(params, stats, images, 6))
  noise = jax.random.normal(jax.random.PRNGKey(3), (6, 16))
  np.testing.assert_allclose(
      outputs, model.head(jnp.concatenate([images.reshape(6, 16), noise],
                                          axis=1)), rtol=1e-6)


def test_mtl_needs_its_embedding_head():
  network, params, stats = linear_model(num_features=16)
  algorithm = algorithms.build_algorithm("MTL", network,
                                         algorithm_hparams("MTL"),
                                         num_domains=NUM_DOMAINS)
  with pytest.raises(ValueError, match="domain_embedding=True"):
    algorithm.update(params, stats, algorithm.init(params), make_batches(),
                     jax.random.PRNGKey(0))


def _checkpointed_state(output_dir, step):
  manager = ocp.CheckpointManager(output_dir / "checkpoints")
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore())).state


def test_mtl_embeddings_resume_bit_for_bit(tmp_path):
  flags = ["--dataset", "RotatedDigits", "--algorithm", "MTL",
           "--test_envs", "0", "--steps", "4", "--checkpoint_freq", "2",
           "--eval_examples", "16", "--eval_batch_size", "16",
           "--num_workers", "0", "--hparams",
           '{"image_size": 8, "cnn_width": 8, "batch_size": 8}']
  whole, resumed = tmp_path / "whole", tmp_path / "resumed"
  for output_dir in (whole, resumed):
    train.claim_and_train(train.resolve_run([*flags, "--output_dir",
                                             str(output_dir)]))
  # What a run killed after its step-2 checkpoint leaves: the rest goes.
  ocp.CheckpointManager(resumed / "checkpoints").delete(4)
  (resumed / "done").unlink()
  (resumed / "final_params.npz").unlink()
  lines = (resumed / "results.jsonl").read_text().splitlines(keepends=True)
  (resumed / "results.jsonl").write_text(lines[0])
  train.claim_and_train(train.resolve_run([*flags, "--output_dir",
                                           str(resumed)]))
  want, got = (_checkpointed_state(d, 4)["algorithm_state"]
               for d in (whole, resumed))
  assert np.abs(want["embeddings"]).max() > 0.01
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(g, w)
  # The embeddings moved after the resumed step 2.
  assert not np.array_equal(
      _checkpointed_state(whole, 2)["algorithm_state"]["embeddings"],
      want["embeddings"])
