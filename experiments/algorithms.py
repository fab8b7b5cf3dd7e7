"""Domain generalization algorithms as pure update functions.

An algorithm's builder ``builder(network, hparams, *, num_domains, seed)``,
registered by name in ``experiments.catalog``, returns an `Algorithm`, a
pair of pure functions:

* ``init(params) -> state``: the algorithm's state (its optimizer state and
  anything else it tracks, PRNG keys included);
* ``update(params, stats, state, batches, key) -> (params, stats, state,
  metrics)``: one training step on ``batches``, one batch per training domain
  stacked on a leading axis: ``{"image": (n, b, H, W, C), "label": (n, b)}``.

``params`` are the model's ``nnx.Param`` and ``stats`` its ``nnx.BatchStat``
(empty unless a ResNet runs with ``bn_mode="train"``). ``update`` has no side
effects, so a training loop jits it once. Its ``metrics`` are scalars or
arrays; a loop averages them over the steps between evaluations, except the
running totals named in `COUNTERS`, whose latest value it reports.

Conventions shared by all algorithms:

* Weight decay is ``optax.add_decayed_weights`` (``wd * params`` added to the
  direction) placed where the reference implementation applies it. PyTorch's
  ``Adam(weight_decay=wd)`` adds ``wd * param`` to the gradient before the
  moments, which is ``optax.chain(optax.add_decayed_weights(wd), adam)``.
  Line numbers are of DomainBed's ``domainbed/algorithms.py`` at commit
  b93c22a1 (facebookresearch/DomainBed):

  - ERM and MixUp: on the gradient fed to Adam (ERM's
    ``torch.optim.Adam(..., weight_decay=...)``, lines 107-111; MixUp
    inherits it, line 791).
  - Fishr: on the gradient fed to Adam, restarted with it (``_init_optimizer``,
    lines 1597-1602).
  - Fish: by default inside the inner Adam of every rollout step, the meta
    step undecayed (``create_clone``'s ``Adam(..., weight_decay=...)``, lines
    415-419; ``fish``, lines 423-427). ``fish_weight_decay="outer"`` moves it
    onto the meta step instead, as this module did before it matched
    DomainBed.
  - PGrad and its variants: on the outer step (``theta_0 - p`` before the
    outer SGD); the inner Adam that builds the trajectory is undecayed, as
    the paper builds its trajectories "without weight decay" (its WILDS setup)
    while drawing a weight decay in its search (appendix A.10). DomainBed
    has no PGrad.
* Fish visits the training domains in DomainBed's fixed order (``for x, y in
  minibatches``, line 432) unless ``fish_order="random"``.
* Dropout: every example gets a key split from the step's key, and a forward
  pass over a batch uses its first example's key, so every inner step of a
  rollout draws fresh masks.
* BatchNorm in ``"train"`` mode: the running statistics are those of the
  loss's own forward passes. A gradient step keeps the statistics of its one
  forward pass; a rollout hands them to `pgrad_jax` as its model state, so
  every inner step updates them in turn and the update returns the statistics
  of the rollout's last step, as a sequence of train-mode steps of the
  network would. (With frozen BatchNorm there are no statistics to carry.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import pgrad_jax
from experiments import catalog
from experiments import tasks

Params = nnx.State
Stats = nnx.State
Batches = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
HParams = Mapping[str, Any]

# Metrics that are running totals rather than per-step values.
COUNTERS = ("num_skipped",)
# Where Fish applies weight decay: DomainBed's inner Adam, or the meta step.
FISH_WEIGHT_DECAY = ("inner", "outer")


@dataclasses.dataclass(frozen=True)
class Network:
  """A `models.Classifier` taken apart for pure functions.

  Attributes:
    graphdef: the model's structure.
    constants: its state that is neither ``nnx.Param`` nor ``nnx.BatchStat``
      (e.g. the stored dropout stream, unused since keys are passed in).
  """

  graphdef: nnx.GraphDef
  constants: nnx.State

  @classmethod
  def split(cls, model: nnx.Module) -> tuple[Network, Params, Stats]:
    """Returns the network, the model's params and its BatchNorm statistics."""
    graphdef, params, stats, constants = nnx.split(
        model, nnx.Param, nnx.BatchStat, ...)
    return cls(graphdef, constants), params, stats

  def bind(
      self, params: Params, stats: Stats, *, train: bool = True
  ) -> nnx.Module:
    """The model with these params and statistics, in train or eval mode."""
    # Fresh Variables: a State built in an outer trace (e.g. the stats closed
    # over by a loss function) must not be mutated from inside a grad.
    model = nnx.merge(self.graphdef, params, stats, self.constants, copy=True)
    if train:
      model.train()
    else:
      model.eval()
    return model

  def logits(
      self,
      params: Params,
      stats: Stats,
      images: jax.Array,
      key: jax.Array | None = None,
      *,
      train: bool = True,
  ) -> tuple[jax.Array, Stats]:
    """The logits of ``images`` and the statistics after the forward pass."""
    model = self.bind(params, stats, train=train)
    return model(images, rngs=key), nnx.state(model, nnx.BatchStat)


