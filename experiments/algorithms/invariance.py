"""Invariant features, by penalties and moment matching: IRM, VREx, IB_ERM,
MMD and CORAL, as DomainBed's. The adversarial ones are in `adversarial`.

Line numbers are of DomainBed's ``domainbed/algorithms.py`` at b93c22a1
unless another file is named.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.data import tasks
from experiments.algorithms import base

# The bandwidths of MMD's Gaussian kernels (``gaussian_kernel``, line 994).
MMD_GAMMAS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)


def irm_penalty(outputs: jax.Array, labels: jax.Array) -> jax.Array:
  """IRMv1's penalty of every domain, as DomainBed computes it.

  The penalty is the squared gradient of the domain's risk with respect to a
  scalar multiplier ``s`` of the outputs, at ``s = 1``. DomainBed estimates the
  square without bias as the product of the gradients of two halves of the
  batch: the even and the odd examples (``_irm_penalty``, lines 590-598).

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
    # The multiplier in the outputs' dtype: a Python 1.0 would be JAX's
    # default dtype, float64 where enabled.
    scale = jnp.ones((), outputs.dtype)
    return (grad(scale, outputs[::2], labels[::2])
            * grad(scale, outputs[1::2], labels[1::2]))

  return jax.vmap(domain_penalty)(outputs, labels)


def _annealed_penalty(
    hparams: base.HParams,
    terms: Callable[[base.Params, base.Stats, base.Batches],
                    tuple[jax.Array, jax.Array, base.Stats, base.Metrics]],
    *,
    weight: float,
    warmup_weight: float,
    anneal: int,
) -> base.Algorithm:
  """Adam on a risk plus a penalty whose weight jumps at step ``anneal``.

  DomainBed's IRM, VREx and IB_ERM share this update: the penalty weighs
  ``warmup_weight`` before update number ``anneal`` (counted from 0) and
  ``weight`` from it on; at that step Adam restarts
  (`base.restart_at_anneal`), then steps, then the count goes up.

  Args:
    hparams: the run's hparams (ERM's Adam: ``lr``, ``weight_decay``).
    terms: ``terms(params, stats, batches) -> (risk, penalty, stats,
      metrics)``, on batches with example keys; its metrics join ``loss``
      (the objective), ``nll`` (the risk) and ``penalty``, and override them.
    weight: the penalty's weight from step ``anneal`` on.
    warmup_weight: its weight before.
    anneal: the step its weight jumps, and Adam restarts.
  """
  tx = base.adam(hparams)

  def objective(params, stats, batches, count):
    risk, penalty, stats, metrics = terms(params, stats, batches)
    objective = risk + jnp.where(count >= anneal, weight,
                                 warmup_weight) * penalty
    return objective, (stats, {"loss": objective, "nll": risk,
                               "penalty": penalty, **metrics})

  def update(params, stats, state, batches, key):
    batches = base.with_example_keys(batches, key)
    grads, (stats, metrics) = jax.grad(objective, has_aux=True)(
        params, stats, batches, state.count)
    opt_state = base.restart_at_anneal(tx, params, state.opt_state,
                                       state.count, anneal)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, stats, base.AnnealState(opt_state, state.count + 1), metrics

  return base.Algorithm(
      lambda params: base.AnnealState(tx.init(params),
                                      jnp.zeros((), jnp.int32)),
      update)


def _pooled_outputs(
    network: base.Network, params: base.Params, stats: base.Stats,
    batches: base.Batches,
) -> tuple[jax.Array, jax.Array, base.Stats]:
  """One forward pass over all domains pooled, as DomainBed's ``all_x``.

  Returns:
    ``(features (n, b, F), outputs (n, b, C), stats after the pass)``.
  """
  n, b = batches["label"].shape
  batch = base.merge_domains(batches)
  model = network.bind(params, stats)
  features = model.features(batch["image"], rngs=batch["key"][0])
  outputs = model.head(features)
  return (features.reshape(n, b, -1), outputs.reshape(n, b, -1),
          nnx.state(model, nnx.BatchStat))


def _domain_risks(outputs: jax.Array, labels: jax.Array) -> jax.Array:
  """``(n,)``: every domain's mean task loss of its ``(n, b, C)`` outputs."""
  n, b = labels.shape
  return tasks.example_loss(outputs.reshape(n * b, -1),
                            {"label": labels.reshape(-1)}).reshape(n, b).mean(1)


