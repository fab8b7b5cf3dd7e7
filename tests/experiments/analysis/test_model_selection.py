"""DomainBed model selection on hand-made records with hand-computed answers."""

import json

import numpy as np
import pytest

from experiments.analysis import model_selection as ms
from experiments.rundir import pack


def make_record(dataset, algorithm, test_env, hparams_seed, trial_seed, step,
                in_accs, out_accs, **extra):
  """One results.jsonl record; ``in_accs``/``out_accs`` list every domain."""
  record = {
      "args": {"dataset": dataset, "algorithm": algorithm,
               "test_envs": [test_env], "hparams_seed": hparams_seed,
               "trial_seed": trial_seed},
      "hparams": {},
      "step": step,
      **extra,
  }
  for i, (in_acc, out_acc) in enumerate(zip(in_accs, out_accs)):
    record[f"env{i}_in_acc"] = in_acc
    record[f"env{i}_out_acc"] = out_acc
  return record


def write_runs(root, records):
  """Writes records to ``root/<run>/results.jsonl``, a directory per run, in
  step order."""
  for r in sorted(records, key=lambda r: r["step"]):
    a = r["args"]
    run = (f"{a['dataset']}_{a['algorithm']}_{a['test_envs']}"
           f"_h{a['hparams_seed']}_t{a['trial_seed']}")
    (root / run).mkdir(parents=True, exist_ok=True)
    with open(root / run / "results.jsonl", "a") as f:
      f.write(json.dumps(r) + "\n")


# Dataset "Toy" (3 domains), held-out domain 0, two hparam draws, three trials,
# checkpoints at steps 100 and 200. Per record: the test accuracy env0_in, the
# held-out domain's env0_out, and the training domains' env1_out and env2_out.
#   (trial, hparams): {step: (env0_in, env0_out, env1_out, env2_out)}
TOY = {
    (0, 0): {100: (0.50, 0.10, 0.8, 0.6), 200: (0.90, 0.85, 0.6, 0.6)},
    (0, 1): {100: (0.40, 0.20, 0.7, 0.6), 200: (0.60, 0.55, 0.8, 0.7)},
    (1, 0): {100: (0.70, 0.60, 0.9, 0.9), 200: (0.20, 0.30, 0.5, 0.5)},
    (1, 1): {100: (0.30, 0.90, 0.8, 0.8), 200: (0.40, 0.45, 0.9, 0.8)},
    (2, 0): {100: (0.50, 0.10, 0.6, 0.6), 200: (0.65, 0.70, 0.6, 0.64)},
    (2, 1): {100: (0.80, 0.20, 0.7, 0.7), 200: (0.30, 0.60, 0.5, 0.5)},
}
# Training-domain validation, val = mean(env1_out, env2_out), best checkpoint:
#   trial 0: h0 (0.70 @100, test 0.50) vs h1 (0.75 @200, test 0.60) -> 0.60
#   trial 1: h0 (0.90 @100, test 0.70) vs h1 (0.85 @200, test 0.40) -> 0.70
#   trial 2: h0 (0.62 @200, test 0.65) vs h1 (0.70 @100, test 0.80) -> 0.80
# Oracle, val = env0_out at step 200:
#   trial 0: h0 0.85 (test 0.90) vs h1 0.55 -> 0.90
#   trial 1: h0 0.30 vs h1 0.45 (test 0.40) -> 0.40
#   trial 2: h0 0.70 (test 0.65) vs h1 0.60 -> 0.65
EXPECTED = {
    ms.TrainingDomainValidation: {0: 0.60, 1: 0.70, 2: 0.80},
    ms.OracleSelection: {0: 0.90, 1: 0.40, 2: 0.65},
}
# [0.6, 0.7, 0.8]: mean 70, population std 8.165 / sqrt(3) = 4.714.
# [0.9, 0.4, 0.65]: mean 65, population std 20.41 / sqrt(3) = 11.785.
EXPECTED_CELL = {
    ms.TrainingDomainValidation: "70.0 ± 4.7",
    ms.OracleSelection: "65.0 ± 11.8",
}


def toy_records():
  records = []
  for (trial, hparams), checkpoints in TOY.items():
    # Later steps come first in the file: "last" must mean the highest step.
    for step in sorted(checkpoints, reverse=True):
      env0_in, env0_out, env1_out, env2_out = checkpoints[step]
      records.append(make_record(
          "Toy", "ERM", 0, hparams, trial, step,
          in_accs=(env0_in, 0.99, 0.99),
          out_accs=(env0_out, env1_out, env2_out)))
  return records


def test_training_domain_validation_run_acc_ignores_held_out_domain():
  run = [r for r in toy_records()
         if r["args"]["trial_seed"] == 0 and r["args"]["hparams_seed"] == 0]
  # Counting env0_out would prefer step 200: (0.85+0.6+0.6)/3 > (0.1+0.8+0.6)/3.
  acc = ms.TrainingDomainValidation.run_acc(run)
  assert acc.val_acc == pytest.approx(0.7)
  assert acc.test_acc == 0.5


