"""Tests for benchmarks/grad_accumulation.py and benchmarks/vmap_trials.py:
the CPU what-if benchmarks of the digits study, on tiny sizes."""

import json

import jax
import pytest

from benchmarks import common
from test_benchmarks import run_json


@pytest.mark.slow
def test_grad_accumulation_checks_its_gradients_and_times_every_variant(
    tmp_path):
  from benchmarks import grad_accumulation
  out = tmp_path / "accumulation.json"
  assert grad_accumulation.main(
      ["--image-sizes", "8", "--widths", "8", "--domains", "2", "--batch", "6",
       "--micro-batches", "3", "--repeats", "1", "--out", str(out)]) == 0
  (result,) = json.loads(out.read_text())["results"]
  assert result["median_seconds"].keys() == {
      "full", "accumulate3", "rolled3", "pgrad_b"}
  assert all(t > 0 for t in result["median_seconds"].values())


def test_accumulated_erm_gradient_is_the_full_batch_gradient():
  import numpy as np
  from flax import nnx
  from benchmarks import grad_accumulation
  from experiments import algorithms, models
  model = models.build_model("mnist_cnn", num_classes=10,
                             input_shape=(8, 8, 1), rngs=nnx.Rngs(0),
                             widths=(8, 8, 8, 8))
  network, params, stats = algorithms.Network.split(model)
  rng = np.random.default_rng(0)
  batch = algorithms.merge_domains(algorithms.with_example_keys(
      common.digit_batches(rng, 2, 6, 8), jax.random.key(0)))
  grads = {}
  for micro, unroll in ((None, True), (4, True), (3, False)):
    step, init = grad_accumulation.erm_step(network, micro, unroll)
    grads[micro] = step(params, stats, init(params), batch)[2]
  for micro in (4, 3):
    for got, want in zip(jax.tree.leaves(grads[micro]),
                         jax.tree.leaves(grads[None])):
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)


def test_vmap_trials_checks_every_trial_and_times_both_variants(tmp_path):
  from benchmarks import vmap_trials
  record = run_json(vmap_trials.main,
                    ["--algorithms", "ERM", "--trials", "1", "2",
                     "--domains", "2", "--batch", "3", "--repeats", "1"],
                    tmp_path)
  assert [(r["algorithm"], r["trials"]) for r in record["results"]] == [
      ("ERM", 1), ("ERM", 2)]
  for result in record["results"]:
    assert result["timings"].keys() == {"separate", "vmapped"}
    for timing in result["timings"].values():
      assert timing["compile_ms"] > 0 and len(timing["times_ms"]) == 1
      assert timing["trial_steps_per_hour"] == pytest.approx(
          result["trials"] * 3.6e6 / timing["median_ms"])


def test_vmap_trials_defaults_come_from_the_models_dataset():
  from benchmarks import vmap_trials
  digits = vmap_trials.parse_args([])
  assert (digits.domains, digits.batch, digits.image_size) == (5, 63, 8)
  photos = vmap_trials.parse_args(["--model", "resnet18"])
  assert (photos.domains, photos.batch, photos.image_size) == (3, 33, 32)


def test_vmap_trials_check_catches_another_trials_step():
  import numpy as np
  from benchmarks import vmap_trials
  params = {"w": np.zeros(3, np.float32)}
  step = ({"w": np.array([1e-3, 0, 0], np.float32)}, None, None,
          {"loss": np.float32(2.3)})
  vmap_trials.check_same_step(params, step, step)
  other_params = ({"w": np.array([0, 1e-3, 0], np.float32)}, *step[1:])
  with pytest.raises(AssertionError, match="vmapped params differ"):
    vmap_trials.check_same_step(params, step, other_params)
  other_loss = (step[0], None, None, {"loss": np.float32(2.2)})
  with pytest.raises(AssertionError, match="loss"):
    vmap_trials.check_same_step(params, step, other_loss)
  for flags in (["--trials", "0"], ["--trials", "3", "0"], ["--width", "12"]):
    with pytest.raises(SystemExit):
      vmap_trials.parse_args(flags)
