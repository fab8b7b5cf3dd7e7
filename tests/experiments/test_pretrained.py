"""Tests for experiments.pretrained: reading .pth files and fetching weights.

The reader is checked against files that PyTorch wrote (tests/data/, made by
tests/data/make_torch_state_dicts.py). The downloads come from an HTTP
server on 127.0.0.1 that the tests start, serving those files or files of
tests/experiments/torch_writer.py, under names whose hex digits start their
SHA-256 as torchvision's do.
"""

import contextlib
import dataclasses
import hashlib
import http.server
import io
import os
import pickle
import socket
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import input_pipeline as input_benchmark
from experiments import catalog
from experiments import config as config_lib
from experiments import pretrained
from experiments import train
from test_models import random_state_dict
import torch_writer

REPO = Path(__file__).resolve().parents[2]
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
  loaded = pretrained.read_torch_state_dict(FIXTURES[file_format])
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
    for header in (pretrained._LEGACY_MAGIC_NUMBER,
                   pretrained._LEGACY_PROTOCOL_VERSION,
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
  with pytest.raises(pretrained.UnsafeCheckpointError,
                     match=r"refers to posix\.system"):
    pretrained.read_torch_state_dict(path)
  assert not marker.exists()


@pytest.mark.parametrize("file_format", FIXTURES)
def test_reader_refuses_truncated_files(file_format, tmp_path):
  data = FIXTURES[file_format].read_bytes()
  path = tmp_path / "cut.pth"
  path.write_bytes(data[:len(data) - 100])
  with pytest.raises(ValueError, match="damaged|truncated|not a PyTorch"):
    pretrained.read_torch_state_dict(path)


def test_reader_refuses_what_is_not_a_state_dict(tmp_path):
  path = tmp_path / "list.pth"
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("archive/data.pkl", pickle.dumps([1, 2], protocol=2))
  with pytest.raises(ValueError, match="not a state dict"):
    pretrained.read_torch_state_dict(path)


def test_test_writer_round_trips_through_the_reader(tmp_path):
  # The writer makes the full-size files below; PyTorch checked the reader.
  expected, _ = _expected()
  torch_writer.write_state_dict(tmp_path / "w.pth", expected)
  loaded = pretrained.read_torch_state_dict(tmp_path / "w.pth")
  assert list(loaded) == list(expected)
  for name, array in loaded.items():
    np.testing.assert_array_equal(array, expected[name], strict=True)


def test_convert_cli_needs_no_torch(monkeypatch, tmp_path, capsys):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails.
  state_dict = random_state_dict(18)
  torch_writer.write_state_dict(tmp_path / "r.pth", state_dict)
  out = tmp_path / "r.npz"
  assert pretrained.main(["convert", "--in", str(tmp_path / "r.pth"),
                          "--out", str(out)]) == 0
  assert "resnet18" in capsys.readouterr().out
  with np.load(out) as converted:
    np.testing.assert_array_equal(
        converted["layer2/0/downsample/0/kernel"],
        state_dict["layer2.0.downsample.0.weight"].transpose(2, 3, 1, 0))


# ---------------------------------------------------------------------------
# Downloads.


class _Server(http.server.ThreadingHTTPServer):
  """Serves ``files`` (name -> bytes) under /models/, and counts requests.

  ``damage`` changes what the next responses send: ``"corrupt"`` flips a
  byte, ``"truncate"`` closes the connection halfway through the body.
  """

  def __init__(self):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.files, self.requests, self.damage = {}, [], None

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/models"


class _Handler(http.server.BaseHTTPRequestHandler):

  def do_GET(self):  # pylint: disable=invalid-name
    server = self.server
    server.requests.append(self.path)
    data = server.files.get(self.path.removeprefix("/models/"))
    if data is None:
      self.send_error(404)
      return
    body = data
    if server.damage == "corrupt":
      body = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    elif server.damage == "truncate":
      body = data[:len(data) // 2]
    self.send_response(200)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):  # Quiet.
    del args


@pytest.fixture(name="server")
def fixture_server(monkeypatch, tmp_path):
  """A local server, and the weights' URL and cache pointed at it."""
  server = _Server()
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  monkeypatch.setenv(pretrained.URL_VARIABLE, server.url)
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "cache"))
  yield server
  server.shutdown()
  server.server_close()


