"""Tests for benchmarks/profile_update.py: the trace's ops, summed."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import profile_update


def _convolve(x, w):
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")  # The known op.
  return jnp.tanh(y).sum()


def test_summary_of_a_traced_convolution(tmp_path):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 16, 16)),
                  jnp.float32)
  w = jnp.ones((4, 3, 3, 3), jnp.float32)
  fn = jax.jit(_convolve)
  calls = 2
  record = profile_update.trace_program(fn, (x, w), warmup=1, calls=calls,
                                        trace_dir=tmp_path)
  hlo_text = fn.lower(x, w).compile().as_text()
  instructions = set(re.findall(r"%([\w.\-]+) = ", hlo_text))
  rows = record["by_op"]
  assert rows and {r["name"] for r in rows} <= instructions
  # The convolution's line is where some op's time is.
  lines, first = inspect.getsourcelines(_convolve)
  conv_line = first + next(i for i, line in enumerate(lines)
                           if "conv_general_dilated" in line)
  sources = {r["source"] for r in rows}
  assert f"tests/benchmarks/test_profile_update.py:{conv_line}" in sources
  # Every op of this loop-free program ran once a call.
  assert all(r["count"] == calls for r in rows)
  for table in ("by_op", "by_kind", "by_source"):
    shares = [r["share"] for r in record[table]]
    assert all(0 <= s <= 1 for s in shares)
    assert sum(shares) == pytest.approx(1.0, abs=1e-9)
    assert sum(r["ms_per_update"] for r in record[table]) == pytest.approx(
        record["op_ms_per_update"])
  assert record["module"] == profile_update.hlo_module_name(hlo_text)
  assert record["module"] in record["trace_overview"]["hlo_modules"]
  assert record["num_ops"] == len(rows)


def test_the_principal_step_is_what_the_rollout_has_no_line_of():
  def row(name, ms, source):
    return {"name": name, "count": 1, "total_ms": ms, "ms_per_update": ms,
            "share": ms / 10, "source": source}
  rollout = [row("fusion.1", 4.0, "rollout.py:3"), row("copy.2", 1.0, None)]
  pgrad = [row("fusion.7", 4.0, "rollout.py:3"),
           row("dot.3", 2.5, "principal.py:10"),
           row("fusion.9", 0.5, "principal.py:12"), row("copy.4", 3.0, None)]
  principal = profile_update.principal_step(pgrad, rollout)
  assert [r["name"] for r in principal["ops"]] == ["dot.3", "fusion.9"]
  assert principal["ms_per_update"] == 3.0


def _event(name, ts, dur, pid=1, tid=1, module="jit_f"):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
          "name": name, "args": {"hlo_op": name, "hlo_module": module}}


def _name(kind, pid, name, tid=None):
  event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
  return event if tid is None else {**event, "tid": tid}


def test_nested_ops_count_their_own_time():
  events = [_name("process_name", 1, "/host:CPU"),
            _event("while.1", 0, 10), _event("dot.2", 2, 3),
            _event("add.3", 6, 1), _event("add.3", 20, 2),
            _event("other.4", 0, 5, module="jit_g")]
  ops = profile_update.op_events(events, "jit_f")
  own = {(e["name"], e["ts"]): e["self_us"] for e in ops}
  assert own == {("while.1", 0): 6, ("dot.2", 2): 3, ("add.3", 6): 1,
                 ("add.3", 20): 2}
  rows = profile_update.summarize(ops, calls=2)
  assert [(r["name"], r["count"], r["total_ms"]) for r in rows] == [
      ("while.1", 1, 6e-3), ("dot.2", 1, 3e-3), ("add.3", 2, 3e-3)]
  assert rows[0]["ms_per_update"] == 3e-3 and rows[0]["share"] == 0.5


def test_a_device_counts_its_xla_ops_line_alone():
  events = [_name("process_name", 1, "/host:CPU"),
            _name("process_name", 2, "/device:GPU:0"),
            _name("thread_name", 2, "XLA Ops", tid=7),
            _name("thread_name", 2, "Stream #1", tid=8),
            _event("fusion.1", 0, 4, pid=1),  # the host's launch
            _event("fusion.1", 5, 2, pid=2, tid=7),
            _event("fusion.1", 5, 2, pid=2, tid=8)]  # its kernel
  ops = profile_update.op_events(events, "jit_f")
  assert [(e["pid"], e["tid"]) for e in ops] == [(2, 7)]
  # Where the ops' line does not name the ops' module, the kernels count.
  unnamed = {**events[5], "args": {"hlo_op": "fusion.1"}}
  ops = profile_update.op_events(events[:5] + [unnamed, events[6]], "jit_f")
  assert [(e["pid"], e["tid"]) for e in ops] == [(2, 8)]


def test_a_module_may_carry_its_programs_id():
  assert profile_update.of_module("jit_step", "jit_step")
  assert profile_update.of_module("jit_step(12)", "jit_step")
  assert profile_update.of_module("jit_step.3", "jit_step")
  assert not profile_update.of_module("jit_step_2", "jit_step")
  assert not profile_update.of_module(None, "jit_step")


def test_op_kind_drops_the_numbers():
  assert profile_update.op_kind("fusion.12") == "fusion"
  assert profile_update.op_kind("loop_add_fusion_3.1") == "loop_add_fusion"
  assert profile_update.op_kind("custom-call") == "custom-call"
