"""DomainBed-style hyperparameters, answered: an algorithm's defaults on a
dataset, its random draws, the check of overrides and the table that
`--list_hparams` prints.

The hyperparameters are declared in ``search_space``'s terms, by the blocks
of ``experiments/catalog.py`` (see ``search_space`` for their order). Each
hyperparameter draws from its own random stream, seeded by the seeds and its
name, so adding a hyperparameter never changes the draws of the others.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from experiments import catalog
from experiments import entries
from experiments import search_space


def _entries(
    algorithm: str, dataset: str
) -> tuple[entries.AlgorithmEntry, entries.DatasetEntry]:
  """The catalog's entries of ``algorithm`` and ``dataset``."""
  return catalog.ALGORITHMS[algorithm], catalog.DATASETS[dataset]


def _hparams(algorithm: str, dataset: str) -> dict[str, search_space.HParam]:
  """Every hyperparameter of ``algorithm`` on ``dataset``, by name."""
  entry, data = _entries(algorithm, dataset)
  if entry.variant_of:
    hp = _hparams(entry.variant_of, dataset)
    for name, value in entry.fixed_hparams.items():
      hp[name] = search_space.HParam(value, None, hp[name].allowed)
    return hp
  head = _entries(entry.family, dataset)[0] if entry.family else entry
  blocks = [head.training_hparams or search_space.domainbed_training,
            search_space.dataset_hparams, head.hparams]
  if head is not entry:
    blocks.append(entry.hparams)
  space = search_space.SearchSpace(entry, data)
  for block in blocks:
    if block is not None:
      block(space)
  return space.hparams()


def default_hparams(algorithm: str, dataset: str) -> dict[str, Any]:
  """The default hyperparameters of ``algorithm`` on ``dataset``.

  Args:
    algorithm: a name of ``catalog.ALGORITHMS``.
    dataset: a name of ``catalog.DATASETS``.

  Returns:
    A dict of hyperparameters.
  """
  return {name: hparam.default
          for name, hparam in _hparams(algorithm, dataset).items()}


def random_hparams(
    algorithm: str, dataset: str, seed: int, trial_seed: int = 0
) -> dict[str, Any]:
  """A random draw from the search space; seed 0 gives the defaults.

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.
    seed: the hparams seed; 0 returns `default_hparams`.
    trial_seed: the trial, so that every trial draws its own hyperparameters.

  Returns:
    A dict of hyperparameters.
  """
  if seed == 0:
    return default_hparams(algorithm, dataset)
  hparams = {}
  for name, hparam in _hparams(algorithm, dataset).items():
    value = hparam.draw(np.random.default_rng(
        [seed, trial_seed, zlib.crc32(name.encode())]))
    # Plain Python numbers, for JSON and for hashing as static arguments.
    hparams[name] = value.item() if isinstance(value, np.generic) else value
  return hparams


def check_hparams(
    algorithm: str, dataset: str, hparams: Mapping[str, Any]
) -> None:
  """Checks names, types and ranges of hyperparameters against the registry.

  Each is checked alone; what a run needs of several together (a batch that
  splits into its chunks and over the devices) is the run's
  (``config.Config.check_batch_split``).

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.
    hparams: hyperparameters, e.g. a draw updated with ``--hparams``.

  Raises:
    ValueError: naming the first unknown or out-of-range hyperparameter and
      what it accepts.
  """
  registry = _hparams(algorithm, dataset)
  unknown = sorted(hparams.keys() - registry.keys())
  if unknown:
    raise ValueError(f"Unknown hparams {unknown} for {algorithm} on {dataset}; "
                     f"known: {sorted(registry)}.")
  for name, value in hparams.items():
    allowed = registry[name].allowed
    if not allowed.accepts(value):
      raise ValueError(f"hparam {name!r} must be {allowed}, got {value!r}.")


def describe_hparams(algorithm: str, dataset: str) -> str:
  """A table of ``algorithm``'s hyperparameters on ``dataset``.

  Args:
    algorithm: an algorithm name.
    dataset: a dataset name.

  Returns:
    One line per hyperparameter: its name, default, random search
    distribution (``hparams_seed`` > 0) and accepted values.
  """
  rows = [("hparam", "default", "search (hparams_seed > 0)", "allowed")]
  for name, hparam in _hparams(algorithm, dataset).items():
    search = "fixed" if hparam.search is None else hparam.search.description
    rows.append((name, repr(hparam.default), search, str(hparam.allowed)))
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  return "\n".join(
      "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3]
      for row in rows)
