"""torchvision's ResNet-18 and ResNet-50 featurizers, with dropout on the
pooled features."""

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from experiments.models import layers


def _downsample(
    in_channels: int, out_channels: int, stride: int, bn_mode: layers.BNMode,
    **kwargs
) -> nnx.List | None:
  """torchvision's 1x1 conv + BN shortcut projection, when shapes change."""
  if stride == 1 and in_channels == out_channels:
    return None
  return nnx.List([
      layers.conv(in_channels, out_channels, 1, stride, **kwargs),
      layers.batch_norm(out_channels, bn_mode, **kwargs),
  ])


def _shortcut(downsample: nnx.List | None, x: jax.Array) -> jax.Array:
  if downsample is None:
    return x
  conv, bn = downsample
  return bn(conv(x))


class BasicBlock(nnx.Module):
  """Two 3x3 convs (ResNet-18/34). Names mirror torchvision's."""

  expansion = 1

  def __init__(
      self,
      in_channels: int,
      width: int,
      stride: int,
      *,
      bn_mode: layers.BNMode,
      **kwargs,
  ):
    self.conv1 = layers.conv(in_channels, width, 3, stride, **kwargs)
    self.bn1 = layers.batch_norm(width, bn_mode, **kwargs)
    self.conv2 = layers.conv(width, width, 3, 1, **kwargs)
    self.bn2 = layers.batch_norm(width, bn_mode, **kwargs)
    self.downsample = _downsample(in_channels, width, stride, bn_mode, **kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    return nnx.relu(y + _shortcut(self.downsample, x))


class Bottleneck(nnx.Module):
  """1x1, 3x3, 1x1 convs, strided on the 3x3 as torchvision's ResNet v1.5."""

  expansion = 4

  def __init__(
      self,
      in_channels: int,
      width: int,
      stride: int,
      *,
      bn_mode: layers.BNMode,
      **kwargs,
  ):
    out_channels = width * self.expansion
    self.conv1 = layers.conv(in_channels, width, 1, 1, **kwargs)
    self.bn1 = layers.batch_norm(width, bn_mode, **kwargs)
    self.conv2 = layers.conv(width, width, 3, stride, **kwargs)
    self.bn2 = layers.batch_norm(width, bn_mode, **kwargs)
    self.conv3 = layers.conv(width, out_channels, 1, 1, **kwargs)
    self.bn3 = layers.batch_norm(out_channels, bn_mode, **kwargs)
    self.downsample = _downsample(
        in_channels, out_channels, stride, bn_mode, **kwargs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = nnx.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    return nnx.relu(y + _shortcut(self.downsample, x))


_BlockType = type[BasicBlock] | type[Bottleneck]
# depth -> (block, blocks in each of the four stages).
RESNET_SPECS: dict[int, tuple[_BlockType, tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    50: (Bottleneck, (3, 4, 6, 3)),
}
# Attribute names of the four stages, as in torchvision.
RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


class ResNet(nnx.Module):
  """A torchvision-architecture ResNet featurizer (no ``fc``), with dropout.

  Attribute names mirror torchvision (``conv1``, ``bn1``, ``layer1``.. with
  integer block indices) so converted checkpoints map one-to-one; see
  ``experiments.weights.convert``.
  """

  def __init__(
      self,
      in_channels: int = 3,
      *,
      depth: int,
      bn_mode: layers.BNMode = "frozen",
      dropout: float = 0.0,
      rngs: nnx.Rngs,
      dtype: Dtype = jnp.float32,
      param_dtype: Dtype = jnp.float32,
  ):
    """Builds the network.

    Args:
      in_channels: number of input channels; pretrained RGB stems are adapted
        by ``experiments.weights.convert.adapt_input_channels``.
      depth: a key of :data:`RESNET_SPECS` (18 or 50).
      bn_mode: ``"frozen"`` or ``"train"``; see ``experiments.models``.
      dropout: dropout rate on the pooled features, active in train mode.
      rngs: initialization keys; also seeds the stored dropout stream.
      dtype: computation dtype.
      param_dtype: parameter dtype (BN statistics:
        `layers.statistics_dtype`).
    """
    if depth not in RESNET_SPECS:
      raise ValueError(
          f"depth must be one of {sorted(RESNET_SPECS)}, got {depth}."
      )
    block, stage_sizes = RESNET_SPECS[depth]
    layer_kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1 = layers.conv(in_channels, 64, 7, 2, **layer_kwargs)
    self.bn1 = layers.batch_norm(64, bn_mode, **layer_kwargs)
    channels = 64
    for stage, (name, num_blocks) in enumerate(zip(RESNET_STAGES, stage_sizes)):
      width = 64 * 2**stage
      blocks = nnx.List()
      for i in range(num_blocks):
        # The first block of every stage but the first halves the resolution.
        stride = 2 if stage > 0 and i == 0 else 1
        blocks.append(
            block(channels, width, stride, bn_mode=bn_mode, **layer_kwargs)
        )
        channels = width * block.expansion
      setattr(self, name, blocks)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.num_features = channels

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
    """Returns ``(N, num_features)`` pooled features, after dropout."""
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for name in RESNET_STAGES:
      for block in getattr(self, name):
        x = block(x)
    return self.dropout(x.mean(axis=(1, 2)), rngs=rngs)
