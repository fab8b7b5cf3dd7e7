"""Where a run trains: what of its machine can change the run's numbers.

XLA:CPU compiles for the instructions of the host it runs on, and uses as
many threads as the process has cores, so one run's floating-point results
can differ in their last digits from one kind of CPU to another; a release
of JAX or of the packages around it (`PACKAGES`), another backend or other
``XLA_FLAGS`` can change them too.
`describe` says all of that about the process calling it, for the run to
keep beside its records (`experiments.rundir.records.ENVIRONMENT_FILE`), so
that a difference found on retraining can be read against the machines. It
names no host, user or path.

Only `describe` imports JAX, when called: commands that read runs import
this module without it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections.abc import Mapping, Sequence
from typing import Any

CPUINFO = "/proc/cpuinfo"
# The instruction sets that XLA:CPU's code generation and its libraries
# (oneDNN, Eigen) pick kernels by, as Linux's cpuinfo names them: x86's
# "flags", then aarch64's "Features".
CPU_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f",
    "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "i8mm", "bf16")
# The packages whose release can change a run's numbers: the compiler and its
# runtime, the optimizers, the models' layers and initialisers, the host
# arrays and their dtypes, and the input pipeline that orders the batches.
PACKAGES = ("jax", "jaxlib", "optax", "flax", "numpy", "ml_dtypes", "grain")


def _cpuinfo_fields(text: str) -> dict[str, str]:
  """The first value of every field of a cpuinfo text (its first CPU's)."""
  fields = {}
  for line in text.splitlines():
    name, colon, value = line.partition(":")
    if colon:
      fields.setdefault(name.strip(), value.strip())
  return fields


def processor(cpuinfo: str | None = None) -> dict[str, Any]:
  """The processor's model and the instruction sets among `CPU_FEATURES`
  that it has.

  Args:
    cpuinfo: the text of Linux's ``/proc/cpuinfo``; by default, read from
      there where it exists.

  Returns:
    ``{"processor": str, "processor_features": [str]}``, the features in
    `CPU_FEATURES`'s order. Without a cpuinfo (not Linux) or a model name
    in it (some ARM kernels), the model is Python's `platform.processor`
    or else `platform.machine`; without a cpuinfo, or flags in it, the
    features are left out rather than said to be none.
  """
  if cpuinfo is None:
    try:
      with open(CPUINFO, encoding="utf-8", errors="replace") as f:
        cpuinfo = f.read()
    except OSError:
      cpuinfo = ""
  fields = _cpuinfo_fields(cpuinfo)
  described = {"processor": (fields.get("model name")
                             or platform.processor() or platform.machine())}
  flags = fields.get("flags", fields.get("Features"))
  if flags is not None:
    present = set(flags.split())
    described["processor_features"] = [
        name for name in CPU_FEATURES if name in present]
  return described


def cores() -> int:
  """The cores this process may run on, which size XLA:CPU's thread pool."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def versions() -> dict[str, str | None]:
  """The installed version of each of `PACKAGES` (None: not installed), read
  from their metadata without importing them."""
  found = {}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def describe(devices: int = 1) -> dict[str, Any]:
  """This process's environment as a run records it: the processor
  (`processor`), its cores, JAX's backend and the first ``devices`` of its
  devices, which the run trains on, the versions of `PACKAGES` and of
  Python, and ``$XLA_FLAGS`` (None when unset).

  Every value is a JSON value, so that the entry equals itself read back.
  Runs trained before an entry held every one of `PACKAGES` name jax and
  jaxlib alone; `differences` reads the others as unrecorded.
  """
  # Here, not at the top: only training imports JAX.
  import jax  # pylint: disable=import-outside-toplevel
  used = jax.devices()[:devices]
  return {
      **processor(),
      "cores": cores(),
      "backend": jax.default_backend(),
      "devices": {"kind": used[0].device_kind, "count": len(used)},
      **versions(),
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS"),
  }


def locked_versions(requirements: str) -> dict[str, str]:
  """The versions of `PACKAGES` that a requirements file pins: its
  ``name==version`` lines, as ``uv pip compile`` and pip-tools write them,
  names compared as PEP 503 normalises them (``ml-dtypes`` is
  ``ml_dtypes``)."""
  def normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()
  wanted = {normal(name): name for name in PACKAGES}
  found = {}
  for line in requirements.splitlines():
    if match := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)",
                         line):
      if (name := wanted.get(normal(match[1]))) is not None:
        found[name] = match[2]
  return found


def _value(entry: Mapping[str, Any] | None, field: str) -> str:
  if entry is None or field not in entry:
    return "unrecorded"
  value = entry[field]
  if field == "processor_features":
    return " ".join(value) or "none"
  if field == "devices":
    return f"{value['count']} x {value['kind']}"
  return "unset" if value is None else str(value)


def summary(entry: Mapping[str, Any] | None) -> str:
  """One entry of `describe` in one line: processor, cores, instruction
  sets, backend and devices, then the versions and ``XLA_FLAGS``; None (the
  steps of a run resumed after it lost its entries) is unrecorded."""
  if entry is None:
    return "unrecorded"
  versions_text = ", ".join(f"{name} {_value(entry, name)}"
                            for name in (*PACKAGES, "python"))
  return (f"{_value(entry, 'processor')}, {_value(entry, 'cores')} cores "
          f"({_value(entry, 'processor_features')}); "
          f"{_value(entry, 'backend')} backend, {_value(entry, 'devices')}; "
          f"{versions_text}; XLA_FLAGS {_value(entry, 'xla_flags')}")


def differences(trained: Sequence[Mapping[str, Any] | None],
                retrained: Mapping[str, Any]) -> list[str]:
  """What of ``retrained`` differs from where a run trained.

  Args:
    trained: the run's entries (`describe`'s), one per machine it trained
      on; None for steps trained where it was not recorded.
    retrained: the entry of the process that trained it again.

  Returns:
    One line per field that differs from the value in any of ``trained``,
    ``"field: <trained values> trained, <value> now"``, in `describe`'s
    order; a field that an older entry lacks reads as unrecorded. Empty
    when every entry equals ``retrained``.
  """
  fields = list(retrained)
  fields += [f for entry in trained for f in entry or {} if f not in fields]
  lines = []
  for field in fields:
    then = list(dict.fromkeys(_value(entry, field) for entry in trained))
    now = _value(retrained, field)
    if then != [now]:
      lines.append(f"{field}: {' / '.join(then)} trained, {now} now")
  return lines
