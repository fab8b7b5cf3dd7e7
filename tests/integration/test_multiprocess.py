"""pgrad across two processes gives the single-device update.

Follows the multi-host launch of docs/scaling.md on CPU: two subprocesses,
each with two CPU devices, join through ``jax.distributed.initialize`` on a
localhost coordinator (cross-process collectives over gloo). They build one
(data, fsdp) = (2, 2) mesh over the four global devices, with ``data`` split
between the processes and ``fsdp`` within each, place the params with
``jax.device_put``, feed their own rows of every domain's batch through
``jax.make_array_from_process_local_data`` and take two jitted training
steps. Each writes the gathered params; the test compares them with the same
two steps on one device with the full batch.
"""

import concurrent.futures
import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pgrad_jax
from benchmarks import common

NUM_PROCESSES, LOCAL_DEVICES = 2, 2
DOMAINS, BATCH, B, K, STEPS = 3, 8, 2, 3, 2
HIDDEN = 16
ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
# The relative error against one device: at most 5.5e-8 under
# --xla_cpu_max_isa SSE4_2, AVX, AVX2 and AVX-512; the tolerance is 18 times
# that, and the two steps move the params by over 100 times the tolerance.
TOLERANCE = 1e-6


def _problem():
  """Params, the global batches and the loss, identical in every process."""
  model = common.mlp(hidden=HIDDEN)  # Seeded: the same params everywhere.
  return model.params, common.random_batches(model, DOMAINS, BATCH), (
      model.loss_fn)


def _transform():
  # A rolled scan compiles fastest.
  return optax.chain(pgrad_jax.pgrad(optax.adam(1e-2), K, B, unroll=1),
                     optax.sgd(0.1))


def _train(params, state, batches, loss_fn, tx):
  @jax.jit
  def train_step(params, state, batches):
    updates, state = tx.update(None, state, params, loss_fn=loss_fn,
                               batches=batches)
    return optax.apply_updates(params, updates), state

  for _ in range(STEPS):
    params, state = train_step(params, state, batches)
  return params


# --- what each subprocess runs ------------------------------------------------


def _worker(coordinator: str, process_id: int, out_path: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=NUM_PROCESSES,
                             process_id=process_id, initialization_timeout=60)
  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  assert jax.process_count() == NUM_PROCESSES, jax.process_count()
  assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
  mesh = jax.make_mesh((NUM_PROCESSES, LOCAL_DEVICES), ("data", "fsdp"),
                       axis_types=(AxisType.Explicit, AxisType.Auto))
  # Each row of the data axis lives on one process, so the batch really is
  # split between the processes and the gradients are reduced across them.
  owners = [{d.process_index for d in row} for row in mesh.devices]
  assert owners == [{i} for i in range(NUM_PROCESSES)], owners

  def fsdp_sharding(x):
    axes = [i for i in np.argsort(x.shape)[::-1]
            if x.shape[i] % mesh.shape["fsdp"] == 0]
    spec = [None] * x.ndim
    if axes:
      spec[axes[0]] = "fsdp"
    return NamedSharding(mesh, P(*spec))

  params, batches, loss_fn = _problem()
  tx = _transform()
  params = jax.device_put(params, jax.tree.map(fsdp_sharding, params))
  state = tx.init(params)
  rows = BATCH // NUM_PROCESSES
  local_batches = jax.tree.map(
      lambda x: x[:, process_id * rows:(process_id + 1) * rows], batches)
  batch_sharding = NamedSharding(mesh, P(None, "data"))
  batches = jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(batch_sharding, x),
      local_batches)
  params = _train(params, state, batches, loss_fn, tx)
  params = multihost_utils.process_allgather(params, tiled=True)
  leaves, _ = jax.tree.flatten(params)
  np.savez(out_path, *[np.asarray(x) for x in leaves])
  jax.distributed.shutdown()


# --- the test -----------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _rel_error(a, b):
  a = np.concatenate([np.ravel(x) for x in a])
  b = np.concatenate([np.ravel(x) for x in b])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run_processes(tmp_path):
  """Runs the workers; returns each one's params leaves."""
  coordinator = f"localhost:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [str(ROOT), os.environ.get("PYTHONPATH", "")]))
  # A device count forced by XLA_FLAGS would override jax_num_cpu_devices;
  # the other flags stay.
  env["XLA_FLAGS"] = " ".join(
      flag for flag in env.get("XLA_FLAGS", "").split()
      if not flag.startswith("--xla_force_host_platform_device_count"))
  outs = [tmp_path / f"process{i}.npz" for i in range(NUM_PROCESSES)]
  with contextlib.ExitStack() as stack:
    logs = [stack.enter_context(open(tmp_path / f"process{i}.log", "w+"))
            for i in range(NUM_PROCESSES)]
    procs = [subprocess.Popen([sys.executable, __file__, coordinator, str(i),
                               str(outs[i])], env=env, cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    # A process that fails leaves the other waiting in a collective, so stop
    # at the first failure rather than at the timeout (a hang guard).
    def wait_ok(proc):
      if proc.wait():
        raise ChildProcessError(proc.returncode)

    with concurrent.futures.ThreadPoolExecutor(NUM_PROCESSES) as pool:
      try:
        concurrent.futures.wait(
            [pool.submit(wait_ok, p) for p in procs], timeout=TIMEOUT_S,
            return_when=concurrent.futures.FIRST_EXCEPTION)
      finally:
        # What still runs is killed, so the pool's waits, and the pool, end.
        for p in procs:
          if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    text = []
    for i, log in enumerate(logs):
      log.seek(0)
      text.append(f"--- process {i} ---\n{log.read()[-4000:]}")
  assert codes == [0] * NUM_PROCESSES, (
      f"exit codes {codes} (negative: killed after a failure or the "
      f"{TIMEOUT_S} s timeout)\n" + "\n".join(text))
  results = []
  for out in outs:
    with np.load(out) as f:
      results.append([f[f"arr_{i}"] for i in range(len(f.files))])
  return results


def test_two_processes_match_single_device(tmp_path):
  results = _run_processes(tmp_path)
  for leaves in results[1:]:
    assert all(np.array_equal(a, b) for a, b in zip(leaves, results[0])), (
        "the processes disagree")

  # Under jit the chunks are taken from the global array, so chunk i is the
  # i-th contiguous block of the concatenated rows, as on one device.
  params, batches, loss_fn = _problem()
  tx = _transform()
  expected = jax.tree.leaves(_train(
      jax.tree.map(jnp.asarray, params), tx.init(params),
      jax.tree.map(jnp.asarray, batches), loss_fn, tx))
  initial = jax.tree.leaves(params)
  # The steps moved the params, so processes that skipped them would fail.
  assert _rel_error(initial, expected) > 100 * TOLERANCE
  assert _rel_error(results[0], expected) < TOLERANCE


if __name__ == "__main__":
  try:
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
  except BaseException:  # pylint: disable=broad-exception-caught
    # A normal exit would wait in jax.distributed's shutdown barrier for the
    # other process, which may itself be stuck waiting for this one.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
