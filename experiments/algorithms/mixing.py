"""Augmentation: MixUp and ARM, as DomainBed's.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1
unless another file is named.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.data import tasks
from experiments.algorithms import base

# DomainBed evaluates in batches of 64 (``scripts/train.py`` lines 161-165),
# and ARM adapts to each of them (`support_context`).
ARM_EVAL_BATCH = 64


def mixup_algorithm(network: base.Network, hparams: base.HParams, *,
                    num_domains: int, seed: int) -> base.Algorithm:
  """Inter-domain MixUp (Yan et al., 2020) as in DomainBed (lines 791-820).

  ERM's Adam on the loss of every domain mixed with the next in a random
  cyclic order (`base.mixup`). DomainBed runs the network on each mixed pair
  in its loop over the pairs; where BatchNorm trains, so does this, in
  DomainBed's order of the pairs (`base.domain_features`); elsewhere one
  pass over all pairs pooled gives the same outputs.
  """
  del num_domains, seed

  def objective(params, stats, batches, key):
    mixed = base.mixup(batches, key, hparams["mixup_alpha"],
                       dtype=base.model_dtype(params))
    model = network.bind(params, stats)
    if base.trains_batch_norm(model.featurizer):
      order = jnp.argsort(mixed["mix_pass"][:, 0])
      mixed = jax.tree.map(lambda x: x[order], mixed)
    batch = base.merge_domains(mixed)
    features = base.domain_features(model, mixed)
    logits = model.head(features.reshape(batch["label"].shape[0], -1))
    loss = tasks.example_loss(logits, batch).mean()
    return loss, ({"loss": loss}, nnx.state(model, nnx.BatchStat))

  return base.gradient_algorithm(hparams, objective)


def support_context(
    maps: jax.Array, support_size: int, count: jax.Array | int,
    batch_size: int
) -> jax.Array:
  """Every example's context: the mean context map of its support set.

  DomainBed's ``ARM.predict`` (lines 462-474) on each loader batch of
  ``batch_size`` consecutive examples: a batch whose size is a multiple of
  ``support_size`` is cut into support sets of ``support_size`` consecutive
  examples (lines 464-466); any other batch is one support set (line 468).
  Each example gets the mean map of its set (lines 469-472). Only the first
  ``count`` examples are real; the others (padding) belong to no set, so the
  last loader batch holds ``count`` modulo ``batch_size`` examples.

  Args:
    maps: ``(N, H, W, 1)``, the context network's map of every example.
    support_size: ARM's support size, DomainBed's ``batch_size`` hparam
      (line 460).
    count: the number of real examples, the first ones.
    batch_size: the loader's batch: the whole ``N`` in training (DomainBed's
      ``update`` predicts all domains at once), `ARM_EVAL_BATCH` in
      evaluation.

  Returns:
    ``(N, H, W, 1)`` contexts; a padding example's is its set's mean, or 0.
  """
  n = maps.shape[0]
  index = jnp.arange(n)
  batch, position = index // batch_size, index % batch_size
  real = index < count
  # The real examples in each example's loader batch.
  size = jnp.clip(count - batch * batch_size, 0, batch_size)
  within = jnp.where(size % support_size == 0, position // support_size, 0)
  support_set = batch * batch_size + within
  num_sets = -(-n // batch_size) * batch_size
  weights = real.astype(maps.dtype)[:, None, None, None]
  sums = jax.ops.segment_sum(maps * weights, support_set, num_sets)
  sizes = jax.ops.segment_sum(weights, support_set, num_sets)
  return (sums / jnp.maximum(sizes, 1))[support_set]


def arm(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """ARM's contextual meta-learner (Zhang et al., NeurIPS 2021) as DomainBed's.

  DomainBed's ``ARM`` (lines 452-474), an ERM (lines 92-125) whose network
  sees one more input channel (line 456): the mean over the example's support
  set of a context network's one-channel map (`support_context`). The model
  is a `models.ContextClassifier`, whose ``context_net`` is DomainBed's
  ``ContextNet`` (``networks.py`` lines 211-228): ``catalog``'s
  ``model_options`` has the training loop build it for ARM.

  * Training: ERM's Adam on the loss of all domains pooled (lines 113-122),
    each domain's batch one support set (its ``batch_size`` examples). The
    context network is left out of the Adam (ERM builds its Adam over
    ``self.network``, lines 107-111, before ARM adds ``context_net``, line
    459): it keeps its initial weights, while its BatchNorm statistics
    follow its train-mode passes.
  * Evaluation (``predict``): eval mode, support sets within batches of
    `ARM_EVAL_BATCH`, DomainBed's evaluation batch. The evaluation order is
    random, here as in DomainBed (``FastDataLoader``'s ``RandomSampler``,
    ``lib/fast_data_loader.py`` line 91).

  DomainBed's featurizer is its ``Featurizer`` for the shape with one more
  channel (``networks.py`` lines 231-247): the MNIST CNN at 28x28, a Wide
  ResNet at 32x32, the ResNet at 224x224, whose pretrained RGB stem is
  repeated over the channels, the context's taking the red filters
  (``networks.py`` lines 125-135; ``weights.convert.adapt_input_channels``
  here); any other size raises
  ``NotImplementedError`` there. The context network keeps the image's size
  (its 5x5 convs are padded by 2), so here ARM runs on every size the model
  takes, the study's 8x8 digits included.
  """
  del num_domains, seed
  support_size = hparams["batch_size"]

  def outputs(params, stats, images, key, count, batch_size, train):
    model = network.bind(params, stats, train=train)
    # The context network is not trained: no gradient flows into it.
    maps = jax.lax.stop_gradient(model.context_net(images))
    context = support_context(maps, support_size, count, batch_size)
    return (model(images, rngs=key, context=context),
            nnx.state(model, nnx.BatchStat))

  def objective(params, stats, batches, key):
    del key
    batch = base.merge_domains(batches)
    n = batch["label"].shape[0]
    logits, stats = outputs(params, stats, batch["image"], batch["key"][0], n,
                            n, True)
    loss = tasks.example_loss(logits, batch).mean()
    return loss, ({"loss": loss}, stats)

  def predict(params, stats, images, count):
    return outputs(params, stats, images, None, count, ARM_EVAL_BATCH,
                   False)[0]

  algorithm = base.gradient_algorithm(hparams, objective, frozen="context_net")

  def init(params):
    if "context_net" not in params:
      raise ValueError(
          "ARM needs a model with a context network: build it with "
          "models.build_model(..., context_net=True), as the training loop "
          "does for ARM.")
    return algorithm.init(params)

  return algorithm._replace(init=init, predict=predict)
