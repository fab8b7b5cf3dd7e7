"""The Markdown report, its plots and its claims section, on hand-made records
and a tiny real sweep."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from matplotlib.backends import backend_agg
from matplotlib import colormaps
from matplotlib.figure import Figure
from PIL import Image

from experiments import catalog
from experiments import train
from experiments.runs import convergence
from experiments.analysis import claims as claims_lib
from experiments.analysis import curves
from experiments.analysis import model_selection
from experiments.analysis import plots
from experiments.rundir import pack
from experiments.rundir import records as records_lib
from experiments.analysis import report
from experiments.runs import study
from experiments.runs import grid as grid_lib
from experiments.runs import sweep
from test_claims import fixture_one_openmp_thread  # pylint: disable=unused-import
from test_convergence import _run as converging_run
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
# only, which the cell and the average say; Avg (60 + 80 + 90) / 3 = 76.7.
COLORED_TABLE = """\
| Algorithm | env0 (+90%) | env1 (+80%) | env2 (-90%) | Avg |
| :-- | :-: | :-: | :-: | :-: |
| ERM | 60.0 ± 7.1 | 80.0 ± 0.0 | 80.0 ± 7.1 | 73.3 |
| PGrad | 60.0 ± 0.0 | 80.0 ± 7.1 | 90.0 (1 of 2 trials) | 76.7 (incomplete) |"""
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
| PGrad | 80.0 (1 of 2 trials) | X | X |"""


def _build_figures_only(monkeypatch):
  """From here on, figures are built but neither drawn nor written: drawing
  and writing them takes most of a report's time."""
  monkeypatch.setattr(plots, "save", lambda figure, path: None)


@pytest.fixture(name="undrawn")
def fixture_undrawn(monkeypatch):
  """`_build_figures_only`, for the tests of what the report says rather
  than of what it shows."""
  _build_figures_only(monkeypatch)


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
  assert "ColoredDigits_env2_PGrad_eigenvalues.png" in plot_names
  for name in plot_names:
    assert f"(plots/{name})" in text
  # Toy has no PGrad runs: the report says why it has no spectrum.
  reason = ("Toy, held-out env1: no eigenvalue spectrum: none of ERM records "
            "eigenvalues")
  assert reason in text


def test_rows_selected_among_fewer_draws_say_so(tmp_path, undrawn):
  # A second draw for ColoredDigits' ERM alone, worse on validation, so the
  # selected accuracies stay the same: PGrad's rows there, and every row of
  # the averages, selected among fewer draws than ERM's ColoredDigits cells.
  second = [make_record(r["args"]["dataset"], "ERM", r["args"]["test_envs"][0],
                        1, r["args"]["trial_seed"], r["step"],
                        in_accs=[0.0] * 3, out_accs=[0.3] * 3)
            for r in sweep_records()
            if r["args"]["dataset"] == "ColoredDigits"
            and r["args"]["algorithm"] == "ERM"]
  write_runs(tmp_path / "sweep", sweep_records() + second)
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  colored = COLORED_TABLE.replace("| PGrad |", "| PGrad (1 of 2 draws) |")
  summary = (SUMMARY_TABLE.replace("| ERM |", "| ERM (1-2 of 2 draws) |")
             .replace("| PGrad |", "| PGrad (1 of 2 draws) |"))
  for section in text.split("## Model selection: ")[1:]:
    assert colored in section
    # Toy's cells all hold one draw: its table says nothing.
    assert TOY_TABLE in section
    assert "### Averages\n\n" + summary in section


def test_hparams_seeds_reports_only_those_draws(tmp_path, capsys, undrawn):
  # A second draw of ColoredDigits' ERM, best on validation and worse on
  # the held-out domains: selected when reported, absent when filtered out.
  # ColoredDigits alone: the Toy dataset's plots would only slow it down.
  draw = [make_record("ColoredDigits", "ERM", env, 1, trial, STEPS[-1],
                      in_accs=[0.1] * 3, out_accs=[0.9] * 3)
          for env in range(3) for trial in (0, 1)]
  defaults = [r for r in sweep_records()
              if r["args"]["dataset"] == "ColoredDigits"]
  write_runs(tmp_path / "sweep", defaults + draw)

  def reported(*flags):
    assert report.main(["--input_dir", str(tmp_path / "sweep"),
                        "--output_dir", str(tmp_path / "out"), *flags]) == 0
    return (tmp_path / "out" / "results.md").read_text()

  everything = reported()
  assert "| ERM | 10.0 ± 0.0 | 10.0 ± 0.0 | 10.0 ± 0.0 | 10.0 |" in everything
  assert COLORED_TABLE not in everything
  reported_defaults = reported("--hparams_seeds", "0")
  assert f"{len(defaults)} records (runs with hparams_seed 0)." in (
      reported_defaults)
  assert COLORED_TABLE in reported_defaults
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "none"),
                      "--hparams_seeds", "7"]) == 1
  assert "(runs with hparams_seed 7)" in capsys.readouterr().err


@pytest.mark.parametrize("other_final_validation, selected_plateaued", [
    (0.80, "0/1"),  # Validates best and is still moving: selected.
    (0.40, "1/1"),  # Still moving and validates worse: not selected.
])
def test_training_table_counts_the_selected_runs_that_plateaued(
    other_final_validation, selected_plateaued):
  plateaued = converging_run(0.68)
  assert convergence.run_end(plateaued).plateaued
  other = [{**r, "args": {**r["args"], "hparams_seed": 1}}
           for r in converging_run(other_final_validation)]
  assert not convergence.run_end(other).plateaued
  table = report.training_table(plateaued + other, ["ERM"])
  row = [cell.strip() for cell in table.splitlines()[2].split("|")[1:-1]]
  assert row[:4] == ["ERM", "2", "1/2", selected_plateaued]


