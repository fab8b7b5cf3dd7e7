"""The small networks: DomainBed's MLP (DANN's discriminator) and its MNIST
CNN (the digits' featurizer)."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from experiments.models import layers


class MLP(nnx.Module):
  """DomainBed's ``MLP`` (``networks.py`` lines 47-70), DANN's discriminator.

  ``depth`` Linear layers (PyTorch's init), ``width`` wide but the last, each
  but the last followed by dropout and ReLU. Dropout draws from the key
  passed as ``rngs`` (folded in per layer) or an ``nnx.Rngs``; none is stored.
  """

  def __init__(self, in_features: int, out_features: int, *, width: int,
               depth: int, dropout: float = 0.0, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    if depth < 2:
      raise ValueError(f"An MLP's depth is at least 2, got {depth}.")
    sizes = [in_features] + [width] * (depth - 1) + [out_features]
    self.layers = nnx.List([
        nnx.Linear(a, b, kernel_init=layers.torch_default_init(a),
                   bias_init=layers.torch_default_init(a), dtype=dtype,
                   param_dtype=param_dtype, rngs=rngs)
        for a, b in zip(sizes[:-1], sizes[1:])])
    self.dropout = nnx.Dropout(dropout)
    self.num_features = out_features

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
    """Returns ``(N, out_features)``; ``x`` is flattened to ``(N, -1)``."""
    x = x.reshape(x.shape[0], -1)
    for i, layer in enumerate(self.layers[:-1]):
      key = jax.random.fold_in(rngs, i) if isinstance(rngs, jax.Array) else (
          rngs)
      x = nnx.relu(self.dropout(layer(x), rngs=key))
    return self.layers[-1](x)


class MNISTCNN(nnx.Module):
  """DomainBed's MNIST_CNN: four 3x3 convs, each + ReLU + GroupNorm(8).

  Widths are 64, 128 (stride 2), 128, 128; global average pooling gives 128
  features. ``widths`` narrows the network for CPU-sized experiments (each
  width must be a multiple of the 8 GroupNorm groups).
  """

  WIDTHS = (64, 128, 128, 128)
  STRIDES = (1, 2, 1, 1)

  def __init__(
      self,
      in_channels: int,
      *,
      rngs: nnx.Rngs,
      widths: Sequence[int] = WIDTHS,
      dtype: Dtype = jnp.float32,
      param_dtype: Dtype = jnp.float32,
  ):
    if len(widths) != len(self.STRIDES) or any(w % 8 for w in widths):
      raise ValueError(f"widths must be {len(self.STRIDES)} multiples of 8, "
                       f"got {tuple(widths)}.")
    self.convs = nnx.List()
    self.norms = nnx.List()
    for width, stride in zip(widths, self.STRIDES):
      # Explicit padding 1 matches PyTorch's; 'SAME' would pad stride-2 convs
      # asymmetrically.
      self.convs.append(
          nnx.Conv(
              in_channels,
              width,
              (3, 3),
              strides=stride,
              padding=((1, 1), (1, 1)),
              dtype=dtype,
              param_dtype=param_dtype,
              rngs=rngs,
          )
      )
      self.norms.append(
          nnx.GroupNorm(
              width,
              num_groups=8,
              epsilon=1e-5,  # PyTorch's default.
              dtype=dtype,
              param_dtype=param_dtype,
              rngs=rngs,
          )
      )
      in_channels = width
    self.num_features = widths[-1]

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
    """Returns ``(N, widths[-1])`` features; ``rngs`` is unused (no dropout)."""
    del rngs
    for conv, norm in zip(self.convs, self.norms):
      x = norm(nnx.relu(conv(x)))
    return x.mean(axis=(1, 2))
