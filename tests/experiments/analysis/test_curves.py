"""The report's training curves: a line per method, averaging runs included."""

import numpy as np
import pytest

from experiments import averaging_flags
from experiments.analysis import curves
from experiments.analysis import plots
from test_model_selection import make_record

STEPS = (5, 10, 15)
TRIALS = (0, 1)
# Held out: env0 of three; the training domains' losses are recorded.
TRAIN_ENVS = (1, 2)


def _run(averaging, trial):
  """One run's records: its trained weights' accuracy and loss at every step,
  and its averaged model's (``averaged_*``, set apart from the trained
  weights') where the averaging evaluates one: EMA and SMA at every step,
  SWAD at its last."""
  records = []
  for step in STEPS:
    acc = 0.02 * step + 0.1 * trial
    losses = {f"env{i}_in_loss": 1.0 / step + 0.1 * i + 0.03 * trial
              for i in TRAIN_ENVS}
    record = make_record("ColoredDigits", "ERM", 0, 0, trial, step,
                         in_accs=[acc] * 3, out_accs=[acc] * 3, **losses)
    if averaging != "none":
      record["args"]["averaging"] = averaging
      if averaging != "swad" or step == STEPS[-1]:
        record.update({"averaged_" + key: value + 0.25
                       for key, value in record.items()
                       if key.startswith("env")})
    records.append(record)
  return records


def _records(*averagings):
  return [record for averaging in averagings for trial in TRIALS
          for record in _run(averaging, trial)]


def _mean_over_trials(records, key):
  """Per step, the float64 mean of ``record[key]`` over the records with it."""
  steps = sorted({r["step"] for r in records if key in r})
  return steps, [np.mean([r[key] for r in records
                          if key in r and r["step"] == s], dtype=np.float64)
                 for s in steps]


def _plots(records, tmp_path):
  written, skipped = curves.write_plots(records, "ColoredDigits", 0, tmp_path)
  assert skipped == ["no eigenvalue spectrum: none of ERM records eigenvalues "
                     "(the PGrad variants do)"]
  return {plot.caption.split(";")[0]: plot for plot in written}


def _of(records, method):
  return [r for r in records
          if r["args"].get("averaging", "none") == method]


def test_every_method_is_a_line_of_its_own(tmp_path):
  records = _records("none", "sma", "swad")
  drawn = _plots(records, tmp_path)
  assert drawn["held-out accuracy"].caption == (
      "held-out accuracy" + curves.AVERAGED_ACCURACY)
  assert drawn["training loss per domain"].caption == (
      "training loss per domain" + curves.TRAINED_LOSS)
  assert drawn["held-out accuracy"].path.is_file()
  erm = plots.algorithm_colour("ERM")

  # Held-out accuracy: ERM's trained weights at every step; ERM + SMA's
  # averaged model at every step; ERM + SWAD's final averaged model alone,
  # one point at the last step.
  (axes,) = drawn["held-out accuracy"].figure.axes
  assert axes.get_legend_handles_labels()[1] == [
      "ERM", "ERM + SMA", "ERM + SWAD"]
  lines = {line.get_label(): line for line in axes.get_lines()
           if not line.get_label().startswith("_")}
  assert list(lines) == ["ERM", "ERM + SMA"]
  for label, averaging, key in (("ERM", "none", "env0_in_acc"),
                                ("ERM + SMA", "sma", "averaged_env0_in_acc")):
    steps, means = _mean_over_trials(_of(records, averaging), key)
    np.testing.assert_array_equal(lines[label].get_xdata(), steps)
    np.testing.assert_allclose(lines[label].get_ydata(), means, rtol=1e-12)
  assert [lines[label].get_linestyle() for label in lines] == ["-", ":"]
  assert all(lines[label].get_color() == erm for label in lines)
  (swad,) = axes.containers
  assert swad.get_label() == "ERM + SWAD"
  point = swad.lines[0]
  _, (final,) = _mean_over_trials(_of(records, "swad"),
                                  "averaged_env0_in_acc")
  assert list(point.get_xdata()) == [STEPS[-1]]
  np.testing.assert_allclose(point.get_ydata(), [final], rtol=1e-12)
  assert point.get_marker() == "D" and point.get_linestyle() == "None"
  assert point.get_color() == erm
  # The bar spans ±1 s.d. of the trials' final models: 0.1 apart, 0.05.
  ((low, high),) = np.array(swad.lines[2][0].get_segments())[:, :, 1]
  np.testing.assert_allclose([final - low, high - final], [0.05, 0.05],
                             rtol=1e-9)
  assert "+ averaging" in axes.figure.legends[0].get_title().get_text()

  # Training loss: every method's trained weights at every step, not its
  # averaged model's.
  for panel, env in zip(drawn["training loss per domain"].figure.axes,
                        TRAIN_ENVS):
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert list(lines) == ["ERM", "ERM + SMA", "ERM + SWAD"]
    for label, averaging in (("ERM", "none"), ("ERM + SMA", "sma"),
                             ("ERM + SWAD", "swad")):
      steps, means = _mean_over_trials(_of(records, averaging),
                                       f"env{env}_in_loss")
      np.testing.assert_array_equal(lines[label].get_xdata(), steps)
      np.testing.assert_allclose(lines[label].get_ydata(), means, rtol=1e-12)
    assert [line.get_linestyle() for line in lines.values()] == [
        "-", ":", "-."]


