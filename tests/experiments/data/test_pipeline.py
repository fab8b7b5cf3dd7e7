"""Tests for experiments/data/pipeline.py."""

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.data import datasets
from experiments.data import pipeline as input_pipeline

REPO = Path(__file__).resolve().parents[3]
SIZES = (50, 37, 21)


def _fake_dataset() -> datasets.MultiDomainDataset:
  """Constant 4x4 images whose value is 1000 * domain + index."""
  domains = []
  for d, size in enumerate(SIZES):
    codes = 1000.0 * d + np.arange(size)
    images = np.broadcast_to(codes[:, None, None, None], (size, 4, 4, 1))
    domains.append(datasets.ArraySource(images, np.arange(size) % 3))
  return datasets.MultiDomainDataset(
      name="Fake",
      domain_names=("a", "b", "c"),
      domains=tuple(domains),
      num_classes=3,
      input_shape=(4, 4, 1),
  )


@pytest.fixture(name="dataset")
def fixture_dataset():
  return _fake_dataset()


@pytest.fixture(name="splits")
def fixture_splits(dataset):
  return input_pipeline.split_domains(dataset, seed=0)


def _train_iter(dataset, splits, seed=0, **kwargs):
  return input_pipeline.make_train_iterator(
      dataset, [0, 2], splits, batch_size=8, seed=seed, **kwargs
  )


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same_batches(batches, others):
  assert len(batches) == len(others)
  for a, b in zip(batches, others):
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])


def test_splits_are_disjoint_cover_the_domain_and_hold_out_20_percent(
    dataset, splits
):
  assert len(splits) == len(SIZES)
  for (in_idx, out_idx), size in zip(splits, SIZES):
    assert len(out_idx) == int(0.2 * size)
    assert not set(in_idx) & set(out_idx)
    np.testing.assert_array_equal(
        np.sort(np.concatenate([in_idx, out_idx])), np.arange(size)
    )


def test_splits_depend_on_the_seed(dataset, splits):
  again = input_pipeline.split_domains(dataset, seed=0)
  other = input_pipeline.split_domains(dataset, seed=1)
  for (a, _), (b, _) in zip(splits, again):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(splits[0][0], other[0][0])


def test_train_batches_stack_domains_and_sample_the_in_split(dataset, splits):
  batches = _take(_train_iter(dataset, splits), 20)
  for batch in batches:
    assert batch["image"].shape == (2, 8, 4, 4, 1)
    assert batch["image"].dtype == np.float32
    assert batch["label"].shape == (2, 8)
    assert batch["label"].dtype == np.int32
  for row, d in enumerate([0, 2]):
    codes = np.concatenate([b["image"][row, :, 0, 0, 0] for b in batches])
    domains, indices = np.divmod(codes.astype(int), 1000)
    assert np.all(domains == d)
    assert set(indices) <= set(splits[d][0])
    labels = np.concatenate([b["label"][row] for b in batches])
    np.testing.assert_array_equal(labels, indices % 3)
    # 160 draws from at most 40 examples: with replacement, some repeat.
    assert len(set(indices)) < len(indices)


def test_train_batches_are_a_function_of_seed_and_step(dataset, splits):
  batches = _take(_train_iter(dataset, splits), 8)
  _assert_same_batches(batches, _take(_train_iter(dataset, splits), 8))
  _assert_same_batches(
      batches, _take(_train_iter(dataset, splits, num_workers=0), 8)
  )
  _assert_same_batches(
      batches[5:], _take(_train_iter(dataset, splits, start_step=5), 3)
  )
  other = next(_train_iter(dataset, splits, seed=1))
  assert not np.array_equal(batches[0]["image"], other["image"])


def test_train_iterator_state_round_trips(dataset, splits):
  iterator = _train_iter(dataset, splits)
  _take(iterator, 5)
  state = iterator.get_state()
  expected = _take(iterator, 3)
  fresh = _train_iter(dataset, splits)
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, 3), expected)


def test_train_iterator_resumes_from_an_orbax_checkpoint(
    dataset, splits, tmp_path
):
  iterator = _train_iter(dataset, splits)
  _take(iterator, 5)
  save = grain.checkpoint.CheckpointSave(iterator)
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(5, args=ocp.args.Composite(data=save))
    manager.wait_until_finished()
  expected = _take(iterator, 3)

  fresh = _train_iter(dataset, splits)
  restore = grain.checkpoint.CheckpointRestore(fresh)
  with ocp.CheckpointManager(tmp_path) as manager:
    assert manager.latest_step() == 5
    restored = manager.restore(5, args=ocp.args.Composite(data=restore))
  assert restored.data is fresh
  _assert_same_batches(_take(fresh, 3), expected)


