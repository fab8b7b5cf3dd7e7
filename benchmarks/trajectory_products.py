"""The products over a stored trajectory: layouts, precision, read rates.

After its rollout, a PGrad update reads the whole trajectory twice: for the
Gram matrix ``K = D D^T`` and for the projection ``sum_i beta_i D_i``. Both
are bound by memory, so their read rate, trajectory bytes per second, is
what to set against the device's bandwidth. This benchmark times them on a
random trajectory of ResNet-50's size (``--steps`` x ``--params`` float32
displacements like a rollout's: each step adds a random increment):

* through the library (``pgrad_jax.gram`` and the projection), on the
  trajectory stored contiguously (``pgrad_jax._src.layout``) in one block
  and in blocks of each ``--blocks`` size;
* the alternatives the library does not take: the Gram matrix of one block
  at XLA's default precision (which a GPU may run in TensorFloat-32), and
  the projection as a matrix-vector product;
* the ``m x m`` eigendecomposition alone, for scale.

Each product's error is the largest difference from the float64 NumPy
product of the same float32 numbers, relative to that product's largest
entry; for the Gram matrix also the error of the centred matrix's
eigenvalues relative to the largest (the spectrum PGrad weighs).

Run ``python -m benchmarks.trajectory_products --help`` for the flags; the
results go to stdout as a table and, with ``--out``, to a JSON file.
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pgrad_jax
from benchmarks import common
from pgrad_jax._src import trajectory as trajectory_lib


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=9,
                      help="Stored steps s (m - 1; the paper's setting: 9).")
  parser.add_argument("--params", type=int, default=23_528_522,
                      help="Parameters (default: ResNet-50 with 7 classes).")
  parser.add_argument("--blocks", type=int, nargs="*",
                      default=[1 << 13, 1 << 15, 1 << 17],
                      help="Block sizes of the contiguous trajectory.")
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


def contiguous(rows: jax.Array, block: int | None) -> Any:
  """``rows`` (s, n) stored as a contiguous trajectory of one leaf."""
  steps, size = rows.shape
  block = min(block or size, size)
  num_blocks = -(-size // block)
  padded = jnp.pad(rows, ((0, 0), (0, num_blocks * block - size)))
  return trajectory_lib.ContiguousTrajectory(
      padded.reshape(steps, num_blocks, block).transpose(1, 0, 2),
      jax.tree.structure(0), ((size,),))


def run(args: argparse.Namespace) -> dict[str, Any]:
  rng = np.random.default_rng(args.seed)
  increments = rng.standard_normal((args.steps, args.params),
                                   dtype=np.float32) * np.float32(1e-3)
  trajectory = np.cumsum(increments, axis=0, dtype=np.float32)
  del increments
  beta = rng.standard_normal(args.steps)
  wide = trajectory.astype(np.float64)
  reference_gram = wide @ wide.T
  reference_sum = beta @ wide
  del wide
  reference_eigenvalues = centred_eigenvalues(reference_gram)
  rows = jax.device_put(trajectory)
  beta_device = jax.device_put(beta.astype(np.float32))

  # name -> (product, call, reference): every call returns a float32 array.
  cases = {}
  gram_fn = jax.jit(pgrad_jax.gram)
  sum_fn = jax.jit(lambda b, t: trajectory_lib.weighted_sum(b, t))
  for block in [None] + list(args.blocks):
    stored = jax.block_until_ready(jax.jit(contiguous, static_argnums=1)(
        rows, block))
    name = "one block" if block is None else f"blocks of {block}"
    cases[f"gram, {name}"] = (
        "gram", lambda s=stored: gram_fn(s), reference_gram)
    cases[f"projection, {name}"] = (
        "projection", lambda s=stored: sum_fn(beta_device, s), reference_sum)
  default_gram = jax.jit(lambda r: jax.lax.dot_general(
      r, r, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.DEFAULT,
      preferred_element_type=jnp.float32))
  cases["gram, one block, default precision"] = (
      "gram", lambda: default_gram(rows), reference_gram)
  matvec = jax.jit(lambda b, r: jnp.tensordot(
      b, r, axes=1, precision=jax.lax.Precision.HIGHEST))
  cases["projection, matrix-vector product"] = (
      "projection", lambda: matvec(beta_device, rows), reference_sum)
  # The centred Gram matrix, scaled, as PGrad decomposes it.
  centred = np.zeros((args.steps + 1,) * 2)
  centred[1:, 1:] = reference_gram / np.abs(reference_gram).max()
  centring = np.eye(args.steps + 1) - 1.0 / (args.steps + 1)
  small = jax.device_put((centring @ centred @ centring).astype(np.float32))
  eigh = jax.jit(jnp.linalg.eigh)
  calls = {name: call for name, (_, call, _) in cases.items()}
  calls["eigh (m x m)"] = lambda: eigh(small)
  timings = common.time_interleaved(calls, args.repeats, 1)

  results = {}
  for name, (product, call, reference) in cases.items():
    got = np.asarray(call(), np.float64)
    row = timings[name].as_dict() | {
        "product": product,
        "read_gb_per_s": trajectory.nbytes / timings[name].median_ms / 1e6,
        "max_relative_error": float(np.abs(got - reference).max()
                                    / np.abs(reference).max()),
    }
    if product == "gram":
      row["eigenvalue_relative_error"] = float(
          np.abs(centred_eigenvalues(got) - reference_eigenvalues).max()
          / reference_eigenvalues[0])
    results[name] = row
  results["eigh (m x m)"] = timings["eigh (m x m)"].as_dict()
  return {"benchmark": "trajectory_products",
          "environment": common.environment(),
          "config": vars(args) | {"trajectory_bytes": trajectory.nbytes},
          "results": results}


def report(record: dict[str, Any]) -> str:
  config, env = record["config"], record["environment"]

  def cell(row, key):
    return row[key] if key in row else ""

  return "\n\n".join([
      f"{config['steps']} x {config['params']:,} float32 displacements "
      f"({config['trajectory_bytes'] / 1e9:.3g} GB) on {env['device_kind']} "
      f"({env['platform']}), jax {env['jax']}, median of {config['repeats']}",
      common.format_table(
          ["case", "median ms", "read GB/s", "max error", "eigenvalue error"],
          [[name, r["median_ms"], cell(r, "read_gb_per_s"),
            cell(r, "max_relative_error"), cell(r, "eigenvalue_relative_error")]
           for name, r in record["results"].items()])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  record = run(args)
  common.publish(record, report(record), args.out)
  return record


if __name__ == "__main__":
  main()
