"""Task losses and metrics: classification and regression.

A batch's labels say its task: integer labels are classes, scored by the
cross-entropy of the model's ``(N, num_classes)`` logits; floating-point labels
are regression targets, scored by the squared error of the model's ``(N, 1)``
output. The dtype is static under ``jax.jit``, so every algorithm runs either
task unchanged.

The metrics are those WILDS reports (Koh et al., ICML 2021): accuracy and
worst-group accuracy (FMoW: the worst of the five regions), and Pearson's r
and worst-group Pearson's r (PovertyMap: the worse of urban and rural), by
the rules of WILDS 2.0.0's ``eval`` (docs/wilds.md). They work on NumPy
arrays of a whole evaluation split, outside ``jit``.
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


def _defined_pearson(predicted: np.ndarray, labels: np.ndarray) -> float:
  """Pearson's r, or NaN where it is undefined, as SciPy's ``pearsonr``: a
  constant input or fewer than two examples."""
  x = np.asarray(predicted, np.float64)
  y = np.asarray(labels, np.float64)
  # Compared exactly: the deviations of a constant from its float mean are
  # rounding noise, whose r is meaningless.
  if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
    return float("nan")
  x, y = x - x.mean(), y - y.mean()
  return float((x * y).sum() / np.sqrt((x**2).sum() * (y**2).sum()))


def pearson(predicted: np.ndarray, labels: np.ndarray) -> float:
  """Pearson's correlation of predicted and true values.

  Returns 0 where r is undefined (a constant input, or fewer than two
  examples), so that selecting the largest r is well defined; SciPy, and
  WILDS's ``r_all``, give NaN there. A constant prediction explains nothing.
  """
  r = _defined_pearson(predicted, labels)
  return 0.0 if np.isnan(r) else r


_METRICS = {"acc": accuracy, "mse": mean_squared_error, "r": pearson}
# WILDS's ``utils.minimum`` of no values.
_EMPTY_WORST = 0.0


def worst_group(
    metric: str, predicted: np.ndarray, labels: np.ndarray, groups: np.ndarray
) -> float:
  """The lowest of ``metric`` over the groups, as WILDS's worst group.

  A negative group is no group: FMoW's "Other" (-1), the examples from
  countries in none of its regions, which WILDS leaves out of the worst
  region (``fmow_dataset.py``, ``eval``) while counting them in the average
  accuracy. Groups without examples are left out, and so, for ``"r"``, are
  groups whose r is undefined (WILDS's ``utils.minimum`` drops NaN). With no
  group left the result is 0, WILDS's value for none.

  Args:
    metric: ``"acc"`` or ``"r"``.
    predicted: predictions, ``(N,)``.
    labels: labels, ``(N,)``.
    groups: the group of every example, ``(N,)``; negative for none.

  Returns:
    The metric of the group where it is lowest.
  """
  if metric not in ("acc", "r"):
    raise ValueError(f"worst_group takes 'acc' or 'r', got {metric!r}.")
  predicted, labels, groups = map(np.asarray, (predicted, labels, groups))
  compute = _defined_pearson if metric == "r" else accuracy
  values = [compute(predicted[groups == g], labels[groups == g])
            for g in np.unique(groups[groups >= 0])]
  defined = [v for v in values if not np.isnan(v)]
  return min(defined) if defined else _EMPTY_WORST


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
