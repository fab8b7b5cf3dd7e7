"""Models, meshes and timing shared by the benchmarks.

Everything here runs unchanged on CPU, GPU and TPU, and on one or several
processes: meshes are built from the global device list and batches are
assembled from each process's local rows.
"""

import dataclasses
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pgrad_jax._src import layout

MODELS = ("mlp", "mnist_cnn", "resnet18", "resnet50")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NUM_CLASSES = 10
MLP_INPUTS = 1024
DATA, FSDP = "data", "fsdp"


@dataclasses.dataclass(frozen=True)
class Model:
  """A model as the benchmarks use it: params, a loss and an input shape.

  Attributes:
    params: the trainable parameters, a pytree of float32 arrays.
    loss_fn: ``loss_fn(params, batch) -> scalar`` for a batch
      ``{"x": (N, *input_shape), "y": (N,) int32}``.
    input_shape: the shape of one example.
  """

  params: Any
  loss_fn: Callable[[Any, Any], jax.Array]
  input_shape: tuple[int, ...]

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def mlp(hidden: int = 2048, dtype=jnp.float32, seed: int = 0) -> Model:
  """A ReLU MLP ``1024 -> hidden -> hidden/2 -> 10`` with dict params.

  ``hidden=2048`` gives 4.2M parameters. Params stay float32; ``dtype`` is
  the compute dtype of the matmuls.
  """
  widths = (MLP_INPUTS, hidden, max(hidden // 2, 1), NUM_CLASSES)
  keys = jax.random.split(jax.random.key(seed), len(widths) - 1)
  params = {
      f"layer{i}": {
          "w": jax.random.normal(key, (a, b)) / np.sqrt(a),
          "b": jnp.zeros((b,)),
      } for i, (key, a, b) in enumerate(zip(keys, widths[:-1], widths[1:]))
  }

  def loss_fn(params, batch):
    x = batch["x"].astype(dtype)
    for i in range(len(params)):
      layer = params[f"layer{i}"]
      x = x @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
      if i < len(params) - 1:
        x = jax.nn.relu(x)
    return _cross_entropy(x, batch["y"])

  return Model(params, loss_fn, (MLP_INPUTS,))


def flax_model(name: str, image_size: int, dtype=jnp.float32,
               seed: int = 0) -> Model:
  """A network of ``experiments.models`` split into params and a pure loss.

  Everything that is not an ``nnx.Param`` (e.g. frozen BatchNorm statistics)
  is closed over as a constant.
  """
  # Only the CNNs need flax, an optional dependency.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from experiments import models  # pylint: disable=g-import-not-at-top

  channels = 1 if name == "mnist_cnn" else 3
  input_shape = (image_size, image_size, channels)
  model = models.build_model(name, num_classes=NUM_CLASSES,
                             input_shape=input_shape, rngs=nnx.Rngs(seed),
                             dtype=dtype)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, batch):
    return _cross_entropy(nnx.merge(graphdef, params, rest)(batch["x"]),
                          batch["y"])

  return Model(params, loss_fn, input_shape)


def digits_cnn(image_size: int, width: int, seed: int = 0):
  """The study's MNIST CNN on one-channel ``image_size`` digits, as the
  experiments' algorithms take it: ``(network, params, stats)``.

  ``width`` is its first layer's width; the others are twice it.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from experiments import algorithms  # pylint: disable=g-import-not-at-top
  from experiments import models  # pylint: disable=g-import-not-at-top

  model = models.build_model(
      "mnist_cnn", num_classes=NUM_CLASSES,
      input_shape=(image_size, image_size, 1), rngs=nnx.Rngs(seed),
      widths=(width, 2 * width, 2 * width, 2 * width))
  return algorithms.Network.split(model)


def digit_batches(rng: np.random.Generator, num_domains: int, batch: int,
                  image_size: int, channels: int = 1) -> dict[str, np.ndarray]:
  """Random ``{"image", "label"}`` batches of ``num_domains x batch`` digits
  (or, with three ``channels``, photos) for the experiments' algorithms,
  drawn from ``rng`` (images first)."""
  images = rng.random((num_domains, batch, image_size, image_size, channels),
                      np.float32)
  labels = rng.integers(0, NUM_CLASSES, (num_domains, batch)).astype(np.int32)
  return {"image": images, "label": labels}


def build_model(name: str, *, dtype=jnp.float32, image_size: int | None = None,
                hidden: int = 2048) -> Model:
  """Builds one of :data:`MODELS`; ``image_size`` defaults to 28 / 224."""
  if name == "mlp":
    return mlp(hidden, dtype)
  if name not in MODELS:
    raise ValueError(f"--model must be one of {MODELS}, got {name!r}.")
  default = 28 if name == "mnist_cnn" else 224
  return flax_model(name, image_size or default, dtype)


def random_batches(model: Model, num_domains: int, batch: int,
                   seed: int = 1) -> dict[str, np.ndarray]:
  """Host-side ``{"x", "y"}`` with leaves ``(num_domains, batch, ...)``."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_domains, batch) + model.input_shape,
                          dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, (num_domains, batch), dtype=np.int32)
  return {"x": x, "y": y}


