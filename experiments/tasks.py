"""Task losses and metrics: classification and regression.

A batch's labels say its task: integer labels are classes, scored by the
cross-entropy of the model's ``(N, num_classes)`` logits; floating-point labels
are regression targets, scored by the squared error of the model's ``(N, 1)``
output. The dtype is static under ``jax.jit``, so every algorithm runs either
task unchanged.

The metrics are those WILDS reports (Koh et al., ICML 2021): accuracy and
worst-group accuracy (FMoW: the worst of the five regions), and Pearson's r
and worst-group Pearson's r (PovertyMap: the worse of urban and rural). They
work on NumPy arrays of a whole evaluation split, outside ``jit``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax


def is_regression(labels: jax.Array | np.ndarray) -> bool:
  """Whether ``labels`` are regression targets (floats) rather than classes."""
  return jnp.issubdtype(labels.dtype, jnp.floating)


def predictions(outputs: jax.Array, labels: jax.Array) -> jax.Array:
  """The predicted class, or the predicted value ``(N,)`` of a regression."""
  if is_regression(labels):
    return outputs[:, 0]
  return jnp.argmax(outputs, axis=-1)


def _single_loss(outputs: jax.Array, labels: jax.Array) -> jax.Array:
  if is_regression(labels):
    if outputs.shape[-1] != 1:
      raise ValueError(
          f"A regression model has one output, got {outputs.shape[-1]}; build "
          "it with num_classes=1 (the dataset's num_classes).")
    return (outputs[:, 0] - labels) ** 2
  return optax.softmax_cross_entropy_with_integer_labels(outputs, labels)


def example_loss(outputs: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
  """Per-example loss: cross-entropy of classes or squared error of values.

  A batch mixed by MixUp carries the partner's labels as ``"mix_label"`` and
  the weight of its own as ``"mix_weight"``; its loss is the weighted sum of
  the losses of the two labels.

  Args:
    outputs: ``(N, num_classes)`` logits, or ``(N, 1)`` predicted values.
    batch: ``{"label": (N,), ...}``.

  Returns:
    ``(N,)`` losses.
  """
  loss = _single_loss(outputs, batch["label"])
  if "mix_label" in batch:
    weight = batch["mix_weight"]
    loss = weight * loss + (1 - weight) * _single_loss(outputs,
                                                       batch["mix_label"])
  return loss


def accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
  """The fraction of predicted classes equal to the labels."""
  return float(np.mean(np.asarray(predicted) == np.asarray(labels)))


def mean_squared_error(predicted: np.ndarray, labels: np.ndarray) -> float:
  """The mean squared error of predicted values."""
  error = np.asarray(predicted, np.float64) - np.asarray(labels, np.float64)
  return float(np.mean(error**2))


def pearson(predicted: np.ndarray, labels: np.ndarray) -> float:
  """Pearson's correlation of predicted and true values.

  Returns 0 when either has no variance (a constant prediction explains
  nothing), where the formula would divide by zero.
  """
  x = np.asarray(predicted, np.float64)
  y = np.asarray(labels, np.float64)
  x, y = x - x.mean(), y - y.mean()
  scale = np.sqrt((x**2).sum() * (y**2).sum())
  return float((x * y).sum() / scale) if scale > 0 else 0.0


_METRICS = {"acc": accuracy, "mse": mean_squared_error, "r": pearson}


def worst_group(
    metric: str, predicted: np.ndarray, labels: np.ndarray, groups: np.ndarray
) -> float:
  """The lowest of ``metric`` over the groups present (WILDS's worst-group).

  Args:
    metric: ``"acc"`` or ``"r"``.
    predicted: predictions, ``(N,)``.
    labels: labels, ``(N,)``.
    groups: the group of every example, ``(N,)``.

  Returns:
    The metric of the group where it is lowest.
  """
  if metric not in ("acc", "r"):
    raise ValueError(f"worst_group takes 'acc' or 'r', got {metric!r}.")
  predicted, labels, groups = map(np.asarray, (predicted, labels, groups))
  return min(_METRICS[metric](predicted[groups == g], labels[groups == g])
             for g in np.unique(groups))


def split_metrics(
    predicted: np.ndarray, labels: np.ndarray, groups: np.ndarray | None = None
) -> dict[str, float]:
  """The metrics of one evaluation split, by task.

  Classification: ``acc`` (and ``worst_acc`` with groups). Regression:
  ``mse`` and ``r`` (and ``worst_r`` with groups).
  """
  if is_regression(np.asarray(labels)):
    names = ("mse", "r")
  else:
    names = ("acc",)
  result = {name: _METRICS[name](predicted, labels) for name in names}
  if groups is not None:
    worst = "r" if "r" in result else "acc"
    result[f"worst_{worst}"] = worst_group(worst, predicted, labels, groups)
  return result