def test_training_table_gives_the_steps_the_runs_trained():
  # Three draws of one run, stopped at steps 50, 20 and 30.
  runs = [[{**r, "args": {**r["args"], "hparams_seed": seed}}
           for r in converging_run(0.68)[:evaluations]]
          for seed, evaluations in ((0, 5), (1, 2), (2, 3))]
  table = report.training_table([r for run in runs for r in run], ["ERM"])
  header = [cell.strip() for cell in table.splitlines()[0].split("|")[1:-1]]
  row = [cell.strip() for cell in table.splitlines()[2].split("|")[1:-1]]
  assert row[header.index("steps (median; most)")] == "30; 50"


def _domainbed_record(algorithm, trial, step):
  """A ColoredDigits record as DomainBed's own train.py writes it: every
  domain's accuracies, but no loss of any domain."""
  return make_record("ColoredDigits", algorithm, 0, 0, trial, step,
                     in_accs=[0.5] * 3, out_accs=[0.4 + 0.01 * step] * 3,
                     epoch=step / 100, loss=0.3, step_time=0.1, mem_gb=0.0)


@pytest.mark.parametrize("without_losses", [
    ("ERM",), ("ERM", "PGrad", "PGrad-Bottom")])
def test_runs_without_training_losses_are_reported_without_them(
    tmp_path, capsys, undrawn, without_losses):
  # The case seen: the report of such a sweep failed, KeyError:
  # 'env1_in_loss'. This project's runs record every domain's loss; a
  # sweep of DomainBed's own runs (alone, or beside this project's) does not.
  steps, trials = (5, 10, 15), (0, 1)
  records = []
  for algorithm in ("ERM", "PGrad", "PGrad-Bottom"):
    for trial in trials:
      for step in steps:
        record = _domainbed_record(algorithm, trial, step)
        if algorithm not in without_losses:
          record.update(env1_in_loss=1 / step + trial,
                        env2_in_loss=2 / step + trial,
                        eigenvalues=[0.9, 0.1])
        records.append(record)
  write_runs(tmp_path / "sweep", records)
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  err = capsys.readouterr().err
  assert "nan" not in text.lower()

  training = text.split("## Training\n")[1].split("\n## ")[0]
  header, _, *rows = [[cell.strip() for cell in line.split("|")[1:-1]]
                      for line in training.splitlines()
                      if line.startswith("|")]
  losses = {row[0]: row[header.index("final training loss")] for row in rows}
  assert list(losses) == ["ERM", "PGrad", "PGrad-Bottom"]
  # The runs' final loss, the mean over domains 1 and 2, over the trials.
  final = np.array([np.mean([1 / steps[-1] + t, 2 / steps[-1] + t])
                    for t in trials], np.float64)
  measured = (f"{final.mean():.4f} ± "
              f"{final.std(ddof=1) / np.sqrt(len(final)):.4f}")
  assert losses == {algorithm: "n/a" if algorithm in without_losses
                    else measured for algorithm in losses}
  # Its other columns read accuracies alone.
  for row in rows:
    assert row[header.index("training acc. (%)")] == "50.0 ± 0.0"
  assert (f"{2 * len(without_losses)} of the 6 runs record no training-domain "
          "losses (env{i}_in_loss, which DomainBed's own runs do not write): "
          "their final training loss is n/a.") in training

  # The loss-based claims read every run they compare, or are not measured.
  claims = json.loads((tmp_path / "out" / "claims" /
                       "claims.json").read_text())
  lacking = {"smoothness": [a for a in ("ERM", "PGrad")
                            if a in without_losses],
             "bottom": [a for a in ("PGrad", "PGrad-Bottom")
                        if a in without_losses]}
  for claim, algorithms in lacking.items():
    reason = (f"ColoredDigits: no {claim} numbers or figures: "
              f"{2 * len(algorithms)} of its 4 runs ({', '.join(algorithms)}) "
              "record no training-domain losses (env{i}_in_loss, which "
              "DomainBed's own runs do not write).")
    assert (reason in text) == bool(algorithms), claim
    assert (reason in err) == bool(algorithms), claim
    assert (claim in claims.get("ColoredDigits", {})) == (not algorithms)
  plot_reason = ("ColoredDigits, held-out env0: no training loss per domain "
                 "plot: no run records env{i}_in_loss." if len(
                     without_losses) == 3 else
                 f"ColoredDigits, held-out env0: no loss curves of "
                 f"{', '.join(without_losses)}: their runs record no "
                 "env{i}_in_loss.")
  assert plot_reason in text


def test_report_skips_damaged_runs_and_says_why(tmp_path, capsys, undrawn):
  write_runs(tmp_path / "sweep", sweep_records())
  damaged = sorted((tmp_path / "sweep").iterdir())[0]
  lines = (damaged / "results.jsonl").read_text().splitlines(keepends=True)
  (damaged / "results.jsonl").write_text("".join(reversed(lines)))
  (damaged / "done").write_text("")
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  why = (f"{damaged / 'results.jsonl'} (a finished run): line 2 is of step "
         f"{STEPS[0]}, after step {STEPS[1]}")
  assert f"Skipped {damaged}, its records damaged: {why}" in (
      capsys.readouterr().err)
  total = len(sweep_records())
  assert (f"{total - len(STEPS)} records; 1 runs skipped, their records "
          f"damaged: {damaged}. Cells:") in (
              tmp_path / "out" / "results.md").read_text()


