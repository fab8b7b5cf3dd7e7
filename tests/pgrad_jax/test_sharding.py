"""pgrad on 8 simulated CPU devices gives the single-device update.

JAX fixes the number of CPU devices when it first initialises, which other
test modules have done by the time this one runs. So the sharded runs happen
once, in a subprocess started with ``--xla_force_host_platform_device_count=8``
that writes a JSON report; the tests below check the report.

Covered: data parallelism under jit (Auto and Explicit mesh axes) and under
``shard_map`` with ``axis_name``; FSDP (params, inner Adam state and hence
the trajectory sharded), including the compiled HLO's collectives; both on a
2 x 4 mesh built by the benchmarks' helpers; and the step-time benchmark on a
4-device mesh. All with a rolled scan (``unroll=1``).
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pgrad_jax
from benchmarks import common
from benchmarks import step_time

NUM_DEVICES = 8
DOMAINS, BATCH, B, K = 3, 16, 2, 4
STEPS = DOMAINS * B  # Stored trajectory points, m - 1.
SIZES = (16, 64, 64, 8)
ROOT = pathlib.Path(__file__).resolve().parents[2]


# --- what the subprocess runs -------------------------------------------------


def _sharded_report(out_path: str) -> None:
  """Runs every sharded case and writes their results to ``out_path``."""
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  rng = np.random.default_rng(0)
  params = {
      f"layer{i}": {"w": rng.normal(size=(a, b)) / np.sqrt(a),
                    "b": rng.normal(size=b) * 0.1}
      for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))}
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  batches = {
      "x": jnp.asarray(rng.normal(size=(DOMAINS, BATCH, SIZES[0])),
                       jnp.float32),
      "y": jnp.asarray(rng.integers(0, SIZES[-1], (DOMAINS, BATCH)),
                       jnp.int32)}

  def mlp_loss(p, batch):
    x = batch["x"]
    for i in range(len(p)):
      x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
      x = jax.nn.relu(x) if i < len(p) - 1 else x
    return optax.softmax_cross_entropy_with_integer_labels(
        x, batch["y"]).mean()

  def make_update(loss_fn, axis_name=None, inner=optax.adam(1e-2), **extras):
    # A rolled scan, the default on GPU and TPU, also compiles fastest.
    tx = pgrad_jax.pgrad(inner, K, B, unroll=1, axis_name=axis_name,
                         num_domains=DOMAINS)

    def update(params, state, batches):
      return tx.update(None, state, params, loss_fn=loss_fn, batches=batches,
                       **extras)

    return tx, update

  def rel_error(a, b):
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  def run_compiled(fn, *args):
    """``fn(*args)`` and the result shapes of every all-gather and all-reduce
    in its compiled HLO."""
    compiled = jax.jit(fn).lower(*args).compile()
    found = {"all-gather": [], "all-reduce": []}
    for line in compiled.as_text().splitlines():
      match = re.search(r"= (.+?) (all-gather|all-reduce)(-start)?\(", line)
      if match:
        found[match.group(2)] += [
            [int(n) for n in dims.split(",") if n]
            for dims in re.findall(r"\w+\[([\d,]*)\]", match.group(1))]
    return compiled(*args), found

  def single_device(tx, update, params, batches):
    return jax.jit(update)(params, tx.init(params), batches)[0]

  def on_mesh(tx, update, mesh, params, batches, param_spec, batch_spec):
    """The update with params/state and batches placed by the two specs."""
    state = tx.init(params)
    put = lambda tree, spec: jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), tree)
    args = (put(params, param_spec), put(state, param_spec),
            put(batches, batch_spec))
    with jax.set_mesh(mesh):
      (out, _), found = run_compiled(update, *args)
    return out, found

  replicated = lambda x: P()
  by_batch = lambda x: P(None, "data")
  by_fsdp = lambda x: common.fsdp_spec(x.shape, NUM_DEVICES)
  report = {"param_shapes": [list(x.shape) for x in jax.tree.leaves(params)]}

  # One update and its single-device result serve every jit-sharded case.
  tx, update = make_update(mlp_loss)
  expected = single_device(tx, update, params, batches)
  for name, axis_type in [("auto", AxisType.Auto),
                          ("explicit", AxisType.Explicit)]:
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))
    out, found = on_mesh(tx, update, mesh, params, batches, replicated,
                         by_batch)
    report[f"data_{name}"] = {"error": rel_error(out, expected), **found}

  # shard_map: each device chunks its own rows, so its chunk i is a slice of
  # the single-device chunk i once the rows are reordered chunk-major. SGD,
  # unlike Adam, would show gradients summed instead of averaged.
  sgd_tx, sgd_update = make_update(mlp_loss, inner=optax.sgd(0.1))
  _, local_update = make_update(mlp_loss, axis_name="data",
                                inner=optax.sgd(0.1))
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  mapped = jax.jit(jax.shard_map(
      local_update, mesh=mesh, in_specs=(P(), P(), P(None, "data")),
      out_specs=P()))
  per_chunk = BATCH // (NUM_DEVICES * B)
  chunk_major = jax.tree.map(
      lambda x: x.reshape((DOMAINS, NUM_DEVICES, B, per_chunk) + x.shape[2:])
      .swapaxes(1, 2).reshape(x.shape), batches)
  out = mapped(params, sgd_tx.init(params), batches)[0]
  report["shard_map"] = {"error": rel_error(
      out, single_device(sgd_tx, sgd_update, params, chunk_major))}

  # A model state (a running mean of the inputs, as BatchNorm keeps) follows
  # the rollout and is averaged over the data axis.
  def stateful_loss(p, batch, model_state):
    return mlp_loss(p, batch), 0.9 * model_state + 0.1 * batch["x"].mean(0)

  model_state = jnp.zeros(SIZES[0])
  stateful_tx, stateful_update = make_update(
      stateful_loss, inner=optax.sgd(0.1), model_state=model_state)
  _, local_stateful = make_update(stateful_loss, axis_name="data",
                                  inner=optax.sgd(0.1),
                                  model_state=model_state)
  state = stateful_tx.init(params)
  mapped = jax.jit(jax.shard_map(
      local_stateful, mesh=mesh, in_specs=(P(), P(), P(None, "data")),
      out_specs=P()))
  report["shard_map_model_state"] = {"error": rel_error(
      mapped(params, state, batches)[1].model_state,
      jax.jit(stateful_update)(params, state, chunk_major)[1].model_state)}

  mesh = jax.make_mesh((NUM_DEVICES,), ("fsdp",), axis_types=(AxisType.Auto,))
  out, found = on_mesh(tx, update, mesh, params, batches, by_fsdp, replicated)
  report["fsdp"] = {"error": rel_error(out, expected), **found}

  # Explicit FSDP reaches the leaf-wise Gram with sharded operands; a linear
  # model keeps the loss itself free of ambiguous explicit shardings.
  linear = {"w": params["layer0"]["w"]}
  linear_tx, linear_update = make_update(
      lambda p, batch: jnp.mean((batch["x"] @ p["w"])**2))
  mesh = jax.make_mesh((NUM_DEVICES,), ("fsdp",),
                       axis_types=(AxisType.Explicit,))
  out, _ = on_mesh(linear_tx, linear_update, mesh, linear, batches,
                   lambda x: P(None, "fsdp") if x.ndim == 2 else P(),
                   replicated)
  report["fsdp_explicit"] = {"error": rel_error(
      out, single_device(linear_tx, linear_update, linear, batches))}

  # Both, on the benchmarks' (data, fsdp) mesh and placement helpers.
  mesh = common.make_mesh(data=2, fsdp=4)
  args = (common.place(params, mesh, fsdp=True),
          common.place(tx.init(params), mesh, fsdp=True),
          common.shard_batches(jax.tree.map(np.asarray, batches), mesh))
  with jax.set_mesh(mesh):
    (out, _), found = run_compiled(update, *args)
  report["data_fsdp"] = {"error": rel_error(out, expected), **found}

  record = step_time.main([
      "--model", "mlp", "--hidden", "8", "--domains", "1", "--batch", "4",
      "--B", "1", "--devices", "4", "--unroll", "1", "--repeats", "1",
      "--warmup", "0", "--no-split"])
  report["step_time"] = {"devices": record["config"]["devices"],
                         "methods": sorted(record["results"])}

  with open(out_path, "w") as f:
    json.dump(report, f)


# --- the tests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharding") / "report.json"
  device_count = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [str(ROOT), os.environ.get("PYTHONPATH", "")]),
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {device_count}")
  proc = subprocess.run([sys.executable, __file__, str(out)], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  return json.loads(out.read_text())


# The relative errors against one device, under --xla_cpu_max_isa SSE4_2,
# AVX, AVX2 and AVX-512: at most 1.1e-6 (shard_map, whose devices sum their
# own rows' gradients before the all-reduce), at most 6.8e-7 for the others;
# the tolerance is 9 times the largest.
TOLERANCE = 1e-5


@pytest.mark.parametrize("case", ["data_auto", "data_explicit", "shard_map",
                                  "shard_map_model_state", "fsdp",
                                  "fsdp_explicit", "data_fsdp"])
def test_matches_single_device(report, case):
  assert report[case]["error"] < TOLERANCE


def test_explicit_data_axis_runs_data_parallel(report):
  # The inner step (the body of the rolled scan) all-reduces a full gradient
  # over the data axis: it ran on each device's share of the chunk rather
  # than replicated.
  reduced = sum(math.prod(s) for s in report["data_explicit"]["all-reduce"])
  assert reduced >= sum(math.prod(s) for s in report["param_shapes"])


@pytest.mark.parametrize("case", ["fsdp", "data_fsdp"])
def test_fsdp_never_gathers_the_trajectory(report, case):
  gathered = report[case]["all-gather"]
  largest = max(math.prod(s) for s in report["param_shapes"])
  for shape in gathered:
    assert shape[:1] != [STEPS] or shape[1:] not in report["param_shapes"]
    # Nothing bigger than one parameter leaf moves; the trajectory of the
    # largest leaf would be STEPS times that.
    assert math.prod(shape) <= largest, shape
  # Only the (m - 1) x (m - 1) Gram partial sums are reduced for the PCA.
  assert [STEPS, STEPS] in report[case]["all-reduce"]


def test_step_time_runs_on_a_mesh(report):
  assert report["step_time"] == {
      "devices": 4, "methods": ["erm", "fish", "pgrad-B", "rollout"]}


if __name__ == "__main__":
  _sharded_report(sys.argv[1])
