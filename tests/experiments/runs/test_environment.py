"""Tests for experiments/runs/environment.py: what a run records of the
machine it trains on."""

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib
import numpy as np
import optax

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
  assert described["optax"] == optax.__version__
  assert described["flax"] == importlib.metadata.version("flax")
  assert described["numpy"] == np.__version__
  assert described["python"] == platform.python_version()
  assert described["xla_flags"] == "--xla_cpu_enable_fast_math=false"
  assert described["cores"] >= 1
  assert described["processor"]
  monkeypatch.delenv("XLA_FLAGS")
  assert environment.describe()["xla_flags"] is None
  # These and no more: nothing that names the host, the user or a path.
  assert set(described) - {"processor_features"} == {
      "processor", "cores", "backend", "devices", "python", "xla_flags",
      "jax", "jaxlib", "optax", "flax", "numpy", "ml_dtypes", "grain"}


def test_a_package_not_installed_is_said_so(monkeypatch):
  monkeypatch.setattr(environment, "PACKAGES", ("jax", "no-such-package"))
  assert environment.versions() == {"jax": jax.__version__,
                                    "no-such-package": None}


# An entry of a run trained before entries named every package, as the
# runs of then wrote it.
OLD_ENTRY = {"processor": "AMD EPYC 7B13",
             "processor_features": ["sse4_2", "avx", "avx2", "fma", "f16c"],
             "cores": 2, "backend": "cpu",
             "devices": {"kind": "cpu", "count": 1}, "jax": "0.10.2",
             "jaxlib": "0.10.2", "python": "3.11.7", "xla_flags": None}
NEW_ENTRY = {**OLD_ENTRY, "processor_features": [
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f"], "optax": "0.2.8",
             "flax": "0.12.8", "numpy": "2.4.6", "ml_dtypes": "0.6.0",
             "grain": "0.2.18", "xla_flags": "--xla_cpu_max_isa=AVX2"}


def test_summary_names_processor_versions_and_flags_in_one_line():
  assert environment.summary(NEW_ENTRY) == (
      "AMD EPYC 7B13, 2 cores (sse4_2 avx avx2 fma f16c avx512f); cpu "
      "backend, 1 x cpu; jax 0.10.2, jaxlib 0.10.2, optax 0.2.8, flax "
      "0.12.8, numpy 2.4.6, ml_dtypes 0.6.0, grain 0.2.18, python 3.11.7; "
      "XLA_FLAGS --xla_cpu_max_isa=AVX2")
  # An older entry reads: what it lacks is unrecorded.
  assert environment.summary(OLD_ENTRY).endswith(
      "jaxlib 0.10.2, optax unrecorded, flax unrecorded, numpy unrecorded, "
      "ml_dtypes unrecorded, grain unrecorded, python 3.11.7; XLA_FLAGS unset")


def test_differences_name_each_field_that_differs_from_any_entry():
  assert environment.differences([NEW_ENTRY], NEW_ENTRY) == []
  assert environment.differences([OLD_ENTRY], NEW_ENTRY) == [
      "processor_features: sse4_2 avx avx2 fma f16c trained, sse4_2 avx avx2 "
      "fma f16c avx512f now",
      "xla_flags: unset trained, --xla_cpu_max_isa=AVX2 now",
      "optax: unrecorded trained, 0.2.8 now",
      "flax: unrecorded trained, 0.12.8 now",
      "numpy: unrecorded trained, 2.4.6 now",
      "ml_dtypes: unrecorded trained, 0.6.0 now",
      "grain: unrecorded trained, 0.2.18 now"]
  # A run resumed on another machine: what either of them had.
  assert environment.differences(
      [NEW_ENTRY, {**NEW_ENTRY, "jax": "0.11.2"}], NEW_ENTRY) == [
          "jax: 0.10.2 / 0.11.2 trained, 0.10.2 now"]
  # Resumed after its entries were lost: the steps before are unrecorded.
  assert environment.differences([None, NEW_ENTRY], NEW_ENTRY)[:2] == [
      "processor: unrecorded / AMD EPYC 7B13 trained, AMD EPYC 7B13 now",
      "processor_features: unrecorded / sse4_2 avx avx2 fma f16c avx512f "
      "trained, sse4_2 avx avx2 fma f16c avx512f now"]
  assert environment.summary(None) == "unrecorded"


def test_importing_it_imports_no_jax():
  # The commands that read runs import experiments.runs, and the run
  # directory's modules but its checkpoints, without JAX.
  found = subprocess.run(
      [sys.executable, "-c", "import sys\n"
       "from experiments.runs import environment\n"
       "from experiments.rundir import claim, pack, records\n"
       "print(sorted(m for m in sys.modules if m.split('.')[0] in "
       "('jax', 'jaxlib')))"],
      cwd=REPO, capture_output=True, text=True, check=True)
  assert found.stdout == "[]\n", found.stderr


def test_locked_versions_are_read_from_a_requirements_lock():
  lock = """\
# via uv pip compile
flax==0.12.8 \\
    --hash=sha256:00
ml-dtypes==0.6.0 ; python_version >= "3.10"
    # via jax
jaxlib==0.10.2
scipy==1.17.1
"""
  assert environment.locked_versions(lock) == {
      "flax": "0.12.8", "ml_dtypes": "0.6.0", "jaxlib": "0.10.2"}