def test_plots_name_domains_as_the_records_do():
  assert plots.domain_name(1, ["0°", "15°"]) == "env1 (15°)"
  assert plots.domain_name(1, None) == "env1"  # Records before names.


def test_missing_input_fails(tmp_path, capsys):
  # A directory without runs: nothing to report yet.
  assert report.main(["--input_dir", str(tmp_path),
                      "--output_dir", str(tmp_path / "out")]) == 1
  # No directory at all: the user's mistake, named before anything is read.
  with pytest.raises(SystemExit) as raised:
    report.main(["--input_dir", str(tmp_path / "sweeep"),
                 "--output_dir", str(tmp_path / "out")])
  assert raised.value.code == 2
  # Named by the command the docs give, not by the file that argparse sees.
  assert (f"python -m experiments.analysis.report: error: --input_dir "
          f"{tmp_path / 'sweeep'}: no such directory") in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


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


@pytest.mark.parametrize("plot", [plots.plot_loss_curves,
                                  plots.plot_heldout_accuracy,
                                  plots.plot_mean_training_loss])
def test_step_axes_tick_whole_steps(tmp_path, plot):
  # A sweep of one evaluation per run: matplotlib's default ticks around a
  # single step are fractional (9.6, 9.8, ...), steps that never happen.
  records = [r for r in sweep_records()
             if r["args"]["dataset"] == "ColoredDigits"
             and r["args"]["test_envs"] == [0] and r["step"] == STEPS[-1]]
  figure = plot(records, tmp_path / "figure.png")
  for axes in figure.axes:
    low, high = axes.get_xlim()
    ticks = [t for t in axes.get_xticks() if low <= t <= high]
    assert ticks and all(t == round(t) for t in ticks), ticks


def test_step_tick_labels_of_a_long_run_do_not_run_into_each_other(tmp_path):
  # Five narrow panels over 2,000 steps, as the study's smoothness figures:
  # ten whole-step ticks a panel wrote "10001250150017502000".
  records = [{"args": {"dataset": "RotatedDigits", "algorithm": "ERM",
                       "test_envs": [0], "trial_seed": 0, "hparams_seed": 0},
              "domains": [f"{a}°" for a in range(0, 90, 15)], "step": step,
              **{f"env{i}_in_loss": 1.0 / step for i in range(6)},
              **{f"env{i}_{split}_acc": 0.5 for i in range(6)
                 for split in ("in", "out")}}
             for step in range(100, 2001, 100)]
  figure = plots.plot_loss_curves(records, tmp_path / "figure.png")
  canvas = backend_agg.FigureCanvasAgg(figure)  # Laid out as when saved.
  canvas.draw()
  renderer = canvas.get_renderer()
  for axes in figure.axes:
    labels = [label for label in axes.get_xticklabels() if label.get_text()]
    boxes = [label.get_window_extent(renderer) for label in labels]
    # Apart by a third of a character's height at least: closer, the
    # numbers read as one.
    gap = labels[0].get_fontsize() * figure.dpi / 72 / 3
    assert len(boxes) >= 2
    for left, right in zip(boxes, boxes[1:]):
      assert right.x0 - left.x1 >= gap, [label.get_text() for label in labels]


def test_mean_std_over_runs():
  records = [{"step": s, "loss": v}
             for s, v in [(2, 1.0), (1, 4.0), (2, 3.0), (3, 5.0)]]
  steps, mean, std = plots.mean_std_over_runs(records + [{"step": 4}], "loss")
  assert steps.tolist() == [1, 2, 3]
  assert mean.tolist() == [4.0, 2.0, 5.0]
  assert std.tolist() == [0.0, 1.0, 0.0]


def test_loss_bands_span_the_trials_on_a_log_scale(tmp_path):
  # Three trials: the band is their range, not the mean +- one standard
  # deviation (which would go below zero on a log scale).
  records = [make_record("ColoredDigits", "ERM", 0, 0, trial, step,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                         env1_in_loss=step * (1 + trial) * 0.1,
                         env2_in_loss=1.0)
             for trial in (0, 1, 2) for step in STEPS]
  axes = plots.plot_loss_curves(records, tmp_path / "loss.png").axes[0]
  assert axes.get_yscale() == "log"
  (band,) = axes.collections
  edge = band.get_paths()[0].vertices[:, 1]
  assert {round(y, 9) for y in edge} == {
      round(s * (1 + t) * 0.1, 9) for s in STEPS for t in (0, 2)}


def test_report_says_why_a_plot_is_missing(tmp_path, capsys):
  records = [make_record("ColoredDigits", "ERM", 0, 1, 0, 5,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3)]
  write_runs(tmp_path / "sweep", records)
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  reason = "ColoredDigits, held-out env0: no plots: no run has hparams_seed 0."
  assert reason in capsys.readouterr().err
  assert reason in (tmp_path / "out" / "results.md").read_text()


def _one_evaluation_sweep():
  """A run of every smoothness and bottom-eigenvector algorithm, evaluated
  once, its records without step times (as records of older runs)."""
  return [make_record("ColoredDigits", algorithm, 0, 0, 0, 5,
                      in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                      env1_in_loss=0.7, env2_in_loss=0.9,
                      **({"eigenvalues": [0.9, 0.1]}
                         if algorithm.startswith("PGrad") else {}))
          for algorithm in ("ERM", "PGrad", "PGrad-Bottom")]


