"""Optimization: ERM, ERM++, SD, GroupDRO and MLDG, as DomainBed's.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1
unless another file is named.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments import averaging
from experiments.algorithms import base
from experiments.data import tasks

# How MLDG pairs meta-train with meta-test domains (see `meta_pairs`).
MLDG_PAIRS = ("meta_test_split", "random_pairs")


def erm(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """Empirical risk minimisation: Adam on the loss of all domains pooled.

  DomainBed's ``ERM`` (lines 92-125): Adam at ``lr`` with ``weight_decay``
  (lines 107-111) on the mean loss of one forward pass over all domains
  (lines 113-122).
  """
  del num_domains, seed
  return base.gradient_algorithm(hparams, _pooled_objective(network))


def _pooled_objective(network: base.Network):
  """ERM's objective: the mean loss of one forward pass over all domains
  pooled (lines 113-122), with the metric ``loss``."""

  def objective(params, stats, batches, key):
    del key
    loss, stats = base.batch_loss(network)(params,
                                           base.merge_domains(batches), stats)
    return loss, ({"loss": loss}, stats)

  return objective


# DomainBed's ERM++ starts its moving average at update 600, a constant
# (``lib/misc.py`` line 56), not an hparam.
ERM_PLUS_PLUS_SMA_START = 600


class ErmPlusPlusState(NamedTuple):
  """ERM++'s state.

  Attributes:
    linear_opt_state: the linear probe's optimizer state, over the head.
    opt_state: the full optimizer's state, over every parameter; it stays
      as initialised until the probe ends.
    average: the moving average (`averaging.SmaState`) of the network,
      ``{"params": ..., "stats": ...}``; its ``updates`` counts the updates
      taken (DomainBed's ``global_iter``), which also picks the optimizer.
  """

  linear_opt_state: optax.OptState
  opt_state: optax.OptState
  average: averaging.SmaState


def _erm_plus_plus_optimizer(hparams: base.HParams,
                             lr: float) -> optax.GradientTransformation:
  """ERM++'s optimizer at ``lr``: PyTorch's Adam, or with ``lars`` LARS.

  DomainBed's ``LARS`` (``lib/misc.py`` lines 533-566) is optax's
  ``lars`` with its defaults (momentum 0.9, trust coefficient 0.001, no
  Nesterov) and its weight decay and trust ratio masked to the tensors of
  more than one dimension (line 550: not biases, not BatchNorm's scale and
  bias). optax scales by the learning rate before the momentum and DomainBed
  after it, the same at a constant learning rate.
  """
  weight_decay = hparams["weight_decay"]
  if not hparams["lars"]:
    return base.torch_adam(lr, weight_decay)
  matrices = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.lars(lr, weight_decay=weight_decay,
                    weight_decay_mask=matrices, trust_ratio_mask=matrices)


def erm_plus_plus(network: base.Network, hparams: base.HParams, *,
                  num_domains: int, seed: int,
                  sma_start_iter: int = ERM_PLUS_PLUS_SMA_START
                  ) -> base.Algorithm:
  """ERM++ (Teterwak et al., 2023) as DomainBed's ``ERMPlusPlus``.

  DomainBed's ``ERMPlusPlus`` (lines 127-233) with its
  ``ErmPlusPlusMovingAvg`` (``lib/misc.py`` lines 51-72):

  * Two optimizers (lines 141-175), each PyTorch's Adam with
    ``weight_decay``, or with the hparam ``lars`` DomainBed's LARS
    (`optax.lars`, see `_erm_plus_plus_optimizer`): the full one over every
    parameter at ``lr``, and the linear probe's over the head alone
    (``network[1]``, line 158) at ``linear_lr``.
  * The linear probe (lines 183-186): while the updates taken so far
    (``global_iter``) are at most ``linear_steps``, the update steps the
    linear probe's optimizer, so the first ``linear_steps + 1`` updates move
    the head alone; every later one steps the full optimizer, whose state
    starts fresh then (it has not stepped before). Nothing is reset: each
    optimizer keeps its own state, the probe's unused after the switch.
    The gradient is ERM's, of one forward pass over all domains pooled
    (lines 190-196), so trained BatchNorm statistics follow that pass in
    both phases.
  * The moving average (line 197, ``update_sma``): `averaging.sma` of the
    network's params *and* BatchNorm statistics (its ``state_dict``, less
    ``num_batches_tracked``), the latest network until update
    ``sma_start_iter``, then the equal-weight mean of the networks after
    update ``sma_start_iter - 1`` and every later one; where BatchNorm
    trains, `_step_averaged_batch_norm` (lines 198-200).
  * Evaluation runs the averaged network in eval mode (``predict``, lines
    204-206): `_averaged_network`, the algorithm's ``evaluated``.

  The metrics are ``loss`` and ``linear_probe``, 1 where the update stepped
  the linear probe's optimizer, else 0 (a record's share of probe steps).

  With the hparam ``auto_lr`` the training loop sets the full optimizer's
  learning rate at its evaluations (`_full_optimizer`); without it the
  learning rates stay constant, as in DomainBed's ``scripts/train.py``.
  (At b93c22a1 DomainBed's ``lars`` fails to build: it passes
  ``foreach=False``, which its ``LARS`` does not take, line 537.)

  Args:
    network: the model.
    hparams: ``lr``, ``linear_lr``, ``weight_decay``, ``linear_steps``,
      ``lars`` and ``auto_lr``.
    num_domains: unused: the domains are pooled.
    seed: unused.
    sma_start_iter: the update from which the moving average holds more than
      the latest network, counting from 1; DomainBed's 600.

  Returns:
    The algorithm, whose state is an `ErmPlusPlusState`.
  """
  del num_domains, seed
  if network.stats_shapes is None:
    raise ValueError("ERM++ averages the network's BatchNorm statistics: "
                     "build its network with Network.split(model).")
  sma = averaging.sma(sma_start_iter)
  linear_steps = hparams["linear_steps"]
  tx = _full_optimizer(hparams)
  linear_tx = _linear_probe_optimizer(hparams)
  objective = _pooled_objective(network)

  def init(params):
    # init sees no statistics: zeros hold their place until the first
    # update copies the network.
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         network.stats_shapes)
    return ErmPlusPlusState(linear_tx.init(params), tx.init(params),
                            sma.init({"params": params, "stats": stats}))

  def update(params, stats, state, batches, key):
    data_key, objective_key = jax.random.split(key)
    batches = base.with_example_keys(batches, data_key)
    # DomainBed copies the network when it builds ERM++: the network the
    # first update is given.
    first = state.average.updates == 0
    average = jax.tree.map(lambda copy, kept: jnp.where(first, copy, kept),
                           sma.init({"params": params, "stats": stats}),
                           state.average)
    grads, (metrics, stats) = jax.grad(objective, has_aux=True)(
        params, stats, batches, objective_key)
    linear = average.updates <= linear_steps
    updates, linear_opt_state, opt_state = jax.lax.cond(
        linear,
        lambda: (*linear_tx.update(grads, state.linear_opt_state, params),
                 state.opt_state),
        lambda: _with_probe_state(tx.update(grads, state.opt_state, params),
                                  state.linear_opt_state))
    params = optax.apply_updates(params, updates)
    average = _step_averaged_batch_norm(
        network, sma.update({"params": params, "stats": stats}, average),
        batches)
    metrics["linear_probe"] = linear.astype(base.model_dtype(params))
    return (params, stats,
            ErmPlusPlusState(linear_opt_state, opt_state, average), metrics)

  return base.Algorithm(
      init, update, evaluated=_averaged_network,
      set_learning_rate=_with_learning_rate if hparams["auto_lr"] else None)


def _full_optimizer(hparams: base.HParams) -> optax.GradientTransformation:
  """ERM++'s full optimizer, over every parameter at ``lr``.

  With the hparam ``auto_lr`` it is built at rate 1 and its output scaled
  by the learning rate, a hyperparameter of its state
  (`optax.inject_hyperparams`), which the training loop sets at its
  evaluations (the algorithm's ``set_learning_rate``) as DomainBed's
  ``set_lr`` sets the optimizer's (lines 208-233,
  ``scripts/train_autolr.py``; the decisions are
  ``experiments.lr_plateau``'s). It scales after LARS's momentum, as
  DomainBed's LARS scales it (``lib/misc.py`` line 566), where optax's
  scales each gradient by the rate of its own step; the two differ once the
  rate changes (Adam's are the same). The linear probe's stays
  ``linear_lr``, as DomainBed's ``scheduler`` wraps ``self.optimizer`` alone
  (line 178). Without ``auto_lr`` the optimizer is built as before.
  """
  if not hparams["auto_lr"]:
    return _erm_plus_plus_optimizer(hparams, hparams["lr"])
  return optax.inject_hyperparams(
      lambda learning_rate: optax.chain(
          _erm_plus_plus_optimizer(hparams, 1.0), optax.scale(learning_rate))
  )(learning_rate=hparams["lr"])


def _with_learning_rate(state: ErmPlusPlusState,
                        lr: jax.Array) -> ErmPlusPlusState:
  """ERM++'s state with its full optimizer at ``lr`` (``auto_lr``): the
  learning rate of its `optax.inject_hyperparams` state."""
  opt_state = state.opt_state
  kept = opt_state.hyperparams["learning_rate"]
  return state._replace(opt_state=opt_state._replace(
      hyperparams={**opt_state.hyperparams,
                   "learning_rate": lr.astype(kept.dtype)}))


def _linear_probe_optimizer(hparams: base.HParams
                            ) -> optax.GradientTransformation:
  """ERM++'s linear probe: its optimizer at ``linear_lr`` on the head's
  params; the featurizer's are left as they are (DomainBed's
  ``network[1]``, line 158)."""
  return optax.multi_transform(
      {"head": _erm_plus_plus_optimizer(hparams, hparams["linear_lr"]),
       "featurizer": optax.set_to_zero()},
      lambda params: jax.tree_util.tree_map_with_path(
          lambda path, _: "head" if path[0].key == "head" else "featurizer",
          params))


def _with_probe_state(full_step: tuple[Any, Any], linear_opt_state: Any
                      ) -> tuple[Any, Any, Any]:
  """The full optimizer's ``(updates, opt_state)`` with the probe's state
  kept as it is, in the order of the probe's step."""
  updates, opt_state = full_step
  return updates, linear_opt_state, opt_state


def _step_averaged_batch_norm(network: base.Network, average: Any,
                              batches: base.Batches) -> Any:
  """``average`` after the averaged network's train-mode pass over the
  pooled batch, where its BatchNorm trains (DomainBed's lines 198-200):
  its statistics move one momentum step towards that batch's."""
  averaged = network.bind(average.average["params"], average.average["stats"])
  if not base.trains_batch_norm(averaged.featurizer):
    return average
  pooled = base.merge_domains(batches)
  averaged.features(pooled["image"], rngs=pooled["key"][0])
  return average._replace(average={
      "params": average.average["params"],
      "stats": nnx.state(averaged, nnx.BatchStat)})


def _averaged_network(params: base.Params, stats: base.Stats,
                      state: ErmPlusPlusState
                      ) -> tuple[base.Params, base.Stats]:
  """What ERM++ evaluates: its moving average, or before its first update
  the network itself (DomainBed's ``deepcopy``, ``lib/misc.py`` line 54)."""
  chosen = jax.tree.map(
      lambda trained, kept: jnp.where(state.average.updates == 0, trained,
                                      kept),
      {"params": params, "stats": stats}, state.average.average)
  return chosen["params"], chosen["stats"]


def sd(network: base.Network, hparams: base.HParams, *, num_domains: int,
       seed: int) -> base.Algorithm:
  """Spectral decoupling (Pezeshki et al., NeurIPS 2021) as in DomainBed.

  DomainBed's ``SD`` (lines 1305-1328): ERM's Adam on the mean loss of one
  forward pass over all domains pooled plus ``sd_reg`` times the mean of
  the squared logits, over examples and classes (lines 1316-1322). The
  metrics are the loss without the penalty (``loss``, as DomainBed's) and
  the penalty.
  """
  del num_domains, seed

  def objective(params, stats, batches, key):
    del key
    batch = base.merge_domains(batches)
    logits, stats = network.logits(params, stats, batch["image"],
                                   batch["key"][0])
    loss = tasks.example_loss(logits, batch).mean()
    penalty = (logits**2).mean()
    return loss + hparams["sd_reg"] * penalty, (
        {"loss": loss, "penalty": penalty}, stats)

  return base.gradient_algorithm(hparams, objective)


class GroupDROState(NamedTuple):
  """GroupDRO's state.

  Attributes:
    opt_state: Adam's state.
    q: ``(num_domains,)``, the weights of the domains' losses.
  """

  opt_state: optax.OptState
  q: jax.Array


def group_dro(network: base.Network, hparams: base.HParams, *,
              num_domains: int, seed: int) -> base.Algorithm:
  """GroupDRO (Sagawa et al., ICLR 2020) as in DomainBed (lines 823-854).

  The weights ``q`` start at 1 per domain (lines 836-837). Every update
  computes each domain's mean loss from its own forward pass (lines 841-843,
  `base.domain_losses`), multiplies ``q`` by ``exp(groupdro_eta * loss)``
  with the loss held constant (line 844), normalises ``q`` to sum to 1 (line
  846), and takes an Adam step (ERM's) on ``q . losses`` (lines 848-852).

  ``q`` has one weight per minibatch of a step, in their order: per domain
  when every step draws every training domain, as DomainBed's protocol does.
  The metrics are the weighted loss (``loss``) and ``q`` after the step.
  """
  del seed
  tx = base.adam(hparams)
  eta = hparams["groupdro_eta"]

  def objective(params, stats, batches, q):
    losses, stats = base.domain_losses(network, params, stats, batches)
    q = q * jnp.exp(eta * jax.lax.stop_gradient(losses))
    q = q / q.sum()
    loss = jnp.dot(losses, q)
    return loss, (q, stats, {"loss": loss, "q": q})

  def update(params, stats, state, batches, key):
    batches = base.with_example_keys(batches, key)
    grads, (q, stats, metrics) = jax.grad(objective, has_aux=True)(
        params, stats, batches, state.q)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    return (optax.apply_updates(params, updates), stats,
            GroupDROState(opt_state, q), metrics)

  return base.Algorithm(
      lambda params: GroupDROState(
          tx.init(params), jnp.ones(num_domains, base.model_dtype(params))),
      update)


def meta_pairs(
    key: jax.Array, num_domains: int, n_meta_test: int, rule: str
) -> tuple[jax.Array, jax.Array]:
  """MLDG's (meta-train, meta-test) pairs of domains for one update.

  Both rules put the domains in a random order ``perm`` first:

  * ``"meta_test_split"``, DomainBed's ``split_meta_train_test`` at
    b93c22a1 (``lib/misc.py`` lines 196-210): the last ``n_meta_test``
    domains of ``perm`` are meta-test, and the others, in order, are paired
    with them cyclically; ``num_domains - n_meta_test`` pairs.
  * ``"random_pairs"``, ``random_pairs_of_minibatches`` (``lib/misc.py``
    lines 180-194), which DomainBed's MLDG used before commit 960f6a2
    (April 2022): every domain of ``perm`` with the next one, cyclically;
    ``num_domains`` pairs.

  Args:
    key: the update's pairing key.
    num_domains: the number of training domains.
    n_meta_test: meta-test domains of ``"meta_test_split"``.
    rule: one of `MLDG_PAIRS`.

  Returns:
    ``(meta_train, meta_test)`` domain indices, one entry per pair.
  """
  perm = jax.random.permutation(key, num_domains)
  if rule == "random_pairs":
    return perm, jnp.roll(perm, -1)
  num_train = num_domains - n_meta_test
  return perm[:num_train], perm[num_train:][jnp.arange(num_train)
                                            % n_meta_test]


def mldg(network: base.Network, hparams: base.HParams, *, num_domains: int,
         seed: int) -> base.Algorithm:
  """First-order MLDG (Li et al., AAAI 2018) as in DomainBed (lines 857-939).

  For every pair ``(i, j)`` of `meta_pairs` (line 893; ``mldg_pairs`` picks
  the rule, ``n_meta_test`` its meta-test count), from the current params
  ``theta``:

  * ``G_i``, the gradient of domain ``i``'s loss at ``theta`` (lines
    903-906);
  * one step of a fresh Adam at ``lr`` with ``weight_decay`` (lines
    895-907), which moves every parameter by ``lr * g / (|g| + eps)``, ``g =
    G_i + weight_decay * theta``: about ``lr`` each, since a first Adam
    step is normalised;
  * ``G_j``, the gradient of domain ``j``'s loss at those inner params
    (lines 920-922), held as a gradient at ``theta``: first order, no
    second derivatives.

  The update is ERM's Adam step on ``sum over pairs of (G_i + mldg_beta *
  G_j) / num_domains`` (lines 911-914, 927-930, 937). The ``loss`` metric is
  ``sum of (L_i + mldg_beta * L_j) / num_domains`` (lines 917, 925, 935).
  The inner passes are of DomainBed's throw-away copies of the network (line
  895), so trained BatchNorm statistics stay as they were.

  The pairs come from the update's key: ``pairs_key`` of
  ``data_key, pairs_key = jax.random.split(key)``.

  Raises:
    ValueError: ``mldg_pairs`` is unknown, or ``"meta_test_split"`` leaves no
      meta-train domain (``n_meta_test >= num_domains``; DomainBed would
      then step on a zero gradient forever).
  """
  del seed
  rule, n_meta_test, beta = (hparams["mldg_pairs"], hparams["n_meta_test"],
                             hparams["mldg_beta"])
  if rule not in MLDG_PAIRS:
    raise ValueError(f"mldg_pairs must be one of {MLDG_PAIRS}, got {rule!r}.")
  if rule == "meta_test_split" and n_meta_test >= num_domains:
    raise ValueError(
        f"MLDG with n_meta_test = {n_meta_test} and {num_domains} training "
        "domains has no meta-train domain: set hparam n_meta_test below "
        f"{num_domains}, or mldg_pairs to 'random_pairs'.")
  # The outer Adam, and each pair's fresh inner one.
  tx = base.adam(hparams)
  loss_and_grad = jax.value_and_grad(base.batch_loss(network), has_aux=True)

  def update(params, stats, state, batches, key):
    data_key, pairs_key = jax.random.split(key)
    batches = base.with_example_keys(batches, data_key)

    def add_pair(totals, pair):
      grads, objective = totals
      domain = lambda d: jax.tree.map(lambda x: x[d], batches)
      (loss_i, _), grads_i = loss_and_grad(params, domain(pair[0]), stats)
      step, _ = tx.update(grads_i, tx.init(params), params)
      inner_params = optax.apply_updates(params, step)
      (loss_j, _), grads_j = loss_and_grad(inner_params, domain(pair[1]),
                                           stats)
      grads = jax.tree.map(lambda g, g_i, g_j: g + (g_i + beta * g_j),
                           grads, grads_i, grads_j)
      return (grads, objective + loss_i + beta * loss_j), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    # Unrolled, as `base.domain_losses` is: at most num_domains pairs.
    (grads, objective), _ = jax.lax.scan(
        add_pair, (zeros, jnp.zeros((), base.model_dtype(params))),
        meta_pairs(pairs_key, num_domains, n_meta_test, rule), unroll=True)
    grads = jax.tree.map(lambda g: g / num_domains, grads)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), stats, state,
            {"loss": objective / num_domains})

  return base.Algorithm(tx.init, update)
