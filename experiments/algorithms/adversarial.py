"""Invariant features learnt adversarially: DANN and CDANN, against a domain
discriminator, and SagNet, against a style network, as DomainBed's. Each
trains its adversary with its own optimizers in the same update.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1
unless another file is named.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import models
from experiments.data import tasks
from experiments.algorithms import base


class DANNState(NamedTuple):
  """DANN's state.

  Attributes:
    gen_opt_state: the generator's Adam, over the model's params.
    disc_params: the discriminator's params (a `models.MLP`).
    disc_opt_state: the discriminator's Adam.
    count: the number of updates taken (DomainBed's ``update_count``).
  """

  gen_opt_state: optax.OptState
  disc_params: nnx.State
  disc_opt_state: optax.OptState
  count: jax.Array


def dann_step_kind(count: jax.Array, d_steps_per_g_step: int) -> jax.Array:
  """Whether update number ``count`` (1 for the first) trains the discriminator.

  DomainBed's rule (lines 546-547): ``count % (1 + d) < d``. With ``d = 1``
  the first update trains the generator, then they alternate.
  """
  return count % (1 + d_steps_per_g_step) < d_steps_per_g_step


def _discriminator(hparams: base.HParams, head_kernel: jax.Array, *,
                   num_domains: int, seed: int,
                   conditional: bool) -> nnx.Module:
  """DANN's discriminator of the features the head of ``head_kernel`` takes
  (lines 491-498): DomainBed's MLP, and for CDANN the classes' embeddings.

  In the model's dtype (its head's): parameters, Adam's moments and the
  forward pass, which computes in the dtype its inputs (the features) and
  parameters promote to.
  """
  num_features, num_classes = head_kernel.shape
  rngs = nnx.Rngs(seed)
  mlp = models.MLP(num_features, num_domains, width=hparams["mlp_width"],
                   depth=hparams["mlp_depth"],
                   dropout=hparams["mlp_dropout"], rngs=rngs, dtype=None,
                   param_dtype=head_kernel.dtype)
  if not conditional:
    return mlp
  # DomainBed's nn.Embedding, whose PyTorch init is N(0, 1) (line 498).
  embeddings = nnx.Embed(
      num_classes, num_features, param_dtype=head_kernel.dtype,
      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
  return nnx.Dict(mlp=mlp, class_embeddings=embeddings)


def _discriminator_loss(
    disc: nnx.Module, features: jax.Array, labels: jax.Array,
    domains: jax.Array, key: jax.Array, *, conditional: bool,
    num_classes: int, grad_penalty: float
) -> tuple[jax.Array, jax.Array]:
  """The discriminator's loss on ``features`` (lines 521-541), with its
  gradient penalty, and the penalty.

  Args:
    disc: the discriminator (`_discriminator`).
    features: the ``(N, F)`` features of the pooled batch.
    labels: their ``(N,)`` classes.
    domains: their ``(N,)`` domains, which it predicts.
    key: its dropout's key.
    conditional: CDANN's: the classes' embeddings join the features, and
      the examples are class-balanced.
    num_classes: the task's classes.
    grad_penalty: the penalty's weight.
  """
  if conditional:
    # The input is the features plus the class's embedding (line 523),
    # so the gradient penalty is taken at that sum (lines 540-541).
    inputs = features + disc["class_embeddings"](labels)
    disc = disc["mlp"]
  else:
    inputs = features

  def summed_loss(inputs):
    losses = optax.softmax_cross_entropy_with_integer_labels(
        disc(inputs, rngs=key), domains)
    return losses.sum(), losses

  (total, losses), input_grads = jax.value_and_grad(
      summed_loss, has_aux=True)(inputs)
  penalty = (input_grads**2).sum(axis=1).mean()
  if conditional:
    # DomainBed's class balance (lines 532-536): example weights of
    # 1 / (its class's count * the classes), where F.one_hot without
    # num_classes counts the classes up to the batch's largest label,
    # fewer than the task's when the batch lacks the last ones.
    counts = jnp.bincount(labels, length=num_classes)
    weights = 1.0 / (counts[labels] * (labels.max() + 1))
    loss = (weights.astype(losses.dtype) * losses).sum()
  else:
    loss = total / len(domains)
  return loss + grad_penalty * penalty, penalty


def _adversarial(network: base.Network, hparams: base.HParams, *,
                 num_domains: int, seed: int,
                 conditional: bool) -> base.Algorithm:
  """DomainBed's ``AbstractDANN`` (lines 477-565): DANN, or CDANN with
  ``conditional`` (its ``conditional=True, class_balance=True``); see
  `dann` and `cdann`."""
  d_steps = hparams["d_steps_per_g_step"]
  gen_tx = base.torch_adam(hparams["lr_g"], hparams["weight_decay_g"],
                           hparams["beta1"], 0.9)
  disc_tx = base.torch_adam(hparams["lr_d"], hparams["weight_decay_d"],
                            hparams["beta1"], 0.9)

  def discriminator(head_kernel):
    return _discriminator(hparams, head_kernel, num_domains=num_domains,
                          seed=seed, conditional=conditional)

  def head_kernel(params):
    return params["head"]["kernel"][...]

  def num_classes(params):
    return head_kernel(params).shape[1]

  def init(params):
    disc_params = nnx.state(discriminator(head_kernel(params)), nnx.Param)
    return DANNState(gen_tx.init(params), disc_params,
                     disc_tx.init(disc_params), jnp.zeros((), jnp.int32))

  def update(params, stats, state, batches, key):
    if conditional and tasks.is_regression(batches["label"]):
      raise ValueError("CDANN's discriminator is conditioned on classes; "
                       "a regression task has none: train DANN instead.")
    data_key, disc_key = jax.random.split(key)
    n, b = batches["label"].shape
    batch = base.merge_domains(base.with_example_keys(batches, data_key))
    labels = batch["label"]
    domains = jnp.repeat(jnp.arange(n), b)
    disc_def = nnx.graphdef(nnx.eval_shape(
        lambda: discriminator(head_kernel(params))))

    def disc_loss_fn(disc_params, features):
      return _discriminator_loss(
          nnx.merge(disc_def, disc_params), features, labels, domains,
          disc_key, conditional=conditional,
          num_classes=num_classes(params),
          grad_penalty=hparams["grad_penalty"])

    def featurize(params):
      model = network.bind(params, stats)
      return (model.features(batch["image"], rngs=batch["key"][0]),
              nnx.state(model, nnx.BatchStat))

    def head_loss(params, features):
      logits = network.bind(params, stats).head(features)
      return tasks.example_loss(logits, batch).mean()

    def generator_objective(params, features):
      nll = head_loss(params, features)
      disc_loss, penalty = disc_loss_fn(state.disc_params, features)
      return nll - hparams["lambda"] * disc_loss, (nll, disc_loss, penalty)

    def generator_step():
      (head_grads, feature_grads), losses = jax.grad(
          generator_objective, argnums=(0, 1), has_aux=True)(params, features)
      return (head_grads, feature_grads, state.disc_params,
              state.disc_opt_state, losses)

    def discriminator_step():
      (disc_loss, penalty), grads = jax.value_and_grad(
          disc_loss_fn, has_aux=True)(state.disc_params, features)
      updates, disc_opt_state = disc_tx.update(
          grads, state.disc_opt_state, state.disc_params)
      return (jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(features),
              optax.apply_updates(state.disc_params, updates), disc_opt_state,
              (head_loss(params, features), disc_loss, penalty))

    def generator_update(grads):
      updates, gen_opt_state = gen_tx.update(grads, state.gen_opt_state,
                                             params)
      return optax.apply_updates(params, updates), gen_opt_state

    # The featurizer's pass and its backward stay outside the branches, as
    # XLA:CPU runs convolutions inside a conditional several times slower.
    # (DomainBed's discriminator step also backpropagates into the
    # featurizer, line 550, and discards it.)
    features, featurizer_vjp, stats = jax.vjp(featurize, params, has_aux=True)
    count = state.count + 1
    train_discriminator = dann_step_kind(count, d_steps)
    head_grads, feature_grads, disc_params, disc_opt_state, losses = (
        jax.lax.cond(train_discriminator, discriminator_step, generator_step))
    grads = jax.tree.map(jnp.add, head_grads,
                         featurizer_vjp(feature_grads)[0])
    params, gen_opt_state = jax.lax.cond(
        train_discriminator, lambda _: (params, state.gen_opt_state),
        generator_update, grads)
    nll, disc_loss, penalty = losses
    metrics = {"loss": nll, "disc_loss": disc_loss, "penalty": penalty}
    return params, stats, DANNState(gen_opt_state, disc_params,
                                    disc_opt_state, count), metrics

  return base.Algorithm(init, update)


def dann(network: base.Network, hparams: base.HParams, *, num_domains: int,
         seed: int) -> base.Algorithm:
  """Unconditional DANN (Ganin et al., JMLR 2016) as in DomainBed.

  DomainBed's ``AbstractDANN`` with ``conditional=False,
  class_balance=False`` (``DANN``, lines 567-571; the class, lines 477-565):

  * The discriminator is DomainBed's ``MLP`` from the featurizer's outputs to
    the domains (lines 496-497; ``networks.py`` lines 47-70): `models.MLP`
    of ``mlp_width``, ``mlp_depth`` and ``mlp_dropout``, initialised from
    ``seed``, in the model's dtype (as DomainBed's, a part of the same
    ``torch.nn.Module``). It and its Adam live in the algorithm's state.
  * Two Adams with ``betas=(beta1, 0.9)``: the discriminator's at ``lr_d``
    with ``weight_decay_d`` (lines 502-507) and the generator's, over the
    featurizer and the classifier, at ``lr_g`` with ``weight_decay_g``
    (lines 509-514). ``lr`` and ``weight_decay`` are unused, as in
    DomainBed.
  * Every update counts itself first (line 518), runs the featurizer once
    over all domains pooled (lines 519-521) and the discriminator on its
    outputs (line 526), whose labels are the domains (lines 527-530). The
    discriminator's loss is its mean cross-entropy (line 538) plus
    ``grad_penalty`` times the mean over examples of the squared norm of the
    gradient of its summed cross-entropy with respect to its input (lines
    540-544).
  * `dann_step_kind` (lines 546-547) picks the step: the discriminator
    descends its loss (lines 549-552), or the generator descends the
    classifier's mean cross-entropy minus ``lambda`` times the
    discriminator's loss, penalty included (lines 554-562).

  The metrics are the classifier's loss (``loss``), the discriminator's
  (``disc_loss``) and the gradient penalty (``penalty``), every step.
  """
  return _adversarial(network, hparams, num_domains=num_domains, seed=seed,
                      conditional=False)


def cdann(network: base.Network, hparams: base.HParams, *, num_domains: int,
          seed: int) -> base.Algorithm:
  """Conditional DANN (Li et al., ECCV 2018) as in DomainBed.

  DomainBed's ``AbstractDANN`` with ``conditional=True,
  class_balance=True`` (``CDANN``, lines 574-578): `dann`'s update, but

  * the discriminator sees the features plus a learned embedding of the
    example's class (lines 522-523): DomainBed's ``nn.Embedding(num_classes,
    num_features)`` (lines 498-499), ``N(0, 1)`` at init as PyTorch's, which
    the discriminator's Adam trains with it (lines 502-507) and the
    generator's leaves alone. Its params are ``{"mlp": ...,
    "class_embeddings": ...}``;
  * its cross-entropy is class-balanced (lines 532-536): every example
    weighs ``1 / (count of its class * number of classes)``, summed. As
    DomainBed's ``F.one_hot(all_y)``, the number of classes is the batch's
    largest label plus one, so a batch without the last classes weighs its
    examples more. The gradient penalty stays of the unweighted summed
    cross-entropy (lines 540-541).

  Raises (at the first update):
    ValueError: the labels are regression targets, which have no classes.
  """
  return _adversarial(network, hparams, num_domains=num_domains, seed=seed,
                      conditional=True)


# SagNet's variance floor in its normalisation (``randomize``'s ``eps``,
# line 1192).
SAGNET_EPS = 1e-5


class SagNetState(NamedTuple):
  """SagNet's state: its three Adams (DomainBed's lines 1175-1181).

  Attributes:
    featurizer_opt_state: the featurizer's, which steps twice an update.
    content_opt_state: the content network's (the model's ``head``).
    style_opt_state: the style network's (its ``style_head``).
  """

  featurizer_opt_state: optax.OptState
  content_opt_state: optax.OptState
  style_opt_state: optax.OptState


class SagNetDraws(NamedTuple):
  """The random draws of one of SagNet's forward passes.

  Attributes:
    alpha: ``(N, 1)``, every example's weight of its own style (``U(0,
      1)``, line 1195; a content randomisation draws it too and uses none).
    perm: ``(N,)``, the example whose style or content it takes
      (``torch.randperm``, line 1206).
    dropout_key: the featurizer pass's dropout key.
  """

  alpha: jax.Array
  perm: jax.Array
  dropout_key: jax.Array


def sagnet_draws(key: jax.Array, num_examples: int,
                 dtype: jnp.dtype) -> list[SagNetDraws]:
  """The draws of a SagNet update from its ``key``: those of its content,
  style and adversary passes, in that order (`sagnet`)."""
  draws = []
  for pass_key in jax.random.split(key, 3):
    alpha_key, perm_key, dropout_key = jax.random.split(pass_key, 3)
    draws.append(SagNetDraws(
        jax.random.uniform(alpha_key, (num_examples, 1), dtype),
        jax.random.permutation(perm_key, num_examples), dropout_key))
  return draws


def sagnet_randomize(features: jax.Array, draws: SagNetDraws,
                     what: str) -> jax.Array:
  """DomainBed's ``SagNet.randomize`` (lines 1190-1214) of ``(N, F)``
  features.

  Every example's features are normalised by their mean and (unbiased)
  variance over the features, then given back a mean and variance:
  ``"style"`` mixes its own with example ``perm``'s, ``alpha`` of its own;
  ``"content"`` gives example ``perm``'s normalised features, held constant
  (``detach``, line 1211), the example's own mean and variance, through
  which gradients flow.

  DomainBed's featurizers all end in a flat vector, so its branch for
  ``(N, C, H, W)`` feature maps (lines 1197-1199) never runs, and is not
  here.
  """
  mean = features.mean(-1, keepdims=True)
  var = features.var(-1, ddof=1, keepdims=True)
  normalised = (features - mean) / jnp.sqrt(var + SAGNET_EPS)
  if what == "style":
    alpha = draws.alpha.astype(features.dtype)
    mean = alpha * mean + (1 - alpha) * mean[draws.perm]
    var = alpha * var + (1 - alpha) * var[draws.perm]
  else:
    normalised = jax.lax.stop_gradient(normalised[draws.perm])
  return normalised * jnp.sqrt(var + SAGNET_EPS) + mean


def _in_part(part: str, tree: base.Params) -> base.Params:
  """Whether each leaf of the model's ``tree`` is in its ``part``
  (``"featurizer"``, ``"head"`` or ``"style_head"``)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: path[0].key == part, tree)