@pytest.mark.filterwarnings("error")  # NumPy's warnings fail the test.
def test_a_sweep_of_one_evaluation_draws_points_and_says_what_it_cannot(
    tmp_path, capsys, monkeypatch):
  write_runs(tmp_path / "sweep", _one_evaluation_sweep())
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  assert "nan" not in text.lower()
  training = text.split("## Training\n")[1].split("\n## ")[0]
  header, _, *rows = [line.split("|")[1:-1] for line in training.splitlines()
                      if line.startswith("|")]
  header = [cell.strip() for cell in header]
  for row in rows:
    cells = dict(zip(header, (cell.strip() for cell in row)))
    # No change over a single evaluation, no time without step times.
    assert cells["validation change, last 20% of steps (pts)"] == "n/a"
    assert cells["training time per run (s, median)"] == "n/a"
    # One run has no standard error.
    assert cells["final training loss"] == "0.8000 (n = 1)"
  err = capsys.readouterr().err
  # Smoothness reads ERM and PGrad, the bottom claim PGrad and PGrad-Bottom.
  for claim in ("smoothness", "bottom"):
    reason = (f"ColoredDigits: no {claim} numbers or figures: 2 of its 2 runs "
              "have a single evaluation")
    assert reason in text
    assert reason in err
  assert not list((tmp_path / "out" / "claims").glob("*_roughness.png"))

  # A curve of one point is drawn as a marker with error bars, unjoined:
  # the report's figures again, not drawn a second time.
  _build_figures_only(monkeypatch)
  written, skipped = curves.write_plots(
      pack.load_runs(tmp_path / "sweep").records, "ColoredDigits", 0,
      tmp_path / "out" / "plots")
  assert skipped == []
  figures = {plot.caption: plot.figure for plot in written}
  for caption in ("held-out accuracy", "training loss per domain"):
    for axes in figures[caption].axes:
      assert [bars.get_label() for bars in axes.containers] == [
          "ERM", "PGrad", "PGrad-Bottom"]
      for bars in axes.containers:
        point = bars.lines[0]
        assert len(point.get_xdata()) == 1 and point.get_marker() == "o"
        assert point.get_linestyle() == "None"


def test_plots_are_palette_pngs_that_look_as_full_colour(tmp_path):
  figure = plots.plot_heldout_accuracy(sweep_records(), tmp_path / "a.png")
  full = tmp_path / "full.png"
  figure.savefig(full, dpi=plots.DPI)
  with Image.open(tmp_path / "a.png") as written, Image.open(full) as drawn:
    assert written.mode == "P" and "Software" in drawn.info
    assert "Software" not in written.info
    got = np.asarray(written.convert("RGB"), np.float64)
    expected = np.asarray(drawn.convert("RGB"), np.float64)
  assert got.shape == expected.shape
  # Levels of 0-255: a fraction of a level off on average.
  assert np.abs(got - expected).mean() < 1
  assert (tmp_path / "a.png").stat().st_size < full.stat().st_size / 2
  # The same figure, the same bytes.
  plots.plot_heldout_accuracy(sweep_records(), tmp_path / "b.png")
  assert (tmp_path / "b.png").read_bytes() == (tmp_path / "a.png").read_bytes()


def test_curves_of_several_points_are_lines_without_markers(tmp_path):
  figure = plots.plot_heldout_accuracy(sweep_records()[:4],
                                       tmp_path / "accuracy.png")
  for line in figure.axes[0].get_lines():
    assert len(line.get_xdata()) == 2 and line.get_marker() == "None"


def test_every_claims_figure_has_a_title(tmp_path, monkeypatch):
  # The figures as built, not drawn: their titles are set before.
  figures = {}
  monkeypatch.setattr(
      plots, "save",
      lambda figure, path: figures.__setitem__(Path(path).name, figure))
  rng = np.random.default_rng(0)
  records, trajectories = [], {}
  for algorithm in ("ERM", "PGrad", "PGrad-Bottom", "PGrad-B"):
    run = [make_record("ColoredDigits", algorithm, 0, 0, 0, step,
                       in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                       env1_in_loss=1 / step, env2_in_loss=2 / step)
           for step in STEPS]
    records += run
    if algorithm in catalog.TRAJECTORY_ALGORITHMS:
      files = {}
      for step in (0, *STEPS):
        files[step] = tmp_path / f"{algorithm}_{step}.npy"
        np.save(files[step], rng.standard_normal(8))
      trajectories[tmp_path / algorithm] = (run[0], files)
  paths = claims_lib.project_paths(trajectories)
  selected = claims_lib.select(
      records, [(trajectories[d][0], paths[d]) for d in sorted(paths)])
  measured = claims_lib.measure(selected)
  written = plots.plot_claims(selected, measured, tmp_path)
  assert {path.name for _, path in written} == {
      "ColoredDigits_roughness.png", "ColoredDigits_env0_smoothness.png",
      "ColoredDigits_bottom_loss.png", "ColoredDigits_trajectory_length.png",
      "ColoredDigits_env0_trial0_trajectory.png"}
  for caption, path in written:
    figure = figures[path.name]
    titles = [figure.get_suptitle(), *(a.get_title() for a in figure.axes)]
    if path.name.endswith("_smoothness.png"):  # As every loss plot.
      assert figure.get_suptitle() == "ColoredDigits, held out env0"
    else:
      assert caption in titles, path.name


