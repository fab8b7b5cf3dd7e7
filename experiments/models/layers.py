"""The layers that the networks share: BatchNorm with its statistics in the
model's dtype and PyTorch's running variance, frozen BatchNorm, and convs and
inits as PyTorch's."""

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

BNMode = Literal["frozen", "train"]
Rng = nnx.Rngs | jax.Array | None

# torchvision's ResNet init: Kaiming-normal on fan-out. Only matters when
# training from scratch, since pretrained weights overwrite it.
_RESNET_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def torch_default_init(fan_in: int) -> nnx.Initializer:
  """PyTorch's default init of Linear and Conv weights and biases, both
  ``U(-1 / sqrt(fan_in), 1 / sqrt(fan_in))``."""
  bound = fan_in**-0.5

  # Flax passes the layer's param_dtype; float32 is only the protocol's
  # default, as Flax's own initializers have it.
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


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


def conv(
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


def batch_norm(num_features: int, bn_mode: BNMode, **kwargs) -> BatchNorm:
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
