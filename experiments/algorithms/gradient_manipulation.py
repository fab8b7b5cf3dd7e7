"""Gradient manipulation: Fish and Fishr, as DomainBed's.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1.
"""

from __future__ import annotations

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