# A real sweep, shared by the end-to-end tests below: the default algorithm,
# ERM, and the runs the paper's claims need, a few steps each, params saved
# every 2 steps.
TINY_ALGORITHMS = ("ERM", "PGrad", "PGrad-B", "PGrad-Bottom")


@pytest.fixture(name="tiny_sweep", scope="module")
def fixture_tiny_sweep(tmp_path_factory):
  output_dir = tmp_path_factory.mktemp("sweep")
  args = sweep.parse_args([
      "launch", "--datasets", "ColoredDigits",
      "--algorithms", *TINY_ALGORITHMS,
      "--test_envs", "0", "--n_hparams", "1", "--n_trials", "1",
      "--steps", "6", "--checkpoint_freq", "2", "--trajectory_freq", "2",
      "--hparams", json.dumps({"batch_size": 3, "cnn_width": 8}),
      "--output_dir", str(output_dir)])
  # The sweep's runs, each trained by the command line the sweep would run,
  # but here: a subprocess would import JAX, Flax and Orbax again for every
  # run (test_launchers.py tests the launchers).
  for run in sweep.runs_for(args):
    assert train.main(run.command(
        "--eval_examples 16 --eval_batch_size 16 --loss_examples 8")) == 0
  return output_dir


class Report(NamedTuple):
  """A report written by ``report.main``.

  Attributes:
    output_dir: its directory.
    figures: every figure it saved, by file name.
  """

  output_dir: Path
  figures: dict[str, Figure]


@pytest.fixture(name="tiny_report", scope="module")
def fixture_tiny_report(tiny_sweep, tmp_path_factory):
  """The tiny sweep's report, which the tests below read and do not change."""
  output_dir = tmp_path_factory.mktemp("report")
  figures = {}
  original_savefig = Figure.savefig

  def savefig(self, path, **kwargs):
    figures[Path(path).name] = self
    original_savefig(self, path, **kwargs)

  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(Figure, "savefig", savefig)
    assert report.main(["--input_dir", str(tiny_sweep),
                        "--output_dir", str(output_dir)]) == 0
  return Report(output_dir, figures)


@pytest.mark.slow
def test_report_of_a_tiny_sweep_has_pgrad_b_spectrum_and_loss_curves(
    tiny_sweep, tiny_report, tmp_path, monkeypatch):
  text = (tiny_report.output_dir / "results.md").read_text()
  assert "(plots/ColoredDigits_env0_PGrad-B_eigenvalues.png)" in text
  assert "(plots/ColoredDigits_env0_loss.png)" in text

  # The training table: a row per algorithm, each over its one run.
  records = pack.load_runs(tiny_sweep).records
  training = text.split("## Training\n")[1].split("\n## ")[0]
  table = [line for line in training.splitlines() if line.startswith("|")]
  rows = [line.split("|")[1:-1] for line in table[2:]]  # Header, alignment.
  assert [row[0].strip() for row in rows] == [
      a for a in catalog.ALGORITHMS if a in TINY_ALGORITHMS]
  for row in rows:
    (run,) = [r for r in model_selection.by_run(records)
              if r[0]["args"]["algorithm"] == row[0].strip()]
    end = convergence.run_end(run)
    assert row[1].strip() == "1"
    assert row[2].strip() == row[3].strip() == f"{int(end.plateaued)}/1"
    assert row[4].strip() == f"{end.loss:.4f} (n = 1)"

  # The report's figures again, not drawn a second time.
  _build_figures_only(monkeypatch)
  written, skipped = curves.write_plots(records, "ColoredDigits", 0, tmp_path)
  assert skipped == []
  figures = {plot.caption: plot.figure for plot in written}
  loss_figure = figures["training loss per domain"]
  loss = loss_figure.axes
  # The records of a real run name the domains.
  assert [a.get_title() for a in loss] == ["training domain env1 (+80%)",
                                           "training domain env2 (-90%)"]
  [legend] = loss_figure.legends
  assert sorted(t.get_text() for t in legend.get_texts()) == (
      sorted(TINY_ALGORITHMS))
  spectrum = figures["PGrad-B eigenvalue spectrum"].axes[0]
  assert spectrum.get_xlabel() == "step (interval centre)"
  # 2 training domains x B = 3 chunks + the start: 7 trajectory points.
  pgrad_b = sorted((r for r in records
                    if r["args"]["algorithm"] == "PGrad-B"),
                   key=lambda r: r["step"])
  assert len(pgrad_b[0]["eigenvalues"]) == 7
  # The components at numerical zero (the last of 7 points of 6 moves) are
  # not drawn.
  drawn = [k for k in range(7) if max(
      r["eigenvalues"][k] for r in pgrad_b) >= plots.EIGENVALUE_FLOOR]
  assert 0 < len(drawn) < 7
  lines = spectrum.get_lines()
  assert [line.get_label() for line in lines] == [
      f"$\\lambda_{{{k + 1}}}$" for k in drawn]
  for k, line in zip(drawn, lines):
    np.testing.assert_allclose(
        line.get_ydata(),
        [np.float64(r["eigenvalues"][k]) for r in pgrad_b])