def serve_weights(server, monkeypatch, model, data):
  """Serves ``data`` as ``model``'s ImageNet weights file, named as
  torchvision names its files; returns the name."""
  digest = hashlib.sha256(data).hexdigest()
  filename = f"{model}-{digest[:8]}.pth"
  monkeypatch.setitem(catalog.MODELS, model, dataclasses.replace(
      catalog.MODELS[model], imagenet_weights=filename))
  server.files[filename] = data
  return filename


def test_fetch_downloads_checks_and_caches_once(server, monkeypatch,
                                                tmp_path):
  data = FIXTURES["zip"].read_bytes()
  filename = serve_weights(server, monkeypatch, "resnet18", data)
  path = pretrained.fetch_imagenet("resnet18")
  assert path == tmp_path / "cache" / filename
  assert path.read_bytes() == data
  assert server.requests == [f"/models/{filename}"]
  assert pretrained.fetch_imagenet("resnet18") == path
  assert len(server.requests) == 1  # The second came from the cache.
  assert os.listdir(tmp_path / "cache") == [filename]  # No temporary files.


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_fetch_refuses_a_damaged_download_and_caches_nothing(
    damage, server, monkeypatch, tmp_path):
  serve_weights(server, monkeypatch, "resnet18", FIXTURES["zip"].read_bytes())
  server.damage = damage
  with pytest.raises(pretrained.WeightsUnavailableError,
                     match="--pretrained none") as error:
    pretrained.fetch_imagenet("resnet18")
  if damage == "corrupt":
    assert "does not start with" in str(error.value)
  assert os.listdir(tmp_path / "cache") == []
  server.damage = None  # A good download afterwards is kept.
  assert pretrained.fetch_imagenet("resnet18").exists()


def test_fetch_command_fills_the_cache_ahead_of_runs(server, monkeypatch,
                                                    tmp_path, capsys):
  filename = serve_weights(server, monkeypatch, "resnet18",
                           FIXTURES["legacy"].read_bytes())
  assert pretrained.main(["fetch", "resnet18"]) == 0
  assert capsys.readouterr().out == f"{tmp_path / 'cache' / filename}\n"
  server.files.clear()  # Offline from now on: the cache answers.
  assert pretrained.main(["fetch", "resnet18"]) == 0
  assert len(server.requests) == 1


def _free_port():
  """A port where nothing listens (bound, then released)."""
  with contextlib.closing(socket.socket()) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_fetch_offline_names_the_url_the_cache_path_and_none(
    monkeypatch, tmp_path):
  url = f"http://127.0.0.1:{_free_port()}/models"
  monkeypatch.setenv(pretrained.URL_VARIABLE, url)
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "cache"))
  with pytest.raises(pretrained.WeightsUnavailableError) as error:
    pretrained.fetch_imagenet("resnet50")
  message = str(error.value)
  assert f"{url}/resnet50-0676ba61.pth" in message
  assert str(tmp_path / "cache" / "resnet50-0676ba61.pth") in message
  assert "--pretrained none" in message
  assert list((tmp_path / "cache").iterdir()) == []


def test_fetch_into_a_cache_that_cannot_be_written_names_the_variable(
    monkeypatch, tmp_path, capsys):
  # A directory under a file, as no one can create (root included): a
  # read-only home on a cluster fails the same way, before any download.
  (tmp_path / "a_file").write_text("")
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "a_file" / "w"))
  with pytest.raises(pretrained.WeightsUnavailableError,
                     match=r"Cannot write the weights cache .*a_file/w \(Not "
                     r"a directory\): set \$PGRAD_JAX_WEIGHTS_DIR to a "
                     "writable directory, or pass --pretrained none"):
    pretrained.fetch_imagenet("resnet50")
  assert "Downloading" not in capsys.readouterr().err