class Algorithm(NamedTuple):
  """The pure functions of a training algorithm (see the module docstring)."""

  init: Callable[[Params], Any]
  update: Callable[
      [Params, Stats, Any, Batches, jax.Array],
      tuple[Params, Stats, Any, Metrics]]


def build_algorithm(
    name: str,
    network: Network,
    hparams: HParams,
    *,
    num_domains: int,
    seed: int = 0,
) -> Algorithm:
  """Builds a registered algorithm.

  Args:
    name: a name of ``catalog.ALGORITHMS``.
    network: the model, from `Network.split`.
    hparams: its hyperparameters (see ``experiments.hparams_registry``).
    num_domains: the number of training domains.
    seed: seeds the algorithm's own randomness (e.g. PGrad's domain order).

  Returns:
    The algorithm.
  """
  return catalog.ALGORITHMS[name].build(network, hparams,
                                       num_domains=num_domains, seed=seed)


# ----------------------------------------------------------------------------
# Shared pieces.


def merge_domains(batches: Batches) -> Batches:
  """Pools the domains: leaves ``(n, b, ...)`` become ``(n * b, ...)``."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batches)


def with_example_keys(batches: Batches, key: jax.Array) -> Batches:
  """Adds ``"key"``: one PRNG key per example, for dropout."""
  n, b = batches["label"].shape
  keys = jax.random.split(key, n * b)
  return {**batches, "key": keys.reshape((n, b) + keys.shape[1:])}


def batch_loss(
    network: Network
) -> Callable[[Params, Batches, Stats], tuple[jax.Array, Stats]]:
  """``loss_fn(params, batch, stats) -> (mean task loss, new stats)``.

  The task loss is `tasks.example_loss`: cross-entropy for classes, squared
  error for regression targets.
  """

  def loss_fn(params, batch, stats):
    logits, stats = network.logits(params, stats, batch["image"],
                                   batch["key"][0])
    return tasks.example_loss(logits, batch).mean(), stats

  return loss_fn


def mixup(
    batches: Batches, key: jax.Array, alpha: float, num_chunks: int = 1
) -> Batches:
  """DomainBed's inter-domain MixUp, separately for every chunk.

  Every domain's batch is split into ``num_chunks`` chunks, as a PGrad-B
  rollout splits it. For every chunk index, the domains are put in a random
  cyclic order and each is mixed with the next (DomainBed's
  ``random_pairs_of_minibatches``), with ``lambda ~ Beta(alpha, alpha)`` drawn
  per pair: ``image = lambda * image_i + (1 - lambda) * image_j``. With
  ``num_chunks=1`` this is DomainBed's MixUp.

  Args:
    batches: ``{"image": (n, b, ...), "label": (n, b), ...}``; other leaves
      pass through.
    key: a PRNG key.
    alpha: the Beta distribution's parameter.
    num_chunks: chunks per domain batch; must divide ``b``.

  Returns:
    The batches with mixed images, the partner's labels as ``"mix_label"``
    and ``lambda`` per example as ``"mix_weight"`` (see `tasks.example_loss`).
  """
  n, b = batches["label"].shape

  def mix_round(batch, key):
    order_key, weight_key = jax.random.split(key)
    order = jax.random.permutation(order_key, n)
    # Domain order[i] is mixed with domain order[i + 1], cyclically.
    partner = jnp.zeros(n, jnp.int32).at[order].set(jnp.roll(order, -1))
    weight = jax.random.beta(weight_key, alpha, alpha, (n,))
    images = batch["image"]
    w = weight.reshape((n,) + (1,) * (images.ndim - 1)).astype(images.dtype)
    return {
        **batch,
        "image": w * images + (1 - w) * images[partner],
        "mix_label": batch["label"][partner],
        "mix_weight": jnp.broadcast_to(weight[:, None], batch["label"].shape),
    }

  def to_rounds(x):  # (n, b, ...) -> (num_chunks, n, b / num_chunks, ...)
    chunked = x.reshape((n, num_chunks, b // num_chunks) + x.shape[2:])
    return jnp.swapaxes(chunked, 0, 1)

  def from_rounds(x):
    return jnp.swapaxes(x, 0, 1).reshape((n, b) + x.shape[3:])

  mixed = jax.vmap(mix_round)(jax.tree.map(to_rounds, batches),
                              jax.random.split(key, num_chunks))
  return jax.tree.map(from_rounds, mixed)


def _adam(hparams: HParams) -> optax.GradientTransformation:
  return optax.chain(optax.add_decayed_weights(hparams["weight_decay"]),
                     optax.adam(hparams["lr"]))


def _gradient_algorithm(
    hparams: HParams,
    objective: Callable[[Params, Stats, Batches, jax.Array],
                        tuple[jax.Array, tuple[Metrics, Stats]]],
) -> Algorithm:
  """Adam on ``objective(params, stats, batches, key)``.

  The objective returns ``(loss, (metrics, new_stats))``.
  """
  tx = _adam(hparams)

  def update(params, stats, state, batches, key):
    data_key, objective_key = jax.random.split(key)
    batches = with_example_keys(batches, data_key)
    grads, (metrics, stats) = jax.grad(objective, has_aux=True)(
        params, stats, batches, objective_key)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), stats, state, metrics

  return Algorithm(tx.init, update)


def _rollout_algorithm(
    network: Network,
    hparams: HParams,
    rollout: optax.GradientTransformationExtraArgs,
    outer_lr: float,
    *,
    outer_weight_decay: float,
    mix_chunks: int | None = None,
) -> Algorithm:
  """SGD(``outer_lr``) on a rollout transform (`pgrad_jax.pgrad` or ``fish``).

  ``outer_weight_decay`` decays the outer step's direction (0 for none).
  ``mix_chunks`` (the rollout's ``B``) turns on `mixup` inside every chunk.
  """
  tx = optax.chain(rollout, optax.add_decayed_weights(outer_weight_decay),
                   optax.sgd(outer_lr))

  loss_fn = batch_loss(network)

  def update(params, stats, state, batches, key):
    data_key, mix_key = jax.random.split(key)
    batches = with_example_keys(batches, data_key)
    if mix_chunks is not None:
      batches = mixup(batches, mix_key, hparams["mixup_alpha"], mix_chunks)
    # Trained statistics ride along as the rollout's model state for this one
    # update; the algorithm's own state keeps None there, so its structure
    # (and checkpoints) do not depend on the BatchNorm mode.
    stateful = bool(jax.tree.leaves(stats))
    updates, state = tx.update(
        None, state, params,
        loss_fn=loss_fn if stateful else (
            lambda p, batch: loss_fn(p, batch, stats)[0]),
        batches=batches, model_state=stats if stateful else None)
    if stateful:
      stats = optax.tree_utils.tree_get(state, "model_state")
      state = optax.tree_utils.tree_set(state, model_state=None)
    params = optax.apply_updates(params, updates)
    metrics = {name: optax.tree_utils.tree_get(state, name)
               for name in ("loss", "ref_norm", "num_skipped")}
    eigenvalues = optax.tree_utils.tree_get(state, "eigenvalues")
    if eigenvalues is not None:
      total = eigenvalues.sum()
      metrics["eigenvalues"] = eigenvalues / jnp.where(total > 0, total, 1.0)
    return params, stats, state, metrics

  return Algorithm(tx.init, update)


# ----------------------------------------------------------------------------
# The algorithms.


def erm(network: Network, hparams: HParams, *, num_domains: int,
        seed: int) -> Algorithm:
  """Empirical risk minimisation: Adam on the loss of all domains pooled."""
  del num_domains, seed

  def objective(params, stats, batches, key):
    del key
    loss, stats = batch_loss(network)(params, merge_domains(batches), stats)
    return loss, ({"loss": loss}, stats)

  return _gradient_algorithm(hparams, objective)


def pgrad(
    network: Network,
    hparams: HParams,
    *,
    num_domains: int,
    seed: int,
    order: str = "random",
    parallel: bool = False,
    mix: bool = False,
) -> Algorithm:
  """PGrad and its variants: ``pgrad_jax.pgrad`` (Adam inside) + SGD outside.

  Args:
    network: the model.
    hparams: ``lr`` (inner Adam), ``outer_lr``, ``k`` (an int, or ``"all"``
      for every component of the trajectory), ``B``, ``components``
      (``"top"`` or ``"bottom"``), ``weight_decay``, optionally
      ``outer_lr_per_domain`` (the outer step is ``outer_lr / num_domains``)
      and, with ``mix``, ``mixup_alpha``.
    num_domains: the number of training domains.
    seed: seeds the random domain order.
    order: ``"random"`` (PGrad) or ``"fixed"`` (PGrad-F).
    parallel: every inner step starts from the same point (PGradParallel).
    mix: MixUp inside every chunk's loss (PGrad-BMix).

  Returns:
    The algorithm.
  """
  k = hparams["k"]
  if k == "all":
    # A trajectory of n * B steps has at most n * B non-zero components.
    k = num_domains * hparams["B"]
  elif not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k must be a positive int or 'all', got {k!r}.")
  rollout = pgrad_jax.pgrad(
      optax.adam(hparams["lr"]), k=k, B=hparams["B"], order=order,
      components=hparams["components"], parallel=parallel,
      num_domains=num_domains, seed=seed)
  # The paper's WILDS protocol scales the outer step by the rollout's length:
  # gamma = c / n-hat, with c = outer_lr.
  outer_lr = hparams["outer_lr"] / (
      num_domains if hparams.get("outer_lr_per_domain", False) else 1)
  return _rollout_algorithm(network, hparams, rollout, outer_lr,
                            outer_weight_decay=hparams["weight_decay"],
                            mix_chunks=hparams["B"] if mix else None)


def fish(network: Network, hparams: HParams, *, num_domains: int,
         seed: int) -> Algorithm:
  """Fish: ``theta += meta_lr * (theta_inner - theta)`` after a rollout.

  The inner Adam keeps its moments across outer steps, as DomainBed's Fish
  reloads ``optimizer_inner_state``. ``hparams["fish_weight_decay"]`` places
  the weight decay (``"inner"``: DomainBed's; ``"outer"``: on the meta step)
  and ``hparams["fish_order"]`` the domain order (``"fixed"``: DomainBed's;
  ``"random"``: a fresh permutation every step).
  """
  placement, order = hparams["fish_weight_decay"], hparams["fish_order"]
  if placement not in FISH_WEIGHT_DECAY:
    raise ValueError(f"fish_weight_decay must be one of {FISH_WEIGHT_DECAY}, "
                     f"got {placement!r}.")
  if order not in ("fixed", "random"):
    raise ValueError(f"fish_order must be 'fixed' or 'random', got {order!r}.")
  inner = placement == "inner"
  rollout = pgrad_jax.fish(
      _adam(hparams) if inner else optax.adam(hparams["lr"]), order=order,
      num_domains=num_domains, seed=seed)
  return _rollout_algorithm(
      network, hparams, rollout, hparams["meta_lr"],
      outer_weight_decay=0.0 if inner else hparams["weight_decay"])


def restart_at_anneal(
    tx: optax.GradientTransformation,
    params: Params,
    opt_state: optax.OptState,
    count: jax.Array,
    anneal: int,
) -> optax.OptState:
  """A fresh optimizer state at the step a penalty's weight jumps, as DomainBed.

  The jump in gradient scale when the penalty's full weight switches on
  (step ``count == anneal``) would mislead Adam's moment estimates, so
  DomainBed's IRM and Fishr restart Adam there. At ``anneal == 0`` the state
  is fresh anyway.
  """
  restart = (count == anneal) & (anneal > 0)
  return jax.tree.map(lambda new, old: jnp.where(restart, new, old),
                      tx.init(params), opt_state)


class FishrState(NamedTuple):
  """Fishr's state.

  Attributes:
    opt_state: Adam's state.
    ema: ``(num_domains, P)``, the moving average of every domain's variance
      of the per-example gradients of the ``P`` head parameters.
    count: the number of updates taken.
  """

  opt_state: optax.OptState
  ema: jax.Array
  count: jax.Array


def head_gradients(
    network: Network,
    params: Params,
    stats: Stats,
    images: jax.Array,
    labels: jax.Array,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Stats]:
  """Logits and per-example cross-entropy gradients w.r.t. the head.

  The gradients stay differentiable w.r.t. all ``params``, featurizer
  included, as Fishr's penalty needs.

  Args:
    network: the model.
    params: its parameters.
    stats: its BatchNorm statistics.
    images: ``(N, H, W, C)``.
    labels: ``(N,)``.
    key: dropout key.

  Returns:
    ``(logits (N, C), gradients (N, P), stats)``, ``P`` the number of head
    params and ``stats`` the BatchNorm statistics after the forward pass.
  """
  model = network.bind(params, stats)
  features = model.features(images, rngs=key)
  head_def, head_params, head_rest = nnx.split(model.head, nnx.Param, ...)

  def example_loss(head_params, feature, label):
    outputs = nnx.merge(head_def, head_params, head_rest)(feature[None])
    return tasks.example_loss(outputs, {"label": label[None]})[0]

  grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(
      head_params, features, labels)
  flat = [g.reshape(len(labels), -1) for g in jax.tree.leaves(grads)]
  return (model.head(features), jnp.concatenate(flat, axis=1),
          nnx.state(model, nnx.BatchStat))


def fishr_penalty(variances: jax.Array) -> jax.Array:
  """Mean over domains of the mean squared distance to the mean variance.

  Args:
    variances: ``(num_domains, P)`` gradient variances.

  Returns:
    The scalar penalty of DomainBed's Fishr.
  """
  return jnp.mean((variances - variances.mean(axis=0)) ** 2)


def fishr(network: Network, hparams: HParams, *, num_domains: int,
          seed: int) -> Algorithm:
  """Fishr (Rame et al., ICML 2022) as in DomainBed.

  The penalty matches across domains the variance of the per-example gradients
  of the classifier head. Each domain's variance is smoothed by an exponential
  moving average (``ema``; the average starts at zero and its value is
  divided by ``1 - ema``, as DomainBed's ``MovingAverage``). The penalty's
  weight is 0 for the first ``penalty_anneal_iters`` steps and ``lambda``
  after; Adam restarts when it switches on.
  """
  del seed
  tx = _adam(hparams)
  ema, weight, anneal = (hparams["ema"], hparams["lambda"],
                         hparams["penalty_anneal_iters"])

  def init(params):
    size = sum(leaf.size for leaf in jax.tree.leaves(params["head"]))
    return FishrState(tx.init(params), jnp.zeros((num_domains, size)),
                      jnp.zeros((), jnp.int32))

  def objective(params, stats, batches, state):
    n, b = batches["label"].shape
    batch = merge_domains(batches)
    logits, grads, stats = head_gradients(
        network, params, stats, batch["image"], batch["label"],
        batch["key"][0])
    nll = tasks.example_loss(logits, batch).mean()
    variances = jnp.var(grads.reshape(n, b, -1), axis=1)
    moving = ema * state.ema + (1 - ema) * variances
    penalty = fishr_penalty(moving / (1 - ema))
    objective = nll + jnp.where(state.count >= anneal, weight, 0.0) * penalty
    return objective, (moving, stats, {"loss": objective, "nll": nll,
                                       "penalty": penalty})

  def update(params, stats, state, batches, key):
    batches = with_example_keys(batches, key)
    grads, (moving, stats, metrics) = jax.grad(objective, has_aux=True)(
        params, stats, batches, state)
    opt_state = restart_at_anneal(tx, params, state.opt_state, state.count,
                                  anneal)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    state = FishrState(opt_state, moving, state.count + 1)
    return params, stats, state, metrics

  return Algorithm(init, update)


def mixup_algorithm(network: Network, hparams: HParams, *, num_domains: int,
                    seed: int) -> Algorithm:
  """Inter-domain MixUp (Yan et al., 2020) as in DomainBed; see `mixup`."""
  del num_domains, seed

  def objective(params, stats, batches, key):
    mixed = mixup(batches, key, hparams["mixup_alpha"])
    loss, stats = batch_loss(network)(params, merge_domains(mixed), stats)
    return loss, ({"loss": loss}, stats)

  return _gradient_algorithm(hparams, objective)


class AnnealState(NamedTuple):
  """The state of an algorithm whose penalty weight changes at one step.

  Attributes:
    opt_state: Adam's state.
    count: the number of updates taken.
  """

  opt_state: optax.OptState
  count: jax.Array


def irm_penalty(outputs: jax.Array, labels: jax.Array) -> jax.Array:
  """IRMv1's penalty of every domain, as DomainBed computes it.

  The penalty is the squared gradient of the domain's risk with respect to a
  scalar multiplier ``s`` of the outputs, at ``s = 1``. DomainBed estimates the
  square without bias as the product of the gradients of two halves of the
  batch: the even and the odd examples.

  Args:
    outputs: ``(n, b, C)`` logits, or ``(n, b, 1)`` predicted values.
    labels: ``(n, b)`` classes or regression targets.

  Returns:
    ``(n,)`` penalties, one per domain.
  """

  def risk(scale, outputs, labels):
    return tasks.example_loss(outputs * scale, {"label": labels}).mean()

  def domain_penalty(outputs, labels):
    grad = jax.grad(risk)
    return (grad(1.0, outputs[::2], labels[::2])
            * grad(1.0, outputs[1::2], labels[1::2]))

  return jax.vmap(domain_penalty)(outputs, labels)


def irm(network: Network, hparams: HParams, *, num_domains: int,
        seed: int) -> Algorithm:
  """IRMv1 (Arjovsky et al., 2019) as in DomainBed.

  The objective is the mean over domains of the risk plus ``irm_lambda``
  times the mean of `irm_penalty`. Before step ``irm_penalty_anneal_iters``
  the penalty's weight is 1 (DomainBed's warm-up, not 0); at that step it
  becomes ``irm_lambda`` and Adam restarts (`restart_at_anneal`).
  """
  del num_domains, seed
  tx = _adam(hparams)
  weight, anneal = hparams["irm_lambda"], hparams["irm_penalty_anneal_iters"]

  def objective(params, stats, batches, count):
    n, b = batches["label"].shape
    batch = merge_domains(batches)
    outputs, stats = network.logits(params, stats, batch["image"],
                                    batch["key"][0])
    nll = tasks.example_loss(outputs, batch).mean()
    penalty = irm_penalty(outputs.reshape(n, b, -1), batches["label"]).mean()
    objective = nll + jnp.where(count >= anneal, weight, 1.0) * penalty
    return objective, (stats, {"loss": objective, "nll": nll,
                               "penalty": penalty})

  def update(params, stats, state, batches, key):
    batches = with_example_keys(batches, key)
    grads, (stats, metrics) = jax.grad(objective, has_aux=True)(
        params, stats, batches, state.count)
    opt_state = restart_at_anneal(tx, params, state.opt_state, state.count,
                                  anneal)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, stats, AnnealState(opt_state, state.count + 1), metrics

  return Algorithm(
      lambda params: AnnealState(tx.init(params), jnp.zeros((), jnp.int32)),
      update)


def coral_penalty(features: jax.Array) -> jax.Array:
  """DomainBed's CORAL penalty: feature mean and covariance gaps of domains.

  For every pair of domains ``i < j``, the mean over features of the squared
  difference of their feature means, plus the mean over feature pairs of the
  squared difference of their covariances (unbiased, ``1 / (b - 1)``),
  averaged over the ``n (n - 1) / 2`` pairs.

  Args:
    features: ``(n, b, F)``, every domain's batch of features.

  Returns:
    The scalar penalty; 0 with one domain.
  """
  n, b, _ = features.shape
  if n < 2:
    return jnp.zeros((), features.dtype)
  means = features.mean(axis=1)
  centered = features - means[:, None]
  covariances = jnp.einsum("nbi,nbj->nij", centered, centered) / (b - 1)
  first, second = jnp.triu_indices(n, k=1)
  mean_gaps = ((means[first] - means[second]) ** 2).mean(axis=-1)
  covariance_gaps = ((covariances[first] - covariances[second]) ** 2).mean(
      axis=(-2, -1))
  return (mean_gaps + covariance_gaps).mean()


def coral(network: Network, hparams: HParams, *, num_domains: int,
          seed: int) -> Algorithm:
  """Deep CORAL (Sun & Saenko, 2016) as in DomainBed.

  Adam on the mean risk of the domains plus ``mmd_gamma`` times
  `coral_penalty` of the featurizer's outputs.
  """
  del num_domains, seed

  def objective(params, stats, batches, key):
    del key
    n, b = batches["label"].shape
    batch = merge_domains(batches)
    model = network.bind(params, stats)
    features = model.features(batch["image"], rngs=batch["key"][0])
    nll = tasks.example_loss(model.head(features), batch).mean()
    penalty = coral_penalty(features.reshape(n, b, -1))
    objective = nll + hparams["mmd_gamma"] * penalty
    return objective, ({"loss": objective, "nll": nll, "penalty": penalty},
                       nnx.state(model, nnx.BatchStat))

  return _gradient_algorithm(hparams, objective)