def test_make_train_iterator_validates_arguments(dataset, splits):
  make = input_pipeline.make_train_iterator
  with pytest.raises(ValueError, match="train_domains"):
    make(dataset, [], splits, batch_size=8, seed=0)
  with pytest.raises(ValueError, match="batch_size"):
    make(dataset, [0], splits, batch_size=0, seed=0)


@pytest.mark.parametrize("batch_size", [4, 7, 100])
def test_eval_batches_cover_the_indices_once_in_order(
    dataset, splits, batch_size
):
  indices = splits[1][1]
  batches = list(
      input_pipeline.eval_batches(dataset, 1, indices, batch_size=batch_size)
  )
  sizes = [len(b["label"]) for b in batches]
  assert all(s == batch_size for s in sizes[:-1])
  assert 0 < sizes[-1] <= batch_size
  codes = np.concatenate([b["image"][:, 0, 0, 0] for b in batches])
  np.testing.assert_array_equal(codes, 1000 + indices)
  np.testing.assert_array_equal(
      np.concatenate([b["label"] for b in batches]), indices % 3
  )
  assert batches[0]["image"].shape[1:] == (4, 4, 1)


def test_pipeline_on_rotated_digits():
  dataset = datasets.get_dataset("RotatedDigits", seed=0)
  splits = input_pipeline.split_domains(dataset, seed=0)
  batch = next(
      input_pipeline.make_train_iterator(
          dataset, [1, 2, 3, 4, 5], splits, batch_size=16, seed=0
      )
  )
  assert batch["image"].shape == (5, 16, 28, 28, 1)
  assert batch["label"].shape == (5, 16)
  sizes = [
      len(b["label"])
      for b in input_pipeline.eval_batches(dataset, 0, splits[0][0])
  ]
  assert sum(sizes) == len(splits[0][0])


