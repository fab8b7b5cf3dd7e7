"""``--averaging``: its choices, each one's knobs, and their checks.

A run averages its weights along the way with ``--averaging ema|sma|swad``
(`experiments.averaging`; ``experiments.training.weight_averaging`` runs it
in the loop). Each averaging has knobs, flags that it alone reads, with the
defaults of its source (timm's usual EMA decay, DomainBed's SMA start,
khanrc/swad's ``LossValley`` defaults). They are flags, not hparams:
DomainBed's random search draws none of them (swad fixes its own), and an
hparam would enter every run's hparams.

The fields were added after runs were committed: they are in a run's
identity and records only where it averages (``config.Config.record_args``),
so that every run without averaging keeps the identity and records it had.
This module reads a config's fields by name and imports no JAX, so that a
finished run's result is printed without it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from experiments import errors
from experiments import loss_valley

# Each choice's knobs, with their defaults.
KNOBS = {
    "none": {},
    "ema": {"ema_decay": 0.999},
    "sma": {"sma_start_iter": 600},
    "swad": {"swad_n_converge": 3, "swad_n_tolerance": 6,
             "swad_tolerance_ratio": 0.3},
}
# The config's fields that --averaging adds.
FIELDS = ("averaging", *(knob for knobs in KNOBS.values() for knob in knobs))
# Between an algorithm and its weight averaging in a `method`'s name.
JOINT = " + "


def method(args: Mapping[str, Any]) -> str:
  """What a run of these ``args`` is reported and compared as: its
  algorithm, and its weight averaging where it has one.

  >>> method({"algorithm": "ERM", "averaging": "swad"})
  'ERM + SWAD'
  >>> method({"algorithm": "ERM"})
  'ERM'
  """
  averaging = args.get("averaging", "none")
  return args["algorithm"] + ("" if averaging == "none"
                              else JOINT + averaging.upper())

def resolve(config: Any) -> Any:
  """``config`` (a ``config.Config``) with the knobs of its
  ``--averaging`` filled in, checked.

  Raises:
    errors.UsageError: an unknown averaging, a knob of another averaging
      (or of none), a knob out of its range, or averaging for ERM++, which
      averages its own weights.
  """
  averaging = config.averaging
  if averaging not in KNOBS:
    raise errors.UsageError(
        f"--averaging {averaging!r} is none of {', '.join(KNOBS)}.")
  knobs = KNOBS[averaging]
  for name in FIELDS[1:]:
    if getattr(config, name) is not None and name not in knobs:
      raise errors.UsageError(
          f"--{name} is a knob of --averaging {name.split('_')[0]}, and this "
          f"run's --averaging is {averaging}: drop it, or pass "
          f"--averaging {name.split('_')[0]}.")
  if averaging != "none" and config.algorithm == "ERMPlusPlus":
    raise errors.UsageError(
        f"--averaging {averaging}: ERMPlusPlus averages its weights "
        "itself (its SMA, which it evaluates); averaging them again has no "
        "reference. Pass --averaging none, or another --algorithm (ERM with "
        "--averaging sma is ERM with ERM++'s average).")
  config = dataclasses.replace(config, **{
      name: default if getattr(config, name) is None else getattr(config, name)
      for name, default in knobs.items()})
  # The ranges `experiments.averaging` accepts, checked here, before
  # anything is built.
  if averaging == "ema" and not 0 <= config.ema_decay < 1:
    raise errors.UsageError(
        f"--ema_decay must be in [0, 1), got {config.ema_decay}.")
  if averaging == "sma" and config.sma_start_iter < 1:
    raise errors.UsageError("--sma_start_iter counts updates from 1, so it "
                            f"must be at least 1, got {config.sma_start_iter}.")
  if averaging == "sma" and config.steps < config.sma_start_iter:
    # Not an error (a short trial run is fine), but its "average" is only
    # the trained weights, which the final line would show twice unexplained.
    print(f"Warning: --averaging sma starts at update {config.sma_start_iter}"
          f" (--sma_start_iter), after this run's {config.steps} steps: its "
          "average is the trained weights.", file=sys.stderr)
  if averaging == "swad":
    try:
      loss_valley.valley_init(valley_config(config))
    except ValueError as e:
      raise errors.UsageError(f"--averaging swad: {e}") from None
  return config


def valley_config(config: Any) -> loss_valley.ValleyConfig:
  """The valley of a resolved ``--averaging swad`` config's knobs."""
  return loss_valley.ValleyConfig(config.swad_n_converge,
                                  config.swad_n_tolerance,
                                  config.swad_tolerance_ratio)
