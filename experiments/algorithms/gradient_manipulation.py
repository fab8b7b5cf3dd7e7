"""Gradient manipulation: Fish, Fishr, ANDMask, SANDMask, IGA and RSC, as
DomainBed's.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import pgrad_jax
from experiments.data import tasks
from experiments.algorithms import base

# Where Fish applies weight decay: DomainBed's inner Adam, or the meta step.
FISH_WEIGHT_DECAY = ("inner", "outer")


def fish(network: base.Network, hparams: base.HParams, *, num_domains: int,
         seed: int) -> base.Algorithm:
  """Fish: ``theta += meta_lr * (theta_inner - theta)`` after a rollout.

  DomainBed's ``Fish`` (lines 392-449): from a copy of the params (line
  430), one inner Adam step at ``lr`` per domain in turn (lines 432-436),
  then the meta step (lines 423-427, 439-444). The inner Adam keeps its
  moments across outer steps, as DomainBed's Fish reloads
  ``optimizer_inner_state`` (lines 420-421, 438).
  ``hparams["fish_weight_decay"]`` places the weight decay (``"inner"``:
  DomainBed's; ``"outer"``: on the meta step) and ``hparams["fish_order"]``
  the domain order (``"fixed"``: DomainBed's; ``"random"``: a fresh
  permutation every step).
  """
  placement, order = hparams["fish_weight_decay"], hparams["fish_order"]
  if placement not in FISH_WEIGHT_DECAY:
    raise ValueError(f"fish_weight_decay must be one of {FISH_WEIGHT_DECAY}, "
                     f"got {placement!r}.")
  if order not in ("fixed", "random"):
    raise ValueError(f"fish_order must be 'fixed' or 'random', got {order!r}.")
  inner = placement == "inner"
  rollout = pgrad_jax.fish(
      base.adam(hparams) if inner else optax.adam(hparams["lr"]), order=order,
      num_domains=num_domains, seed=seed)
  return base.rollout_algorithm(
      network, rollout, hparams["meta_lr"],
      outer_weight_decay=0.0 if inner else hparams["weight_decay"])


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
    network: base.Network,
    params: base.Params,
    stats: base.Stats,
    images: jax.Array,
    labels: jax.Array,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, base.Stats]:
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


def fishr(network: base.Network, hparams: base.HParams, *, num_domains: int,
          seed: int) -> base.Algorithm:
  """Fishr (Rame et al., ICML 2022) as in DomainBed (lines 1571-1699).

  The penalty matches across domains the variance of the per-example gradients
  of the classifier head (lines 1637-1664, `head_gradients`; the distance,
  lines 1674-1696, `fishr_penalty`), of one forward pass over all domains
  (lines 1610-1611). Each domain's variance is smoothed by an exponential
  moving average (``ema``; the average starts at zero and its value is
  divided by ``1 - ema``, as DomainBed's ``MovingAverage``, ``lib/misc.py``
  lines 75-103). The penalty's weight is 0 for the first
  ``penalty_anneal_iters`` steps and ``lambda`` after (lines 1616-1618);
  Adam restarts when it switches on (lines 1619-1622).
  """
  del seed
  tx = base.adam(hparams)
  ema, weight, anneal = (hparams["ema"], hparams["lambda"],
                         hparams["penalty_anneal_iters"])

  def init(params):
    size = sum(leaf.size for leaf in jax.tree.leaves(params["head"]))
    return FishrState(tx.init(params),
                      jnp.zeros((num_domains, size), base.model_dtype(params)),
                      jnp.zeros((), jnp.int32))

  def objective(params, stats, batches, state):
    n, b = batches["label"].shape
    batch = base.merge_domains(batches)
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
    batches = base.with_example_keys(batches, key)
    grads, (moving, stats, metrics) = jax.grad(objective, has_aux=True)(
        params, stats, batches, state)
    opt_state = base.restart_at_anneal(tx, params, state.opt_state,
                                       state.count, anneal)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    state = FishrState(opt_state, moving, state.count + 1)
    return params, stats, state, metrics

  return base.Algorithm(init, update)


def and_mask(grads: jax.Array, tau: float) -> jax.Array:
  """ANDMask's direction for one parameter tensor from its domains' gradients.

  DomainBed's ``ANDMask.mask_grads`` (lines 1360-1373): an entry is kept
  where ``|mean over domains of sign(gradient)| >= tau`` (the domains agree
  on its sign), then the masked mean gradient is divided by the fraction of
  the tensor's entries kept, ``1e-10 +`` it. The fraction is per tensor,
  as DomainBed's loop over ``network.parameters()``; a tensor with no entry
  kept gets a zero direction.

  Args:
    grads: ``(n, ...)``, every domain's gradient of one tensor.
    tau: the agreement threshold.

  Returns:
    The tensor's direction, ``grads.shape[1:]``.
  """
  # DomainBed's mask is float32 (line 1366): the same in float32, here in
  # the gradients' dtype.
  mask = (jnp.abs(jnp.sign(grads).mean(axis=0)) >= tau).astype(grads.dtype)
  return _rescaled(mask, grads.mean(axis=0))


def sand_mask(grads: jax.Array, tau: float, k: float) -> jax.Array:
  """SANDMask's direction for one parameter tensor from its domains' gradients.

  DomainBed's ``SANDMask.mask_grads`` (lines 1548-1567): the soft mask
  ``max(0, tanh(k / var * (|mean sign| - tau)))``, ``var`` the unbiased
  variance over domains (``torch.var``'s default) of every entry, times the
  mean gradient, divided by the mean of the mask (``1e-10 +`` it). As
  DomainBed: a NaN variance (one domain) is 1e-17 (line 1560), and a NaN
  mask entry (a zero variance where the agreement is exactly ``tau``,
  ``inf * 0``) is 1e-17 (line 1564).

  Args:
    grads: ``(n, ...)``, every domain's gradient of one tensor.
    tau: the agreement threshold.
    k: the steepness of the soft mask.

  Returns:
    The tensor's direction, ``grads.shape[1:]``.
  """
  var = jnp.var(grads, axis=0, ddof=1)
  var = jnp.where(jnp.isnan(var), 1e-17, var)
  # (k * (1 / var)) * (agreement - tau), in DomainBed's order (line 1562), so
  # that an infinite 1 / var meets a zero agreement gap as NaN there too.
  agreement = jnp.abs(jnp.sign(grads).mean(axis=0))
  mask = jnp.maximum(jnp.tanh(k * (1 / var) * (agreement - tau)), 0)
  mask = jnp.where(jnp.isnan(mask), 1e-17, mask)
  return _rescaled(mask, grads.mean(axis=0))


def _rescaled(mask: jax.Array, mean_grad: jax.Array) -> jax.Array:
  """``mask * mean_grad / (1e-10 + mean(mask))``, in DomainBed's order
  (``param.grad = mask * avg_grad``, then ``*= 1 / (1e-10 + mask_t)``)."""
  return mask * mean_grad * (1 / (1e-10 + mask.sum() / mask.size))


def _masked_gradients(
    network: base.Network,
    hparams: base.HParams,
    mask_fn: Callable[[jax.Array], jax.Array],
) -> base.Algorithm:
  """ERM's Adam on every tensor's ``mask_fn`` of its domains' gradients.

  DomainBed's ``ANDMask.update`` and ``SANDMask.update`` (lines 1341-1358,
  1527-1546): each domain's loss from its own forward pass, in order, and
  its gradient (`base.domain_gradients`); the masked direction of every
  parameter tensor is the gradient fed to Adam, whose weight decay adds to
  it. The ``loss`` metric is the mean of the domains' losses.
  """
  tx = base.adam(hparams)

  def update(params, stats, state, batches, key):
    batches = base.with_example_keys(batches, key)
    losses, grads, stats = base.domain_gradients(network, params, stats,
                                                 batches)
    updates, state = tx.update(jax.tree.map(mask_fn, grads), state, params)
    return (optax.apply_updates(params, updates), stats, state,
            {"loss": losses.mean()})

  return base.Algorithm(tx.init, update)


def andmask(network: base.Network, hparams: base.HParams, *,
            num_domains: int, seed: int) -> base.Algorithm:
  """ANDMask (Parascandolo et al., ICLR 2021) as in DomainBed (lines 1330-1373).

  Adam (ERM's, lines 107-111) on `and_mask` of every parameter tensor's
  domain gradients, with ``tau`` (`_masked_gradients`).
  """
  del num_domains, seed
  tau = hparams["tau"]
  return _masked_gradients(network, hparams, lambda g: and_mask(g, tau))


def sandmask(network: base.Network, hparams: base.HParams, *,
             num_domains: int, seed: int) -> base.Algorithm:
  """SAND-mask (Shahtalebi et al., 2021) as in DomainBed (lines 1506-1567).

  Adam at ``lr`` with ``weight_decay`` and betas (0.9, 0.999), ERM's
  (lines 1517-1523), on `sand_mask` of every parameter tensor's domain
  gradients, with ``tau`` and ``k`` (`_masked_gradients`). DomainBed's
  ``update_count`` (lines 1525, 1544) is read nowhere, so it is not kept.
  """
  del num_domains, seed
  tau, k = hparams["tau"], hparams["k"]
  return _masked_gradients(network, hparams, lambda g: sand_mask(g, tau, k))


def iga(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """Inter-environmental gradient alignment (Koyama & Yamaguchi, 2020) as in
  DomainBed (lines 1375-1414).

  Adam (ERM's) on ``mean_loss + penalty * sum over domains e of |g_e -
  g_mean|^2``, ``g_e`` domain ``e``'s loss gradient w.r.t. every parameter
  from its own forward pass (lines 1387-1396, `base.domain_gradients`), and
  ``g_mean`` the gradient of the mean loss (lines 1398-1400). The gradients
  are differentiated again, as DomainBed's ``create_graph=True`` (line
  1394), through the loss's second derivatives; ``g_mean``, taken without
  ``create_graph``, is a constant of the objective, as DomainBed's (line
  1399). (The deviations ``g_e - g_mean`` sum to zero, so holding it
  constant changes no gradient in exact arithmetic.) The metrics are the
  mean loss (``loss``) and the penalty.
  """
  del num_domains, seed
  weight = hparams["penalty"]

  def objective(params, stats, batches, key):
    del key
    losses, grads, stats = base.domain_gradients(network, params, stats,
                                                 batches)
    mean_grad = jax.lax.stop_gradient(
        jax.tree.map(lambda g: g.mean(axis=0), grads))
    penalty = sum(((g - m) ** 2).sum() for g, m in
                  zip(jax.tree.leaves(grads), jax.tree.leaves(mean_grad)))
    mean_loss = losses.mean()
    return mean_loss + weight * penalty, (
        {"loss": mean_loss, "penalty": penalty}, stats)

  return base.gradient_algorithm(hparams, objective)


def numpy_percentile(x: jax.Array, q: float) -> jax.Array:
  """NumPy's ``np.percentile(x, q, axis=-1)``, ``method="linear"``, to the bit.

  The position ``(n - 1) * (q / 100)`` is NumPy's, in Python's float64:
  `jax.numpy.percentile` computes it in ``x``'s dtype, so in float32 it
  lands below an integer that NumPy reaches (``q = 200 / 3``, RSC's default,
  and ``n = 4`` gives 1.9999999 rather than 2.0), which moves the threshold
  off a data point. The interpolation is NumPy's ``_lerp``: from the lower
  neighbour below half the way, from the upper one from half.

  Args:
    x: ``(..., n)``.
    q: the percentile, in [0, 100].

  Returns:
    ``(..., 1)`` percentiles, in ``x``'s dtype.
  """
  n = x.shape[-1]
  position = (n - 1) * (q / 100)
  lower = math.floor(position)
  upper = min(lower + 1, n - 1)
  t = position - lower
  ordered = jnp.sort(x, axis=-1)
  below, above = ordered[..., lower:lower + 1], ordered[..., upper:upper + 1]
  if t >= 0.5:
    return above - (above - below) * (1 - t)
  return below + (above - below) * t


def rsc(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """Representation self-challenging (Huang et al., ECCV 2020) as in
  DomainBed (lines 1248-1302).

  One forward pass of the featurizer over all domains pooled (lines
  1260-1268), then, with the masks held constant:

  * ``g``, the gradient of the summed true-class logits w.r.t. the features
    (line 1271); every example's features at or above its
    ``(1 - rsc_f_drop_factor) * 100``-th percentile of ``g`` are muted
    (lines 1274-1280): ``mask_f = g < percentile``;
  * the drop of every example's true-class probability when muted (lines
    1283-1288); the examples whose drop is below the batch's
    ``(1 - rsc_b_drop_factor) * 100``-th percentile are not muted at all
    (lines 1289-1291): ``mask = mask_f or mask_b``;
  * ERM's Adam on the cross-entropy of the head on ``features * mask``
    (lines 1294-1300), which differentiates the featurizer through the kept
    features.

  The percentiles are NumPy's (DomainBed's ``np.percentile``,
  `numpy_percentile`), the comparisons strict (``lt``). DomainBed's
  ``torch.Tensor(percentiles)`` (line 1275) makes the feature percentiles
  float32, the model's dtype there; here they keep the model's dtype.
  RSC is for class labels (its one-hot masks, line 1264).
  """
  del num_domains, seed
  drop_f = (1 - hparams["rsc_f_drop_factor"]) * 100
  drop_b = (1 - hparams["rsc_b_drop_factor"]) * 100

  def objective(params, stats, batches, key):
    del key
    batch = base.merge_domains(batches)
    labels = batch["label"]
    if tasks.is_regression(labels):
      raise ValueError("RSC masks the true class's logit: it needs class "
                       "labels, not regression targets.")
    model = network.bind(params, stats)
    features = model.features(batch["image"], rngs=batch["key"][0])
    logits = model.head(features)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    # Equation (1) of the paper: a gradient without a graph (line 1271).
    feature_grads = jax.grad(lambda f: (model.head(f) * one_hot).sum())(
        jax.lax.stop_gradient(features))
    mask_f = feature_grads < numpy_percentile(feature_grads, drop_f)
    muted_logits = model.head(features * mask_f.astype(features.dtype))
    true_probability = lambda z: (jax.nn.softmax(z) * one_hot).sum(axis=1)
    changes = jax.lax.stop_gradient(
        true_probability(logits) - true_probability(muted_logits))
    mask_b = changes < numpy_percentile(changes, drop_b)
    mask = (mask_f | mask_b[:, None]).astype(features.dtype)
    loss = tasks.example_loss(model.head(features * mask), batch).mean()
    return loss, ({"loss": loss}, nnx.state(model, nnx.BatchStat))

  return base.gradient_algorithm(hparams, objective)
