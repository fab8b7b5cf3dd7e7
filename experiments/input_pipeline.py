"""DomainBed's data protocol: domain splits, training and evaluation batches.

Training batches come from a Grain iterator whose batch at step ``t`` is a pure
function of ``(seed, t)``, so training resumes exactly. Save and restore the
iterator with Orbax through the handler Grain registers for it,
``grain.checkpoint.CheckpointSave`` / ``grain.checkpoint.CheckpointRestore``
(they wrap ``grain.checkpoint.CheckpointHandler``), for example next to the
train state in an ``orbax.checkpoint.CheckpointManager``::

    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(train_iter)))
    manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(train_iter)))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import numpy as np

from experiments.datasets import DomainSource, MultiDomainDataset

# Stands in for "forever": Grain map datasets need a length.
_ENDLESS = 2**62
# Keep the random streams of splitting and sampling apart for the same seed.
_SPLIT_STREAM = 0
_TRAIN_STREAM = 1

Split = tuple[np.ndarray, np.ndarray]


def split_domains(
    dataset: MultiDomainDataset, *, holdout_fraction: float = 0.2, seed: int
) -> list[Split]:
  """Splits every domain at random into a training and a validation part.

  As in DomainBed, ``int(len(domain) * holdout_fraction)`` examples of each
  domain are held out ("out" split, for validation and model selection) and
  the rest form the "in" split (training, or testing on test domains).

  Args:
    dataset: the dataset.
    holdout_fraction: the fraction of each domain held out.
    seed: seeds the splits.

  Returns:
    One ``(in_indices, out_indices)`` pair of sorted int64 arrays per domain.
  """
  if not 0.0 <= holdout_fraction < 1.0:
    raise ValueError(f"holdout_fraction must be in [0, 1): {holdout_fraction}")
  splits = []
  for i, source in enumerate(dataset.domains):
    rng = np.random.default_rng([seed, _SPLIT_STREAM, i])
    order = rng.permutation(len(source))
    num_out = int(len(source) * holdout_fraction)
    splits.append((np.sort(order[num_out:]), np.sort(order[:num_out])))
  return splits


def _gather(source: DomainSource, indices: np.ndarray) -> dict[str, np.ndarray]:
  """Stacks ``source[i]`` for ``i`` in ``indices`` into one batch."""
  items = [source[int(i)] for i in indices]
  # Every key the source gives (e.g. WILDS's "group"), in its own dtype:
  # integer classes or float regression targets.
  return {key: np.stack([item[key] for item in items]) for key in items[0]}


def make_train_iterator(
    dataset: MultiDomainDataset,
    train_domains: Sequence[int],
    splits: Sequence[Split],
    *,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    num_threads: int = 1,
    domains_per_step: int | None = None,
) -> grain.DatasetIterator:
  """An endless iterator of training batches, one per domain per step.

  Like DomainBed's infinite loaders, each step samples ``batch_size``
  examples with replacement from the "in" split of every training domain.
  The batch of step ``t`` depends only on ``(seed, t)``.

  To resume, either build the iterator with ``start_step`` set to the next
  step, or build it with the original ``start_step`` and restore its saved
  state (see the module docstring) -- not both.

  Args:
    dataset: the dataset.
    train_domains: indices of the training domains, in the order of the
      leading axis of the batches.
    splits: `split_domains`'s output for ``dataset``.
    batch_size: examples per domain per step.
    seed: seeds the sampling.
    start_step: the step of the first batch.
    num_threads: threads preparing batches ahead of time; 0 prepares each
      batch when it is requested.
    domains_per_step: if set, every step samples this many of the training
      domains (without replacement, in increasing order) and batches only
      those, as the paper's WILDS protocol samples n-hat domains per step.

  Returns:
    A Grain iterator of ``{"image": float32 (D, B, H, W, C),
    "label": (D, B), ...}`` with ``D = len(train_domains)`` (or
    ``domains_per_step``), ``B = batch_size``; ``get_state``/``set_state``
    round-trip.
  """
  if not train_domains:
    raise ValueError("train_domains is empty.")
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive: {batch_size}")
  in_indices = tuple(splits[d][0] for d in train_domains)
  for d, idx in zip(train_domains, in_indices):
    if len(idx) == 0:
      raise ValueError(f"Domain {dataset.domain_names[d]!r} has no train data.")
  sources = [dataset.domains[d] for d in train_domains]
  if domains_per_step is not None and not (
      1 <= domains_per_step <= len(sources)):
    raise ValueError(f"domains_per_step must be in [1, {len(sources)}] (the "
                     f"training domains), got {domains_per_step}.")

  def make_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
    chosen = range(len(sources))
    if domains_per_step is not None:
      chosen = np.sort(rng.choice(len(sources), domains_per_step,
                                  replace=False))
    batches = [
        _gather(sources[d], in_indices[d][rng.integers(len(in_indices[d]),
                                                       size=batch_size)])
        for d in chosen
    ]
    return {key: np.stack([b[key] for b in batches]) for key in batches[0]}

  steps = grain.MapDataset.range(start_step, start_step + _ENDLESS)
  # One element is a whole multi-domain batch, so prefetch only a few.
  read_options = grain.ReadOptions(
      num_threads=num_threads, prefetch_buffer_size=num_threads
  )
  return iter(steps.map(make_batch).to_iter_dataset(read_options))


def eval_batches(
    dataset: MultiDomainDataset,
    domain: int,
    indices: np.ndarray,
    *,
    batch_size: int = 256,
    num_threads: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
  """Yields the examples ``indices`` of one domain in order, in batches.

  The last batch is smaller when ``len(indices)`` is not a multiple of
  ``batch_size``, so every example is evaluated exactly once.

  Args:
    dataset: the dataset.
    domain: index of the domain.
    indices: example indices within that domain, e.g. a split.
    batch_size: the largest batch.
    num_threads: threads preparing batches ahead of time; 0 for none.

  Yields:
    ``{"image": float32 (b, H, W, C), "label": int32 (b,)}`` with
    ``b <= batch_size``.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive: {batch_size}")
  source = dataset.domains[domain]
  indices = np.asarray(indices)
  num_batches = -(-len(indices) // batch_size)  # Rounded up.
  batches = grain.MapDataset.range(num_batches).map(
      lambda b: _gather(source, indices[b * batch_size:(b + 1) * batch_size])
  )
  read_options = grain.ReadOptions(
      num_threads=num_threads, prefetch_buffer_size=num_threads
  )
  yield from batches.to_iter_dataset(read_options)
