"""The library examples of README.md and docs/api.md run as written.

Each test executes a file's fenced Python blocks in order, in one namespace,
and checks that they do what the text around them says.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pgrad_jax

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"


def python_blocks(path):
  """The fenced Python blocks of a markdown file, in order."""
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run(block, namespace, path):
  exec(compile(block, str(path.relative_to(ROOT)), "exec"), namespace)


def quick_start():
  """The namespace the README's Quick start leaves, which docs/api.md uses."""
  namespace = {}
  run(python_blocks(README)[0], namespace, README)
  return namespace


def numpy_loss(params, batches):
  """The Quick start's loss, mean over its domains, in float64 NumPy."""
  x = np.asarray(batches["x"], np.float64)
  logits = x @ np.asarray(params["w"], np.float64) + np.asarray(
      params["b"], np.float64)
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  labels = np.asarray(batches["y"])[..., None]
  return -np.take_along_axis(log_probs, labels, -1).mean()


def test_quick_start_prints_the_loss_before_and_after(capsys):
  namespace = quick_start()
  printed = [float(number) for number in re.findall(
      r"loss (?:before|after)[^:]*: (\d+\.\d+)", capsys.readouterr().out)]
  assert len(printed) == 2, printed
  before, after = printed
  # Zero params: every class equally likely, a loss of ln 10.
  np.testing.assert_allclose(before, np.log(10), atol=5e-5)
  np.testing.assert_allclose(
      after, numpy_loss(namespace["params"], namespace["batches"]), atol=5e-5)
  assert after < before - 0.01
  # The state is sized for the batches' domains, and so holds every inner
  # step's loss: 3 domains x B = 3 chunks.
  state = namespace["state"][0]
  assert state.losses.shape == (9,)
  assert state.eigenvalues.shape == (10,)
  assert bool(jnp.isfinite(state.ref_norm)) and float(state.ref_norm) > 0


def test_quick_start_says_its_nnx_part_needs_flax():
  text = README.read_text()
  quick_start_text = text[text.index("## Quick start"):]
  before_nnx = quick_start_text[:quick_start_text.index("from flax import")]
  prose = re.sub(r"```python\n.*?```", "", before_nnx, flags=re.S)
  assert re.search(r"pip install[^`]*flax", prose, re.I), prose


def test_readme_examples_run_and_do_what_they_say():
  _, nnx_example, *later_examples = python_blocks(README)
  namespace = quick_start()

  # The NNX model's own parameters move, by the transform's update.
  first_batch = jax.tree.map(lambda x: x[0], namespace["batches"])
  run(nnx_example, namespace, README)
  model, loss = namespace["model"], namespace["model_loss"]
  before = loss(nnx.state(model, nnx.Param), first_batch)
  for _ in range(3):
    namespace["nnx_train_step"](model, namespace["optimizer"],
                                namespace["batches"])
  assert float(loss(nnx.state(model, nnx.Param), first_batch)) < float(before)

  # Any further example runs as written after the ones above.
  for example in later_examples:
    run(example, namespace, README)


def test_api_examples_run_and_do_what_they_say():
  model_state, batch_norm, fish, schedule, inject = python_blocks(API)
  namespace = quick_start()
  inner_steps = 3 * 3  # The Quick start's 3 domains x B = 3 chunks.

  # The model state follows the inner steps of one update.
  run(model_state, namespace, API)
  stats = namespace["stats"]
  assert int(stats["steps"]) == inner_steps
  assert np.all(np.isfinite(stats["mean"])) and np.any(stats["mean"] != 0)

  # The BatchNorm example: its running statistics leave their initial
  # values through the optimizer's model state
  # (tests/integration/test_flax_and_orbax.py checks that the step traces
  # once).
  run(batch_norm, namespace, API)
  bn_model = namespace["bn_model"]
  assert np.any(np.asarray(bn_model.norm.mean[...]) != 0)

  # Fish's state is PGrad's without the eigenvalues; its inner Adam took
  # every inner step, and the chained SGD applied a finite, non-zero step.
  run(fish, namespace, API)
  fish_state = namespace["fish_state"][0]
  assert isinstance(fish_state, pgrad_jax.FishState)
  assert set(pgrad_jax.PGradState._fields) - set(fish_state._fields) == {
      "eigenvalues"}
  assert int(fish_state.inner_state[0].count) == inner_steps
  fish_updates = jax.tree.leaves(namespace["fish_updates"])
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in fish_updates)
  assert any(bool(jnp.any(u != 0)) for u in fish_updates)

  run(schedule, namespace, API)
  assert int(namespace["state"][0].inner_state[1].count) == inner_steps

  # Static k and B stay out of the injected hyperparams, so a jitted update
  # traces (a traced k or B is refused).
  run(inject, namespace, API)
  injected, injected_state = namespace["injected"], namespace["injected_state"]
  assert not {"k", "B"} & set(injected_state.hyperparams)
  update = jax.jit(lambda params, state: injected.update(
      None, state, params, loss_fn=namespace["loss_fn"],
      batches=namespace["batches"]))
  updates, _ = update(namespace["params"], injected_state)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
