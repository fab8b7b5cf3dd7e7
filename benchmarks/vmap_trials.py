"""Does training a run's trials in one vmapped program pay on XLA:CPU?

DomainBed's protocol trains every configuration three times (trial seeds 0,
1, 2). With the default hparams the trials share every shape and differ only
in their initial params, batches and keys, so one program can step them all:
``jax.vmap`` of the algorithm's update over the trials' stacked state. This
times, side by side (the variants alternate within every repeat), one step
of ``--trials`` trials of DomainBed's MNIST CNN:

* ``separate``: one jitted update called once per trial, as the study's one
  process per trial does;
* ``vmapped``: one call of the jitted ``jax.vmap`` of the same update over
  the trials.

It also reports how long each variant took to compile (its first call). The
vmapped step is checked: every trial's metrics (loss, and PGrad's
eigenvalues) and update equal those of its own separate step.

Run ``python -m benchmarks.vmap_trials --help`` for the flags; results go to
stdout and, with ``--out``, to a JSON file.
"""

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from experiments import algorithms
from experiments import catalog
from experiments import hparams_registry


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--algorithms", nargs="+", default=["ERM", "PGrad-B"],
                      choices=list(catalog.ALGORITHMS), metavar="ALGORITHM")
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--image-size", type=int, default=8)
  parser.add_argument("--width", type=int, default=8,
                      help="The CNN's first width, a multiple of 8 (the "
                      "others are twice it).")
  parser.add_argument("--domains", type=int, default=5)
  parser.add_argument("--batch", type=int, default=63,
                      help="Images per domain.")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", default=None, help="JSON file for results.")
  args = parser.parse_args(argv)
  for name in ("trials", "image_size", "width", "domains", "batch",
               "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1.")
  if args.width % 8:
    parser.error(f"--width must be a multiple of 8 (the CNN's GroupNorm has 8 "
                 f"groups), got {args.width}.")
  return args


def _stack(trees):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def check_same_step(params, separate, vmapped) -> None:
  """Raises unless one trial's vmapped step is its separate step.

  Both run the same float32 operations batched differently, so they agree
  to rounding, which a PGrad rollout of several inner steps amplifies and
  Adam's first step turns into a flipped sign wherever a gradient is near 0:
  the metrics are compared to 1e-3, and the params' update as a whole (its
  norm, against the update's own) to 1e-2. Mixing up two trials would miss
  both by far.
  """
  for key, value in separate[3].items():
    np.testing.assert_allclose(vmapped[3][key], value, rtol=1e-3, atol=1e-6,
                               err_msg=key)
  flat = lambda tree: np.concatenate(
      [np.ravel(x) for x in jax.tree.leaves(tree)])
  update = flat(separate[0]) - flat(params)
  error = np.linalg.norm(flat(vmapped[0]) - flat(separate[0]))
  if not error <= 1e-2 * np.linalg.norm(update):
    raise AssertionError(f"vmapped params differ by {error:.3g}, against an "
                         f"update of norm {np.linalg.norm(update):.3g}.")


def time_algorithm(name: str, args: argparse.Namespace) -> dict:
  """Both variants' `common.Timing`s as dicts, their steps checked equal."""
  trials = [common.digits_cnn(args.image_size, args.width, seed)
            for seed in range(args.trials)]
  network = trials[0][0]
  hparams = hparams_registry.default_hparams(name, "RotatedDigits")
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=args.domains)
  rng = np.random.default_rng(0)
  inputs = [
      (params, stats, algorithm.init(params),
       common.digit_batches(rng, args.domains, args.batch, args.image_size),
       jax.random.key(seed))
      for seed, (_, params, stats) in enumerate(trials)]
  stacked = [_stack(column) for column in zip(*inputs)]

  update = jax.jit(algorithm.update)
  vmapped = jax.jit(jax.vmap(algorithm.update))
  timings = common.time_interleaved(
      {"separate": lambda: [update(*x) for x in inputs],
       "vmapped": lambda: vmapped(*stacked)}, args.repeats, warmup=0)
  vmapped_out = vmapped(*stacked)
  for trial, x in enumerate(inputs):
    check_same_step(x[0], update(*x),
                    jax.tree.map(lambda v, t=trial: v[t], vmapped_out))
  return {variant: timing.as_dict() for variant, timing in timings.items()}


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  results, rows = [], []
  for name in args.algorithms:
    timings = time_algorithm(name, args)
    separate = timings["separate"]["median_ms"]
    for variant, timing in timings.items():
      rows.append([name, variant, timing["compile_ms"] / 1e3,
                   timing["median_ms"], timing["median_ms"] / separate])
    results.append({"algorithm": name, "timings": timings})
  record = {"benchmark": "vmap_trials", "args": vars(args),
            "environment": common.environment(), "results": results}
  common.publish(record, common.format_table(
      ["algorithm", "variant", "compile s", f"median ms ({args.trials} "
       "trials)", "/ separate"], rows), args.out)
  return record


if __name__ == "__main__":
  main()
