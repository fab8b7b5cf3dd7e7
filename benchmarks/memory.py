"""Peak memory of one PGrad-B training step against its bound.

A step keeps ``theta_0``, the inner Adam state (2 copies), one gradient,
the current inner point and the stored trajectory, so it should need about
``trajectory + 5 * d * bytes`` plus the activations of one inner step. The
trajectory is the ``m - 1`` displacements, ``(m + 4) * d * bytes`` in all,
or on one CPU device, where leaves are stored interleaved, all ``m`` points
(``theta_0`` as a zero row): ``(m + 5) * d * bytes``.
For MLPs of several widths ``d`` and several ``m = domains * B + 1`` this
reads XLA's compiled memory analysis of the jitted step (params and state
donated, as in a training loop): arguments + outputs - aliased + temporaries,
with the default ``nonfinite="skip"`` (which must keep the previous inner
state until the rollout's losses are known to be finite: two more copies
with Adam) and with ``nonfinite="propagate"``.
Where the device reports allocator statistics (GPU) it also runs each step
once and records its device peak, or None where compilation or an earlier
step had already set a higher high-water mark.

It then compares ``trajectory_dtype=jnp.bfloat16`` with float32 on one
configuration: the relative error and cosine similarity of the update, and
the memory saved.
"""

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import pgrad_jax
from benchmarks import common


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hidden", type=int, nargs="+",
                      default=[256, 512, 1024, 2048],
                      help="MLP hidden widths h; d is about 1024 h + h^2 / 2.")
  parser.add_argument("--domains", type=int, nargs="+", default=[2, 5, 10],
                      help="Domain counts; m = domains * B + 1.")
  parser.add_argument("--batch", type=int, default=63)
  parser.add_argument("--B", type=int, default=3)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--unroll", default="auto",
                      help="Scan unroll: auto (library default), full, or N.")
  parser.add_argument("--out", default=None, help="Write the results as JSON.")
  return parser.parse_args(argv)


def train_step(model: common.Model, tx: optax.GradientTransformation):
  """A jitted step that donates params and state, as a training loop does."""
  def step(params, state, batches):
    updates, state = tx.update(None, state, params, loss_fn=model.loss_fn,
                               batches=batches)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def compile_with_bytes(fn, *args) -> tuple[Any, dict[str, int]]:
  """``fn`` compiled for ``args``, with XLA's memory analysis and the peak it
  implies."""
  compiled = fn.lower(*args).compile()
  stats = compiled.memory_analysis()
  out = {name: int(getattr(stats, f"{name}_size_in_bytes"))
         for name in ("argument", "output", "alias", "temp")}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return compiled, out


def activation_bytes(model: common.Model, chunk: Any) -> int:
  """Temporaries of one inner gradient on one chunk: its activations."""
  return compile_with_bytes(jax.jit(jax.grad(model.loss_fn)), model.params,
                            chunk)[1]["temp"]


def device_memory() -> dict[str, int] | None:
  """The allocator's statistics; None where there are none (CPU)."""
  return jax.devices()[0].memory_stats() or None


def step_peak_bytes(before: dict[str, int], after: dict[str, int],
                    argument_bytes: int) -> int | None:
  """The device peak of one step from the allocator's statistics around it.

  The allocator keeps one high-water mark for the process, which compilation
  (autotuning) and earlier steps may already have raised. If the step raised
  it, its peak is the new mark less what was in use before it, plus its own
  arguments (which were in use before it): comparable with the compiled
  peak. If it did not, the mark belongs to something else, and the step's
  peak is unknown: None.
  """
  if after["peak_bytes_in_use"] <= before["peak_bytes_in_use"]:
    return None
  return (after["peak_bytes_in_use"] - before["bytes_in_use"] +
          argument_bytes)


def trajectory_bytes(model: common.Model, batches: Any, B: int,
                     unroll, dtype=None) -> int:
  """Bytes of the trajectory a PGrad rollout stores, in the layout it picks."""
  inner = optax.adam(1e-3)
  num_domains = jax.tree.leaves(batches)[0].shape[0]

  def stored(params, batches):
    domains, chunks = pgrad_jax.domain_schedule(
        jax.random.key(0), num_domains, B, "fixed")
    return pgrad_jax.rollout(
        model.loss_fn, inner, params, inner.init(params), batches, domains,
        chunks, pgrad_jax.RolloutOptions(
            B=B, unroll=unroll, trajectory_dtype=dtype)).displacements

  return common.num_bytes(jax.eval_shape(stored, model.params, batches))


