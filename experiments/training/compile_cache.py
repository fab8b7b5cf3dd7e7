"""JAX's persistent compilation cache, as a run keeps its programs there.

Where the cache is (``--compile_cache_dir``) is resolved and checked with
the run (``experiments.train.checked_compile_cache``), before JAX is
imported; this module points JAX at it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

# A user's own threshold for the programs the compilation cache keeps.
COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def use_compile_cache(path: Path | None) -> None:
  """Keeps compiled programs in ``path`` (JAX's persistent compilation
  cache), for later runs of the same shape to load; None: none kept.

  Every program is kept, however quick it was to compile, unless
  ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise: JAX's
  default keeps only those of a second or more, but the model's eager
  initialisation compiles one small program per initializer and shape
  (0.3-0.7 s each on a CPU), which together can outlast the step's compile.
  """
  jax.config.update("jax_enable_compilation_cache", path is not None)
  if path is not None:
    jax.config.update("jax_compilation_cache_dir", str(path))
    if COMPILE_TIME_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
