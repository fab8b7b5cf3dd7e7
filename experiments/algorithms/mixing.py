"""Augmentation: MixUp, ARM, SelfReg and MTL, as DomainBed's.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1
unless another file is named.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import models
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


class SelfRegState(NamedTuple):
  """SelfReg's state.

  Attributes:
    opt_state: Adam's state, over the model's params.
    projection: the ``(kernel, bias)`` of the projection's three linear
      layers (DomainBed's ``cdpl``), which no optimizer steps.
  """

  opt_state: optax.OptState
  projection: tuple[tuple[jax.Array, jax.Array], ...]


class SelfRegDraws(NamedTuple):
  """The random draws of one SelfReg update.

  Attributes:
    order: the examples sorted by class (a stable sort).
    first: for every example of the sorted batch, its partner in the first
      shuffle: a random example of its class.
    second: its partner in the second, independent shuffle.
    lam: the mixing weight, ``Beta(0.5, 0.5)``.
  """

  order: jax.Array
  first: jax.Array
  second: jax.Array
  lam: jax.Array


def selfreg_draws(key: jax.Array, labels: jax.Array,
                  dtype: jnp.dtype) -> SelfRegDraws:
  """SelfReg's draws for the pooled ``labels``, from ``key``.

  DomainBed sorts the batch by class (lines 1447-1462), draws ``lam`` from
  ``np.random.beta(0.5, 0.5)`` (line 1442) and two random permutations
  within every class's run of the sorted batch (``torch.randperm`` per
  interval, lines 1474-1483). A sort of the class-sorted batch by random
  keys within each class is such a permutation. DomainBed's ``torch.sort``
  need not be stable; the order within a class is random anyway.
  """
  shuffle_key, second_key, lam_key = jax.random.split(key, 3)
  order = jnp.argsort(labels, stable=True)
  ordered = labels[order]

  def within_classes(key):
    return jnp.lexsort((jax.random.uniform(key, labels.shape), ordered))

  return SelfRegDraws(order, within_classes(shuffle_key),
                      within_classes(second_key),
                      jax.random.beta(lam_key, 0.5, 0.5, dtype=dtype))


def project(projection: tuple[tuple[jax.Array, jax.Array], ...],
            features: jax.Array) -> jax.Array:
  """DomainBed's ``cdpl`` (lines 1426-1435) in train mode: three linear
  layers, each followed by BatchNorm1d, the first two by a ReLU.

  Its BatchNorms normalize with the batch's statistics (biased variance,
  epsilon 1e-5); their scale and shift, which no optimizer steps (see
  `selfreg`), stay PyTorch's initial 1 and 0, and their running statistics,
  which nothing reads, are not kept.
  """
  h = features
  for i, (kernel, bias) in enumerate(projection):
    h = h @ kernel + bias
    h = (h - h.mean(axis=0)) / jnp.sqrt(h.var(axis=0) + 1e-5)
    if i < len(projection) - 1:
      h = nnx.relu(h)
  return h


def selfreg(network: base.Network, hparams: base.HParams, *,
            num_domains: int, seed: int) -> base.Algorithm:
  """SelfReg (Kim et al., ICCV 2021) as in DomainBed (lines 1417-1503).

  One update, on the domains pooled:

  * the batch sorted by class and the draws of `selfreg_draws` (lines
    1439-1462);
  * one featurizer pass over the sorted batch, the logits, and the
    projection of the features (`project`, lines 1464-1467);
  * ``logits_2``, ``proj_2``: the partners' in the first shuffle;
    ``logits_3``, ``proj_3``: ``lam`` times those plus ``1 - lam`` times
    the partners' in the second (lines 1469-1487);
  * the loss (lines 1490-1497): ``ce + min(ce, 1) * (lam * (mse(logits,
    logits_2) + 0.3 mse(features, proj_2)) + (1 - lam) * (mse(logits,
    logits_3) + 0.3 mse(features, proj_3)))``, ``ce`` the cross-entropy and
    ``min(ce, 1)`` a constant (``.item()``, line 1496); ``mse`` averages
    over every entry (``nn.MSELoss``). As DomainBed, the feature terms
    compare an example's *features* with its partners' *projections*
    (lines 1492-1493);
  * ERM's Adam step (lines 1499-1501).

  The projection (hidden width twice the features', or the features' at
  2048, line 1424) is initialised as PyTorch's ``nn.Linear`` from ``seed``
  and kept in the state. ERM's Adam is built over ``self.network`` (lines
  107-111) before ``cdpl`` exists, so, as DomainBed's, it never trains;
  gradients flow through it into the featurizer. SelfReg is for class
  labels (it groups the batch by class).
  """
  del num_domains
  tx = base.adam(hparams)

  def init(params):
    kernel = params["head"]["kernel"][...]
    width = kernel.shape[0]
    hidden = width if width == 2048 else 2 * width
    sizes = (width, hidden, hidden, width)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * (len(sizes) - 1))
    projection = tuple(
        tuple(models.torch_default_init(fan_in)(key, shape, kernel.dtype)
              for key, shape in zip(keys[2 * i:2 * i + 2],
                                    ((fan_in, fan_out), (fan_out,))))
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])))
    return SelfRegState(tx.init(params), projection)

  def objective(params, stats, batch, draws, projection):
    model = network.bind(params, stats)
    labels = batch["label"][draws.order]
    features = model.features(batch["image"][draws.order],
                              rngs=batch["key"][0])
    projected = project(projection, features)
    logits = model.head(features)
    lam = draws.lam
    logits_2, projected_2 = logits[draws.first], projected[draws.first]
    logits_3 = lam * logits_2 + (1 - lam) * logits[draws.second]
    projected_3 = lam * projected_2 + (1 - lam) * projected[draws.second]
    mse = lambda a, b: ((a - b) ** 2).mean()
    individual = mse(logits, logits_2) + 0.3 * mse(features, projected_2)
    hybrid = mse(logits, logits_3) + 0.3 * mse(features, projected_3)
    ce = tasks.example_loss(logits, {"label": labels}).mean()
    scale = jax.lax.stop_gradient(jnp.minimum(ce, 1))
    loss = ce + scale * (lam * individual + (1 - lam) * hybrid)
    return loss, ({"loss": loss}, nnx.state(model, nnx.BatchStat))

  def update(params, stats, state, batches, key):
    data_key, draw_key = jax.random.split(key)
    batch = base.merge_domains(base.with_example_keys(batches, data_key))
    if tasks.is_regression(batch["label"]):
      raise ValueError("SelfReg groups the batch by class: it needs class "
                       "labels, not regression targets.")
    draws = selfreg_draws(draw_key, batch["label"], base.model_dtype(params))
    grads, (metrics, stats) = jax.grad(objective, has_aux=True)(
        params, stats, batch, draws, state.projection)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    return (optax.apply_updates(params, updates), stats,
            SelfRegState(opt_state, state.projection), metrics)

  return base.Algorithm(init, update)


class MTLState(NamedTuple):
  """MTL's state.

  Attributes:
    opt_state: Adam's state.
    embeddings: ``(num_domains, F)``, every domain's moving average of its
      mean features (DomainBed's ``embeddings`` buffer).
  """

  opt_state: optax.OptState
  embeddings: jax.Array


def mtl(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """Marginal transfer learning (Blanchard et al., JMLR 2021) as in
  DomainBed (lines 1071-1124).

  The model is a `models.EmbeddingClassifier`, whose head takes the
  features and a domain embedding (lines 1082-1085): ``catalog``'s
  ``model_options`` has the training loop build it for MTL. Adam at ``lr``
  with ``weight_decay`` over the featurizer and the head (lines 1086-1091)
  on the *sum* over domains of each domain's mean cross-entropy (lines
  1100-1102), each domain's features from its own pass (line 1122;
  `base.domain_features`).

  Every domain's embedding moves to ``mtl_ema * mean features + (1 -
  mtl_ema) * embedding`` (lines 1110-1117: the weight ``mtl_ema`` is on the
  new mean, the reverse of the usual convention), detached; the embeddings
  start at zero (lines 1093-1095). Domain ``i`` is the update's ``i``-th
  batch, DomainBed's ``enumerate(minibatches)``: per training domain when
  every step draws every training domain.

  As DomainBed's, the head never sees the embeddings: ``.normal_()`` (line
  1123) overwrites the embedding it is given with standard normal noise,
  in training and in evaluation alike (DomainBed issue #159), and no
  gradient flows through it. So here: training draws the noise from the
  update's key; evaluation (``predict``) from a fixed key of ``seed``, so
  that an evaluation is reproducible. The embeddings are kept, as
  DomainBed's, though nothing reads them.
  """
  tx = base.adam(hparams)
  ema = hparams["mtl_ema"]

  def init(params):
    # The featurizer's width, the embeddings': half the head's input.
    width = params["head"]["kernel"][...].shape[0] // 2
    return MTLState(tx.init(params),
                    jnp.zeros((num_domains, width), base.model_dtype(params)))

  def logits(model, features, key):
    if model.head.in_features != 2 * features.shape[-1]:
      raise ValueError(
          "MTL needs a model whose head takes a domain embedding: build it "
          "with models.build_model(..., domain_embedding=True), as the "
          "training loop does for MTL.")
    noise = jax.random.normal(key, features.shape, features.dtype)
    return model.head(jnp.concatenate([features, noise], axis=-1))

  def objective(params, stats, batches, key):
    n, b = batches["label"].shape
    model = network.bind(params, stats)
    features = base.domain_features(model, batches)
    outputs = logits(model, features, key)
    losses = tasks.example_loss(outputs.reshape(n * b, -1),
                                base.merge_domains(batches)).reshape(n, b)
    loss = losses.mean(axis=1).sum()
    return loss, (jax.lax.stop_gradient(features.mean(axis=1)),
                  nnx.state(model, nnx.BatchStat))

  def update(params, stats, state, batches, key):
    data_key, noise_key = jax.random.split(key)
    batches = base.with_example_keys(batches, data_key)
    (loss, (means, stats)), grads = jax.value_and_grad(
        objective, has_aux=True)(params, stats, batches, noise_key)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    embeddings = ema * means + (1 - ema) * state.embeddings
    return (optax.apply_updates(params, updates), stats,
            MTLState(opt_state, embeddings), {"loss": loss})

  def predict(params, stats, images, count):
    del count  # Every example is predicted alone.
    model = network.bind(params, stats, train=False)
    return logits(model, model.features(images), jax.random.PRNGKey(seed))

  return base.Algorithm(init, update, predict)
