"""What every algorithm shares: the interface, the network, the pieces.

See the package docstring (``experiments.algorithms``) for the interface and
the conventions every algorithm follows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import catalog
from experiments import models
from experiments.data import tasks

Params = nnx.State
Stats = nnx.State
Batches = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
HParams = Mapping[str, Any]

# Metrics that are running totals rather than per-step values.
COUNTERS = ("num_skipped",)


@dataclasses.dataclass(frozen=True)
class Network:
  """A `models.Classifier` taken apart for pure functions.

  Attributes:
    graphdef: the model's structure.
    constants: its state that is neither ``nnx.Param`` nor ``nnx.BatchStat``
      (e.g. the stored dropout stream, unused since keys are passed in).
    stats_shapes: the shapes and dtypes (``jax.ShapeDtypeStruct``) of its
      BatchNorm statistics, for an algorithm state that holds a copy of them
      (ERM++'s averaged network), which ``init(params)`` cannot see.
  """

  graphdef: nnx.GraphDef
  constants: nnx.State
  stats_shapes: Stats | None = dataclasses.field(default=None, compare=False)

  @classmethod
  def split(cls, model: nnx.Module) -> tuple[Network, Params, Stats]:
    """Returns the network, the model's params and its BatchNorm statistics."""
    graphdef, params, stats, constants = nnx.split(
        model, nnx.Param, nnx.BatchStat, ...)
    shapes = jax.eval_shape(lambda: stats)
    return cls(graphdef, constants, shapes), params, stats

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
  """The pure functions of a training algorithm (see the package docstring).

  Attributes:
    init: ``init(params) -> state``.
    update: ``update(params, stats, state, batches, key) -> (params, stats,
      state, metrics)``.
    predict: ``predict(params, stats, images, count) -> outputs`` at
      evaluation, for an algorithm that adapts to the batch it predicts (ARM);
      only the first ``count`` images are real, the rest padding. ``None``:
      the network's eval-mode outputs, image by image.
    evaluated: ``evaluated(params, stats, state) -> (params, stats)``, the
      network that evaluation runs (through ``predict``), for an algorithm
      that evaluates another network than the one it trains (ERM++'s moving
      average). ``None``: the trained network.
    set_learning_rate: ``set_learning_rate(state, lr) -> state``, the state
      whose optimizer steps at ``lr`` (a scalar array) from then on, for an
      algorithm whose learning rate the training loop schedules (ERM++'s
      ``auto_lr``). ``None``: the learning rate is the algorithm's own.
  """

  init: Callable[[Params], Any]
  update: Callable[
      [Params, Stats, Any, Batches, jax.Array],
      tuple[Params, Stats, Any, Metrics]]
  predict: Callable[[Params, Stats, jax.Array, jax.Array], jax.Array] | None = (
      None)
  evaluated: Callable[[Params, Stats, Any], tuple[Params, Stats]] | None = None
  set_learning_rate: Callable[[Any, jax.Array], Any] | None = None


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
    hparams: its hyperparameters (see ``experiments.search_space``),
      which its builder gets as its entry types them
      (``entries.AlgorithmEntry.typed_hparams``).
    num_domains: the number of training domains.
    seed: seeds the algorithm's own randomness (e.g. PGrad's domain order).

  Returns:
    The algorithm.
  """
  entry = catalog.ALGORITHMS[name]
  return entry.build(network, entry.typed_hparams(hparams),
                     num_domains=num_domains, seed=seed)


def merge_domains(batches: Batches) -> Batches:
  """Pools the domains: leaves ``(n, b, ...)`` become ``(n * b, ...)``."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batches)


def model_dtype(params: Params) -> jnp.dtype:
  """The dtype of the model's parameters, which an algorithm's own floating
  state (GroupDRO's weights, Fishr's averages) takes too, as a PyTorch
  module's buffers take its dtype."""
  return jnp.result_type(*jax.tree.leaves(params))


def trains_batch_norm(module: nnx.Module) -> bool:
  """Whether a forward pass of ``module``, as it is now, updates BatchNorm
  statistics: a BatchNorm in it is neither frozen nor in eval mode."""
  return any(
      isinstance(node, nnx.BatchNorm)
      and not isinstance(node, models.FrozenBatchNorm)
      and not node.use_running_average
      for _, node in nnx.iter_graph(module))