def test_every_algorithm_gets_loss_curves_and_every_variant_a_spectrum(
    tmp_path, capsys):
  records = []
  steps = (5, 10)
  spectra = {"PGrad-B": [[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]],
             "PGrad-F": [[0.8, 0.1, 0.1], [0.6, 0.3, 0.1]]}
  for algorithm in ("ERM", "PGrad-B", "PGrad-F", "Fish"):
    for trial in (0, 1):
      for step in steps:
        extra = {f"env{i}_in_loss": step * (1 + trial) + i for i in (1, 2)}
        if algorithm in spectra:
          extra["eigenvalues"] = spectra[algorithm][trial]
        if algorithm == "Fish":
          extra = {}  # Records of an older run: no losses.
        records.append(make_record("ColoredDigits", algorithm, 0, 0, trial,
                                   step, in_accs=[0.5] * 3, out_accs=[0.5] * 3,
                                   domains=["+90%", "+80%", "-90%"],
                                   **extra))
  written, skipped = curves.write_plots(records, "ColoredDigits", 0, tmp_path)
  plots_by_caption = {plot.caption: plot for plot in written}
  assert list(plots_by_caption) == [
      "held-out accuracy", "training loss per domain",
      "PGrad-F eigenvalue spectrum", "PGrad-B eigenvalue spectrum"]
  assert skipped == ["no loss curves of Fish: their runs record no "
                     "env{i}_in_loss"]
  for plot in written:
    assert plot.path.read_bytes().startswith(b"\x89PNG")

  # Every figure names the dataset and the held-out domain, and domains go
  # by their names.
  held_out = "ColoredDigits, held out env0 (+90%)"
  accuracy = plots_by_caption["held-out accuracy"].figure.axes[0]
  assert accuracy.get_title() == held_out
  loss = plots_by_caption["training loss per domain"].figure
  assert loss.get_suptitle() == held_out
  panels = loss.axes
  assert [a.get_title() for a in panels] == [
      "training domain env1 (+80%)", "training domain env2 (-90%)"]
  assert [a.get_xlabel() for a in panels] == ["step", "step"]
  assert panels[0].get_ylabel() == "training loss"
  # The records came as ERM, PGrad-B, PGrad-F; the legend (the figure's,
  # beside the panels) follows the registry, as the tables do, and every
  # algorithm has its own colour.
  [legend] = loss.legends
  assert [t.get_text() for t in legend.get_texts()] == [
      "ERM", "PGrad-F", "PGrad-B"]
  assert len({line.get_color() for line in panels[0].get_lines()}) == 3
  for axes, env in zip(panels, (1, 2)):
    for line in axes.get_lines():
      # Mean over the two trials of step * (1 + trial) + env.
      expected = [np.mean([s * (1 + t) + env for t in (0, 1)]) for s in steps]
      np.testing.assert_allclose(line.get_ydata(), expected)

  spectrum_figure = plots_by_caption["PGrad-B eigenvalue spectrum"].figure
  (spectrum,) = spectrum_figure.axes
  assert spectrum_figure.get_suptitle() == f"PGrad-B: {held_out}"
  # A colour per component.
  assert len({tuple(line.get_color()) for line in spectrum.get_lines()}) == 3
  assert spectrum.get_ylabel() == "normalised eigenvalue"
  assert [line.get_label() for line in spectrum.get_lines()] == [
      "$\\lambda_{1}$", "$\\lambda_{2}$", "$\\lambda_{3}$"]
  # Both steps of a run hold the same spectrum; the trials are averaged.
  expected = np.mean(np.array(spectra["PGrad-B"], np.float64), axis=0)
  for line, value in zip(spectrum.get_lines(), expected):
    np.testing.assert_allclose(line.get_ydata(), [value, value])