def _only(part: str, grads: base.Params) -> base.Params:
  """The gradient of the part's params alone: a part's Adam passes the
  others' (zero) gradients through, as its parameters' updates."""
  return jax.tree.map(lambda mine, g: g if mine else jnp.zeros_like(g),
                      _in_part(part, grads), grads)


def _step(part_tx: optax.GradientTransformation, grads: base.Params,
          opt_state: optax.OptState, params: base.Params
          ) -> tuple[base.Params, optax.OptState]:
  """One step of a part's Adam."""
  updates, opt_state = part_tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _randomized_logits(network: base.Network, images: jax.Array,
                       params: base.Params, stats: base.Stats,
                       draws: SagNetDraws, what: str, head: str,
                       through_featurizer: bool = True
                       ) -> tuple[jax.Array, base.Stats]:
  """The logits of ``head`` on the features of ``images`` with their
  ``what`` randomised (`sagnet_randomize`), and the statistics of the
  featurizer's pass; ``through_featurizer=False`` holds the features
  constant."""
  model = network.bind(params, stats)
  features = model.features(images, rngs=draws.dropout_key)
  if not through_featurizer:
    features = jax.lax.stop_gradient(features)
  inputs = sagnet_randomize(features, draws, what)
  return getattr(model, head)(inputs), nnx.state(model, nnx.BatchStat)


