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
import json
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
from test_densenet import torchvision_densenet121_state
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
  loaded = pretrained.read_torch_state_dict(path)
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
  loaded = pretrained.read_torch_state_dict(tmp_path / "old.pth")
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


def _place_in_cache(tmp_path, filename, data):
  path = tmp_path / "cache" / filename
  path.parent.mkdir(exist_ok=True)
  path.write_bytes(data)
  return path


@pytest.mark.parametrize("damage", ["another file", "truncated"])
def test_fetch_checks_a_cached_file_as_a_download(damage, server, monkeypatch,
                                                  tmp_path):
  # A file placed at the cache path by hand (as the offline message says),
  # or cut short there, is checked against its name's hash before use.
  data = FIXTURES["zip"].read_bytes()
  filename = serve_weights(server, monkeypatch, "resnet18", data)
  placed = (FIXTURES["legacy"].read_bytes() if damage == "another file"
            else data[:len(data) // 2])
  path = _place_in_cache(tmp_path, filename, placed)
  with pytest.raises(pretrained.WeightsUnavailableError) as error:
    pretrained.fetch_imagenet("resnet18")
  message = str(error.value)
  assert str(path) in message
  assert hashlib.sha256(placed).hexdigest() in message
  assert f"does not start with {filename[9:17]}" in message
  assert ("Delete it, or run `python -m experiments.pretrained fetch "
          "resnet18`") in message
  assert path.read_bytes() == placed and server.requests == []
  # The command that the message names replaces it with a good download.
  assert pretrained.main(["fetch", "resnet18"]) == 0
  assert path.read_bytes() == data
  assert pretrained.fetch_imagenet("resnet18") == path


@pytest.mark.parametrize("form", ["file_url", "path"])
def test_fetch_copies_and_checks_from_a_shared_folder(form, monkeypatch,
                                                      tmp_path, capsys):
  mirror = tmp_path / "mirror"
  mirror.mkdir()
  data = FIXTURES["zip"].read_bytes()
  filename = f"resnet18-{hashlib.sha256(data).hexdigest()[:8]}.pth"
  monkeypatch.setitem(catalog.MODELS, "resnet18", dataclasses.replace(
      catalog.MODELS["resnet18"], imagenet_weights=filename))
  monkeypatch.setenv(pretrained.URL_VARIABLE,
                     mirror.as_uri() if form == "file_url" else str(mirror))
  monkeypatch.setenv(pretrained.DIR_VARIABLE, str(tmp_path / "cache"))
  # Missing there: said so, nothing cached.
  with pytest.raises(pretrained.WeightsUnavailableError,
                     match=f"Cannot copy .*{filename}.*Place torchvision's "
                     f".*{filename} at {mirror / filename} .*--pretrained "
                     "none"):
    pretrained.fetch_imagenet("resnet18")
  # Damaged there: refused, nothing cached.
  (mirror / filename).write_bytes(data[:-1])
  with pytest.raises(pretrained.WeightsUnavailableError,
                     match="copied from .* does not start with"):
    pretrained.fetch_imagenet("resnet18")
  assert os.listdir(tmp_path / "cache") == []
  (mirror / filename).write_bytes(data)
  path = pretrained.fetch_imagenet("resnet18")
  assert path == tmp_path / "cache" / filename
  assert path.read_bytes() == data
  assert "Copying torchvision's ImageNet weights" in capsys.readouterr().err


def test_sha256_tells_directories_apart_by_content_and_names(tmp_path):
  def folder(name, files):
    for relative, data in files.items():
      (tmp_path / name / relative).parent.mkdir(parents=True, exist_ok=True)
      (tmp_path / name / relative).write_bytes(data)
    return pretrained.sha256(tmp_path / name)

  files = {"a": b"1", "d/b": b"2"}
  assert folder("x", files) == folder("copy", files)
  assert folder("x", files) != folder("byte", {**files, "d/b": b"3"})
  assert folder("x", files) != folder("name", {"a": b"1", "d/c": b"2"})
  assert pretrained.sha256(tmp_path / "x" / "a") == (
      hashlib.sha256(b"1").hexdigest())


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


def _exits_2_at_resolution(argv, capsys):
  """The train command's stderr for ``argv``, which must be refused while
  the run is resolved (`train.resolve_run`, which builds no model): exit 2
  with one error line and no traceback, nothing written."""
  with pytest.raises(config_lib.UsageError):
    train.resolve_run(argv)
  capsys.readouterr()
  assert train.main(argv) == 2
  stderr = capsys.readouterr().err
  assert "Traceback" not in stderr
  errors = [line for line in stderr.splitlines() if "error" in line]
  assert len(errors) == 1, stderr
  return errors[0]


@pytest.mark.parametrize("damage", ["another file", "truncated"])
def test_a_damaged_cached_file_exits_2_before_the_model_is_built(
    damage, data_dir, server, monkeypatch, tmp_path, capsys):
  state_dict = random_state_dict(18, seed=3)
  torch_writer.write_state_dict(tmp_path / "resnet18.pth", state_dict)
  data = (tmp_path / "resnet18.pth").read_bytes()
  filename = serve_weights(server, monkeypatch, "resnet18", data)
  placed = data[:len(data) // 3]
  if damage == "another file":  # Valid, but of other values.
    torch_writer.write_state_dict(tmp_path / "other.pth",
                                  random_state_dict(18, seed=4))
    placed = (tmp_path / "other.pth").read_bytes()
  path = _place_in_cache(tmp_path, filename, placed)
  error = _exits_2_at_resolution(
      [*PACS_FLAGS, "--data_dir", str(data_dir),
       "--output_dir", str(tmp_path / "run")], capsys)
  assert str(path) in error
  assert "does not start with" in error
  assert "python -m experiments.pretrained fetch resnet18" in error
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, said", [
    ("text.pth", "is a zip archive but not a PyTorch file"),
    ("text.npz", "is a zip archive of notes.txt, not a .npz file of arrays"),
    ("cut.pth", "is truncated or damaged: it starts as a zip archive"),
])
def test_pretrained_file_that_is_no_weights_exits_2_saying_what_it_is(
    name, said, data_dir, tmp_path, capsys):
  path = tmp_path / name
  if name == "cut.pth":
    path.write_bytes(FIXTURES["zip"].read_bytes()[:-100])
  else:  # A zip of a text file.
    with zipfile.ZipFile(path, "w") as archive:
      archive.writestr("notes.txt", "not weights")
  error = _exits_2_at_resolution(
      [*PACS_FLAGS, "--data_dir", str(data_dir), "--output_dir",
       str(tmp_path / "run"), "--pretrained", str(path)], capsys)
  assert f"--pretrained: {str(path)!r} {said}" in error


@pytest.mark.parametrize("converted", [False, True], ids=["pth", "npz"])
def test_weights_of_another_architecture_say_which_they_are(
    converted, data_dir, tmp_path, capsys):
  state_dict = random_state_dict(18)
  path = tmp_path / "weights.pth"
  torch_writer.write_state_dict(path, state_dict)
  if converted:
    path = tmp_path / "weights.npz"
    pretrained.save_npz(
        pretrained.convert_torchvision_state_dict(state_dict, 18), path)
  argv = [*PACS_FLAGS, "--data_dir", str(data_dir), "--output_dir",
          str(tmp_path / "run"), "--pretrained", str(path)]
  argv[argv.index("resnet18")] = "resnet50"
  error = _exits_2_at_resolution(argv, capsys)
  assert (f"{path} holds ResNet-18 weights, and --model is resnet50: pass "
          "--model resnet18, or weights of resnet50.") in error


def test_densenet_weights_say_which_they_are(tmp_path):
  path = tmp_path / "densenet.pth"
  torch_writer.write_state_dict(
      path, torchvision_densenet121_state(num_classes=1000))
  with pytest.raises(ValueError, match=(
      "holds DenseNet-121 weights, and --model is resnet18: pass --model "
      "densenet121, or weights of resnet18")):
    pretrained.checked_weights(str(path), "resnet18")
  assert pretrained.checked_weights(str(path), "densenet121").sha256 == (
      hashlib.sha256(path.read_bytes()).hexdigest())


def test_a_run_records_the_name_and_sha256_of_its_weights(
    data_dir, server, monkeypatch, tmp_path):
  torch_writer.write_state_dict(tmp_path / "a.pth",
                                random_state_dict(18, seed=1))
  torch_writer.write_state_dict(tmp_path / "b.pth",
                                random_state_dict(18, seed=2))
  served = (tmp_path / "a.pth").read_bytes()
  filename = serve_weights(server, monkeypatch, "resnet18", served)
  flags = [*PACS_FLAGS, "--data_dir", str(data_dir), "--output_dir",
           str(tmp_path / "run")]
  runs = {
      "imagenet": train.resolve_run(flags),
      "file": train.resolve_run([*flags, "--pretrained",
                                 str(tmp_path / "b.pth")]),
      "none": train.resolve_run([*flags, "--pretrained", "none"])}
  assert runs["imagenet"].weights == {
      "file": filename, "sha256": hashlib.sha256(served).hexdigest()}
  assert runs["file"].weights == {
      "file": "b.pth",
      "sha256": hashlib.sha256((tmp_path / "b.pth").read_bytes()).hexdigest()}
  assert runs["none"].weights is None
  # What the config file holds; without weights, what it held before.
  for spec in runs.values():
    record = config_lib.run_record(spec.config, spec.hparams, spec.weights)
    assert record.get("weights") == spec.weights
    assert set(record) == {"args", "hparams"} | (
        {"weights"} if spec.weights else set())


@pytest.mark.slow
def test_pacs_starts_from_imagenet_weights_by_default(
    data_dir, server, monkeypatch, tmp_path, capsys):
  # torchvision's resnet18 file cannot be served here (it is not in the
  # repository, and no other file has its hash), so the run's resnet18 is
  # given a random state dict of torchvision's names and shapes, served
  # under a name of its own hash.
  state_dict = random_state_dict(18, seed=3)
  torch_writer.write_state_dict(tmp_path / "resnet18.pth", state_dict)
  filename = serve_weights(server, monkeypatch, "resnet18",
                           (tmp_path / "resnet18.pth").read_bytes())
  output_dir = tmp_path / "run"
  assert train.main([*PACS_FLAGS, "--data_dir", str(data_dir),
                     "--output_dir", str(output_dir)]) == 0
  assert len(server.requests) == 1
  assert "Featurizer weights from" in capsys.readouterr().err
  digest = hashlib.sha256((tmp_path / "resnet18.pth").read_bytes())
  assert json.loads((output_dir / "config.json").read_text())["weights"] == {
      "file": filename, "sha256": digest.hexdigest()}
  # Resumed, it must start from the same weights: here the served ones
  # change (and their name with them, as torchvision's would).
  (output_dir / "done").unlink()
  torch_writer.write_state_dict(tmp_path / "other.pth",
                                random_state_dict(18, seed=4))
  other = serve_weights(server, monkeypatch, "resnet18",
                        (tmp_path / "other.pth").read_bytes())
  with pytest.raises(config_lib.UsageError, match=(
      f"started from weights {filename} .*, but --pretrained imagenet now "
      f"gives {other} ")):
    train.resolve_run([*PACS_FLAGS, "--data_dir", str(data_dir),
                       "--output_dir", str(output_dir)])
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