@pytest.fixture(name="data_dir", scope="module")
def fixture_data_dir(tmp_path_factory):
  """PACS's four domains, two classes, two 40x40 photos each."""
  return input_benchmark.write_photo_folder(
      tmp_path_factory.mktemp("data"), classes=("dog", "horse"),
      per_class=2, size=40)


def test_pacs_offline_with_an_empty_cache_exits_2_with_one_message(
    data_dir, monkeypatch, tmp_path, capsys):
  # The command, python -m experiments.train, in this process: its main.
  url = f"http://127.0.0.1:{_free_port()}/models"
  monkeypatch.setenv(pretrained.URL_VARIABLE, url)
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "cache"))
  status = train.main(["--dataset", "PACS", "--data_dir", str(data_dir),
                       "--output_dir", str(tmp_path / "run")])
  stderr = capsys.readouterr().err
  assert status == 2, stderr
  errors = [line for line in stderr.splitlines() if "error" in line]
  assert len(errors) == 1, stderr
  assert f"{url}/resnet50-0676ba61.pth" in errors[0]
  assert str(tmp_path / "cache" / "resnet50-0676ba61.pth") in errors[0]
  assert "--pretrained none" in errors[0]
  assert "Traceback" not in stderr
  assert not (tmp_path / "run").exists()


PACS_FLAGS = ["--dataset", "PACS", "--model", "resnet18", "--algorithm",
              "ERM", "--steps", "1", "--checkpoint_freq", "1",
              "--hparams", '{"batch_size": 2, "image_size": 32}',
              "--eval_examples", "2", "--eval_batch_size", "8",
              "--loss_examples", "2", "--num_workers", "0"]


@pytest.mark.slow
def test_pacs_starts_from_imagenet_weights_by_default(
    data_dir, server, monkeypatch, tmp_path, capsys):
  # torchvision's resnet18 file cannot be served here (it is not in the
  # repository, and no other file has its hash), so the run's resnet18 is
  # given a random state dict of torchvision's names and shapes, served
  # under a name of its own hash.
  state_dict = random_state_dict(18, seed=3)
  torch_writer.write_state_dict(tmp_path / "resnet18.pth", state_dict)
  serve_weights(server, monkeypatch, "resnet18",
         (tmp_path / "resnet18.pth").read_bytes())
  output_dir = tmp_path / "run"
  assert train.main([*PACS_FLAGS, "--data_dir", str(data_dir),
                     "--output_dir", str(output_dir)]) == 0
  assert len(server.requests) == 1
  assert "Featurizer weights from" in capsys.readouterr().err
  with np.load(output_dir / "final_params.npz") as params:
    # Frozen BatchNorm keeps the loaded statistics through training.
    np.testing.assert_array_equal(
        params["stats/featurizer/layer3/1/bn2/mean"],
        state_dict["layer3.1.bn2.running_mean"])


def test_pretrained_none_builds_from_scratch_without_a_download(
    data_dir, monkeypatch, tmp_path, capsys):
  # Nothing listens at the URL: a download would fail.
  monkeypatch.setenv(pretrained.URL_VARIABLE,
                     f"http://127.0.0.1:{_free_port()}/models")
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "cache"))
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from experiments import training  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from experiments.data import datasets
  config = config_lib.parse_args([*PACS_FLAGS, "--data_dir", str(data_dir),
                                  "--pretrained", "none"])
  assert config.pretrained == "none"
  dataset = datasets.resized(
      datasets.get_dataset("PACS", data_dir=data_dir), 32)
  # Built abstractly, as shapes: drawing its initial weights takes a second,
  # and what the build says (or fetches) does not depend on them.
  nnx.eval_shape(lambda: training.build_model(config, dataset,
                                              config.hyperparameters()))
  assert capsys.readouterr().err == ""
  assert not (tmp_path / "cache").exists()