def make_mesh(data: int = 1, fsdp: int = 1) -> jax.sharding.Mesh:
  """A ``(data, fsdp)`` mesh over the first ``data * fsdp`` global devices.

  ``data`` is an Explicit axis: a batch sharded over it keeps its sharding
  through pgrad's chunking, so every inner step runs data-parallel. ``fsdp``
  is an Auto axis: the SPMD partitioner places the model's collectives.
  """
  size = data * fsdp
  devices = jax.devices()
  if size > len(devices):
    raise ValueError(f"A {data} x {fsdp} mesh needs {size} devices; "
                     f"{len(devices)} are visible.")
  return jax.make_mesh((data, fsdp), (DATA, FSDP),
                       axis_types=(AxisType.Explicit, AxisType.Auto),
                       devices=devices[:size])


def shard_batches(local_batches: Any, mesh: jax.sharding.Mesh) -> Any:
  """Global batches from each process's rows, sharded over ``data``.

  Every process passes its own ``(num_domains, local_batch, ...)`` rows; the
  global per-domain batch is their concatenation in process order. With one
  process this is a plain ``device_put``.
  """
  sharding = NamedSharding(mesh, P(None, DATA))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x),
      local_batches)


def fsdp_spec(shape: Sequence[int], size: int) -> P:
  """Shards the largest axis that ``size`` divides over ``fsdp``, if any."""
  axes = [i for i in np.argsort(shape)[::-1] if shape[i] % size == 0]
  if size == 1 or not axes:
    return P()
  spec = [None] * len(shape)
  spec[axes[0]] = FSDP
  return P(*spec)


def place(tree: Any, mesh: jax.sharding.Mesh, fsdp: bool = False) -> Any:
  """Puts identical host values from every process on ``mesh``.

  Leaves are replicated, or with ``fsdp=True`` sharded by :func:`fsdp_spec`.
  Built from a callback, so it also works when the mesh spans processes.
  """
  size = mesh.shape[FSDP]

  def put(x):
    x = np.asarray(x)
    spec = fsdp_spec(x.shape, size) if fsdp else P()
    return jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, spec), lambda index: x[index])

  return jax.tree.map(put, tree)


def environment() -> dict[str, Any]:
  """The backend, devices and library versions a result was measured on."""
  device = jax.devices()[0]
  return {
      "platform": device.platform,
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "process_count": jax.process_count(),
      "jax": jax.__version__,
      "jaxlib": importlib.metadata.version("jaxlib"),
      "optax": optax.__version__,
  }


def block(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.block_until_ready(), tree)


@dataclasses.dataclass
class Timing:
  """Wall-clock times of one function, in milliseconds."""

  compile_ms: float
  times_ms: list[float]

  @property
  def median_ms(self) -> float:
    return statistics.median(self.times_ms)

  def as_dict(self) -> dict[str, Any]:
    return {"median_ms": self.median_ms, "compile_ms": self.compile_ms,
            "times_ms": self.times_ms}


def time_interleaved(calls: dict[str, Callable[[], Any]], repeats: int,
                     warmup: int = 1) -> dict[str, Timing]:
  """Times zero-argument calls round-robin, so drifting load hits all alike.

  The first call of each (compilation included) is recorded as
  ``compile_ms``; ``warmup`` more calls are discarded; then every round
  calls each function once and waits for its result.
  """
  compile_ms = {}
  for name, call in calls.items():
    start = time.perf_counter()
    block(call())
    compile_ms[name] = 1e3 * (time.perf_counter() - start)
    for _ in range(warmup):
      block(call())
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      block(call())
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: Timing(compile_ms[name], times[name]) for name in calls}


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A plain-text table; floats get 4 significant digits, None a dash."""
  def cell(v):
    if v is None:
      return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)

  cells = [list(map(str, header))] + [[cell(v) for v in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def parse_unroll(value: str) -> int | bool | None:
  """``auto`` (the library's default for the backend and loss), ``full`` or an
  int."""
  if value == "auto":
    return None
  if value == "full":
    return True
  return int(value)


def default_unroll(model: Model, batch: int, B: int) -> int | bool:
  """The library's unroll for ``model`` on chunks of ``batch / B``."""
  chunk = jax.tree.map(lambda x: x[0], random_batches(model, 1, batch // B))
  return layout.default_layout(
      jax.make_jaxpr(model.loss_fn)(model.params, chunk)).unroll


def unroll_name(unroll: int | bool) -> str:
  """How results name a scan unroll: ``full`` or the integer."""
  return "full" if unroll is True else str(unroll)


def num_bytes(tree: Any) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def write_json(record: dict[str, Any], out: str) -> None:
  """Writes a benchmark's record as JSON to ``out``."""
  with open(out, "w") as f:
    json.dump(record, f, indent=2)
    f.write("\n")


def publish(record: dict[str, Any], table: str, out: str | None) -> None:
  """Prints a benchmark's table and writes its record as JSON to ``out``."""
  print(table)
  if out:
    write_json(record, out)
