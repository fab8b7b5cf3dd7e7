"""Tests for experiments/runs/environment.py: what a run records of the
machine it trains on."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib

from experiments.runs import environment

REPO = Path(__file__).resolve().parents[3]

# Two processors of a Linux /proc/cpuinfo, shortened.
X86_CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 sha_ni
"""
# An aarch64 kernel's: features, but no model name.
ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_the_processor_is_named_with_the_instruction_sets_xla_picks_by():
  assert environment.processor(X86_CPUINFO) == {
      "processor": "AMD EPYC 7B13",
      "processor_features": ["sse4_2", "avx", "avx2", "fma", "f16c"]}


def test_a_cpuinfo_without_a_model_name_falls_back_to_python(monkeypatch):
  monkeypatch.setattr(platform, "processor", lambda: "")
  monkeypatch.setattr(platform, "machine", lambda: "aarch64")
  assert environment.processor(ARM_CPUINFO) == {
      "processor": "aarch64",
      "processor_features": ["asimd", "sve", "i8mm", "bf16"]}
  # No cpuinfo at all (not Linux): no features rather than none.
  monkeypatch.setattr(platform, "processor", lambda: "arm")
  assert environment.processor("") == {"processor": "arm"}


def test_describe_says_this_process_in_json_values(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  described = environment.describe()
  assert json.loads(json.dumps(described)) == described
  assert described["backend"] == jax.default_backend()
  assert described["devices"] == {"kind": jax.devices()[0].device_kind,
                                  "count": 1}
  assert (described["jax"], described["jaxlib"]) == (jax.__version__,
                                                      jaxlib.__version__)
  assert described["python"] == platform.python_version()
  assert described["xla_flags"] == "--xla_cpu_enable_fast_math=false"
  assert described["cores"] >= 1
  assert described["processor"]
  monkeypatch.delenv("XLA_FLAGS")
  assert environment.describe()["xla_flags"] is None
  # These and no more: nothing that names the host, the user or a path.
  assert set(described) - {"processor_features"} == {
      "processor", "cores", "backend", "devices", "jax", "jaxlib", "python",
      "xla_flags"}


def test_importing_it_imports_no_jax():
  # The commands that read runs import experiments.runs without JAX.
  found = subprocess.run(
      [sys.executable, "-c", "import sys\n"
       "from experiments.runs import environment, records\n"
       "print(sorted(m for m in sys.modules if m.split('.')[0] in "
       "('jax', 'jaxlib')))"],
      cwd=REPO, capture_output=True, text=True, check=True)
  assert found.stdout == "[]\n", found.stderr
