"""Whether a run trained again lies within the noise of its cell's trials:
the numbers a study reports of a run (`reported_numbers`), and Student's t
test of the retrained ones against the committed trials' (`judge_noise`),
which ``experiments.runs.rerun``'s ``reproduce`` applies where a run
trained again elsewhere differs (docs/study.md#reproducing-the-study).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from experiments.runs import convergence
from experiments.runs import records

# How often, at most, a run trained again elsewhere is said to differ beyond
# the trials' noise when it does not (docs/study.md#reproducing-the-study):
# shared by `NUMBERS`, each tested at a third of it.
FALSE_ALARM_RATE = 0.01
# The numbers a study reports of a run (`reported_numbers`), as they are
# printed.
NUMBERS = {"held_out_acc": "held-out accuracy",
           "validation_acc": "validation accuracy",
           "log_final_loss": "log final training loss"}


def reported_numbers(run: Sequence[records.Record]) -> dict[str, Any]:
  """The numbers a study reports of one run, each with how many examples it
  counts.

  Args:
    run: the run's records, in step order.

  Returns:
    For each of `NUMBERS`, ``(value, examples)``: at the evaluation that
    training-domain validation selects
    (`experiments.analysis.model_selection.TrainingDomainValidation`), the
    held-out domain's accuracy and the training domains' mean validation
    accuracy; and the log of the final training-domain loss
    (`experiments.runs.convergence.run_end`), whose examples are 0 (not an
    accuracy). Examples are 0 where the records do not count them.
  """
  # Here, not at the top: launching and training (sweep.py imports this
  # module, through rerun) import nothing of the analysis.
  from experiments.analysis import model_selection  # pylint: disable=import-outside-toplevel
  selected = model_selection.TrainingDomainValidation.run_acc(run)
  last = run[-1]
  held_out = records.held_out_env(last)
  validation_examples = [last.get(records.env_key(i, "out", "examples"))
                         for i in records.train_envs(last)]
  return {
      "held_out_acc": (
          selected.test_acc,
          last.get(records.env_key(held_out, "in", "examples"), 0)),
      "validation_acc": (
          selected.val_acc,
          0 if None in validation_examples else sum(validation_examples)),
      "log_final_loss": (math.log(convergence.run_end(run).loss), 0),
  }


def t_two_sided_cdf(t: float, df: int) -> float:
  """P(|T| <= t) for Student's t with ``df`` (a positive integer) degrees of
  freedom, in closed form (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
  theta = math.atan(t / math.sqrt(df))
  cos2 = math.cos(theta) ** 2
  # A series in the powers of cos(theta) up to df - 2: the odd ones for odd
  # df, the even ones for even df.
  term, total = (math.cos(theta), 0.0) if df % 2 else (1.0, 0.0)
  for power in range(df % 2, df - 1, 2):
    total += term
    term *= cos2 * (power + 1) / (power + 2)
  if df % 2:
    return 2 / math.pi * (theta + math.sin(theta) * total)
  return math.sin(theta) * total


def t_critical(alpha: float, df: int) -> float:
  """The t with P(|T| > t) = ``alpha`` for Student's t with ``df`` degrees
  of freedom, by bisection of `t_two_sided_cdf`."""
  low, high = 0.0, 1.0
  while t_two_sided_cdf(high, df) < 1 - alpha:
    low, high = high, 2 * high
  for _ in range(100):
    middle = (low + high) / 2
    low, high = ((middle, high) if t_two_sided_cdf(middle, df) < 1 - alpha
                 else (low, middle))
  return high


def judge_noise(retrained: dict[str, Any], committed: dict[str, Any],
                trials: Sequence[dict[str, Any]],
                false_alarm_rate: float = FALSE_ALARM_RATE
                ) -> dict[str, dict[str, Any]] | None:
  """Whether a run trained again lies within its cell's spread of trials.

  For each of `NUMBERS`, the retrained value x is held against the n
  committed trials of the run's cell (its dataset, algorithm, draw and
  held-out domain; the committed run is one of them): their mean m and
  standard deviation s, at least one example's worth, 1 / examples, for an
  accuracy, since three trials can tie. If x were one more trial, (x - m) /
  (s sqrt(1 + 1/n)) would follow Student's t with n - 1 degrees of freedom,
  so x lies within the noise where that is at most `t_critical` of a third
  of ``false_alarm_rate``: the run is then said to differ when it does not
  with probability at most ``false_alarm_rate``. A run trained again from
  its own seeds lies closer to its committed run than another trial would,
  so the rate is lower in fact (docs/study.md).

  Args:
    retrained: `reported_numbers` of the run trained again.
    committed: `reported_numbers` of the committed run, for the report.
    trials: `reported_numbers` of every committed trial of the cell.
    false_alarm_rate: the rate above.

  Returns:
    None with fewer than two trials (no spread to judge by); else, for each
    of `NUMBERS`, the retrained and the committed value, the trials' values,
    mean and standard deviation, the most that the retrained value may lie
    from their mean (``allowed``), and whether it lies within.
  """
  if len(trials) < 2:
    return None
  n = len(trials)
  factor = t_critical(false_alarm_rate / len(NUMBERS), n - 1) * math.sqrt(
      1 + 1 / n)
  judged = {}
  for name in NUMBERS:
    values = [trial[name][0] for trial in trials]
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    examples = retrained[name][1]
    allowed = factor * max(sd, 1 / examples if examples else 0.0)
    judged[name] = {
        "retrained": retrained[name][0], "committed": committed[name][0],
        "trials": values, "mean": mean, "sd": sd, "allowed": allowed,
        "within": abs(retrained[name][0] - mean) <= allowed}
  return judged
