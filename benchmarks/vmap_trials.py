"""Does training a run's trials in one vmapped program pay?

DomainBed's protocol trains every configuration three times (trial seeds 0,
1, 2). With the default hparams the trials share every shape and differ only
in their initial params, batches and keys, so one program can step them all:
``jax.vmap`` of the algorithm's update over the trials' stacked state. This
times, side by side (the variants alternate within every repeat), one step
of each number of ``--trials`` trials of ``--model`` (DomainBed's MNIST CNN
on digits, or a ResNet on photos):

* ``separate``: one jitted update called once per trial, as the study's one
  process per trial does;
* ``vmapped``: one call of the jitted ``jax.vmap`` of the same update over
  the trials.

It also reports how long each variant took to compile (its first call; the
separate update compiles for the first number of trials only, and the later
ones find it compiled) and the trial steps per hour each variant makes. The
vmapped step is checked: every trial's metrics (loss, and PGrad's
eigenvalues) and update equal those of its own separate step.

The hparams are each algorithm's defaults on the model's dataset
(RotatedDigits for the CNN, PACS for the ResNets), and so, unless given, are
the domains (all but one held out) and the images per domain (PGrad-B's
``batch_size``).

Run ``python -m benchmarks.vmap_trials --help`` for the flags; results go to
stdout and, with ``--out``, to a JSON file.
"""

import argparse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from experiments import algorithms
from experiments import catalog
from experiments import hparams_registry
from experiments import models


# The dataset each model trains on, for its hparams and default shapes.
DATASETS = {"mnist_cnn": "RotatedDigits", "resnet18": "PACS",
            "resnet50": "PACS"}
DEFAULT_IMAGE_SIZES = {"mnist_cnn": 8, "resnet18": 32, "resnet50": 32}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--algorithms", nargs="+", default=["ERM", "PGrad-B"],
                      choices=list(catalog.ALGORITHMS), metavar="ALGORITHM")
  parser.add_argument("--model", choices=list(DATASETS), default="mnist_cnn")
  parser.add_argument("--trials", type=int, nargs="+", default=[3],
                      help="Numbers of trials stepped together, each timed.")
  parser.add_argument("--image-size", type=int, default=None,
                      help="Image side (default: 8 for the CNN, 32 for the "
                      "ResNets).")
  parser.add_argument("--width", type=int, default=8,
                      help="The CNN's first width, a multiple of 8 (the "
                      "others are twice it); the ResNets have their own.")
  parser.add_argument("--domains", type=int, default=None,
                      help="Training domains (default: the dataset's, one "
                      "held out).")
  parser.add_argument("--batch", type=int, default=None,
                      help="Images per domain (default: PGrad-B's "
                      "batch_size on the dataset).")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", default=None, help="JSON file for results.")
  args = parser.parse_args(argv)
  dataset = DATASETS[args.model]
  if args.image_size is None:
    args.image_size = DEFAULT_IMAGE_SIZES[args.model]
  if args.domains is None:
    args.domains = len(catalog.DATASETS[dataset].domains) - 1
  if args.batch is None:
    args.batch = hparams_registry.default_hparams(
        "PGrad-B", dataset)["batch_size"]
  if min(args.trials) < 1:
    parser.error(f"--trials must be at least 1, got {args.trials}.")
  for name in ("image_size", "width", "domains", "batch", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1.")
  if args.width % 8:
    parser.error(f"--width must be a multiple of 8 (the CNN's GroupNorm has 8 "
                 f"groups), got {args.width}.")
  return args


def build_trial(args: argparse.Namespace, name: str,
                hparams: Mapping[str, Any], seed: int):
  """One trial's ``(network, params, stats)``: the model at ``seed``, a
  ResNet with the options the training loop gives it for algorithm
  ``name`` and its ``hparams``."""
  if args.model == "mnist_cnn":
    return common.digits_cnn(args.image_size, args.width, seed)
  model = models.build_model(
      args.model, num_classes=common.NUM_CLASSES,
      input_shape=(args.image_size, args.image_size, 3), rngs=nnx.Rngs(seed),
      **catalog.ALGORITHMS[name].model_options,
      **catalog.MODELS[args.model].hparams_options(hparams))
  return algorithms.Network.split(model)


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


def time_algorithm(name: str, args: argparse.Namespace) -> Iterator[dict]:
  """For every number of trials in turn, both variants' `common.Timing`s as
  dicts and their trial steps per hour, their steps checked equal."""
  hparams = hparams_registry.default_hparams(name, DATASETS[args.model])
  trials = [build_trial(args, name, hparams, seed)
            for seed in range(max(args.trials))]
  network = trials[0][0]
  algorithm = algorithms.build_algorithm(name, network, hparams,
                                         num_domains=args.domains)
  rng = np.random.default_rng(0)
  channels = 1 if args.model == "mnist_cnn" else 3
  inputs = [
      (params, stats, algorithm.init(params),
       common.digit_batches(rng, args.domains, args.batch, args.image_size,
                            channels),
       jax.random.key(seed))
      for seed, (_, params, stats) in enumerate(trials)]
  update = jax.jit(algorithm.update)
  vmapped = jax.jit(jax.vmap(algorithm.update))
  for count in args.trials:
    some = inputs[:count]
    stacked = [_stack(column) for column in zip(*some)]
    timings = common.time_interleaved(
        {"separate": lambda some=some: [update(*x) for x in some],
         "vmapped": lambda stacked=stacked: vmapped(*stacked)},
        args.repeats, warmup=0)
    vmapped_out = vmapped(*stacked)
    for trial, x in enumerate(some):
      check_same_step(x[0], update(*x),
                      jax.tree.map(lambda v, t=trial: v[t], vmapped_out))
    yield {
        "algorithm": name, "trials": count,
        "timings": {variant: timing.as_dict() | {
            "trial_steps_per_hour": count * 3.6e6 / timing.median_ms}
                    for variant, timing in timings.items()}}


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  record = {"benchmark": "vmap_trials", "args": vars(args),
            "environment": common.environment(), "results": []}
  rows = []
  for name in args.algorithms:
    for result in time_algorithm(name, args):
      separate = result["timings"]["separate"]["median_ms"]
      for variant, timing in result["timings"].items():
        rows.append([name, result["trials"], variant,
                     timing["compile_ms"] / 1e3, timing["median_ms"],
                     timing["median_ms"] / separate,
                     timing["trial_steps_per_hour"]])
      record["results"].append(result)
      # The results so far, so a benchmark cut short keeps what ran.
      if args.out:
        common.write_json(record, args.out)
  common.publish(record, common.format_table(
      ["algorithm", "trials", "variant", "compile s", "median ms",
       "/ separate", "trial steps / hour"], rows), args.out)
  return record


if __name__ == "__main__":
  main()
