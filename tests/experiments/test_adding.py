"""Adding a dataset, an algorithm and a launcher by the steps of
experiments/README.md.

A throwaway of each is registered in-process, as its ``catalog.py`` lines
would register it (its builder named by ``module:attribute``, its facts, the
algorithm's hparams block), and then listed, swept, trained and plotted with
no other change: the README's files are all that an addition touches. The
throwaway launcher, its function, flag, check and `launchers.REGISTRY` line,
is listed in the sweep's help, has its flag checked, and trains a sweep.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import catalog
from experiments import config as config_lib
from experiments import hparams_registry
from experiments.data import datasets
from experiments import search_space as hp
from experiments.runs import grid
from experiments.runs import launchers
from experiments.runs import run as run_lib
from experiments.runs import sweep
from experiments import train
from experiments.algorithms import base
from experiments.analysis import plots

from test_sweep import launches, sweep_flags
from test_sweep import train_command  # pylint: disable=unused-import

DATASET = "TinyShapes"
ALGORITHM = "VarianceERM"
DOMAINS = ("light", "dark", "noisy")


def tiny_shapes(*, data_dir=None, seed=0):
  """The throwaway dataset's builder (step 1): 8x8 squares, bright or dark
  by class, each domain a shade of its own."""
  del data_dir
  rng = np.random.default_rng(seed)
  sources = []
  for shade in range(len(DOMAINS)):
    labels = np.arange(24) % 2
    images = rng.normal(0.2 * shade, 0.1, (24, 8, 8, 1))
    images[:, 2:6, 2:6, 0] += labels[:, None, None]
    sources.append(datasets.ArraySource(images, labels))
  return datasets.MultiDomainDataset(
      name=DATASET, domain_names=DOMAINS, domains=tuple(sources),
      num_classes=2, input_shape=(8, 8, 1))


def variance_erm(network, hparams, *, num_domains, seed):
  """The throwaway algorithm's builder (step 1): the mean of the domains'
  losses plus ``variance_weight`` times their variance, as V-REx."""
  del num_domains, seed
  weight = hparams["variance_weight"]

  def objective(params, stats, batches, key):
    del key
    losses, stats = base.domain_losses(network, params, stats, batches)
    penalty = jnp.var(losses)
    loss = jnp.mean(losses) + weight * penalty
    return loss, ({"loss": loss, "penalty": penalty}, stats)

  return base.gradient_algorithm(hparams, objective)


def _variance_erm_hparams(space):
  """The throwaway algorithm's hparams block (step 2)."""
  space.add("variance_weight", 10.0, hp.NON_NEGATIVE, hp.log_uniform(-1, 3),
            wilds=1.0)


@pytest.fixture(name="added")
def fixture_added():
  """The two catalog entries (step 2), removed again afterwards."""
  catalog.DATASETS.register(
      DATASET, f"{__name__}:tiny_shapes", domains=DOMAINS, steps=4,
      checkpoint_freq=2, model="mnist_cnn", small_images=True)
  catalog.ALGORITHMS.register(ALGORITHM, f"{__name__}:variance_erm",
                              hparams=_variance_erm_hparams)
  try:
    yield
  finally:
    del catalog.DATASETS[DATASET]
    del catalog.ALGORITHMS[ALGORITHM]


def test_an_added_algorithm_and_dataset_list_sweep_and_plot(added, capsys):
  del added
  with pytest.raises(SystemExit) as exited:
    config_lib.parse_flags(["--list_hparams", "--algorithm", ALGORITHM,
                            "--dataset", DATASET])
  assert exited.value.code == 0
  rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
  # DomainBed's training hparams of small images, the MNIST CNN's, then its
  # own, as its block declares it.
  assert rows[1:] == [
      ["lr", "0.001", "10^U(-4.5,"], ["batch_size", "64", "int(2^U(3,"],
      ["weight_decay", "0.0", "fixed"], ["cnn_width", "64", "fixed"],
      ["image_size", "28", "fixed"],
      ["variance_weight", "10.0", "10^U(-1,"]]
  # On a WILDS dataset, its WILDS value, unsearched.
  assert hparams_registry.random_hparams(
      ALGORITHM, "FMoW", 5)["variance_weight"] == 1.0

  runs = grid.make_runs(output_dir="sweep", datasets=[DATASET],
                        algorithms=[ALGORITHM], n_hparams=3, n_trials=1)
  assert len(runs) == 3 * len(DOMAINS)
  weights = {hparams_registry.random_hparams(
      ALGORITHM, DATASET, r.args["hparams_seed"],
      r.args["trial_seed"])["variance_weight"] for r in runs}
  assert len(weights) == 3 and all(0.1 <= w <= 1000 for w in weights)

  # A colour of its own, past the 20 of tab20.
  colours = [plots.algorithm_colour(a) for a in catalog.ALGORITHMS]
  assert len(set(colours)) == len(colours)


