"""The README's library examples run as written and do what the text says."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

README = pathlib.Path(__file__).parent.parent / "README.md"


def library_examples():
  """The Python blocks from "Quick start" to "Benchmarks", in order."""
  text = README.read_text()
  text = text[text.index("## Quick start"):text.index("## Benchmarks")]
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_library_examples_run_and_do_what_they_say():
  quick_start, nnx_example, model_state, schedule = library_examples()
  namespace = {}
  exec(compile(quick_start, "README.md", "exec"), namespace)
  state = namespace["state"]
  assert bool(jnp.isfinite(state[0].ref_norm))
  assert float(state[0].ref_norm) > 0

  # The NNX model's own parameters move, by the transform's update.
  first_batch = jax.tree.map(lambda x: x[0], namespace["batches"])
  exec(compile(nnx_example, "README.md", "exec"), namespace)
  model, loss = namespace["model"], namespace["model_loss"]
  before = loss(nnx.state(model, nnx.Param), first_batch)
  for _ in range(3):
    namespace["nnx_train_step"](model, namespace["optimizer"],
                                namespace["batches"])
  assert float(loss(nnx.state(model, nnx.Param), first_batch)) < float(before)

  # The model state follows the 9 inner steps of one update.
  exec(compile(model_state, "README.md", "exec"), namespace)
  stats = namespace["stats"]
  assert int(stats["steps"]) == 9
  assert np.all(np.isfinite(stats["mean"])) and np.any(stats["mean"] != 0)

  exec(compile(schedule, "README.md", "exec"), namespace)
  assert int(namespace["state"][0].inner_state[1].count) == 9