def measure(hidden: int, domains: int, args: argparse.Namespace,
            unroll) -> dict[str, Any]:
  """One row: compiled peak against the bound and, where the device keeps
  allocator statistics, the peak of running the step once."""
  model = common.mlp(hidden)
  batches = jax.tree.map(jnp.asarray,
                         common.random_batches(model, domains, args.batch))
  m = domains * args.B + 1
  param_bytes = common.num_bytes(model.params)
  chunk = jax.tree.map(lambda x: x[0, : args.batch // args.B], batches)
  activations = activation_bytes(model, chunk)
  compiled = {}
  for nonfinite in ("skip", "propagate"):
    tx = pgrad_jax.pgrad(optax.adam(1e-3), args.k, args.B, unroll=unroll,
                         nonfinite=nonfinite)
    state = tx.init(model.params)
    step, compiled[nonfinite] = compile_with_bytes(
        train_step(model, tx), model.params, state, batches)
  trajectory = trajectory_bytes(model, batches, args.B, unroll)
  bound = trajectory + 5 * param_bytes + activations
  row = {
      "hidden": hidden, "d": model.num_params, "domains": domains, "m": m,
      "param_bytes": param_bytes,
      "trajectory_bytes": trajectory,
      "activation_bytes": activations,
      "compiled": compiled["skip"],
      "compiled_propagate": compiled["propagate"],
      "bound_bytes": bound,
      "peak_over_bound": compiled["skip"]["peak"] / bound,
      "peak_over_bound_propagate": compiled["propagate"]["peak"] / bound,
      "device_peak_bytes": None,
  }
  if device_memory() is not None:
    # The step (the last compiled: nonfinite="propagate") donates params and
    # state, so it runs on copies.
    arguments = jax.tree.map(jnp.copy, (model.params, state))
    common.block(arguments)
    before = device_memory()
    common.block(step(*arguments, batches))
    row["device_peak_bytes"] = step_peak_bytes(
        before, device_memory(), compiled["propagate"]["argument"])
  return row


def measure_all(args: argparse.Namespace, unroll) -> list[dict[str, Any]]:
  """Every row, each compiled, run and freed before the next is built, so
  that each device peak belongs to its own step (see
  :func:`step_peak_bytes`)."""
  return [measure(h, n, args, unroll) for h in args.hidden
          for n in args.domains]


def bfloat16_trajectory(hidden: int, domains: int, args: argparse.Namespace,
                        unroll) -> dict[str, Any]:
  """Error and memory of a bfloat16 trajectory against a float32 one."""
  model = common.mlp(hidden)
  batches = jax.tree.map(jnp.asarray,
                         common.random_batches(model, domains, args.batch))
  out = {"hidden": hidden, "d": model.num_params, "domains": domains,
         "m": domains * args.B + 1}
  updates = {}
  for name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
    tx = pgrad_jax.pgrad(optax.adam(1e-3), args.k, args.B, unroll=unroll,
                         trajectory_dtype=dtype)
    state = tx.init(model.params)
    update, out[f"{name}_compiled"] = compile_with_bytes(
        jax.jit(lambda p, s, b, tx=tx: tx.update(
            None, s, p, loss_fn=model.loss_fn, batches=b)[0]),
        model.params, state, batches)
    flat, _ = ravel_pytree(update(model.params, state, batches))
    updates[name] = np.asarray(flat, np.float64)
  ref, low = updates["float32"], updates["bfloat16"]
  out["relative_error"] = float(np.linalg.norm(low - ref) /
                                np.linalg.norm(ref))
  out["cosine_similarity"] = float(
      low @ ref / (np.linalg.norm(low) * np.linalg.norm(ref)))
  out["temp_bytes_saved"] = (out["float32_compiled"]["temp"] -
                             out["bfloat16_compiled"]["temp"])
  out["trajectory_bytes_saved"] = (
      trajectory_bytes(model, batches, args.B, unroll) -
      trajectory_bytes(model, batches, args.B, unroll, jnp.bfloat16))
  return out


def report(record: dict[str, Any]) -> str:
  """The tables a run prints."""
  mb = lambda n: n / 2**20
  rows = [[r["hidden"], r["d"], r["m"], mb(r["trajectory_bytes"]),
           mb(r["activation_bytes"]), mb(r["compiled"]["temp"]),
           mb(r["compiled"]["peak"]), mb(r["bound_bytes"]),
           r["peak_over_bound"], r["peak_over_bound_propagate"],
           "-" if r["device_peak_bytes"] is None else
           mb(r["device_peak_bytes"])]
          for r in record["rows"]]
  env = record["environment"]
  bf16 = record["bfloat16_trajectory"]
  return "\n\n".join([
      f"PGrad-B step memory (MiB), {env['device_kind']} ({env['platform']}), "
      f"unroll={record['config']['unroll_used']}",
      common.format_table(
          ["hidden", "d", "m", "trajectory", "activations", "temp",
           "peak (compiled)", "bound", "peak/bound",
           "peak/bound propagate", "device peak"], rows),
      f"bfloat16 trajectory, d={bf16['d']}, m={bf16['m']}: relative error "
      f"{bf16['relative_error']:.3g}, cosine {bf16['cosine_similarity']:.6f}, "
      f"compiled temp {mb(bf16['float32_compiled']['temp']):.1f} -> "
      f"{mb(bf16['bfloat16_compiled']['temp']):.1f} MiB (the trajectory itself "
      f"is {mb(bf16['trajectory_bytes_saved']):.1f} MiB smaller)",
  ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  unroll = common.parse_unroll(args.unroll)
  used = unroll
  if unroll is None:
    used = common.default_unroll(common.mlp(args.hidden[0]), args.batch, args.B)
  rows = measure_all(args, unroll)
  record = {
      "benchmark": "memory",
      "environment": common.environment(),
      "config": vars(args) | {"unroll_used": common.unroll_name(used)},
      "rows": rows,
      "bfloat16_trajectory": bfloat16_trajectory(
          args.hidden[-1], args.domains[-1], args, unroll),
  }
  common.publish(record, report(record), args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
