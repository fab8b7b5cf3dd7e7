"""PGrad (principal gradients for domain generalization) for Optax."""

from pgrad_jax._src.interleave import Interleaved
from pgrad_jax._src.principal import gram
from pgrad_jax._src.principal import Principal
from pgrad_jax._src.principal import principal_gradient
from pgrad_jax._src.rollout import Rollout
from pgrad_jax._src.rollout import rollout
from pgrad_jax._src.schedule import domain_schedule
from pgrad_jax._src.transform import fish
from pgrad_jax._src.transform import pgrad
from pgrad_jax._src.transform import PGradState

__version__ = "0.1.0"

__all__ = (
    "domain_schedule",
    "fish",
    "gram",
    "Interleaved",
    "pgrad",
    "PGradState",
    "Principal",
    "principal_gradient",
    "rollout",
    "Rollout",
)