def test_an_added_algorithm_trains_on_an_added_dataset(added, tmp_path,
                                                       capsys):
  del added
  run = tmp_path / "run"
  status = train.main([
      "--dataset", DATASET, "--algorithm", ALGORITHM, "--test_envs", "2",
      "--output_dir", str(run), "--num_workers", "0", "--hparams",
      '{"variance_weight": 2.5, "batch_size": 4, "cnn_width": 8, '
      '"image_size": 8}'])
  out, err = capsys.readouterr()
  assert status == 0, err
  assert "noisy (env2)" in out.splitlines()[-1]
  results = [json.loads(line)
             for line in (run / "results.jsonl").read_text().splitlines()]
  assert [r["step"] for r in results] == [2, 4]
  assert results[-1]["hparams"]["variance_weight"] == 2.5
  assert results[-1]["domains"] == list(DOMAINS)
  assert np.isfinite(results[-1]["loss"]) and results[-1]["penalty"] >= 0
  assert (run / "done").exists()


LAUNCHER = "in_slices"


def in_slices(runs, args):
  """The throwaway launcher's function (step 1): trains at most
  ``--in_slices_runs`` of the runs to launch, one at a time, so that each
  launch trains a slice of the sweep."""
  failed = []
  for run in launchers.to_launch(runs)[:args.in_slices_runs]:
    process = run.start(**launchers.trainer(args))
    run.record_launch(launcher=LAUNCHER, pid=process.pid)
    if process.wait() != 0:
      failed.append(run)
  return failed


def _in_slices_flags(parser):
  """Its flag (step 2)."""
  parser.add_argument("--in_slices_runs", type=int, default=None,
                      help="in_slices: the most runs a launch trains; "
                      "default: all of them.")


def _check_in_slices(args):
  """Its flag's check (step 2)."""
  if args.in_slices_runs is None:
    return None
  if args.launcher != LAUNCHER:
    return f"--in_slices_runs: only with --launcher {LAUNCHER}."
  if args.in_slices_runs < 1:
    return f"--in_slices_runs must be at least 1, got {args.in_slices_runs}."
  return None


@pytest.fixture(name="added_launcher")
def fixture_added_launcher():
  """The throwaway launcher's `launchers.REGISTRY` line (step 3), removed
  again afterwards."""
  launchers.REGISTRY[LAUNCHER] = launchers.Launcher(
      in_slices, "at most --in_slices_runs runs a launch, one at a time",
      _in_slices_flags, _check_in_slices)
  try:
    yield
  finally:
    del launchers.REGISTRY[LAUNCHER]


def test_an_added_launcher_is_listed_checks_its_flag_and_launches(
    added_launcher, train_command, tmp_path, capsys):
  del added_launcher
  with pytest.raises(SystemExit) as exited:
    sweep.parse_args(["--help"])
  assert exited.value.code == 0
  usage = " ".join(capsys.readouterr().out.split())
  assert "--launcher {local,multi_gpu,slurm,in_slices}" in usage
  assert ("slurm: an array job through submitit, a job per run (the "
          "--slurm_* flags); in_slices: at most --in_slices_runs runs a "
          "launch, one at a time. Default: local.") in usage
  assert "--in_slices_runs IN_SLICES_RUNS in_slices: the most runs" in usage

  flags = sweep_flags(tmp_path, n_hparams=2) + [
      "--train_command", train_command]
  for wrong, message in [
      (["--in_slices_runs", "2"],
       "--in_slices_runs: only with --launcher in_slices."),
      (["--launcher", LAUNCHER, "--in_slices_runs", "0"],
       "--in_slices_runs must be at least 1, got 0."),
      (["--launcher", LAUNCHER, "--gpus", "0"],
       "--gpus: only with --launcher multi_gpu.")]:
    with pytest.raises(SystemExit, match="2"):
      sweep.main(flags + wrong)
    assert message in capsys.readouterr().err
  assert not any(launches(run) for run in sweep.runs_for(
      sweep.parse_args(flags)))

  # A slice of 3 of the 4 runs, then the rest.
  runs = sweep.runs_for(sweep.parse_args(flags))
  assert len(runs) == 4
  sliced = flags + ["--launcher", LAUNCHER, "--in_slices_runs", "3"]
  assert sweep.main(sliced) == 0
  assert [run.status for run in runs] == [run_lib.Status.DONE] * 3 + [
      run_lib.Status.NOT_STARTED]
  capsys.readouterr()
  assert sweep.main(["list", "--output_dir", str(tmp_path)]) == 0
  listing = capsys.readouterr().out.splitlines()
  for run in runs[:3]:
    (line,) = [line for line in listing if str(run.output_dir) in line]
    assert line.endswith(f"[{LAUNCHER} pid {launches(run)[0]['pid']}]")
  assert sweep.main(sliced) == 0
  assert all(run.status is run_lib.Status.DONE for run in runs)
  assert [len(launches(run)) for run in runs] == [1] * 4
