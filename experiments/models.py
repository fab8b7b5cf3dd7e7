"""Flax NNX networks for the DomainBed experiments, built by name.

Every model is a :class:`Classifier`: a ``featurizer`` that maps channels-last
images ``(N, H, W, C)`` to a feature vector, followed by a linear ``head``.
Keeping the two apart (as DomainBed does) lets algorithms such as Fishr work
on the head alone.

Train/eval modes follow the NNX convention: a freshly built model is in train
mode; ``model.eval()`` switches dropout off and makes ``bn_mode="train"``
BatchNorm use its running statistics; ``model.train()`` switches back.

BatchNorm (the ResNets' and DenseNet's) has two modes:

* ``bn_mode="frozen"`` (default, as DomainBed when fine-tuning): normalizes with
  the running statistics in both modes and never updates them. BN scale and
  bias stay trainable ``nnx.Param``; the statistics are ``nnx.BatchStat``, so
  an optimizer over ``nnx.Param`` never sees them.
* ``bn_mode="train"``: in train mode, normalizes with the batch statistics and
  updates the running averages (``nnx.BatchStat``) on every forward pass,
  the variance's with the unbiased batch variance as PyTorch's
  (:class:`BatchNorm`).

Either way the statistics are in the model's dtype (`statistics_dtype`).

Every module takes ``dtype`` (computation) and ``param_dtype``, float32 by
default as DomainBed's; `build_model` hands its own to every part, and the
parts with state of their own follow the parameters: BatchNorm's statistics
(`statistics_dtype`) and, in ``experiments.algorithms``, DANN's
discriminator and GroupDRO's and Fishr's state.

Dropout on the pooled features (DomainBed's ``resnet_dropout``) draws its mask
from the ``rngs`` passed to ``__call__`` when given (an ``nnx.Rngs`` or a raw
key), else from the ``dropout`` stream (or ``default``) of the ``rngs`` the
model was built with.

Purely functional use (e.g. under ``jax.jit`` with an Optax optimizer)::

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, rest, x, y, key):
    # copy=True gives fresh Variables at this trace level, which BatchNorm
    # (bn_mode="train") needs to update its statistics inside jax.grad.
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(x, rngs=key)  # A fresh key per step drives dropout.
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  @jax.jit
  def train_step(params, rest, opt_state, x, y, key):
    grads, rest = jax.grad(loss_fn, has_aux=True)(params, rest, x, y, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state

Returning ``rest`` carries the running averages updated by ``bn_mode="train"``
to the next step (with ``bn_mode="frozen"`` it comes back unchanged). Passing
the key explicitly matters: the dropout stream stored in ``rest`` would only
advance if ``rest`` were returned, so without a key every step could reuse
one mask. Evaluation is ``nnx.merge(graphdef, params, rest)`` then
``.eval()`` (or the stateful model after ``nnx.update(model, params, rest)``).
"""

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from experiments import catalog

BNMode = Literal["frozen", "train"]
Rng = nnx.Rngs | jax.Array | None

# torchvision's ResNet init: Kaiming-normal on fan-out. Only matters when
# training from scratch, since pretrained weights overwrite it.
_RESNET_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


