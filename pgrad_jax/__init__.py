"""PGrad (principal gradients for domain generalization) for Optax."""

from pgrad_jax._src.layout import TrajectoryLayout
from pgrad_jax._src.principal import principal_gradient
from pgrad_jax._src.principal import PrincipalGradient
from pgrad_jax._src.principal import PrincipalOptions
from pgrad_jax._src.rollout import domain_schedule
from pgrad_jax._src.rollout import Rollout
from pgrad_jax._src.rollout import rollout
from pgrad_jax._src.rollout import RolloutOptions
from pgrad_jax._src.trajectory import gram
from pgrad_jax._src.transform import fish
from pgrad_jax._src.transform import FishState
from pgrad_jax._src.transform import pgrad
from pgrad_jax._src.transform import PGradState
from pgrad_jax._src.transform import with_model_state

__version__ = "0.1.0"

__all__ = (
    "domain_schedule",
    "fish",
    "FishState",
    "gram",
    "pgrad",
    "PGradState",
    "principal_gradient",
    "PrincipalGradient",
    "PrincipalOptions",
    "rollout",
    "Rollout",
    "RolloutOptions",
    "TrajectoryLayout",
    "with_model_state",
)
