"""The Markdown report and the plots, on hand-made records."""

import pytest

from experiments import plots
from experiments import report
from test_model_selection import make_record, write_runs

# {(dataset, algorithm): {held-out env: {trial: test accuracy}}}, one hparam
# draw. ColoredDigits has 3 domains; "Toy" (not registered) has 2.
TEST_ACCS = {
    ("ColoredDigits", "ERM"): {0: {0: 0.5, 1: 0.7}, 1: {0: 0.8, 1: 0.8},
                               2: {0: 0.9, 1: 0.7}},
    ("ColoredDigits", "PGrad"): {0: {0: 0.6, 1: 0.6}, 1: {0: 0.9, 1: 0.7},
                                 2: {0: 0.9}},
    ("Toy", "ERM"): {0: {0: 0.4, 1: 0.6}, 1: {0: 0.6, 1: 0.6}},
}
NUM_DOMAINS = {"ColoredDigits": 3, "Toy": 2}
# Records written by the train command name their domains; Toy's, as older
# records, do not, and its columns show the env indices alone.
DOMAIN_NAMES = {"ColoredDigits": ["+90%", "+80%", "-90%"]}
STEPS = (5, 10)


def sweep_records():
  """Two checkpoints per run; the last is the best on every validation."""
  records = []
  for (dataset, algorithm), per_env in TEST_ACCS.items():
    n = NUM_DOMAINS[dataset]
    for env, per_trial in per_env.items():
      for trial, acc in per_trial.items():
        for step in STEPS:
          final = step == STEPS[-1]
          in_accs = [acc if final else 0.1] * n
          extra = {f"env{i}_in_loss": 1.0 / step + 0.1 * i + 0.01 * trial
                   for i in range(n) if i != env}
          if algorithm == "PGrad":
            extra["eigenvalues"] = [0.9 - 0.1 * trial, 0.09, 0.01]
          if dataset in DOMAIN_NAMES:
            extra["domains"] = DOMAIN_NAMES[dataset]
          records.append(make_record(
              dataset, algorithm, env, 0, trial, step, in_accs=in_accs,
              out_accs=[0.5 if final else 0.2] * n, **extra))
  return records


# ColoredDigits, ERM: env0 [0.5, 0.7] -> 60.0 ± 10/sqrt(2); env1 [0.8, 0.8];
# env2 [0.9, 0.7]; Avg (60 + 80 + 80) / 3 = 73.3. PGrad: env2 has trial 0
# only; Avg (60 + 80 + 90) / 3 = 76.7.
COLORED_TABLE = """\
| Algorithm | env0 (+90%) | env1 (+80%) | env2 (-90%) | Avg |
| :-- | :-: | :-: | :-: | :-: |
| ERM | 60.0 ± 7.1 | 80.0 ± 0.0 | 80.0 ± 7.1 | 73.3 |
| PGrad | 60.0 ± 0.0 | 80.0 ± 7.1 | 90.0 ± 0.0 | 76.7 |"""
# Toy: ERM env0 [0.4, 0.6], env1 [0.6, 0.6]; no PGrad runs.
TOY_TABLE = """\
| Algorithm | env0 | env1 | Avg |
| :-- | :-: | :-: | :-: |
| ERM | 50.0 ± 7.1 | 60.0 ± 0.0 | 55.0 |
| PGrad | X | X | X |"""
# Per trial, the mean over held-out domains. ColoredDigits ERM: trial 0
# (0.5+0.8+0.9)/3, trial 1 (0.7+0.8+0.7)/3, both 0.733. PGrad: only trial 0
# has every domain, (0.6+0.9+0.9)/3 = 0.8. Toy ERM: 0.5 and 0.6 -> 55.0 ±
# 5/sqrt(2). ERM Avg: (73.33 + 55.0) / 2 = 64.2.
SUMMARY_TABLE = """\
| Algorithm | ColoredDigits | Toy | Avg |
| :-- | :-: | :-: | :-: |
| ERM | 73.3 ± 0.0 | 55.0 ± 3.5 | 64.2 |
| PGrad | 80.0 ± 0.0 | X | X |"""


def test_report_tables_and_plots(tmp_path):
  write_runs(tmp_path / "sweep", sweep_records())
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()

  sections = text.split("## Model selection: ")[1:]
  assert [s.splitlines()[0] for s in sections] == [
      "training-domain validation set", "test-domain validation set (oracle)"]
  for section in sections:
    # Registered datasets come first, in registry order.
    assert section.index("### ColoredDigits") < section.index("### Toy")
    assert COLORED_TABLE in section
    assert TOY_TABLE in section
    assert "### Averages\n\n" + SUMMARY_TABLE in section

  plot_names = sorted(p.name for p in (tmp_path / "out" / "plots").iterdir())
  # Loss and accuracy per (dataset, held-out env); spectra only for PGrad.
  assert len(plot_names) == 2 * 5 + 3
  assert "ColoredDigits_env2_eigenvalues.png" in plot_names
  for name in plot_names:
    assert f"(plots/{name})" in text


def test_missing_input_fails(tmp_path):
  assert report.main(["--input_dir", str(tmp_path),
                      "--output_dir", str(tmp_path / "out")]) == 1


@pytest.mark.parametrize("plot", [plots.plot_loss_curves,
                                  plots.plot_eigenvalue_spectrum,
                                  plots.plot_heldout_accuracy])
def test_plot_writes_png(tmp_path, plot):
  records = [r for r in sweep_records()
             if r["args"]["dataset"] == "ColoredDigits"
             and r["args"]["test_envs"] == [0]]
  path = tmp_path / "figure.png"
  plot(records, path)
  assert path.read_bytes().startswith(b"\x89PNG")
  assert path.stat().st_size > 1000


def test_mean_std_over_runs():
  records = [{"step": s, "loss": v}
             for s, v in [(2, 1.0), (1, 4.0), (2, 3.0), (3, 5.0)]]
  steps, mean, std = plots.mean_std_over_runs(records + [{"step": 4}], "loss")
  assert steps.tolist() == [1, 2, 3]
  assert mean.tolist() == [4.0, 2.0, 5.0]
  assert std.tolist() == [0.0, 1.0, 0.0]