def sagnet(network: base.Network, hparams: base.HParams, *, num_domains: int,
           seed: int) -> base.Algorithm:
  """Style-agnostic networks (Nam et al., CVPR 2021) as in DomainBed.

  DomainBed's ``SagNet`` (lines 1126-1245), whose featurizer, content
  network and style network are the model's ``featurizer``, ``head`` and
  ``style_head`` (a `models.StyleClassifier`, which the training loop
  builds for SagNet). Each has its own Adam at ``lr`` with ``weight_decay``
  (lines 1175-1181). Every update, on all domains pooled (lines 1217-1218),
  runs the featurizer three times, each pass with its own draws
  (`sagnet_draws`), and steps in turn (lines 1220-1239):

  1. content: the content network's cross-entropy on the features with
     randomised style (`sagnet_randomize`); the featurizer's and content
     network's Adams step;
  2. style: the style network's cross-entropy on the features, of the
     featurizer just stepped, with randomised content; the style network's
     Adam steps (the gradient that reaches the featurizer is thrown away
     by the next step's ``zero_grad``, line 1235);
  3. adversary: ``sag_w_adv`` times the mean over examples and classes of
     the stepped style network's negative log-probabilities, on
     randomised content again; the featurizer's Adam steps a second time.

  So the featurizer's Adam counts two steps an update, the others one.
  Trained BatchNorm statistics follow the three passes in turn. The
  metrics are the content loss (``loss``, DomainBed's ``loss_c``),
  ``loss_s`` and ``loss_adv``. Prediction is the content network on the
  features (lines 1244-1245), the model's own.

  Raises (at the first update):
    ValueError: the model has no ``style_head``, or the labels are
      regression targets, which the adversary's class probabilities lack.
  """
  del num_domains, seed
  tx = base.adam(hparams)
  weight = hparams["sag_w_adv"]

  def part_adam(part):
    return optax.masked(tx, lambda params: _in_part(part, params))

  featurizer_tx, content_tx, style_tx = (
      part_adam("featurizer"), part_adam("head"), part_adam("style_head"))

  def init(params):
    if "style_head" not in params:
      raise ValueError(
          "SagNet trains a style network beside the classifier: build its "
          "model with models.build_model(..., style_head=True), as the "
          "training loop does for SagNet.")
    return SagNetState(featurizer_tx.init(params), content_tx.init(params),
                       style_tx.init(params))

  def update(params, stats, state, batches, key):
    batch = base.merge_domains(batches)
    images, labels = batch["image"], batch["label"]
    if tasks.is_regression(labels):
      raise ValueError("SagNet's adversary needs classes; a regression task "
                       "has none.")
    content, style, adversary = sagnet_draws(key, len(labels),
                                             base.model_dtype(params))

    randomized_logits = functools.partial(_randomized_logits, network, images)

    def content_loss(params, stats):
      logits, stats = randomized_logits(params, stats, content, "style",
                                        "head")
      return tasks.example_loss(logits, batch).mean(), stats

    def style_loss(params, stats):
      # Only the style network steps on this loss: no backward pass through
      # the featurizer, whose gradient DomainBed throws away.
      logits, stats = randomized_logits(params, stats, style, "content",
                                        "style_head",
                                        through_featurizer=False)
      return tasks.example_loss(logits, batch).mean(), stats

    def adversary_loss(params, stats):
      logits, stats = randomized_logits(params, stats, adversary, "content",
                                        "style_head")
      return -weight * jax.nn.log_softmax(logits).mean(), stats

    grad = lambda loss: jax.value_and_grad(loss, has_aux=True)
    (loss_c, stats), grads = grad(content_loss)(params, stats)
    params, featurizer_opt_state = _step(
        featurizer_tx, _only("featurizer", grads), state.featurizer_opt_state,
        params)
    params, content_opt_state = _step(content_tx, _only("head", grads),
                                      state.content_opt_state, params)
    (loss_s, stats), grads = grad(style_loss)(params, stats)
    params, style_opt_state = _step(style_tx, _only("style_head", grads),
                                    state.style_opt_state, params)
    (loss_adv, stats), grads = grad(adversary_loss)(params, stats)
    params, featurizer_opt_state = _step(
        featurizer_tx, _only("featurizer", grads), featurizer_opt_state,
        params)
    return params, stats, SagNetState(
        featurizer_opt_state, content_opt_state, style_opt_state), {
            "loss": loss_c, "loss_s": loss_s, "loss_adv": loss_adv}

  return base.Algorithm(init, update)