@pytest.mark.slow
def test_report_draws_and_measures_every_claim(tiny_report):
  output_dir, figures = tiny_report
  measured = json.loads((output_dir / "claims" / "claims.json").read_text())
  found = measured["ColoredDigits"]
  assert set(found) == {"smoothness", "bottom", "trajectory_length",
                        "trajectories"}
  assert set(found["smoothness"]) == {"ERM", "PGrad", "PGrad-B"}
  assert set(found["bottom"]) == {"PGrad", "PGrad-Bottom"}
  assert set(found["trajectories"]) == {"ERM", "PGrad"}
  for numbers in found["trajectories"].values():
    assert numbers["length"] >= numbers["displacement"] > 0
  text = (output_dir / "results.md").read_text()
  assert "## The paper's claims" in text

  # Every figure the report links exists, and shows its series and axes.
  for name in ("ColoredDigits_env0_smoothness.png",
               "ColoredDigits_roughness.png",
               "ColoredDigits_bottom_loss.png",
               "ColoredDigits_trajectory_length.png",
               "ColoredDigits_env0_trial0_trajectory.png"):
    assert (output_dir / "claims" / name).is_file()
    assert f"claims/{name}" in text
  smooth = figures["ColoredDigits_env0_smoothness.png"].axes
  assert {line.get_label() for line in smooth[0].get_lines()} >= {
      "ERM", "PGrad", "PGrad-B"}
  assert smooth[0].get_ylabel() == "training loss"
  rough = figures["ColoredDigits_roughness.png"].axes
  assert [[t.get_text() for t in a.get_xticklabels()] for a in rough] == [
      ["ERM", "PGrad", "PGrad-B"]] * 2
  assert all(a.get_ylabel() for a in rough)
  bottom = figures["ColoredDigits_bottom_loss.png"].axes[0]
  (legend,) = figures["ColoredDigits_bottom_loss.png"].legends
  assert {t.get_text() for t in legend.get_texts()} == {
      "PGrad", "PGrad-Bottom"}
  assert bottom.get_xlabel() == "step" and "loss" in bottom.get_ylabel()
  bars = figures["ColoredDigits_trajectory_length.png"].axes[0]
  assert [t.get_text() for t in bars.get_xticklabels()] == ["PGrad",
                                                           "PGrad-B"]
  assert "accuracy" in bars.get_ylabel()
  trajectory = figures["ColoredDigits_env0_trial0_trajectory.png"].axes
  assert [a.get_title() for a in trajectory] == ["PCA", "t-SNE"]
  (legend,) = figures["ColoredDigits_env0_trial0_trajectory.png"].legends
  labels = [t.get_text() for t in legend.get_texts()]
  assert sorted(labels) == ["ERM", "PGrad"]
  # The legend says what the large dot marks.
  assert "the start" in legend.get_title().get_text()
  for axes in trajectory:
    # Snapshots at steps 0, 2, 4, 6 per path.
    assert all(len(line.get_xdata()) == 4 for line in axes.get_lines()
               if line.get_label() in labels)
    assert axes.get_xlabel() and axes.get_ylabel()


def _files(output_dir):
  """Every file of the report in ``output_dir``, by its relative path."""
  return {path.relative_to(output_dir): path.read_bytes()
          for path in sorted(output_dir.rglob("*")) if path.is_file()}


def _report_files(input_dir, output_dir):
  """Every file of the report on ``input_dir``, by its relative path."""
  assert report.main(["--input_dir", str(input_dir),
                      "--output_dir", str(output_dir)]) == 0
  return _files(output_dir)


@pytest.mark.slow
def test_the_report_of_a_packed_sweep_is_its_directories_report(
    tiny_sweep, tiny_report, tmp_path, capsys):
  packed = tmp_path / "packed"
  shutil.copytree(tiny_sweep, packed)
  assert study.pack(packed) == 0
  assert f"Packed {len(TINY_ALGORITHMS)} runs" in capsys.readouterr().out
  run_dirs = pack.finished_run_dirs(packed)
  trajectory_dirs = [d for d in run_dirs if records_lib.trajectory_files(d)]
  assert len(trajectory_dirs) == len(catalog.TRAJECTORY_ALGORITHMS)
  for run_dir in run_dirs:
    shutil.rmtree(run_dir)
  # The pack alone: no params, every figure and number the same bytes.
  assert not list(packed.rglob("*.npy"))
  expected = _files(tiny_report.output_dir)
  assert _report_files(packed, tmp_path / "from_pack") == expected
  assert "claims/ColoredDigits_env0_trial0_trajectory.png" in {
      path.as_posix() for path in expected}

  # One path read from its directory again, projected apart from the
  # packed one it would be drawn with: refused, saying how to mend it.
  shutil.copytree(tiny_sweep / trajectory_dirs[0].name, trajectory_dirs[0])
  capsys.readouterr()
  assert report.main(["--input_dir", str(packed),
                      "--output_dir", str(tmp_path / "mixed")]) == 2
  assert "were projected apart" in capsys.readouterr().err


@pytest.mark.parametrize("value, text", [
    (11333.333, "11,333"), (2000.0, "2,000"), (-0.99716, "-0.9972"),
    (0.0, "0"), (1.133e-5, "1.133e-05"), (999.96, "1000")])
def test_claim_numbers_keep_four_digits_and_counts_whole(value, text):
  assert report.claim_number(value) == text


