"""The README's quick start runs as written."""

import pathlib
import re

import jax


def test_quick_start_runs():
  readme = pathlib.Path(__file__).parent.parent / "README.md"
  code = re.search(r"## Quick start\s+```python\n(.*?)```", readme.read_text(),
                   re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)
  state = namespace["state"]
  assert bool(jax.numpy.isfinite(state[0].ref_norm))
  assert float(state[0].ref_norm) > 0
