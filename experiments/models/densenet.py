"""torchvision's DenseNet-121 featurizer, with dropout on the pooled
features."""

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from experiments.models import layers


# torchvision's DenseNet init: Kaiming-normal on fan-in.
_DENSENET_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")
# DenseNet-121 (Huang et al., CVPR 2017), as torchvision's densenet121.
DENSENET121_BLOCKS = (6, 12, 24, 16)
DENSENET_GROWTH = 32
DENSENET_BOTTLENECK = 4  # The 1x1 conv's width in multiples of the growth.
DENSENET_STEM = 64


class DenseLayer(nnx.Module):
  """BN-ReLU-1x1 conv, BN-ReLU-3x3 conv; its output joins its input."""

  def __init__(self, in_channels: int, *, bn_mode: layers.BNMode, **kwargs):
    width = DENSENET_BOTTLENECK * DENSENET_GROWTH
    conv_kwargs = dict(kernel_init=_DENSENET_CONV_INIT, **kwargs)
    self.norm1 = layers.batch_norm(in_channels, bn_mode, **kwargs)
    self.conv1 = layers.conv(in_channels, width, 1, 1, **conv_kwargs)
    self.norm2 = layers.batch_norm(width, bn_mode, **kwargs)
    self.conv2 = layers.conv(width, DENSENET_GROWTH, 3, 1, **conv_kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.conv1(nnx.relu(self.norm1(x)))
    y = self.conv2(nnx.relu(self.norm2(y)))
    return jnp.concatenate([x, y], axis=-1)


class Transition(nnx.Module):
  """BN-ReLU-1x1 conv halving the channels, then 2x2 average pooling."""

  def __init__(self, in_channels: int, *, bn_mode: layers.BNMode, **kwargs):
    self.norm = layers.batch_norm(in_channels, bn_mode, **kwargs)
    self.conv = layers.conv(in_channels, in_channels // 2, 1, 1,
                            kernel_init=_DENSENET_CONV_INIT, **kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.conv(nnx.relu(self.norm(x)))
    return nnx.avg_pool(x, (2, 2), strides=(2, 2))


class DenseNet(nnx.Module):
  """A torchvision-architecture DenseNet-121 featurizer (no ``classifier``).

  Attribute names mirror torchvision's ``features`` (``conv0``, ``norm0``,
  ``denseblock1``.. with 0-based layer indices for its 1-based
  ``denselayer1``.., ``transition1``.., ``norm5``) so that converted
  checkpoints map one-to-one; see ``experiments.weights.convert``. BatchNorm
  and
  dropout on the pooled features behave as in `ResNet`.
  """

  def __init__(
      self,
      in_channels: int = 3,
      *,
      bn_mode: layers.BNMode = "frozen",
      dropout: float = 0.0,
      rngs: nnx.Rngs,
      dtype: Dtype = jnp.float32,
      param_dtype: Dtype = jnp.float32,
  ):
    """Builds the network; the arguments are `ResNet`'s but ``depth``."""
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv0 = layers.conv(in_channels, DENSENET_STEM, 7, 2,
                             kernel_init=_DENSENET_CONV_INIT, **kwargs)
    self.norm0 = layers.batch_norm(DENSENET_STEM, bn_mode, **kwargs)
    channels = DENSENET_STEM
    for block, num_layers in enumerate(DENSENET121_BLOCKS, start=1):
      dense_layers = nnx.List()
      for _ in range(num_layers):
        dense_layers.append(DenseLayer(channels, bn_mode=bn_mode, **kwargs))
        channels += DENSENET_GROWTH
      setattr(self, f"denseblock{block}", dense_layers)
      if block < len(DENSENET121_BLOCKS):
        setattr(self, f"transition{block}",
                Transition(channels, bn_mode=bn_mode, **kwargs))
        channels //= 2
    self.norm5 = layers.batch_norm(channels, bn_mode, **kwargs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.num_features = channels

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
    """Returns ``(N, 1024)`` pooled features, after dropout."""
    x = nnx.relu(self.norm0(self.conv0(x)))
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in range(1, len(DENSENET121_BLOCKS) + 1):
      for layer in getattr(self, f"denseblock{block}"):
        x = layer(x)
      if block < len(DENSENET121_BLOCKS):
        x = getattr(self, f"transition{block}")(x)
    x = nnx.relu(self.norm5(x))
    return self.dropout(x.mean(axis=(1, 2)), rngs=rngs)
