"""Principal gradients: PGrad and its variants (PGrad-B, PGrad-BMix, ...).

DomainBed has no PGrad; the hparams follow the paper (appendix A.10).
"""

from __future__ import annotations

import optax

import pgrad_jax
from experiments import catalog
from experiments.algorithms import base


def pgrad(
    network: base.Network,
    hparams: catalog.PGradHParams,
    *,
    num_domains: int,
    seed: int,
    order: str = "random",
    parallel: bool = False,
    mix: bool = False,
) -> base.Algorithm:
  """PGrad and its variants: ``pgrad_jax.pgrad`` (Adam inside) + SGD outside.

  Args:
    network: the model.
    hparams: its hparams, typed (the catalog makes them from the run's).
    num_domains: the number of training domains.
    seed: seeds the random domain order.
    order: ``"random"`` (PGrad) or ``"fixed"`` (PGrad-F).
    parallel: every inner step starts from the same point (PGradParallel).
    mix: MixUp inside every chunk's loss (PGrad-BMix), by
      ``hparams.mixup_alpha``.

  Returns:
    The algorithm.
  """
  k = hparams.k
  if k == "all":
    # A trajectory of n * B steps has at most n * B non-zero components.
    k = num_domains * hparams.B
  elif not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k must be a positive int or 'all', got {k!r}.")
  rollout = pgrad_jax.pgrad(
      optax.adam(hparams.lr), k=k, B=hparams.B, order=order,
      principal=pgrad_jax.PrincipalOptions(components=hparams.components),
      parallel=parallel, num_domains=num_domains, seed=seed)
  # The paper's WILDS protocol scales the outer step by the rollout's length:
  # gamma = c / n-hat, with c = outer_lr.
  outer_lr = hparams.outer_lr / (
      num_domains if hparams.outer_lr_per_domain else 1)
  return base.rollout_algorithm(
      network, rollout, outer_lr, outer_weight_decay=hparams.weight_decay,
      mix=(hparams.B, hparams.mixup_alpha) if mix else None)