def _build_figures_only(monkeypatch):
  """Figures built but neither drawn nor written: what they show is under
  test, not their PNGs."""
  monkeypatch.setattr(plots, "save", lambda figure, path: None)


@pytest.mark.parametrize("averagings", [("none",), ("ema", "none")])
def test_captions_and_legends_speak_of_averaging_where_a_run_averages(
    averagings, tmp_path, monkeypatch):
  _build_figures_only(monkeypatch)
  # Runs without averaging alone: the captions and legends as before
  # averaging runs were plotted, so the committed reports stay as they are.
  drawn = _plots(_records(*averagings), tmp_path)
  plain = averagings == ("none",)
  assert set(drawn) == {"held-out accuracy", "training loss per domain"}
  assert (drawn["held-out accuracy"].caption == "held-out accuracy") == plain
  title = drawn["held-out accuracy"].figure.legends[0].get_title().get_text()
  assert (title == "mean of trials;\nband: ±1 s.d.") == plain
  (axes,) = drawn["held-out accuracy"].figure.axes
  assert axes.get_legend_handles_labels()[1] == (
      ["ERM"] if plain else ["ERM", "ERM + EMA"])


def test_a_swad_run_still_training_says_it_has_no_averaged_accuracy(
    tmp_path, monkeypatch):
  _build_figures_only(monkeypatch)
  # SWAD's final model is evaluated at its last step: before it, none.
  records = [r for r in _records("none", "swad") if r["step"] < STEPS[-1]]
  written, skipped = curves.write_plots(records, "ColoredDigits", 0, tmp_path)
  assert skipped[0] == (
      "no held-out accuracy of ERM + SWAD: their runs have not yet evaluated "
      "their averaged model (SWAD's: at the end)")
  accuracy = next(p for p in written if p.caption.startswith("held-out"))
  assert accuracy.figure.axes[0].get_legend_handles_labels()[1] == ["ERM"]


def test_every_averaging_has_a_style_of_its_own():
  styles = plots.AVERAGING_STYLES
  assert set(styles) == set(averaging_flags.KNOBS)
  assert len({style.linestyle for style in styles.values()}) == len(styles)
  assert len({style.marker for style in styles.values()}) == len(styles)
  # An algorithm's own runs keep the solid lines and round points they had.
  assert styles["none"] == plots.AveragingStyle("-", "o")


def test_a_spectrum_is_its_algorithms_runs_alone(tmp_path, monkeypatch):
  # PGrad-B + SWAD trains as PGrad-B does: its spectrum would be PGrad-B's
  # again, averaged in twice.
  _build_figures_only(monkeypatch)
  records = []
  for averaging, spectrum in (("none", [0.7, 0.2, 0.1]),
                              ("swad", [0.5, 0.3, 0.2])):
    for record in _records(averaging):
      record["args"]["algorithm"] = "PGrad-B"
      records.append({**record, "eigenvalues": spectrum})
  written, skipped = curves.write_plots(records, "ColoredDigits", 0, tmp_path)
  assert skipped == []
  (spectrum,) = [p for p in written if "spectrum" in p.caption]
  assert spectrum.caption == "PGrad-B eigenvalue spectrum"
  assert [line.get_ydata()[0] for line in spectrum.figure.axes[0].get_lines()
          ] == [0.7, 0.2, 0.1]


def test_averaging_runs_alone_draw_their_algorithms_spectrum(tmp_path):
  # PGrad-B + SWAD without plain PGrad-B runs: its training is PGrad-B's,
  # so its spectrum is drawn rather than said to be missing.
  runs = []
  for record in _records("swad"):
    record = {**record, "args": {**record["args"], "algorithm": "PGrad-B"},
              "eigenvalues": [0.6, 0.3, 0.1]}
    runs.append(record)
  written, skipped = curves.write_plots(runs, "ColoredDigits", 0, tmp_path)
  (spectrum,) = [p for p in written
                 if p.caption == "PGrad-B + SWAD eigenvalue spectrum"]
  assert spectrum.path.name == "ColoredDigits_env0_PGrad-B+SWAD_eigenvalues.png"
  assert not [s for s in skipped if "spectrum" in s], skipped