def domain_features(model: nnx.Module, batches: Batches) -> jax.Array:
  """The featurizer's outputs for every domain's batch, ``(n, b, F)``.

  DomainBed's feature-matching algorithms run the featurizer once per
  domain, in order. Where no BatchNorm of the featurizer trains (frozen
  BatchNorm, or none), a pass over all domains pooled gives the same
  features, and is the one pass taken. Otherwise every domain's batch is
  normalized with its own statistics, and the running statistics follow
  the passes in turn, as `domain_losses`'.

  Args:
    model: a bound `models.Classifier` (`Network.bind`), whose statistics
      the passes update.
    batches: ``{"image": (n, b, ...), "key": (n, b, ...)}``; a pass over a
      batch takes its first example's key (`with_example_keys`).

  Returns:
    The ``(n, b, F)`` features.
  """
  n, b = batches["key"].shape[:2]
  if not trains_batch_norm(model.featurizer):
    batch = merge_domains({k: batches[k] for k in ("image", "key")})
    return model.features(batch["image"], rngs=batch["key"][0]).reshape(
        n, b, -1)
  return jnp.stack([model.features(batches["image"][i],
                                   rngs=batches["key"][i, 0])
                    for i in range(n)])


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


def domain_losses(
    network: Network, params: Params, stats: Stats, batches: Batches
) -> tuple[jax.Array, Stats]:
  """Every domain's mean task loss, each from its own forward pass.

  The passes run in domain order, so trained BatchNorm statistics follow
  each in turn, as a loop over DomainBed's minibatches would; every domain's
  batch stays whole (and split over a data axis, if it is). The loop is
  unrolled: XLA:CPU runs the convolutions of a loop's body several times
  slower (as ``pgrad_jax``'s layout knows).

  Returns:
    ``(losses (n,), stats after the last pass)``.
  """
  loss_fn = batch_loss(network)

  def one_domain(stats, batch):
    loss, stats = loss_fn(params, batch, stats)
    return stats, loss

  stats, losses = jax.lax.scan(one_domain, stats, batches, unroll=True)
  return losses, stats


def domain_gradients(
    network: Network, params: Params, stats: Stats, batches: Batches
) -> tuple[jax.Array, Params, Stats]:
  """Every domain's mean task loss and its gradient, from its own pass.

  As `domain_losses`: the passes run in domain order, the statistics
  following each, as DomainBed's loops of ``autograd.grad(env_loss, ...)``
  over the minibatches (ANDMask, SANDMask, IGA). The gradients stay
  differentiable w.r.t. ``params`` (IGA's penalty differentiates them).

  Returns:
    ``(losses (n,), gradients with a leading (n,) axis on every leaf of
    params, stats after the last pass)``.
  """
  loss_and_grad = jax.value_and_grad(batch_loss(network), has_aux=True)

  def one_domain(stats, batch):
    (loss, stats), grads = loss_and_grad(params, batch, stats)
    return stats, (loss, grads)

  stats, (losses, grads) = jax.lax.scan(one_domain, stats, batches,
                                        unroll=True)
  return losses, grads, stats


