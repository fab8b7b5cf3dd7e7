"""Tests for experiments.weights.torch_pickle: reading .pth files.

The reader is checked against files that PyTorch wrote (tests/data/, made by
tests/data/make_torch_state_dicts.py), and against files of
tests/experiments/torch_writer.py.
"""

import os
import pickle
import subprocess
import sys
from pathlib import Path
import zipfile

import numpy as np
import pytest

from experiments.weights import torch_pickle
import torch_writer

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
FIXTURES = {"zip": DATA / "basic_block.pth",
            "legacy": DATA / "basic_block_legacy.pth"}


def _expected():
  """torch.load's tensors of the fixtures, and their strides."""
  with np.load(DATA / "basic_block_expected.npz") as npz:
    arrays = {key: npz[key] for key in npz.files}
  return ({k: v for k, v in arrays.items() if not k.startswith("strides/")},
          {k.removeprefix("strides/"): tuple(v) for k, v in arrays.items()
           if k.startswith("strides/")})


@pytest.mark.parametrize("file_format", FIXTURES)
def test_reader_returns_torch_loads_tensors(file_format):
  expected, strides = _expected()
  loaded = torch_pickle.read_torch_state_dict(FIXTURES[file_format])
  assert list(loaded) == list(expected)  # num_batches_tracked included.
  assert loaded["bn1.num_batches_tracked"].dtype == np.int64
  for name, array in loaded.items():
    np.testing.assert_array_equal(array, expected[name], strict=True,
                                  err_msg=name)
    assert tuple(s // array.itemsize for s in array.strides) == (
        strides[name]), name
  # The fixture's views are what make the strides matter.
  for name in ("views.transposed", "views.strided"):
    assert not loaded[name].flags.c_contiguous, name
  np.testing.assert_array_equal(loaded["views.transposed"],
                                loaded["conv1.weight"].transpose(1, 0, 2, 3))


class _Exploit:
  """Unpickling it would run a shell command."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return os.system, (f"touch {self.marker}",)


def _malicious_zip(path, payload):
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("archive/data.pkl", payload)


def _malicious_legacy(path, payload, state_dict=True):
  """The legacy format with ``payload`` for the state dict, or else for the
  list of storage keys that follows it."""
  with open(path, "wb") as file:
    for header in (torch_pickle._LEGACY_MAGIC_NUMBER,
                   torch_pickle._LEGACY_PROTOCOL_VERSION,
                   {"little_endian": True}):
      pickle.dump(header, file, protocol=2)
    if not state_dict:
      pickle.dump({}, file, protocol=2)
    file.write(payload)


def _malicious_legacy_keys(path, payload):
  _malicious_legacy(path, payload, state_dict=False)


@pytest.mark.parametrize("write", [_malicious_zip, _malicious_legacy,
                                   _malicious_legacy_keys])
def test_reader_refuses_a_pickle_that_would_run_code(write, tmp_path):
  marker = tmp_path / "exploited"
  payload = pickle.dumps({"conv1.weight": _Exploit(marker)}, protocol=2)
  # The command works when unpickled by pickle itself.
  pickle.loads(payload)
  assert marker.exists()
  marker.unlink()
  path = tmp_path / "evil.pth"
  write(path, payload)
  with pytest.raises(torch_pickle.UnsafeCheckpointError,
                     match=r"refers to posix\.system"):
    torch_pickle.read_torch_state_dict(path)
  assert not marker.exists()


@pytest.mark.parametrize("file_format", FIXTURES)
def test_reader_refuses_truncated_files(file_format, tmp_path):
  data = FIXTURES[file_format].read_bytes()
  path = tmp_path / "cut.pth"
  path.write_bytes(data[:len(data) - 100])
  with pytest.raises(ValueError, match="damaged|truncated|not a PyTorch"):
    torch_pickle.read_torch_state_dict(path)


def test_reader_refuses_what_is_not_a_state_dict(tmp_path):
  path = tmp_path / "list.pth"
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("archive/data.pkl", pickle.dumps([1, 2], protocol=2))
  with pytest.raises(ValueError, match="not a state dict"):
    torch_pickle.read_torch_state_dict(path)


def test_reader_reads_what_torchvisions_2017_files_may_hold():
  # densenet121-a639ec97.pth was saved in 2017: by Python 2, maybe from a
  # GPU, with torch < 0.4's _rebuild_tensor; the fixture is all of these at
  # once, holding the tensors of the fixtures that PyTorch wrote.
  expected, _ = _expected()
  path = DATA / "basic_block_2017.pth"
  head = path.read_bytes()[:2000]
  assert b"torch.cuda\nFloatStorage" in head and b"cuda:0" in head
  assert b"torch._utils\n_rebuild_tensor\n" in head
  assert pickle.SHORT_BINSTRING + bytes([12]) + b"conv1.weight" in head
  loaded = torch_pickle.read_torch_state_dict(path)
  assert list(loaded) == list(expected)
  for name, array in loaded.items():
    np.testing.assert_array_equal(array, expected[name], strict=True,
                                  err_msg=name)


@pytest.mark.parametrize("options", [
    dict(legacy=True, python2=True), dict(location="cuda:0"),
    dict(legacy=True, location="cuda:0"),
    dict(rebuild="_rebuild_tensor"),
    dict(legacy=True, rebuild="_rebuild_tensor")], ids=str)
def test_reader_reads_each_old_feature_alone(options, tmp_path):
  expected, _ = _expected()
  torch_writer.write_state_dict(tmp_path / "old.pth", expected, **options)
  loaded = torch_pickle.read_torch_state_dict(tmp_path / "old.pth")
  assert list(loaded) == list(expected)
  for name, array in loaded.items():
    np.testing.assert_array_equal(array, expected[name], strict=True,
                                  err_msg=name)


def test_reader_names_a_file_whose_python2_strings_are_not_utf8(tmp_path):
  # torch.load decodes Python 2's byte strings as UTF-8, and fails where
  # they are not; so does the reader, naming the file.
  path = tmp_path / "latin1.pth"
  torch_writer.write_state_dict(
      path, {"caf\xe9.weight": np.zeros(2, np.float32)}, legacy=True,
      python2=True)
  with pytest.raises(ValueError, match=r"latin1\.pth' is damaged or not a "
                     "PyTorch file .*utf-8"):
    torch_pickle.read_torch_state_dict(path)


def test_test_writer_round_trips_through_the_reader(tmp_path):
  # The writer makes the full-size files below; PyTorch checked the reader.
  expected, _ = _expected()
  torch_writer.write_state_dict(tmp_path / "w.pth", expected)
  loaded = torch_pickle.read_torch_state_dict(tmp_path / "w.pth")
  assert list(loaded) == list(expected)
  for name, array in loaded.items():
    np.testing.assert_array_equal(array, expected[name], strict=True)



def test_reader_imports_neither_torch_nor_jax_nor_flax():
  # A fresh interpreter: this one has imported them all already.
  code = ("import sys; import experiments.weights.torch_pickle; "
          "print(sorted({'torch', 'jax', 'flax'} & set(sys.modules)))")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          capture_output=True, text=True, check=True)
  assert result.stdout == "[]\n"