def test_oracle_run_acc_uses_the_last_step():
  run = [r for r in toy_records()
         if r["args"]["trial_seed"] == 1 and r["args"]["hparams_seed"] == 0]
  assert ms.OracleSelection.run_acc(run) == (0.30, 0.20)


@pytest.mark.parametrize("method", ms.SELECTION_METHODS)
def test_selected_accuracies_from_results_files(tmp_path, method):
  write_runs(tmp_path, toy_records())
  # A truncated last line, as a killed run leaves, is skipped.
  with open(next(tmp_path.glob("*/results.jsonl")), "a") as f:
    f.write('{"args": {"dat')
  records = pack.load_runs(tmp_path).records
  assert len(records) == 12

  selected = ms.selected_accuracies(records, method)
  assert selected.keys() == {("Toy", "ERM", 0)}
  assert selected["Toy", "ERM", 0] == pytest.approx(EXPECTED[method])
  accs = list(selected["Toy", "ERM", 0].values())
  assert ms.format_mean(accs) == EXPECTED_CELL[method]


def test_runs_with_two_test_envs_are_ignored():
  leave_one_out = make_record("Toy", "ERM", 0, 5, 0, 100, in_accs=(1, 1, 1),
                              out_accs=(1, 1, 1))
  leave_one_out["args"]["test_envs"] = [0, 1]
  selected = ms.selected_accuracies(
      toy_records() + [leave_one_out], ms.TrainingDomainValidation)
  assert selected["Toy", "ERM", 0][0] == pytest.approx(0.60)


def test_mean_and_error_matches_domainbed_formula():
  accs = [0.6, 0.7, 0.8]
  mean, err = ms.mean_and_error(accs)
  # DomainBed: 100 * np.std(list(data) / np.sqrt(len(data))).
  assert mean == pytest.approx(70.0)
  assert err == pytest.approx(100 * np.std(np.array(accs) / np.sqrt(3)))
  assert err == pytest.approx(100 * np.sqrt(0.02 / 3) / np.sqrt(3))
  assert ms.format_mean([0.5]) == "50.0 (n = 1)"
  assert ms.format_mean([]) == "X"


def test_draw_counts_are_the_draws_each_trial_selects_among():
  # Toy has both draws for every trial; without trial 2's draw 1, trial 2
  # selects from its default alone.
  records = toy_records()
  assert ms.draw_counts(records) == {("Toy", "ERM"): [2, 2, 2]}
  fewer = [r for r in records if (r["args"]["trial_seed"],
                                  r["args"]["hparams_seed"]) != (2, 1)]
  assert sorted(ms.draw_counts(fewer)["Toy", "ERM"]) == [1, 2, 2]


def _averaging_records(averaging, averaged_steps):
  """Toy's runs with ``--averaging``: the averaged model's metrics are
  Toy's, at ``averaged_steps``; the trained weights' are 0.5 everywhere
  (which no selection can tell apart)."""
  records = []
  for record in toy_records():
    record = {**record, "args": {**record["args"], "averaging": averaging}}
    for key in [k for k in record if k.startswith("env")]:
      if record["step"] in averaged_steps:
        record["averaged_" + key] = record[key]
      record[key] = 0.5
    records.append(record)
  return records


@pytest.mark.parametrize("method", ms.SELECTION_METHODS)
def test_runs_that_average_are_selected_by_their_averaged_model(method):
  ema = _averaging_records("ema", (100, 200))
  records = toy_records() + ema
  selected = ms.selected_accuracies(ms.averaged_model(records), method)
  assert selected.keys() == {("Toy", "ERM", 0), ("Toy", "ERM + EMA", 0)}
  # Each its own method, neither's records among the other's draws.
  assert selected["Toy", "ERM", 0] == pytest.approx(EXPECTED[method])
  assert selected["Toy", "ERM + EMA", 0] == pytest.approx(EXPECTED[method])
  # Their trained weights, as they are.
  assert ms.selected_accuracies(ema, method)["Toy", "ERM + EMA", 0] == {
      0: 0.5, 1: 0.5, 2: 0.5}


def test_swads_final_model_is_its_runs_only_checkpoint():
  # SWAD's final model is in the last record alone: training-domain
  # validation cannot pick step 100 (which is best in trials 1 and 2).
  swad = ms.averaged_model(_averaging_records("swad", (200,)))
  assert {r["step"] for r in swad} == {200}
  assert ms.selected_accuracies(swad, ms.TrainingDomainValidation)[
      "Toy", "ERM + SWAD", 0] == pytest.approx({0: 0.60, 1: 0.40, 2: 0.65})
