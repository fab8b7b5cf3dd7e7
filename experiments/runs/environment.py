"""Where a run trains: what of its machine can change the run's numbers.

XLA:CPU compiles for the instructions of the host it runs on, and uses as
many threads as the process has cores, so one run's floating-point results
can differ in their last digits from one kind of CPU to another; a JAX or
jaxlib release, another backend or other ``XLA_FLAGS`` can change them too.
`describe` says all of that about the process calling it, for the run to
keep beside its records (`experiments.runs.records.ENVIRONMENT_FILE`), so
that a difference found on retraining can be read against the machines. It
names no host, user or path.

Only `describe` imports JAX, when called: commands that read runs import
this module without it.
"""

from __future__ import annotations

import os
import platform
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


def describe(devices: int = 1) -> dict[str, Any]:
  """This process's environment as a run records it: the processor
  (`processor`), its cores, JAX's backend and the first ``devices`` of its
  devices, which the run trains on, the versions of jax, jaxlib and Python,
  and ``$XLA_FLAGS`` (None when unset).

  Every value is a JSON value, so that the entry equals itself read back.
  """
  # Here, not at the top: only training imports JAX.
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  used = jax.devices()[:devices]
  return {
      **processor(),
      "cores": cores(),
      "backend": jax.default_backend(),
      "devices": {"kind": used[0].device_kind, "count": len(used)},
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS"),
  }