def test_train_batches_sample_domains_per_step(dataset, splits):
  def sampled(domains_per_step):
    return input_pipeline.make_train_iterator(
        dataset, [0, 1, 2], splits, batch_size=5, seed=0, num_workers=0,
        domains_per_step=domains_per_step)

  iterator = sampled(2)
  seen = set()
  for _ in range(12):
    batch = next(iterator)
    assert batch["image"].shape == (2, 5, 4, 4, 1)
    # Every example's image encodes its domain: 1000 * domain + index.
    domains = (batch["image"][:, :, 0, 0, 0] // 1000).astype(int)
    assert np.all(domains == domains[:, :1])
    pair = tuple(domains[:, 0])
    assert pair[0] < pair[1]  # Two different domains, in order.
    seen.add(pair)
  # Every pair of the three domains comes up; the draw is seeded per step.
  assert seen == {(0, 1), (0, 2), (1, 2)}
  np.testing.assert_array_equal(next(sampled(2))["image"],
                                next(sampled(2))["image"])
  with pytest.raises(ValueError, match="domains_per_step must be in"):
    sampled(4)


def _draw_transform(example, rng):
  """Replaces the image by one draw of ``rng``, keeping its code in [0]."""
  image = np.array(example["image"])
  image.flat[1:] = rng.random()
  return {**example, "image": image}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_draws_per_seed_step_domain_and_position(
    dataset, splits, num_workers):
  iterator = input_pipeline.make_train_iterator(
      dataset, [0, 2], splits, batch_size=8, seed=5, start_step=3,
      num_workers=num_workers, transform=_draw_transform)
  for step in (3, 4):
    batch = next(iterator)
    for row, domain in enumerate([0, 2]):
      codes = batch["image"][row, :, 0, 0, 0]
      assert np.all(codes // 1000 == domain)  # The examples drawn, ...
      for slot in range(8):
        # ... each transformed with its own generator.
        expected = np.random.default_rng(
            [5, input_pipeline._TRANSFORM_STREAM, step, domain, slot]
        ).random()
        np.testing.assert_array_equal(
            batch["image"][row, slot].flat[1:], np.float32(expected))
  untransformed = next(input_pipeline.make_train_iterator(
      dataset, [0, 2], splits, batch_size=8, seed=5, start_step=3))
  np.testing.assert_array_equal(
      untransformed["image"][..., 0, 0, 0],
      next(input_pipeline.make_train_iterator(
          dataset, [0, 2], splits, batch_size=8, seed=5, start_step=3,
          num_workers=0, transform=_draw_transform))["image"][..., 0, 0, 0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_eval_transform_draws_per_seed_step_domain_and_example(
    dataset, splits, num_workers):
  indices = splits[1][0][:7]
  batches = list(input_pipeline.eval_batches(
      dataset, 1, indices, batch_size=3, num_workers=num_workers,
      transform=_draw_transform, seed=5, step=40))
  images = np.concatenate([b["image"] for b in batches])
  np.testing.assert_array_equal(images[:, 0, 0, 0], 1000 + indices)
  for image, index in zip(images, indices):
    expected = np.random.default_rng(
        [5, input_pipeline._EVAL_TRANSFORM_STREAM, 40, 1, index]).random()
    np.testing.assert_array_equal(image.flat[1:], np.float32(expected))


def test_worker_processes_resume_from_a_state_on_any_number_of_workers(
    dataset, splits):
  # A transform makes the examples worth building in worker processes.
  def iterator(num_workers):
    return input_pipeline.make_train_iterator(
        dataset, [0, 2], splits, batch_size=4, seed=0,
        num_workers=num_workers, transform=_draw_transform)

  reference = _take(iterator(0), 5)
  workers = iterator(2)
  _assert_same_batches(_take(workers, 3), reference[:3])
  state = workers.get_state()
  assert state == {"next_index": 3}
  workers.close()
  for num_workers in (0, 1):
    fresh = iterator(num_workers)
    fresh.set_state(state)
    _assert_same_batches(_take(fresh, 2), reference[3:])


# A program that reads batches built by two worker processes, then does
# THEN; its workers' process ids on the first line of its output.
_READ_FROM_WORKERS = """
import collections, multiprocessing, os, signal, socket, threading
import numpy as np
from experiments.data import datasets, pipeline as input_pipeline

# A Unix datagram socket's path; spawned workers have it with `shifted`.
BUILT = {built!r}

def shifted(example, rng):
  # A datagram of its pid tells the program this worker has built an example.
  with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.sendto(str(os.getpid()).encode(), BUILT)
  return {{**example, "image": example["image"] + np.float32(rng.random())}}

dataset = datasets.MultiDomainDataset(
    name="Fake", domain_names=("a",), num_classes=2, input_shape=(4, 4, 1),
    domains=(datasets.ArraySource(np.zeros((10, 4, 4, 1), np.float32),
                                  np.arange(10) % 2),))
# A thread counts the datagrams by pid as they come, from before the workers
# start to the end: the socket queues few (net.unix.max_dgram_qlen, 10 by
# default), and a worker waits to send while it is full.
built = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
built.bind(BUILT)
ahead = threading.Event()

def count_built():
  counts = collections.Counter()
  while True:
    counts[built.recv(64)] += 1
    if len(counts) == 2 and min(counts.values()) >= 3 * 4:
      ahead.set()

threading.Thread(target=count_built, daemon=True).start()
batches = input_pipeline.make_train_iterator(
    dataset, [0], input_pipeline.split_domains(dataset, seed=0),
    batch_size=4, seed=0, num_workers=2, transform=shifted)
for _ in range(3):
  next(batches)
print(*(p.pid for p in multiprocessing.active_children()), flush=True)
# Each worker has built a batch past the two (of 4 examples) that the three
# taken could have come from: it holds batches of its own. The wait ends
# when the counts get there, with no sleeps; its 60 seconds only stop a run
# that has hung.
if not ahead.wait(60):
  raise TimeoutError("the workers have not built a batch ahead")
{then}
"""


def _read_from_workers(then, tmp_path):
  script = _READ_FROM_WORKERS.format(then=then, built=str(tmp_path / "built"))
  return subprocess.run(
      [sys.executable, "-c", script], cwd=REPO,
      capture_output=True, text=True, check=False, timeout=120)


@pytest.mark.slow
def test_closed_workers_leave_no_shared_memory_to_the_resource_tracker(
    tmp_path):
  # Each worker holds a batch it has built, in shared memory, when the
  # iterator closes: it frees it as it stops. (Killed instead, it left the
  # batch to Python's resource tracker, which frees what is left at exit
  # and warns of "leaked shared_memory objects".)
  result = _read_from_workers("batches.close()", tmp_path)
  assert result.returncode == 0, result.stderr
  assert len(result.stdout.split()) == 2, result.stdout
  assert "leaked" not in result.stderr, result.stderr


def _ended_within(pid, timeout_s):
  """Whether process ``pid`` (not a child of this one) ends within
  ``timeout_s``: its pidfd becomes readable when it has ended."""
  try:
    pidfd = os.pidfd_open(pid)
  except ProcessLookupError:  # Already gone, reaped.
    return True
  try:
    return bool(select.select([pidfd], [], [], timeout_s)[0])
  finally:
    os.close(pidfd)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the kernel ends the workers on Linux only")
def test_workers_end_when_their_process_is_killed(tmp_path):
  # SIGKILL leaves the process no clean-up: the kernel signals its workers,
  # which end once their parent has gone (not when a thread of it ends).
  result = _read_from_workers("os.kill(os.getpid(), signal.SIGKILL)",
                              tmp_path)
  assert result.returncode == -signal.SIGKILL, result.stderr
  workers = [int(pid) for pid in result.stdout.split()]
  assert len(workers) == 2, result.stdout
  assert all(_ended_within(pid, timeout_s=30) for pid in workers), workers
