"""DomainBed's data protocol: domain splits, training and evaluation batches.

Training batches come from a Grain iterator whose batch at step ``t`` is a pure
function of ``(seed, t)``, so training resumes exactly. A per-example
``transform`` (`Transform`, e.g. DomainBed's augmentation) draws from a
generator seeded by the seed, the step and the example, so it keeps that
property. ``num_workers`` worker processes build the training batches, and
as many threads read the examples of the evaluation batches, while the
caller trains or evaluates on the previous ones; the batches do not depend
on how many. Save and restore the
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

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grain
import numpy as np
from absl import flags

from experiments.data import datasets

# Stands in for "forever": Grain map datasets need a length.
_ENDLESS = 2**62
# Keep the random streams of splitting and sampling apart for the same seed.
_SPLIT_STREAM = 0
_TRAIN_STREAM = 1
_TRANSFORM_STREAM = 2
_EVAL_TRANSFORM_STREAM = 3
_VALIDATION_ORDER_STREAM = 4
# prctl's option to signal a process when its parent ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
# Examples a thread reads at a time: short runs keep the threads equally
# busy whatever each example costs.
_RUN = 4

# ``transform(example, rng) -> example``: a per-example transform, e.g. a
# random augmentation, drawing from ``rng``.
Transform = Callable[[datasets.Element, np.random.Generator], datasets.Element]

Split = tuple[np.ndarray, np.ndarray]


def split_domains(
    dataset: datasets.MultiDomainDataset, *, holdout_fraction: float = 0.2,
    seed: int
) -> list[Split]:
  """Splits every domain at random into a training and a validation part.

  As in DomainBed, ``int(len(domain) * holdout_fraction)`` examples of each
  domain (`datasets.held_out_size`) are held out ("out" split, for
  validation and model selection) and the rest form the "in" split
  (training, or testing on test domains).

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
    num_out = datasets.held_out_size(len(source), holdout_fraction)
    splits.append((np.sort(order[num_out:]), np.sort(order[:num_out])))
  return splits


class _Examples:
  """Reads (and transforms) examples in parallel threads, for one batch.

  The examples of a batch are cut into runs of `_RUN` that ``num_workers``
  threads take in turn. Decoding and augmenting photos runs mostly outside
  the GIL (Pillow's decoders, resampling and conversions, NumPy's
  operations), so the threads use as many cores. With one worker or none,
  the calling thread reads them.
  """

  def __init__(self, num_workers: int):
    if num_workers < 0:
      raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
    # The pool's threads start with the first batch. Without a pool the
    # reader can be pickled, e.g. into Grain's worker processes.
    self._pool = futures.ThreadPoolExecutor(
        num_workers, thread_name_prefix="examples") if num_workers > 1 else None

  def map(self, read: Callable[[int], datasets.Element],
          count: int) -> list[datasets.Element]:
    """``[read(0), ..., read(count - 1)]``, in that order."""
    if self._pool is None or count <= 1:
      return [read(k) for k in range(count)]
    parts = self._pool.map(
        lambda start: [read(k) for k in range(start, min(start + _RUN, count))],
        range(0, count, _RUN))
    return [example for part in parts for example in part]


def _read_ahead(num_workers: int) -> grain.ReadOptions:
  """Batches prepared ahead of the caller: none without workers, else up to
  two at a time, so that ``num_workers`` threads read one batch's examples
  while the other is stacked."""
  ahead = min(num_workers, 2)
  return grain.ReadOptions(num_threads=ahead, prefetch_buffer_size=ahead)


def _stack(examples: Sequence[datasets.Element]) -> dict[str, np.ndarray]:
  # Every key the source gives (e.g. WILDS's "group"), in its own dtype:
  # integer classes or float regression targets.
  return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def _in_memory(dataset: datasets.MultiDomainDataset) -> bool:
  """Whether every domain is arrays in memory (`datasets.ArraySource`)."""
  return all(isinstance(d, datasets.ArraySource) for d in dataset.domains)


def uses_workers(dataset: datasets.MultiDomainDataset,
                 transformed: bool) -> bool:
  """Whether `make_train_iterator` builds ``dataset``'s batches in worker
  processes (given ``num_workers`` > 0): not for arrays in memory read as
  they are (the digits), which cost microseconds."""
  return transformed or not _in_memory(dataset)


