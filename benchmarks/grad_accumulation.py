"""Does gradient accumulation make an ERM step cheaper on XLA:CPU?

An ERM step of DomainBed's MNIST CNN (``experiments.models``) on
``domains x batch`` images takes one gradient of the pooled batch. The same
gradient is the mean of the gradients of equal micro-batches, accumulated
in a ``jax.lax.scan``; smaller convolutions may suit the CPU's caches better.
For every image size and CNN width this times, side by side (the variants
alternate within every repeat):

* ``full``: one Adam step on the gradient of the whole batch;
* ``accumulate<m>``: the same step on the gradient accumulated over
  micro-batches of ``m`` images, in an unrolled scan;
* ``rolled<m>``: the same in a rolled scan (a loop);
* ``pgrad_b``: one PGrad-B update (``B`` = 3) on the same images, the
  experiments' algorithm, for scale.

Every accumulated gradient is checked against the full one before timing.
Run ``python -m benchmarks.grad_accumulation --help`` for the flags; results
go to stdout and, with ``--out``, to a JSON file.
"""

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common
from experiments import algorithms
from experiments import hparams_registry


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--image-sizes", type=int, nargs="+", default=[28, 14])
  parser.add_argument("--widths", type=int, nargs="+", default=[16, 8],
                      help="The CNN's first width (the others are twice it).")
  parser.add_argument("--domains", type=int, default=5)
  parser.add_argument("--batch", type=int, default=63,
                      help="Images per domain.")
  parser.add_argument("--micro-batches", type=int, nargs="+",
                      default=[21, 63], help="Images per micro-batch.")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", default=None, help="JSON file for results.")
  return parser.parse_args(argv)


def erm_step(network: algorithms.Network, micro_batch: int | None,
             unroll: bool = True):
  """A jitted Adam step on the pooled batch, optionally accumulated."""
  loss_fn = algorithms.batch_loss(network)
  tx = optax.adam(1e-3)

  def grad_fn(params, stats, batch):
    if micro_batch is None:
      return jax.grad(lambda p: loss_fn(p, batch, stats)[0])(params)
    chunks = jax.tree.map(
        lambda x: x.reshape((-1, micro_batch) + x.shape[1:]), batch)

    def add(total, chunk):
      grads = jax.grad(lambda p: loss_fn(p, chunk, stats)[0])(params)
      return jax.tree.map(jnp.add, total, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    # Unrolled: XLA:CPU runs a rolled loop of convolutions several times
    # slower (measured with this script), as the library's rollout finds.
    total, _ = jax.lax.scan(add, zeros, chunks, unroll=unroll)
    count = len(batch["label"]) // micro_batch
    return jax.tree.map(lambda g: g / count, total)

  @jax.jit
  def step(params, stats, opt_state, batch):
    grads = grad_fn(params, stats, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  return step, tx.init


def time_variants(image_size, width, args):
  """Median seconds per step of every variant at one size and width."""
  network, params, stats = common.digits_cnn(image_size, width)
  batches = common.digit_batches(np.random.default_rng(0), args.domains,
                                 args.batch, image_size)
  pooled = algorithms.with_example_keys(batches, jax.random.key(0))
  pooled = algorithms.merge_domains(pooled)

  steps, reference = {}, None
  variants = [("full", None, True)] + [
      (f"{kind}{micro}", micro, kind == "accumulate")
      for micro in args.micro_batches for kind in ("accumulate", "rolled")]
  for name, micro, unroll in variants:
    step, init = erm_step(network, micro, unroll)
    opt_state = init(params)
    _, _, grads = step(params, stats, opt_state, pooled)  # Compiles.
    if reference is None:
      reference = grads
    else:
      for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    steps[name] = lambda step=step, s=opt_state: step(params, stats, s,
                                                      pooled)
  hparams = hparams_registry.default_hparams("PGrad-B", "RotatedDigits")
  pgrad_b = algorithms.build_algorithm("PGrad-B", network, hparams,
                                       num_domains=args.domains)
  update, state = jax.jit(pgrad_b.update), pgrad_b.init(params)
  key = jax.random.key(1)
  jax.block_until_ready(update(params, stats, state, batches, key))
  steps["pgrad_b"] = lambda: update(params, stats, state, batches, key)

  times = {name: [] for name in steps}
  for _ in range(args.repeats):
    for name, run in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  results = []
  print(f"{'size':>4} {'width':>5} {'variant':>13} {'median s':>9} "
        f"{'/ full':>7}")
  for image_size in args.image_sizes:
    for width in args.widths:
      medians = time_variants(image_size, width, args)
      for name, seconds in medians.items():
        ratio = seconds / medians["full"]
        print(f"{image_size:>4} {width:>5} {name:>13} {seconds:>9.4f} "
              f"{ratio:>7.2f}")
      results.append({"image_size": image_size, "width": width,
                      "median_seconds": medians})
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "backend": jax.default_backend(),
                 "devices": jax.device_count(), "jax": jax.__version__,
                 "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
