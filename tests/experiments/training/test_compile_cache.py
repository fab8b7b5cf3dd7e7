"""Tests for experiments/training/compile_cache.py: what JAX's persistent
compilation cache keeps. Where it is, and whether it can be written, is
resolved with the run (tests/experiments/test_train.py)."""

import jax
import pytest

from experiments.training import compile_cache


@pytest.mark.parametrize("user_threshold", [None, "2.5"])
def test_the_compile_cache_keeps_every_program_unless_the_user_says(
    monkeypatch, tmp_path, user_threshold):
  # The model's initialisation compiles many programs of under a second
  # each, which JAX's default threshold (1 s) would compile again every run.
  name = "jax_persistent_cache_min_compile_time_secs"
  options = (name, "jax_enable_compilation_cache",
             "jax_compilation_cache_dir")
  before = {option: getattr(jax.config, option) for option in options}
  try:
    if user_threshold is None:
      monkeypatch.delenv(compile_cache.COMPILE_TIME_ENV, raising=False)
    else:
      # JAX reads the variable when it starts; a run started so has it.
      monkeypatch.setenv(compile_cache.COMPILE_TIME_ENV, user_threshold)
      jax.config.update(name, float(user_threshold))
    compile_cache.use_compile_cache(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert getattr(jax.config, name) == (
        0 if user_threshold is None else float(user_threshold))
  finally:
    for option, value in before.items():
      jax.config.update(option, value)
