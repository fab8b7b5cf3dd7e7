"""Adding a dataset and an algorithm by the steps of experiments/README.md.

A throwaway of each is registered in-process, as its ``catalog.py`` lines
would register it (its builder named by ``module:attribute``, its facts, the
algorithm's hparams block), and then listed, swept, trained and plotted with
no other change: the README's files are all that an addition touches.
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
from experiments.runs import sweep
from experiments import train
from experiments.algorithms import base
from experiments.analysis import plots

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

  runs = sweep.make_runs(output_dir="sweep", datasets=[DATASET],
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