class Classifier(nnx.Module):
  """A featurizer followed by a linear classification head.

  Attributes:
    featurizer: maps ``(N, H, W, C)`` images to ``(N, num_features)``; has a
      ``num_features`` attribute and accepts ``rngs`` like ``__call__``.
    head: the linear layer mapping features to logits.
  """

  def __init__(
      self,
      featurizer: nnx.Module,
      num_classes: int,
      *,
      rngs: nnx.Rngs,
      dtype: Dtype = jnp.float32,
      param_dtype: Dtype = jnp.float32,
  ):
    self.featurizer = featurizer
    self.head = nnx.Linear(
        featurizer.num_features,
        num_classes,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )

  def features(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
    """Returns the ``(N, num_features)`` features of images ``x``."""
    return self.featurizer(x, rngs=rngs)

  def __call__(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
    """Returns the ``(N, num_classes)`` logits of images ``x``.

    Args:
      x: images, ``(N, H, W, C)``.
      rngs: key or ``nnx.Rngs`` for dropout in train mode; overrides the
        stream stored in the model.
    """
    return self.head(self.features(x, rngs=rngs))


def build_model(
    name: str,
    *,
    num_classes: int,
    input_shape: Sequence[int],
    rngs: nnx.Rngs,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
    context_net: bool = False,
    style_head: bool = False,
    domain_embedding: bool = False,
    **kwargs,
) -> Classifier:
  """Builds the featurizer registered as ``name`` with a fresh linear head.

  Args:
    name: a name of ``catalog.MODELS``, e.g. ``"mnist_cnn"``, ``"resnet50"``.
    num_classes: number of output logits.
    input_shape: channels-last shape of one image, ``(H, W, C)``; only ``C``
      shapes the model (all models pool globally).
    rngs: initialization keys; its ``dropout`` stream (else ``default``)
      seeds the model's stored dropout stream.
    dtype: computation dtype, e.g. ``jnp.bfloat16``.
    param_dtype: parameter dtype.
    context_net: build a :class:`ContextClassifier` (ARM's): the featurizer
      takes ``C + 1`` channels, the last one a context network's map.
    style_head: build a :class:`StyleClassifier` (SagNet's): a second
      linear head beside the classifier's.
    domain_embedding: build an :class:`EmbeddingClassifier` (MTL's): the
      head takes the features and an embedding of as many features.
    **kwargs: model options, e.g. ``bn_mode`` and ``dropout`` for ResNets.

  Returns:
    The :class:`Classifier`, in train mode.
  """
  if len(input_shape) != 3:
    raise ValueError(f"input_shape must be (H, W, C), got {input_shape}.")
  channels = input_shape[-1]
  featurizer = catalog.MODELS[name].build(
      channels + int(context_net), rngs=rngs, dtype=dtype,
      param_dtype=param_dtype, **kwargs)
  if context_net:
    return ContextClassifier(featurizer, num_classes, channels, rngs=rngs,
                             dtype=dtype, param_dtype=param_dtype)
  if domain_embedding:
    return EmbeddingClassifier(featurizer, num_classes, rngs=rngs,
                               dtype=dtype, param_dtype=param_dtype)
  model_class = StyleClassifier if style_head else Classifier
  return model_class(
      featurizer, num_classes, rngs=rngs, dtype=dtype, param_dtype=param_dtype
  )


class StyleClassifier(Classifier):
  """SagNet's network (DomainBed's ``algorithms.py`` lines 1126-1245).

  ``featurizer`` and ``head`` are SagNet's featurizer and content network,
  which predict; ``style_head``, a second linear head of the same shape
  (DomainBed's style network, a ``networks.Classifier`` as the content
  network, lines 1142-1146), only trains, in ``experiments.algorithms``'
  SagNet.
  """

  def __init__(self, featurizer: nnx.Module, num_classes: int, *,
               rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32):
    super().__init__(featurizer, num_classes, rngs=rngs, dtype=dtype,
                     param_dtype=param_dtype)
    self.style_head = nnx.Linear(featurizer.num_features, num_classes,
                                 dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)


def torch_default_init(fan_in: int) -> nnx.Initializer:
  """PyTorch's default init of Linear and Conv weights and biases, both
  ``U(-1 / sqrt(fan_in), 1 / sqrt(fan_in))``."""
  bound = fan_in**-0.5

  # Flax passes the layer's param_dtype; float32 is only the protocol's
  # default, as Flax's own initializers have it.
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


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
        nnx.Linear(a, b, kernel_init=torch_default_init(a),
                   bias_init=torch_default_init(a), dtype=dtype,
                   param_dtype=param_dtype, rngs=rngs)
        for a, b in zip(sizes[:-1], sizes[1:])])
    self.dropout = nnx.Dropout(dropout)
    self.num_features = out_features

  def __call__(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
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

  def __call__(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
    """Returns ``(N, widths[-1])`` features; ``rngs`` is unused (no dropout)."""
    del rngs
    for conv, norm in zip(self.convs, self.norms):
      x = norm(nnx.relu(conv(x)))
    return x.mean(axis=(1, 2))


class ContextNet(nnx.Module):
  """ARM's ``ContextNet`` (DomainBed's ``networks.py`` lines 211-228).

  5x5 convs padded by 2, so the map keeps the image's size: to 64 channels,
  BatchNorm, ReLU, again, then to one channel; PyTorch's default init and
  BatchNorm, its running variance included (`BatchNorm`).
  """

  WIDTHS = (64, 64, 1)

  def __init__(self, in_channels: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.convs = nnx.List()
    self.norms = nnx.List()
    for width in self.WIDTHS:
      init = torch_default_init(in_channels * 5 * 5)
      self.convs.append(nnx.Conv(in_channels, width, (5, 5),
                                 padding=((2, 2), (2, 2)), kernel_init=init,
                                 bias_init=init, **kwargs))
      if width > 1:  # BatchNorm after all but the one-channel map.
        self.norms.append(_batch_norm(width, "train", **kwargs))
      in_channels = width

  def __call__(self, x: jax.Array) -> jax.Array:
    """Returns the ``(N, H, W, 1)`` context map of every image."""
    for conv, norm in zip(self.convs, self.norms):
      x = nnx.relu(norm(conv(x)))
    return self.convs[-1](x)


class ContextClassifier(Classifier):
  """ARM's network (DomainBed's ``algorithms.py`` lines 452-474).

  The featurizer (for ``in_channels + 1`` channels) sees the image and a
  context channel; ``context_net``, a :class:`ContextNet`, maps images to
  contexts, which ARM (``experiments.algorithms``) averages over support sets.
  """

  def __init__(self, featurizer: nnx.Module, num_classes: int,
               in_channels: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    super().__init__(featurizer, num_classes, rngs=rngs, dtype=dtype,
                     param_dtype=param_dtype)
    self.context_net = ContextNet(in_channels, rngs=rngs, dtype=dtype,
                                  param_dtype=param_dtype)

  def __call__(self, x: jax.Array, *, rngs: Rng = None,
               context: jax.Array | None = None) -> jax.Array:
    """The logits of images ``x``, ``(N, H, W, C)``, with their ``context``,
    ``(N, H, W, 1)``: by default the mean map of the batch, one support set."""
    if context is None:
      context = jnp.broadcast_to(self.context_net(x).mean(0), x.shape[:-1] +
                                 (1,))
    return super().__call__(
        jnp.concatenate([x, context.astype(x.dtype)], axis=-1), rngs=rngs)


class EmbeddingClassifier(Classifier):
  """MTL's network (DomainBed's ``algorithms.py`` lines 1071-1124).

  The head sees every example's features and an embedding of its domain,
  a vector of as many features (lines 1082-1085, 1124).
  """

  def __init__(self, featurizer: nnx.Module, num_classes: int, *,
               rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32):
    # Not Classifier's __init__, whose head would take the features alone.
    self.featurizer = featurizer
    self.head = nnx.Linear(2 * featurizer.num_features, num_classes,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, *, rngs: Rng = None,
               embedding: jax.Array | None = None) -> jax.Array:
    """The logits of images ``x``, ``(N, H, W, C)``, with their domain's
    ``embedding``, ``(N, num_features)``: by default the batch's mean
    features, the marginal embedding of MTL's paper."""
    features = self.features(x, rngs=rngs)
    if embedding is None:
      embedding = jnp.broadcast_to(features.mean(0), features.shape)
    return self.head(jnp.concatenate(
        [features, embedding.astype(features.dtype)], axis=-1))


def statistics_dtype(param_dtype: Dtype) -> jnp.dtype:
  """The dtype of BatchNorm's running statistics in a model of ``param_dtype``.

  The model's own, as a PyTorch module keeps its buffers in its dtype, but
  never below float32: a running average in bfloat16 (8 bits of mantissa)
  would round away most of momentum 0.1's updates.
  """
  return jnp.promote_types(param_dtype, jnp.float32)


class BatchNorm(nnx.BatchNorm):
  """Flax's BatchNorm, its statistics in the model's dtype, optionally with
  PyTorch's running variance.

  Flax keeps the running ``mean`` and ``var`` in float32 whatever the
  model's dtype; here they take `statistics_dtype`. Both normalize a
  train-mode batch with its biased variance, but PyTorch's
  ``torch.nn.BatchNorm2d`` averages the *unbiased* batch variance into its
  running variance (its documentation: the value stored in the moving
  average "is calculated via the unbiased estimator"), while Flax averages
  the biased one. With ``unbiased_running_var`` the running variance
  follows PyTorch::

    running_var = momentum * running_var
                  + (1 - momentum) * var * m / (m - 1)

  in Flax's convention of ``momentum`` (PyTorch's ``1 - momentum``), ``var``
  the biased variance of the batch and ``m`` the number of values it
  averages per feature (``N * H * W`` for images). After many updates the
  running variance is ``m / (m - 1)`` times Flax's (docs/wilds.md measures
  it on WILDS's networks).
  """

  def __init__(self, num_features: int, *, unbiased_running_var: bool = False,
               param_dtype: Dtype = jnp.float32, **kwargs):
    """Builds the layer.

    Args:
      num_features: the number of features (channels), the last axis.
      unbiased_running_var: average the unbiased batch variance into the
        running variance, as PyTorch does.
      param_dtype: the dtype of ``scale`` and ``bias``; the statistics take
        `statistics_dtype` of it.
      **kwargs: `flax.nnx.BatchNorm`'s other arguments.
    """
    super().__init__(num_features, param_dtype=param_dtype, **kwargs)
    dtype = statistics_dtype(param_dtype)
    self.mean = nnx.BatchStat(self.mean[...].astype(dtype))
    self.var = nnx.BatchStat(self.var[...].astype(dtype))
    self.unbiased_running_var = unbiased_running_var

  def __call__(self, x: jax.Array,
               use_running_average: bool | None = None) -> jax.Array:
    """Normalizes ``x`` over all but its last axis (see `flax.nnx.BatchNorm`).

    Args:
      x: the inputs, features last.
      use_running_average: normalize with the running statistics, leaving
        them alone; ``None`` takes the layer's (eval mode sets it).

    Returns:
      The normalized inputs, as ``x``.

    Raises:
      ValueError: a train-mode pass with ``unbiased_running_var`` of one value
        per feature, whose unbiased variance is undefined (PyTorch refuses
        it too).
    """
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average or not self.unbiased_running_var:
      return super().__call__(x, use_running_average=use_running_average)
    if x.size == x.shape[-1]:
      raise ValueError("A train-mode BatchNorm needs more than one value per "
                       f"feature for its unbiased variance, got {x.shape}.")
    running_mean, running_var = self.mean[...], self.var[...]
    # Flax's pass normalizes with the batch's statistics and updates the
    # running ones with its biased variance; the update is redone below.
    y = super().__call__(x, use_running_average=False)
    values = x.astype(jnp.result_type(x, running_var))
    axes = tuple(range(x.ndim - 1))
    mean = values.mean(axes)
    var = values.var(axes, ddof=1)
    self.mean[...] = jax.lax.stop_gradient(
        self.momentum * running_mean + (1 - self.momentum) * mean)
    self.var[...] = jax.lax.stop_gradient(
        self.momentum * running_var + (1 - self.momentum) * var)
    return y


class FrozenBatchNorm(BatchNorm):
  """BatchNorm that always normalizes with its running statistics.

  Ignores train/eval mode and never updates ``mean``/``var`` (DomainBed's
  ``freeze_bn``); ``scale`` and ``bias`` remain trainable parameters.
  """

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x, use_running_average=True)


def _conv(
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    stride: int,
    *,
    kernel_init: nnx.Initializer = _RESNET_CONV_INIT,
    **kwargs,
) -> nnx.Conv:
  """A bias-free conv with PyTorch-style symmetric padding."""
  pad = kernel_size // 2
  return nnx.Conv(
      in_channels,
      out_channels,
      (kernel_size, kernel_size),
      strides=stride,
      padding=((pad, pad), (pad, pad)),
      use_bias=False,
      kernel_init=kernel_init,
      **kwargs,
  )


def _batch_norm(num_features: int, bn_mode: BNMode, **kwargs) -> BatchNorm:
  """A BatchNorm with PyTorch's defaults (momentum 0.1 = Flax's 0.9).

  A trained one keeps PyTorch's running variance (`BatchNorm`): every
  network here with trained BatchNorm has a PyTorch reference (WILDS's
  ``bn_mode="train"`` models, DomainBed's and its ``ContextNet``).
  """
  if bn_mode not in ("frozen", "train"):
    raise ValueError(f"bn_mode must be 'frozen' or 'train', got {bn_mode!r}.")
  if bn_mode == "frozen":
    return FrozenBatchNorm(num_features, momentum=0.9, epsilon=1e-5, **kwargs)
  return BatchNorm(num_features, momentum=0.9, epsilon=1e-5,
                   unbiased_running_var=True, **kwargs)


def _downsample(
    in_channels: int, out_channels: int, stride: int, bn_mode: BNMode, **kwargs
) -> nnx.List | None:
  """torchvision's 1x1 conv + BN shortcut projection, when shapes change."""
  if stride == 1 and in_channels == out_channels:
    return None
  return nnx.List([
      _conv(in_channels, out_channels, 1, stride, **kwargs),
      _batch_norm(out_channels, bn_mode, **kwargs),
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
      bn_mode: BNMode,
      **kwargs,
  ):
    self.conv1 = _conv(in_channels, width, 3, stride, **kwargs)
    self.bn1 = _batch_norm(width, bn_mode, **kwargs)
    self.conv2 = _conv(width, width, 3, 1, **kwargs)
    self.bn2 = _batch_norm(width, bn_mode, **kwargs)
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
      bn_mode: BNMode,
      **kwargs,
  ):
    out_channels = width * self.expansion
    self.conv1 = _conv(in_channels, width, 1, 1, **kwargs)
    self.bn1 = _batch_norm(width, bn_mode, **kwargs)
    self.conv2 = _conv(width, width, 3, stride, **kwargs)
    self.bn2 = _batch_norm(width, bn_mode, **kwargs)
    self.conv3 = _conv(width, out_channels, 1, 1, **kwargs)
    self.bn3 = _batch_norm(out_channels, bn_mode, **kwargs)
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
      bn_mode: BNMode = "frozen",
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
      bn_mode: ``"frozen"`` or ``"train"``; see the module docstring.
      dropout: dropout rate on the pooled features, active in train mode.
      rngs: initialization keys; also seeds the stored dropout stream.
      dtype: computation dtype.
      param_dtype: parameter dtype (BN statistics: `statistics_dtype`).
    """
    if depth not in RESNET_SPECS:
      raise ValueError(
          f"depth must be one of {sorted(RESNET_SPECS)}, got {depth}."
      )
    block, stage_sizes = RESNET_SPECS[depth]
    layer_kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1 = _conv(in_channels, 64, 7, 2, **layer_kwargs)
    self.bn1 = _batch_norm(64, bn_mode, **layer_kwargs)
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

  def __call__(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
    """Returns ``(N, num_features)`` pooled features, after dropout."""
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for name in RESNET_STAGES:
      for block in getattr(self, name):
        x = block(x)
    return self.dropout(x.mean(axis=(1, 2)), rngs=rngs)


# torchvision's DenseNet init: Kaiming-normal on fan-in.
_DENSENET_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")
# DenseNet-121 (Huang et al., CVPR 2017), as torchvision's densenet121.
DENSENET121_BLOCKS = (6, 12, 24, 16)
DENSENET_GROWTH = 32
DENSENET_BOTTLENECK = 4  # The 1x1 conv's width in multiples of the growth.
DENSENET_STEM = 64


class DenseLayer(nnx.Module):
  """BN-ReLU-1x1 conv, BN-ReLU-3x3 conv; its output joins its input."""

  def __init__(self, in_channels: int, *, bn_mode: BNMode, **kwargs):
    width = DENSENET_BOTTLENECK * DENSENET_GROWTH
    conv_kwargs = dict(kernel_init=_DENSENET_CONV_INIT, **kwargs)
    self.norm1 = _batch_norm(in_channels, bn_mode, **kwargs)
    self.conv1 = _conv(in_channels, width, 1, 1, **conv_kwargs)
    self.norm2 = _batch_norm(width, bn_mode, **kwargs)
    self.conv2 = _conv(width, DENSENET_GROWTH, 3, 1, **conv_kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.conv1(nnx.relu(self.norm1(x)))
    y = self.conv2(nnx.relu(self.norm2(y)))
    return jnp.concatenate([x, y], axis=-1)


class Transition(nnx.Module):
  """BN-ReLU-1x1 conv halving the channels, then 2x2 average pooling."""

  def __init__(self, in_channels: int, *, bn_mode: BNMode, **kwargs):
    self.norm = _batch_norm(in_channels, bn_mode, **kwargs)
    self.conv = _conv(in_channels, in_channels // 2, 1, 1,
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
      bn_mode: BNMode = "frozen",
      dropout: float = 0.0,
      rngs: nnx.Rngs,
      dtype: Dtype = jnp.float32,
      param_dtype: Dtype = jnp.float32,
  ):
    """Builds the network; the arguments are `ResNet`'s but ``depth``."""
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv0 = _conv(in_channels, DENSENET_STEM, 7, 2,
                       kernel_init=_DENSENET_CONV_INIT, **kwargs)
    self.norm0 = _batch_norm(DENSENET_STEM, bn_mode, **kwargs)
    channels = DENSENET_STEM
    for block, num_layers in enumerate(DENSENET121_BLOCKS, start=1):
      layers = nnx.List()
      for _ in range(num_layers):
        layers.append(DenseLayer(channels, bn_mode=bn_mode, **kwargs))
        channels += DENSENET_GROWTH
      setattr(self, f"denseblock{block}", layers)
      if block < len(DENSENET121_BLOCKS):
        setattr(self, f"transition{block}",
                Transition(channels, bn_mode=bn_mode, **kwargs))
        channels //= 2
    self.norm5 = _batch_norm(channels, bn_mode, **kwargs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.num_features = channels

  def __call__(self, x: jax.Array, *, rngs: Rng = None) -> jax.Array:
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