def irm(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """IRMv1 (Arjovsky et al., 2019) as in DomainBed (lines 581-634).

  The objective is the mean over domains of the risk plus ``irm_lambda``
  times the mean of `irm_penalty` (lines 608-618), of one forward pass over
  all domains (line 609). Before step ``irm_penalty_anneal_iters`` the
  penalty's weight is 1 (DomainBed's warm-up, not 0; lines 602-604); at that
  step it becomes ``irm_lambda`` and Adam restarts (`_annealed_penalty`,
  lines 620-626).
  """
  del num_domains, seed

  def terms(params, stats, batches):
    _, outputs, stats = _pooled_outputs(network, params, stats, batches)
    risk = _domain_risks(outputs, batches["label"]).mean()
    return risk, irm_penalty(outputs, batches["label"]).mean(), stats, {}

  return _annealed_penalty(hparams, terms, weight=hparams["irm_lambda"],
                           warmup_weight=1.0,
                           anneal=hparams["irm_penalty_anneal_iters"])


def vrex(network: base.Network, hparams: base.HParams, *, num_domains: int,
         seed: int) -> base.Algorithm:
  """V-REx (Krueger et al., ICML 2021) as in DomainBed (lines 745-788).

  The objective is the mean of the domains' risks plus ``vrex_lambda``
  times their variance (the biased one, ``((losses - mean) ** 2).mean()``,
  lines 770-772), the risks of one forward pass over all domains (lines
  760-768). Before step ``vrex_penalty_anneal_iters`` the variance weighs 1,
  as IRM's warm-up (lines 753-756); at that step its weight becomes
  ``vrex_lambda`` and Adam restarts (lines 774-780; `_annealed_penalty`).

  As DomainBed's, the ``nll`` metric is the last domain's risk (its loop
  overwrites ``nll``, line 767, and returns it, line 787), not their
  mean. DomainBed gathers the risks in a ``torch.zeros`` buffer of
  PyTorch's default float32 (line 763); here they stay in the model's
  dtype, which is float32 in DomainBed's runs.
  """
  del num_domains, seed

  def terms(params, stats, batches):
    _, outputs, stats = _pooled_outputs(network, params, stats, batches)
    risks = _domain_risks(outputs, batches["label"])
    mean = risks.mean()
    return mean, ((risks - mean) ** 2).mean(), stats, {"nll": risks[-1]}

  return _annealed_penalty(hparams, terms, weight=hparams["vrex_lambda"],
                           warmup_weight=1.0,
                           anneal=hparams["vrex_penalty_anneal_iters"])


def ib_erm(network: base.Network, hparams: base.HParams, *, num_domains: int,
           seed: int) -> base.Algorithm:
  """IB-ERM (Ahuja et al., NeurIPS 2021) as in DomainBed (lines 1869-1924).

  The objective is the mean of the domains' risks plus ``ib_lambda`` times
  the information bottleneck penalty: every domain's featurizer outputs'
  variance over its batch (unbiased, PyTorch's ``var(dim=0)``), averaged
  over the features (line 1900), then over the domains (line 1903), all
  from one forward pass over all domains (lines 1891-1893). Before step
  ``ib_penalty_anneal_iters`` the penalty weighs 0 (lines 1884-1886; IRM's
  and VREx's warm-ups weigh 1); at that step its weight becomes
  ``ib_lambda`` and Adam restarts (lines 1909-1915; `_annealed_penalty`).
  The penalty's metric is ``penalty`` (DomainBed's ``IB_penalty``), as
  IRM's and VREx's.
  """
  del num_domains, seed

  def terms(params, stats, batches):
    features, outputs, stats = _pooled_outputs(network, params, stats,
                                               batches)
    risk = _domain_risks(outputs, batches["label"]).mean()
    penalty = features.var(axis=1, ddof=1).mean(axis=-1).mean()
    return risk, penalty, stats, {}

  return _annealed_penalty(hparams, terms, weight=hparams["ib_lambda"],
                           warmup_weight=0.0,
                           anneal=hparams["ib_penalty_anneal_iters"])


def _mean_over_domain_pairs(
    features: jax.Array,
    pair_penalties: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
  """A penalty of features averaged over the pairs of domains ``i < j``.

  DomainBed adds up the penalty of every pair and divides the sum by the
  ``n (n - 1) / 2`` pairs (lines 1032-1039); with one domain there is no
  pair, and the penalty is 0.

  Args:
    features: ``(n, b, F)``, every domain's batch of features.
    pair_penalties: ``pair_penalties(features, first, second)`` is the
      penalty of every pair, given the indices of its domains ``first <
      second`` (as `jax.numpy.triu_indices` lists them).

  Returns:
    The scalar mean of ``pair_penalties``; 0 with one domain.
  """
  n = features.shape[0]
  if n < 2:
    return jnp.zeros((), features.dtype)
  first, second = jnp.triu_indices(n, k=1)
  return pair_penalties(features, first, second).mean()


def _coral_pair_penalties(features: jax.Array, first: jax.Array,
                          second: jax.Array) -> jax.Array:
  b = features.shape[1]
  means = features.mean(axis=1)
  centered = features - means[:, None]
  covariances = jnp.einsum("nbi,nbj->nij", centered, centered) / (b - 1)
  mean_gaps = ((means[first] - means[second]) ** 2).mean(axis=-1)
  covariance_gaps = ((covariances[first] - covariances[second]) ** 2).mean(
      axis=(-2, -1))
  return mean_gaps + covariance_gaps


def coral_penalty(features: jax.Array) -> jax.Array:
  """DomainBed's CORAL penalty: feature mean and covariance gaps of domains.

  For every pair of domains ``i < j``, the mean over features of the squared
  difference of their feature means, plus the mean over feature pairs of the
  squared difference of their covariances (unbiased, ``1 / (b - 1)``),
  averaged over the pairs (``mmd``'s ``mean_cov`` branch, lines 1011-1021;
  the average, `_mean_over_domain_pairs`).

  Args:
    features: ``(n, b, F)``, every domain's batch of features.

  Returns:
    The scalar penalty; 0 with one domain.
  """
  return _mean_over_domain_pairs(features, _coral_pair_penalties)


def _mmd_pair_penalties(features: jax.Array, first: jax.Array,
                        second: jax.Array) -> jax.Array:
  n, b, _ = features.shape
  norms = (features**2).sum(axis=-1)
  # Every pair of domains (i, j): (n, n, b, b) squared distances.
  distances = (norms[:, None, :, None] + norms[None, :, None, :]
               - 2 * jnp.einsum("ibf,jcf->ijbc", features, features))
  itself = jnp.eye(n, dtype=bool)[:, :, None, None] & jnp.eye(b, dtype=bool)
  distances = jnp.maximum(jnp.where(itself, 0.0, distances), 1e-30)
  kernel_means = sum(jnp.exp(-gamma * distances)
                     for gamma in MMD_GAMMAS).mean(axis=(-2, -1))
  return (kernel_means[first, first] + kernel_means[second, second]
          - 2 * kernel_means[first, second])


def mmd_penalty(features: jax.Array) -> jax.Array:
  """DomainBed's MMD penalty: Gaussian-kernel MMD of every pair of domains.

  The kernel sums ``exp(-gamma * d)`` over the bandwidths `MMD_GAMMAS`
  (``gaussian_kernel``, lines 994-1002), ``d`` the squared distance computed
  as DomainBed's ``my_cdist`` does, ``|x|^2 + |y|^2 - 2 x.y`` clamped below
  at 1e-30 (lines 986-992). A pair's MMD is ``mean K(x, x) + mean K(y, y) -
  2 mean K(x, y)`` (lines 1004-1009), averaged over the pairs ``i < j``
  (`_mean_over_domain_pairs`).

  An example's distance to itself is set to its exact 0 (then clamped):
  the expansion cancels there, leaving float32 rounding of ``1e-7 |x|^2``,
  which the ``gamma = 1000`` kernel magnifies to 1e-4 of the penalty.

  Args:
    features: ``(n, b, F)``, every domain's batch of features.

  Returns:
    The scalar penalty; 0 with one domain.
  """
  return _mean_over_domain_pairs(features, _mmd_pair_penalties)


def _feature_matching(
    network: base.Network,
    hparams: base.HParams,
    penalty_fn: Callable[[jax.Array], jax.Array],
) -> base.Algorithm:
  """Adam on the mean risk plus ``mmd_gamma`` times a penalty of features.

  DomainBed's ``AbstractMMD.update`` (lines 1023-1048): the mean over domains
  of the risk, plus ``mmd_gamma`` times ``penalty_fn`` of every domain's
  featurizer outputs. DomainBed runs the featurizer per domain (line 1028),
  as `base.domain_features` does where BatchNorm trains; elsewhere one pass
  over the pooled domains gives the same outputs.
  """

  def objective(params, stats, batches, key):
    del key
    batch = base.merge_domains(batches)
    model = network.bind(params, stats)
    features = base.domain_features(model, batches)
    nll = tasks.example_loss(
        model.head(features.reshape(batch["label"].shape[0], -1)),
        batch).mean()
    penalty = penalty_fn(features)
    objective = nll + hparams["mmd_gamma"] * penalty
    return objective, ({"loss": objective, "nll": nll, "penalty": penalty},
                       nnx.state(model, nnx.BatchStat))

  return base.gradient_algorithm(hparams, objective)


def coral(network: base.Network, hparams: base.HParams, *, num_domains: int,
          seed: int) -> base.Algorithm:
  """Deep CORAL (Sun & Saenko, 2016) as in DomainBed (lines 1061-1068).

  Adam on the mean risk of the domains plus ``mmd_gamma`` times
  `coral_penalty` of the featurizer's outputs (`_feature_matching`).
  """
  del num_domains, seed
  return _feature_matching(network, hparams, coral_penalty)


def mmd(network: base.Network, hparams: base.HParams, *, num_domains: int,
        seed: int) -> base.Algorithm:
  """MMD (Li et al., CVPR 2018) as in DomainBed (lines 1051-1058).

  Adam on the mean risk of the domains plus ``mmd_gamma`` times
  `mmd_penalty` of the featurizer's outputs (`_feature_matching`).
  """
  del num_domains, seed
  return _feature_matching(network, hparams, mmd_penalty)
