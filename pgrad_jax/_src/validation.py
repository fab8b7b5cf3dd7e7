"""Checks of the options, run once where an option is built."""

import operator
import typing
from typing import Any

import jax


def positive_int(name: str, value: Any) -> int:
  """``value`` as a Python int, or an error naming ``name``.

  Accepts anything integral (``4``, ``np.int64(4)``, a concrete integer
  array); rejects booleans, floats and traced arrays.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a concrete positive integer, got a traced array: it "
        "fixes array shapes, so it must be known when the update is traced. "
        "Under optax.inject_hyperparams, pass static_args=('k', 'B').")
  try:
    number = None if isinstance(value, bool) else operator.index(value)
  except TypeError:
    number = None
  if number is None or number < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  return number


def one_of(name: str, value: Any, literal: Any) -> None:
  """Raises unless ``value`` is one of the choices of the ``Literal`` type."""
  choices = typing.get_args(literal)
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