def test_training_imports_nothing_of_the_analysis():
  # A fresh interpreter: this one has imported the analysis already.
  script = ("import sys\n"
            "from experiments import train, training\n"
            "from experiments.runs import study, sweep\n"
            "print(sorted(m for m in sys.modules if m == 'matplotlib' or "
            "m.startswith('experiments.analysis')))")
  out = subprocess.run([sys.executable, "-c", script], check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == "[]"


def test_the_command_runs_the_report(tmp_path):
  # `python -m experiments.analysis.report`, the command the docs give.
  result = subprocess.run(
      [sys.executable, "-m", "experiments.analysis.report", "--input_dir",
       str(tmp_path), "--output_dir", str(tmp_path / "report")],
      capture_output=True, text=True)
  assert result.returncode == 1
  assert (f"No results.jsonl or runs.jsonl.gz records under {tmp_path}"
          in result.stderr)


def test_every_registered_algorithm_has_a_colour_of_its_own():
  # A default colour cycle repeats after 10 lines; the study plots 14.
  colours = {plots.algorithm_colour(a) for a in catalog.ALGORITHMS}
  assert len(colours) == len(catalog.ALGORITHMS)


def test_the_palette_grows_and_keeps_the_committed_plots_colours():
  # The 20 algorithms of the committed plots keep tab20's colours, by
  # registry position; any number after them get colours of their own.
  tab20 = colormaps["tab20"]
  assert [plots.palette_colour(i) for i in range(20)] == [
      tab20(i) for i in range(20)]
  colours = [plots.palette_colour(i) for i in range(1000)]
  assert len(set(colours)) == len(colours)
  assert all(len(c) == 4 and all(0 <= x <= 1 for x in c) for c in colours)


def test_a_claim_read_from_two_evaluations_says_so(tmp_path, capsys, undrawn):
  # sweep_records' runs have two evaluations each.
  write_runs(tmp_path / "sweep", sweep_records())
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  smoothness = text.split("### ColoredDigits: smoothness\n")[1].split("###")[0]
  warning = ("Warning: ColoredDigits smoothness: read from 11 of its 11 runs "
             "with only 2 evaluations over the steps every run reached "
             "(fewer than 3)")
  assert warning in smoothness
  assert warning in capsys.readouterr().err


def _drawn(figure):
  """Draws ``figure`` (as saving it does) so that its tick labels are set."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  FigureCanvasAgg(figure).draw()
  return figure


def test_eigenvalues_at_numerical_zero_are_not_drawn(tmp_path):
  records = [make_record("ColoredDigits", "PGrad", 0, 0, 0, step,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                         eigenvalues=[0.9, 0.1 - 2e-8, 1e-8, 1e-8])
             for step in (5, 10)]
  figure = plots.plot_eigenvalue_spectrum(records, tmp_path / "e.png")
  (axes,) = figure.axes
  assert [line.get_label() for line in axes.get_lines()] == [
      "$\\lambda_{1}$", "$\\lambda_{2}$"]
  assert "2 at numerical zero (< 1e-06) not drawn" in [
      text.get_text() for text in axes.texts]


def test_log_axes_are_labelled_in_plain_numbers_and_bands_explained(
    tmp_path):
  # Losses within one decade: matplotlib labels minor ticks, as 7×10⁻¹.
  records = [r for r in sweep_records() if r["args"]["dataset"] == "Toy"
             and r["args"]["test_envs"] == [0]]
  for r in records:
    r["env1_in_loss"] = 0.6 + 0.1 * r["args"]["trial_seed"] + 0.01 * r["step"]
  figure = _drawn(plots.plot_loss_curves(records, tmp_path / "l.png"))
  labels = [t.get_text() for axes in figure.axes
            for t in axes.get_yticklabels(minor=True) if t.get_text()]
  assert labels and all("10" not in label and "times" not in label
                        for label in labels), labels
  assert {"0.7", "0.8"} <= set(labels)
  (legend,) = figure.legends
  assert "band: lowest" in legend.get_title().get_text()
  accuracy = plots.plot_heldout_accuracy(records, tmp_path / "a.png")
  # Beside the axes, not over the lines.
  assert not accuracy.axes[0].get_legend()
  assert "±1 s.d." in accuracy.legends[0].get_title().get_text()


def test_bars_all_zero_say_so_and_one_length_is_not_called_a_comparison(
    tmp_path):
  summary = {"ERM": {"excess_variation": 0.0, "rising_rate": 0.25},
             "PGrad": {"excess_variation": 0.0, "rising_rate": 0.0}}
  figure = plots.plot_roughness_bars(summary, tmp_path / "r.png")
  excess, rising = figure.axes
  # Every bar's value labels it, 0 too; a chart of zeros says so.
  assert [t.get_text() for t in excess.texts] == ["0", "0", "0 for every bar"]
  assert [t.get_text() for t in rising.texts] == ["0.25", "0"]
  records = [make_record("ColoredDigits", "PGrad", 0, 0, trial, 10,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3)
             for trial in (0, 1)]
  selected = {"ColoredDigits": claims_lib.ClaimRecords(
      smoothness=[], bottom=[], trajectory_length=records, trajectories={})}
  measured = claims_lib.measure(selected)
  (caption, _), = plots.plot_claims(selected, measured, tmp_path)
  assert caption == ("ColoredDigits: final held-out accuracy of PGrad alone "
                     "(no other k or B was run)")


def test_a_sweeps_report_counts_the_runs_of_its_saved_grid(
    tmp_path, undrawn):
  grid = {**grid_lib.GRID_DEFAULTS, "datasets": ["ColoredDigits"],
          "algorithms": ["ERM"], "test_envs": [0], "n_hparams": 1,
          "n_trials": 2}
  grid_lib.save_grid(tmp_path / "sweep", grid)
  finished, _ = grid_lib.make_runs(output_dir=tmp_path / "sweep", **grid)
  finished.output_dir.mkdir()
  with open(finished.output_dir / records_lib.RESULTS_FILE, "w") as f:
    for step in STEPS:
      f.write(json.dumps(make_record(
          "ColoredDigits", "ERM", 0, 0, 0, step, in_accs=[0.5] * 3,
          out_accs=[0.5] * 3, env1_in_loss=1.0 / step,
          env2_in_loss=2.0 / step)) + "\n")
  (finished.output_dir / records_lib.DONE_FILE).write_text("")
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  assert (f"2 records. The sweep's grid ({grid_lib.GRID_FILE}) has 2 runs: 1 "
          "done, 0 incomplete, 1 not started, 0 damaged. Cells:") in text


def test_the_bottom_loss_title_fits_in_its_figure(tmp_path):
  records = [make_record("ColoredDigits", algorithm, 0, 0, 0, step,
                         in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                         env1_in_loss=1.0 / step, env2_in_loss=2.0 / step)
             for algorithm in ("PGrad", "PGrad-Bottom") for step in (5, 10)]
  title = ("RotatedDigits: mean training loss, bottom against top "
           "eigenvectors")
  figure = _drawn(plots.plot_mean_training_loss(records, tmp_path / "b.png",
                                                title))
  renderer = figure.canvas.get_renderer()
  (text,) = [t for t in [figure._suptitle, *(a.title for a in figure.axes)]  # pylint: disable=protected-access
             if t is not None and t.get_text() == title]
  box = text.get_window_extent(renderer)
  assert 0 <= box.x0 and box.x1 <= figure.bbox.x1, (box, figure.bbox)


def test_runs_that_average_are_reported_by_both_models(tmp_path, undrawn):
  # ColoredDigits' ERM runs again, with SWAD: its final model (in the last
  # record) is 10 points better than the trained weights everywhere.
  averaged = []
  for record in sweep_records():
    if record["args"] != {**record["args"], "dataset": "ColoredDigits",
                          "algorithm": "ERM"}:
      continue
    record = {**record, "args": {**record["args"], "averaging": "swad"}}
    if record["step"] == STEPS[-1]:
      record.update({"averaged_" + k: v + 0.1 for k, v in record.items()
                     if records_lib.parse_env_key(k)})
    averaged.append(record)
  write_runs(tmp_path / "sweep" / "plain", sweep_records())
  write_runs(tmp_path / "sweep" / "swad", averaged)
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  sections = text.split("\n## Training\n")[0].split(
      "## Model selection: ")[1:]
  assert [s.splitlines()[0] for s in sections] == [
      "training-domain validation set", "test-domain validation set (oracle)",
      "training-domain validation set, the trained weights of the runs that "
      "average",
      "test-domain validation set (oracle), the trained weights of the runs "
      "that average"]
  for section in sections[:2]:
    # The runs without averaging as before, SWAD's averaged model a row
    # of its own: ERM's cells plus 10.
    assert COLORED_TABLE.replace(
        "| PGrad |", "| ERM + SWAD | 70.0 ± 7.1 | 90.0 ± 0.0 | 90.0 ± 7.1 "
        "| 83.3 |\n| PGrad |") in section
  for section in sections[2:]:
    assert "| ERM + SWAD | 60.0 ± 7.1 | 80.0 ± 0.0 | 80.0 ± 7.1 | 73.3 |" in (
        section)
    assert "| ERM |" not in section and "| PGrad |" not in section
  # Where the runs ended: a row of their own too.
  assert "\n| ERM + SWAD | 6 |" in text
  # The claims are the runs' without averaging; the curves are every
  # method's, and say what those of the runs that average show.
  assert report.main(["--input_dir", str(tmp_path / "sweep" / "plain"),
                      "--output_dir", str(tmp_path / "plain")]) == 0
  plain = (tmp_path / "plain" / "results.md").read_text()
  claims = "\n## The paper's claims"
  assert text[text.index(claims):] == plain[plain.index(claims):]
  assert ("ColoredDigits, held-out env0: held-out accuracy"
          + curves.AVERAGED_ACCURACY) in text
  assert ("ColoredDigits, held-out env0: training loss per domain"
          + curves.TRAINED_LOSS) in text
  assert curves.AVERAGED_ACCURACY not in plain


def test_runs_without_validation_data_are_left_out_and_said_so(tmp_path,
                                                               undrawn):
  # ERM++'s second stage (--lr_schedule_from, --holdout_fraction 0) has no
  # out split: neither selection method can read it. The tables are the
  # sweep's, without it, and the report says how many runs it left out.
  second_stage = [
      make_record("ColoredDigits", "ERMPlusPlus", 0, 0, 0, step,
                  in_accs=[], out_accs=[],
                  **{f"env{i}_in_{metric}": 0.1 for i in range(3)
                     for metric in ("acc", "loss")})
      for step in STEPS]
  for record in second_stage:
    record["args"].update(holdout_fraction=0, lr_schedule=[[5, 1.0]],
                          lr_schedule_from="stage1")
  write_runs(tmp_path / "sweep", sweep_records() + second_stage)
  assert report.main(["--input_dir", str(tmp_path / "sweep"),
                      "--output_dir", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "results.md").read_text()
  for section in text.split("## Model selection: ")[1:]:
    assert COLORED_TABLE in section
    assert "### Averages\n\n" + SUMMARY_TABLE in section
  assert "ERMPlusPlus" not in text.split("## Model selection: ")[1]
  assert ("1 run holds out no validation data (--holdout_fraction 0, ERM++'s "
          "second stage): no model selection reads it") in text
