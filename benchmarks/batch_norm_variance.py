"""How far Flax's running variance drifts from PyTorch's over a WILDS run.

PyTorch averages the unbiased batch variance (``m / (m - 1)`` times the
biased one, ``m`` the values per feature: ``N * H * W``) into BatchNorm's
running variance; Flax the biased one. ``experiments.models.BatchNorm``
does either (``unbiased_running_var``).

For WILDS's networks with ``bn_mode="train"`` (PovertyMap's ResNet-18 on
8-band 224x224 images, FMoW's DenseNet-121 on 224x224 RGB), this traces one
forward pass of the real model to find every BatchNorm's ``m``, for a pass
over the pooled batch of 64 (WILDS's: 8 domains of 8) and a pass over one
domain's 8 (as GroupDRO, MMD and CORAL take). At each configuration's
smallest ``m`` it then runs ``--steps`` train-mode updates of both rules on
the same batches of activations, whose scale drifts from batch to batch as
a training network's does, and prints the relative difference of the two
running variances at the end, beside ``1 / (m - 1)``.

Run ``python -m benchmarks.batch_norm_variance``; it takes a few minutes on a
CPU.
"""

import argparse
import contextlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import models

# WILDS's networks and batches (see experiments/search_space.py): a
# pooled batch of 8 domains of 8 examples.
NETWORKS = {"PovertyMap resnet18": ("resnet18", 8),
            "FMoW densenet121": ("densenet121", 3)}
IMAGE_SIZE = 224
BATCHES = {"pooled": 64, "per domain": 8}
CHANNELS = 16  # Features of the simulated layer: every one is its own test.


@contextlib.contextmanager
def _recorded_inputs() -> Iterator[list[tuple[int, ...]]]:
  """Records the input shape of every `models.BatchNorm` call inside."""
  shapes = []
  call = models.BatchNorm.__call__

  def recording(self, x, *args, **kwargs):
    shapes.append(x.shape)
    return call(self, x, *args, **kwargs)

  models.BatchNorm.__call__ = recording
  try:
    yield shapes
  finally:
    models.BatchNorm.__call__ = call


def values_per_feature(model_name: str, channels: int,
                       batch: int) -> list[int]:
  """Every trained BatchNorm's ``m`` in one pass of ``batch`` images."""
  def forward(images):
    model = models.build_model(
        model_name, num_classes=1, input_shape=images.shape[1:],
        rngs=nnx.Rngs(0), bn_mode="train")
    return model(images)

  images = jax.ShapeDtypeStruct((batch, IMAGE_SIZE, IMAGE_SIZE, channels),
                                jnp.float32)
  with _recorded_inputs() as shapes:
    jax.eval_shape(forward, images)  # Shapes only: nothing is computed.
  return [int(np.prod(shape[:-1])) for shape in shapes]


def running_variances(m: int, steps: int, seed: int = 0) -> np.ndarray:
  """The running variance of both rules after ``steps`` updates.

  Returns:
    ``(2, CHANNELS)``: Flax's (biased) row, then PyTorch's (unbiased).
  """
  norms = [models.BatchNorm(CHANNELS, momentum=0.9, epsilon=1e-5,
                            unbiased_running_var=unbiased, rngs=nnx.Rngs(0))
           for unbiased in (False, True)]
  graphdef, stats = nnx.split(norms)

  def step(stats, key):
    scale_key, value_key = jax.random.split(key)
    # Every feature's scale drifts in [0.5, 2] from batch to batch.
    scale = jnp.exp(jax.random.uniform(scale_key, (CHANNELS,), minval=-0.7,
                                       maxval=0.7))
    x = scale * jax.random.normal(value_key, (m, CHANNELS))
    norms = nnx.merge(graphdef, stats)
    for norm in norms:
      norm(x)
    return nnx.state(norms), None

  keys = jax.random.split(jax.random.key(seed), steps)
  stats, _ = jax.jit(lambda s, k: jax.lax.scan(step, s, k))(stats, keys)
  norms = nnx.merge(graphdef, stats)
  return np.stack([np.asarray(norm.var[...]) for norm in norms])


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, nargs="+",
                      default=[100, 1000, 10000],
                      help="Lengths of the runs of statistics updates.")
  args = parser.parse_args(argv)
  print("network              batch       layers  smallest m  steps  "
        "PyTorch/Flax - 1  1/(m-1)")
  for label, (model_name, channels) in NETWORKS.items():
    for batch_label, batch in BATCHES.items():
      counts = values_per_feature(model_name, channels, batch)
      m = min(counts)
      for steps in args.steps:
        flax_var, torch_var = running_variances(m, steps)
        gap = float(np.mean(torch_var / flax_var - 1))
        print(f"{label:20s} {batch_label:10s} {len(counts):7d} {m:11d} "
              f"{steps:6d} {gap:17.3e} {1 / (m - 1):8.3e}")


if __name__ == "__main__":
  main()
