"""The classifiers: a featurizer and a linear head (`Classifier`), built by
name (`build_model`), and the heads and context networks that some
algorithms' networks add to it (SagNet's, ARM's, MTL's)."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from experiments import catalog
from experiments.models import layers


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

  def features(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
    """Returns the ``(N, num_features)`` features of images ``x``."""
    return self.featurizer(x, rngs=rngs)

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None) -> jax.Array:
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
      init = layers.torch_default_init(in_channels * 5 * 5)
      self.convs.append(nnx.Conv(in_channels, width, (5, 5),
                                 padding=((2, 2), (2, 2)), kernel_init=init,
                                 bias_init=init, **kwargs))
      if width > 1:  # BatchNorm after all but the one-channel map.
        self.norms.append(layers.batch_norm(width, "train", **kwargs))
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

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None,
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

  def __call__(self, x: jax.Array, *, rngs: layers.Rng = None,
               embedding: jax.Array | None = None) -> jax.Array:
    """The logits of images ``x``, ``(N, H, W, C)``, with their domain's
    ``embedding``, ``(N, num_features)``: by default the batch's mean
    features, the marginal embedding of MTL's paper."""
    features = self.features(x, rngs=rngs)
    if embedding is None:
      embedding = jnp.broadcast_to(features.mean(0), features.shape)
    return self.head(jnp.concatenate(
        [features, embedding.astype(features.dtype)], axis=-1))