def mixup(
    batches: Batches, key: jax.Array, alpha: float, num_chunks: int = 1,
    dtype: jnp.dtype | None = None,
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
    dtype: the dtype of ``lambda``, which weighs the losses: the model's
      (`model_dtype`); ``None``, JAX's default.

  Returns:
    The batches with mixed images, the partner's labels as ``"mix_label"``,
    ``lambda`` per example as ``"mix_weight"`` (see `tasks.example_loss`)
    and, as ``"mix_pass"``, the place of the example's pair in DomainBed's
    loop over the pairs (domain ``order[k]``'s is ``k``).
  """
  n, b = batches["label"].shape

  def mix_round(batch, key):
    order_key, weight_key = jax.random.split(key)
    order = jax.random.permutation(order_key, n)
    # Domain order[i] is mixed with domain order[i + 1], cyclically.
    partner = jnp.zeros(n, order.dtype).at[order].set(jnp.roll(order, -1))
    weight = jax.random.beta(weight_key, alpha, alpha, (n,), dtype)
    images = batch["image"]
    w = weight.reshape((n,) + (1,) * (images.ndim - 1)).astype(images.dtype)
    place = jnp.zeros(n, jnp.int32).at[order].set(
        jnp.arange(n, dtype=jnp.int32))
    return {
        **batch,
        "image": w * images + (1 - w) * images[partner],
        "mix_label": batch["label"][partner],
        "mix_weight": jnp.broadcast_to(weight[:, None], batch["label"].shape),
        "mix_pass": jnp.broadcast_to(place[:, None], batch["label"].shape),
    }

  def to_rounds(x):  # (n, b, ...) -> (num_chunks, n, b / num_chunks, ...)
    chunked = x.reshape((n, num_chunks, b // num_chunks) + x.shape[2:])
    return jnp.swapaxes(chunked, 0, 1)

  def from_rounds(x):
    return jnp.swapaxes(x, 0, 1).reshape((n, b) + x.shape[3:])

  mixed = jax.vmap(mix_round)(jax.tree.map(to_rounds, batches),
                              jax.random.split(key, num_chunks))
  return jax.tree.map(from_rounds, mixed)


def torch_adam(
    lr: float, weight_decay: float, b1: float = 0.9, b2: float = 0.999
) -> optax.GradientTransformation:
  """PyTorch's ``Adam(lr, betas=(b1, b2), weight_decay=weight_decay)``.

  PyTorch adds ``weight_decay * param`` to the gradient before the moments.
  """
  return optax.chain(optax.add_decayed_weights(weight_decay),
                     optax.adam(lr, b1=b1, b2=b2))


def adam(hparams: HParams) -> optax.GradientTransformation:
  """DomainBed's ERM optimizer: `torch_adam` at ``lr`` and ``weight_decay``."""
  return torch_adam(hparams["lr"], hparams["weight_decay"])


def gradient_algorithm(
    hparams: HParams,
    objective: Callable[[Params, Stats, Batches, jax.Array],
                        tuple[jax.Array, tuple[Metrics, Stats]]],
    *,
    frozen: str | None = None,
) -> Algorithm:
  """Adam (`adam`) on ``objective(params, stats, batches, key)``.

  The objective returns ``(loss, (metrics, new_stats))``. ``frozen`` names a
  top-level part of the params (ARM's ``"context_net"``) that Adam leaves
  alone, neither stepped nor decayed, as a PyTorch optimizer built without
  those parameters.
  """
  tx = adam(hparams)
  if frozen is not None:
    tx = optax.multi_transform(
        {"trained": tx, "frozen": optax.set_to_zero()},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if path[0].key == frozen else "trained",
            params))

  def update(params, stats, state, batches, key):
    data_key, objective_key = jax.random.split(key)
    batches = with_example_keys(batches, data_key)
    grads, (metrics, stats) = jax.grad(objective, has_aux=True)(
        params, stats, batches, objective_key)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), stats, state, metrics

  return Algorithm(tx.init, update)


def rollout_algorithm(
    network: Network,
    rollout: optax.GradientTransformationExtraArgs,
    outer_lr: float,
    *,
    outer_weight_decay: float,
    mix: tuple[int, float] | None = None,
) -> Algorithm:
  """SGD(``outer_lr``) on a rollout transform (`pgrad_jax.pgrad` or ``fish``).

  ``outer_weight_decay`` decays the outer step's direction (0 for none).
  ``mix``, ``(chunks, alpha)`` with the rollout's ``B`` chunks, turns on
  `mixup` inside every chunk.
  """
  tx = optax.chain(rollout, optax.add_decayed_weights(outer_weight_decay),
                   optax.sgd(outer_lr))

  loss_fn = batch_loss(network)

  def update(params, stats, state, batches, key):
    data_key, mix_key = jax.random.split(key)
    batches = with_example_keys(batches, data_key)
    if mix is not None:
      mix_chunks, alpha = mix
      batches = mixup(batches, mix_key, alpha, mix_chunks,
                      model_dtype(params))
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


class AnnealState(NamedTuple):
  """The state of an algorithm whose penalty weight changes at one step.

  Attributes:
    opt_state: Adam's state.
    count: the number of updates taken.
  """

  opt_state: optax.OptState
  count: jax.Array


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