def train_batches(
    dataset: datasets.MultiDomainDataset,
    train_domains: Sequence[int],
    splits: Sequence[Split],
    *,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    domains_per_step: int | None = None,
    transform: Transform | None = None,
) -> grain.MapDataset:
  """The training batches of every step, one per domain per step.

  Like DomainBed's infinite loaders, each step samples ``batch_size``
  examples with replacement from the "in" split of every training domain.
  The batch of step ``t`` depends only on ``(seed, t)``: not on where the
  dataset starts, nor on who builds it (`make_train_iterator`'s workers).

  Args:
    dataset: the dataset.
    train_domains: indices of the training domains, in the order of the
      leading axis of the batches.
    splits: `split_domains`'s output for ``dataset``.
    batch_size: examples per domain per step.
    seed: seeds the sampling and the transform's draws.
    start_step: the step of the first batch.
    domains_per_step: if set, every step samples this many of the training
      domains (without replacement, in increasing order) and batches only
      those, as the paper's WILDS protocol samples n-hat domains per step.
    transform: if set, ``transform(example, rng)`` maps every example read
      (``dataset.domains[d][i]``) to the one batched, e.g. a random
      augmentation; ``rng`` is a NumPy Generator seeded by ``(seed, step,
      domain, position in the domain's batch)``.

  Returns:
    An endless Grain map dataset whose element ``k`` is the batch of step
    ``start_step + k``: ``{"image": (D, B, H, W, C), "label": (D, B), ...}``
    with ``D = len(train_domains)`` (or ``domains_per_step``), ``B =
    batch_size``; the images are float32, or the transform's dtype (uint8
    for augmented photos, which the training step normalises).
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
    # (domain, slot, index) of every example, domain by domain.
    drawn = [(d, slot, int(index)) for d in chosen
             for slot, index in enumerate(
                 in_indices[d][rng.integers(len(in_indices[d]),
                                            size=batch_size)])]

    def read(k: int) -> datasets.Element:
      d, slot, index = drawn[k]
      example = sources[d][index]
      if transform is None:
        return example
      return transform(example, np.random.default_rng(
          [seed, _TRANSFORM_STREAM, step, train_domains[d], slot]))

    batch = _stack([read(k) for k in range(len(drawn))])
    return {key: value.reshape((len(chosen), batch_size) + value.shape[1:])
            for key, value in batch.items()}

  steps = grain.MapDataset.range(start_step, start_step + _ENDLESS)
  return steps.map(make_batch)


def make_train_iterator(
    dataset: datasets.MultiDomainDataset,
    train_domains: Sequence[int],
    splits: Sequence[Split],
    *,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    num_workers: int = 1,
    domains_per_step: int | None = None,
    transform: Transform | None = None,
) -> grain.DatasetIterator:
  """An endless iterator of `train_batches`, read ahead of the caller.

  The arguments are `train_batches`'s. With ``num_workers`` > 0 the next
  batches are built while the caller trains on this one: by ``num_workers``
  Grain worker processes, each building whole batches, where examples are
  decoded or transformed (photos, WILDS); by a thread where they are arrays
  in memory read as they are (the digits), which cost microseconds. With 0,
  every batch is built when it is requested.

  To resume, either build the iterator with ``start_step`` set to the next
  step, or build it with the original ``start_step`` and restore its saved
  state (see the module docstring) -- not both.

  Returns:
    A Grain iterator of `train_batches`' batches; ``get_state`` and
    ``set_state`` round-trip, whatever ``num_workers``: the state is the
    number of batches returned.
  """
  batches = train_batches(
      dataset, train_domains, splits, batch_size=batch_size, seed=seed,
      start_step=start_step, domains_per_step=domains_per_step,
      transform=transform)
  if num_workers == 0 or not uses_workers(dataset, transform is not None):
    return iter(batches.to_iter_dataset(_read_ahead(min(num_workers, 1))))
  return _WorkerBatches(batches, num_workers)


def _init_worker(parent: int, worker_index: int, worker_count: int) -> None:
  """Leaves a worker process's end to its parent, the process ``parent``.

  Ctrl-C interrupts the training run, which stops its workers (Grain's
  ``close``) once it has checkpointed, and so does SIGTERM, which a
  scheduler such as SLURM sends to every process of a job: the workers
  ignore Ctrl-C, and SIGTERM while ``parent`` lives. A run killed with
  SIGKILL cannot stop them; on Linux the kernel then sends them SIGTERM
  (``PR_SET_PDEATHSIG``), which ends them, so none is left behind.

  The kernel sends that signal also when the thread that started a worker
  ends, its process living on: Grain starts each worker from a thread of
  its own, and ``close`` ends that thread before it tells the worker to
  stop. A worker ended there would leave the batch it had built in shared
  memory to Python's resource tracker, which frees it at exit and warns.
  """
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if not sys.platform.startswith("linux"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return

  def end_if_orphaned(signum=None, frame=None) -> None:
    del signum, frame
    # The parent gone, the kernel makes another process the parent; a
    # thread gone, its process stays the parent.
    if os.getppid() != parent:
      os._exit(1)

  signal.signal(signal.SIGTERM, end_if_orphaned)
  ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  end_if_orphaned()  # The parent may have ended before the prctl.


class _WorkerBatches(grain.DatasetIterator):
  """A map dataset's elements in order, built by Grain worker processes.

  Worker ``i`` of ``n`` builds elements ``i, i + n, ...`` of the rest of the
  dataset ahead of the caller, each a Grain pipeline of its own, and the
  elements are taken from the workers in turn. Ahead of the caller, a
  worker holds the element it builds and one in its queue, and a Grain
  thread of this process takes up to two more from that queue; stopping
  the workers frees them all (their arrays are in shared memory).

  The workers start with the first element asked for: a program that
  starts them must guard its main code with ``if __name__ == "__main__"``,
  as they are spawned. The state is the number of elements returned
  (``{"next_index": k}``, as Grain's own iterator over a map dataset has
  it), whatever the number of workers; setting it starts them afresh from
  there. ``close`` stops them.
  """

  def __init__(self, batches: grain.MapDataset, num_workers: int):
    super().__init__()
    self._batches = batches
    self._num_workers = num_workers
    self._next_index = 0
    self._workers = None
    self._first_index = 0  # The element the workers started at.

  def _start_workers(self) -> list[grain.DatasetIterator]:
    if not flags.FLAGS.is_parsed():
      # Grain reads an absl flag of its own when it starts workers; this
      # program parses none, which leaves them at their defaults.
      flags.FLAGS.mark_as_parsed()
    rest = self._batches[self._next_index:]
    init_worker = functools.partial(_init_worker, os.getpid())
    return [
        # Batches travel in shared memory, not pickled through the
        # workers' queues: a batch larger than a pipe holds, half written
        # by a worker when the run stops it, leaves the run waiting at exit
        # for the rest (tests/experiments/test_train_photos.py).
        iter(rest[i::self._num_workers].to_iter_dataset(
            _read_ahead(0)).mp_prefetch(
                grain.MultiprocessingOptions(num_workers=1),
                worker_init_fn=init_worker))
        for i in range(self._num_workers)]

  def __next__(self) -> dict[str, np.ndarray]:
    if self._workers is None:
      self._workers = self._start_workers()
      self._first_index = self._next_index
    turn = (self._next_index - self._first_index) % self._num_workers
    try:
      batch = next(self._workers[turn])
    except Exception:
      # A worker's error (e.g. `datasets.UnreadableImageError`) arrives
      # here as raised; the workers stop first, so that it ends the run
      # without them.
      self._stop_workers()
      raise
    self._next_index += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"next_index": self._next_index}

  def set_state(self, state: dict[str, int]) -> None:
    self._stop_workers()
    self._next_index = state["next_index"]

  def _stop_workers(self) -> None:
    for worker in self._workers or ():
      worker.close()
    self._workers = None

  def close(self) -> None:
    self._stop_workers()
    super().close()


def validation_order(indices: np.ndarray, *, seed: int, step: int,
                     domain: int) -> np.ndarray:
  """``indices`` in the order of the validation pass at ``step``: a fresh
  random order at every step, as DomainBed's ``FastDataLoader`` draws one
  (``lib/fast_data_loader.py`` lines 90-94: a ``RandomSampler`` without
  replacement), here from ``(seed, step, domain)``, so a resumed run draws
  the same."""
  rng = np.random.default_rng([seed, _VALIDATION_ORDER_STREAM, step, domain])
  return rng.permutation(indices)


def eval_batches(
    dataset: datasets.MultiDomainDataset,
    domain: int,
    indices: np.ndarray,
    *,
    batch_size: int = 256,
    num_workers: int = 1,
    transform: Transform | None = None,
    seed: int = 0,
    step: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
  """Yields the examples ``indices`` of one domain in order, in batches.

  The last batch is smaller when ``len(indices)`` is not a multiple of
  ``batch_size``, so every example is evaluated exactly once.

  Args:
    dataset: the dataset.
    domain: index of the domain.
    indices: example indices within that domain, e.g. a split.
    batch_size: the largest batch.
    num_workers: threads reading (and transforming) the examples of a
      batch, ahead of the caller; 0 for none.
    transform: if set, ``transform(example, rng)`` maps every example read;
      ``rng`` is a NumPy Generator seeded by ``(seed, step, domain,
      index)``.
    seed: seeds the transform's draws.
    step: the training step evaluated, which seeds the transform's draws.

  Yields:
    ``{"image": (b, H, W, C), "label": int32 (b,)}`` with
    ``b <= batch_size``; float32 images, or the transform's dtype.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive: {batch_size}")
  source = dataset.domains[domain]
  indices = np.asarray(indices)
  num_batches = -(-len(indices) // batch_size)  # Rounded up.
  # In-memory examples read as they are cost microseconds: threads would
  # only add their hand-overs.
  examples = _Examples(
      0 if transform is None and _in_memory(dataset) else num_workers)

  def make_batch(b: int) -> dict[str, np.ndarray]:
    chunk = indices[b * batch_size:(b + 1) * batch_size]

    def read(k: int) -> datasets.Element:
      example = source[int(chunk[k])]
      if transform is None:
        return example
      return transform(example, np.random.default_rng(
          [seed, _EVAL_TRANSFORM_STREAM, step, domain, int(chunk[k])]))

    return _stack(examples.map(read, len(chunk)))

  batches = grain.MapDataset.range(num_batches).map(make_batch)
  yield from batches.to_iter_dataset(_read_ahead(num_workers))
