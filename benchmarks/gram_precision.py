"""The Gram matrix's error at each matrix-product precision, against float64.

PGrad's Gram matrix ``K = D D^T`` of the trajectory's displacements decides
the principal axes. ``pgrad_jax`` computes it at full float32 precision
(``Precision.HIGHEST``); left to XLA's default, a GPU may multiply float32 in
TensorFloat-32, and a TPU in bfloat16 passes. This benchmark measures what
that would cost in accuracy and what full precision costs in time, on a
random trajectory of ResNet-50's size (``--steps`` x ``--params``, float32
displacements like a rollout's: each step adds a random increment):

* the Gram matrix at each precision, timed (median of ``--repeats``);
* its largest error relative to the largest entry of the float64 NumPy
  Gram matrix of the same float32 numbers, and the error of the centred
  matrix's eigenvalues relative to the largest (the spectrum PGrad weighs).

Run ``python -m benchmarks.gram_precision --help`` for the flags; the results
go to stdout as a table and, with ``--out``, to a JSON file.
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common

PRECISIONS = {"default": jax.lax.Precision.DEFAULT,
              "highest": jax.lax.Precision.HIGHEST}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=9,
                      help="Stored steps s (m - 1; the paper's setting: 9).")
  parser.add_argument("--params", type=int, default=23_528_522,
                      help="Parameters (default: ResNet-50 with 7 classes).")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None, help="Write the results as JSON.")
  return parser.parse_args(argv)


def centred_eigenvalues(gram: np.ndarray) -> np.ndarray:
  """Descending eigenvalues of ``H K H`` over theta_0 and the ``s`` steps."""
  m = gram.shape[0] + 1
  full = np.zeros((m, m))
  full[1:, 1:] = gram
  centring = np.eye(m) - 1.0 / m
  return np.linalg.eigvalsh(centring @ full @ centring)[::-1]


def run(args: argparse.Namespace) -> dict[str, Any]:
  rng = np.random.default_rng(args.seed)
  # A rollout's displacements: cumulative sums of small random steps.
  increments = rng.standard_normal((args.steps, args.params),
                                   dtype=np.float32) * np.float32(1e-3)
  trajectory = np.cumsum(increments, axis=0, dtype=np.float32)
  reference = trajectory.astype(np.float64) @ trajectory.astype(np.float64).T
  reference_eigenvalues = centred_eigenvalues(reference)
  rows = jax.device_put(trajectory)
  del increments
  calls, grams = {}, {}
  for name, precision in PRECISIONS.items():
    gram = jax.jit(lambda r, p=precision: jax.lax.dot_general(
        r, r, (((1,), (1,)), ((), ())), precision=p,
        preferred_element_type=jnp.float32))
    grams[name] = np.asarray(gram(rows), np.float64)
    calls[name] = lambda gram=gram: gram(rows)
  timings = common.time_interleaved(calls, args.repeats, 1)
  scale = np.abs(reference).max()
  results = {}
  for name, gram in grams.items():
    results[name] = timings[name].as_dict() | {
        "read_gb_per_s": trajectory.nbytes / timings[name].median_ms / 1e6,
        "max_relative_error": float(np.abs(gram - reference).max() / scale),
        "eigenvalue_relative_error": float(
            np.abs(centred_eigenvalues(gram) - reference_eigenvalues).max()
            / reference_eigenvalues[0]),
    }
  return {"benchmark": "gram_precision", "environment": common.environment(),
          "config": vars(args) | {"trajectory_bytes": trajectory.nbytes},
          "results": results}


def report(record: dict[str, Any]) -> str:
  config, env = record["config"], record["environment"]
  return "\n\n".join([
      f"Gram matrix of {config['steps']} x {config['params']:,} float32 "
      f"displacements on {env['device_kind']} ({env['platform']}), jax "
      f"{env['jax']}, median of {config['repeats']}",
      common.format_table(
          ["precision", "median ms", "read GB/s", "max error / max |K|",
           "eigenvalue error / lambda_1"],
          [[name, r["median_ms"], r["read_gb_per_s"],
            r["max_relative_error"], r["eigenvalue_relative_error"]]
           for name, r in record["results"].items()])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  record = run(args)
  common.publish(record, report(record), args.out)
  return record


if __name__ == "__main__":
  main()
