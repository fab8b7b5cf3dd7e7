"""This host's NVIDIA GPUs, found without importing JAX (which would take a
GPU in this process): those the ``multi_gpu`` launcher trains on, and those
submitit's local executor may hand its jobs."""

from __future__ import annotations

import os
import subprocess

from experiments import errors


def visible_gpus(gpus: str | None = None) -> list[str]:
  """The GPUs a ``multi_gpu`` sweep trains on, one run on each at a time.

  Found without importing JAX (which would take a GPU in this process), as
  DomainBed's multi_gpu launcher finds them but for its ``torch`` fallback.

  Args:
    gpus: comma-separated GPU ids or UUIDs (``--gpus``); ``None``: those
      ``CUDA_VISIBLE_DEVICES`` lists if it is set, else those ``nvidia-smi
      -L`` lists.

  Returns:
    The ids, each to be a run's ``CUDA_VISIBLE_DEVICES``.

  Raises:
    UsageError: no GPU is named or found.
  """
  # Empty entries are dropped, as DomainBed does for a trailing comma.
  if gpus is not None:
    found = [g.strip() for g in gpus.split(",") if g.strip()]
    if not found:
      raise errors.UsageError(
          f"--gpus {gpus!r} names no GPU; give ids such as --gpus 0,1.")
    return found
  if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
    found = [g.strip() for g in listed.split(",") if g.strip()]
    if not found:
      raise errors.UsageError(
          "CUDA_VISIBLE_DEVICES is empty, so no GPU is visible; unset it or "
          "name the GPUs with --gpus 0,1,...")
    return found
  count = nvidia_gpu_count()
  if not count:
    raise errors.UsageError(
        "--launcher multi_gpu found no GPU: CUDA_VISIBLE_DEVICES is unset "
        "and nvidia-smi -L lists none. Name them with --gpus 0,1,... or use "
        "--launcher local.")
  return [str(i) for i in range(count)]


def nvidia_gpu_count() -> int:
  """How many NVIDIA GPUs ``nvidia-smi -L`` lists on this host; 0 without
  ``nvidia-smi``."""
  try:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                             text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return 0
  # Its GPU lines ("GPU 0: NVIDIA H100 ... (UUID: ...)"); MIG lines, indented
  # under them, are not counted.
  return sum(line.startswith("GPU ") for line in listing.splitlines())
