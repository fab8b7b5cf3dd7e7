"""Tests for experiments.weights.imagenet: fetching and checking weights.

The downloads come from an HTTP server on 127.0.0.1 that the tests start,
serving files of tests/data/ or of tests/experiments/torch_writer.py, under
names whose hex digits start their SHA-256 as torchvision's do. The last
tests run the train command with ``--pretrained imagenet``.
"""

import contextlib
import dataclasses
import hashlib
import http.server
import json
import os
import socket
import threading

import numpy as np
import pytest
import safetensors.numpy

from benchmarks import input_pipeline as input_benchmark
from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments import train
from experiments.rundir import claim
from experiments.weights import __main__ as weights_command
from experiments.weights import imagenet
from test_models import random_state_dict
from test_torch_pickle import FIXTURES
import torch_writer


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
  monkeypatch.setenv(imagenet.URL_VARIABLE, server.url)
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
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
  path = imagenet.fetch_imagenet("resnet18")
  assert path == tmp_path / "cache" / filename
  assert path.read_bytes() == data
  assert server.requests == [f"/models/{filename}"]
  assert imagenet.fetch_imagenet("resnet18") == path
  assert len(server.requests) == 1  # The second came from the cache.
  assert os.listdir(tmp_path / "cache") == [filename]  # No temporary files.


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_fetch_refuses_a_damaged_download_and_caches_nothing(
    damage, server, monkeypatch, tmp_path):
  serve_weights(server, monkeypatch, "resnet18", FIXTURES["zip"].read_bytes())
  server.damage = damage
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match="--pretrained none") as error:
    imagenet.fetch_imagenet("resnet18")
  if damage == "corrupt":
    assert "does not start with" in str(error.value)
  assert os.listdir(tmp_path / "cache") == []
  server.damage = None  # A good download afterwards is kept.
  assert imagenet.fetch_imagenet("resnet18").exists()


def test_fetch_command_fills_the_cache_ahead_of_runs(server, monkeypatch,
                                                    tmp_path, capsys):
  filename = serve_weights(server, monkeypatch, "resnet18",
                           FIXTURES["legacy"].read_bytes())
  assert weights_command.main(["fetch", "resnet18"]) == 0
  assert capsys.readouterr().out == f"{tmp_path / 'cache' / filename}\n"
  server.files.clear()  # Offline from now on: the cache answers.
  assert weights_command.main(["fetch", "resnet18"]) == 0
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
  with pytest.raises(imagenet.WeightsUnavailableError) as error:
    imagenet.fetch_imagenet("resnet18")
  message = str(error.value)
  assert str(path) in message
  assert hashlib.sha256(placed).hexdigest() in message
  assert f"does not start with {filename[9:17]}" in message
  assert ("Delete it, or run `python -m experiments.weights fetch "
          "resnet18`") in message
  assert path.read_bytes() == placed and server.requests == []
  # The command that the message names replaces it with a good download.
  assert weights_command.main(["fetch", "resnet18"]) == 0
  assert path.read_bytes() == data
  assert imagenet.fetch_imagenet("resnet18") == path


@pytest.mark.parametrize("form", ["file_url", "path"])
def test_fetch_copies_and_checks_from_a_shared_folder(form, monkeypatch,
                                                      tmp_path, capsys):
  mirror = tmp_path / "mirror"
  mirror.mkdir()
  data = FIXTURES["zip"].read_bytes()
  filename = f"resnet18-{hashlib.sha256(data).hexdigest()[:8]}.pth"
  monkeypatch.setitem(catalog.MODELS, "resnet18", dataclasses.replace(
      catalog.MODELS["resnet18"], imagenet_weights=filename))
  monkeypatch.setenv(imagenet.URL_VARIABLE,
                     mirror.as_uri() if form == "file_url" else str(mirror))
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
  # Missing there: said so, nothing cached.
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match=f"Cannot copy .*{filename}.*Place torchvision's "
                     f".*{filename} at {mirror / filename} .*--pretrained "
                     "none"):
    imagenet.fetch_imagenet("resnet18")
  # Damaged there: refused, nothing cached.
  (mirror / filename).write_bytes(data[:-1])
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match="copied from .* does not start with"):
    imagenet.fetch_imagenet("resnet18")
  assert os.listdir(tmp_path / "cache") == []
  (mirror / filename).write_bytes(data)
  path = imagenet.fetch_imagenet("resnet18")
  assert path == tmp_path / "cache" / filename
  assert path.read_bytes() == data
  assert "Copying torchvision's ImageNet weights" in capsys.readouterr().err


def test_sha256_tells_directories_apart_by_content_and_names(tmp_path):
  def folder(name, files):
    for relative, data in files.items():
      (tmp_path / name / relative).parent.mkdir(parents=True, exist_ok=True)
      (tmp_path / name / relative).write_bytes(data)
    return imagenet.sha256(tmp_path / name)

  files = {"a": b"1", "d/b": b"2"}
  assert folder("x", files) == folder("copy", files)
  assert folder("x", files) != folder("byte", {**files, "d/b": b"3"})
  assert folder("x", files) != folder("name", {"a": b"1", "d/c": b"2"})
  assert imagenet.sha256(tmp_path / "x" / "a") == (
      hashlib.sha256(b"1").hexdigest())


def _free_port():
  """A port where nothing listens (bound, then released)."""
  with contextlib.closing(socket.socket()) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_fetch_offline_names_the_url_the_cache_path_and_none(
    monkeypatch, tmp_path):
  url = f"http://127.0.0.1:{_free_port()}/models"
  monkeypatch.setenv(imagenet.URL_VARIABLE, url)
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
  with pytest.raises(imagenet.WeightsUnavailableError) as error:
    imagenet.fetch_imagenet("resnet50")
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
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "a_file" / "w"))
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match=r"Cannot write the weights cache .*a_file/w \(Not "
                     r"a directory\): set \$PGRAD_JAX_WEIGHTS_DIR to a "
                     "writable directory, or pass --pretrained none"):
    imagenet.fetch_imagenet("resnet50")
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
  monkeypatch.setenv(imagenet.URL_VARIABLE, url)
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
  status = train.main(["--dataset", "PACS", "--data_dir", str(data_dir),
                       "--output_dir", str(tmp_path / "run")])
  stderr = capsys.readouterr().err
  assert status == 2, stderr
  error_lines = [line for line in stderr.splitlines() if "error" in line]
  assert len(error_lines) == 1, stderr
  assert f"{url}/resnet50-0676ba61.pth" in error_lines[0]
  assert str(tmp_path / "cache" / "resnet50-0676ba61.pth") in error_lines[0]
  assert "--pretrained none" in error_lines[0]
  assert "Traceback" not in stderr
  assert not (tmp_path / "run").exists()


PACS_FLAGS = ["--dataset", "PACS", "--model", "resnet18", "--algorithm",
              "ERM", "--steps", "1", "--checkpoint_freq", "1",
              "--hparams", '{"batch_size": 2, "image_size": 32}',
              "--eval_examples", "2", "--eval_batch_size", "8",
              "--loss_examples", "2", "--num_workers", "0"]


def exits_2_at_resolution(argv, capsys):
  """The train command's stderr for ``argv``, which must be refused while
  the run is resolved (`train.resolve_run`, which builds no model): exit 2
  with one error line and no traceback, nothing written."""
  with pytest.raises(errors.UsageError):
    train.resolve_run(argv)
  capsys.readouterr()
  assert train.main(argv) == 2
  stderr = capsys.readouterr().err
  assert "Traceback" not in stderr
  error_lines = [line for line in stderr.splitlines() if "error" in line]
  assert len(error_lines) == 1, stderr
  return error_lines[0]


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
  error = exits_2_at_resolution(
      [*PACS_FLAGS, "--data_dir", str(data_dir),
       "--output_dir", str(tmp_path / "run")], capsys)
  assert str(path) in error
  assert "does not start with" in error
  assert "python -m experiments.weights fetch resnet18" in error
  assert not (tmp_path / "run").exists()




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
  assert runs["imagenet"].run_record["weights"] == {
      "file": filename, "sha256": hashlib.sha256(served).hexdigest()}
  assert runs["imagenet"].weights.name == filename
  assert runs["file"].run_record["weights"] == {
      "file": "b.pth",
      "sha256": hashlib.sha256((tmp_path / "b.pth").read_bytes()).hexdigest()}
  assert runs["file"].weights == tmp_path / "b.pth"
  assert runs["none"].weights is None
  # What the config file holds; without weights, what it held before.
  for spec in runs.values():
    assert spec.run_record == claim.run_record(
        spec.config.identity(), spec.hparams,
        spec.run_record.get("weights"))
    assert set(spec.run_record) == {"args", "hparams"} | (
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
  with pytest.raises(errors.UsageError, match=(
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
  monkeypatch.setenv(imagenet.URL_VARIABLE,
                     f"http://127.0.0.1:{_free_port()}/models")
  monkeypatch.setenv(imagenet.DIR_VARIABLE, str(tmp_path / "cache"))
  from flax import nnx  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from experiments.training import steps as train_steps
  spec = train.resolve_run([*PACS_FLAGS, "--data_dir", str(data_dir),
                            "--pretrained", "none", "--output_dir",
                            str(tmp_path / "run")])
  assert (spec.config.pretrained, spec.weights) == ("none", None)
  # Built abstractly, as shapes: drawing its initial weights takes a second,
  # and what the build says does not depend on them.
  nnx.eval_shape(lambda: train_steps.build_model(
      spec.config, spec.dataset, spec.hparams, spec.weights))
  assert capsys.readouterr().err == ""
  assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------
# timm's AugMix ResNet-50, whose SHA-256 is recorded at its first download.

AUGMIX_FILE = "resnet50.ram_in1k.safetensors"


def safetensors_bytes(tmp_path, seed):
  """A small safetensors file's bytes: what fetching checks needs no
  ResNet-50 (reading it as one is `test_convert.py`'s)."""
  path = tmp_path / f"small-{seed}.safetensors"
  safetensors.numpy.save_file({"conv1.weight": np.random.default_rng(
      seed).standard_normal((4, 3, 7, 7), dtype=np.float32)}, path)
  return path.read_bytes()


def test_augmix_weights_are_recorded_at_first_download_and_checked_after(
    server, tmp_path, capsys):
  data, other = safetensors_bytes(tmp_path, 0), safetensors_bytes(tmp_path, 1)
  server.files[AUGMIX_FILE] = data
  path = imagenet.fetch_imagenet("resnet50", "imagenet_augmix")
  assert path == tmp_path / "cache" / AUGMIX_FILE
  assert path.read_bytes() == data
  assert imagenet.recorded_sha256(path) == hashlib.sha256(data).hexdigest()
  assert "timm's resnet50.ram_in1k (AugMix) weights of resnet50" in (
      capsys.readouterr().err)
  assert imagenet.fetch_imagenet("resnet50", "imagenet_augmix") == path
  assert len(server.requests) == 1
  # Another whole file in its place, as the hub's would be were it changed,
  # is refused, and the command that downloads it again is named.
  path.write_bytes(other)
  with pytest.raises(imagenet.WeightsUnavailableError) as error:
    imagenet.fetch_imagenet("resnet50", "imagenet_augmix")
  message = str(error.value)
  assert f"recorded at its first download in {path}.sha256" in message
  assert ("python -m experiments.weights fetch resnet50 --weights "
          "imagenet_augmix") in message
  assert weights_command.main(
      ["fetch", "resnet50", "--weights", "imagenet_augmix"]) == 0
  assert path.read_bytes() == data
  # Served changed: a new download is checked against the record too.
  path.unlink()
  server.files[AUGMIX_FILE] = other
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match="recorded at its first download.*it was not kept"):
    imagenet.fetch_imagenet("resnet50", "imagenet_augmix")
  assert not path.exists()


@pytest.mark.parametrize("damage", ["truncate", "not safetensors"])
def test_augmix_first_download_that_does_not_read_whole_is_not_kept(
    damage, server, tmp_path):
  server.files[AUGMIX_FILE] = safetensors_bytes(tmp_path, 0)
  if damage == "truncate":
    server.damage = "truncate"
  else:
    server.files[AUGMIX_FILE] = b"<html>Not found</html>" * 10
  with pytest.raises(imagenet.WeightsUnavailableError,
                     match="--pretrained none"):
    imagenet.fetch_imagenet("resnet50", "imagenet_augmix")
  assert list((tmp_path / "cache").iterdir()) == []  # No file, no record.


def test_augmix_file_placed_by_hand_is_recorded_when_first_used(
    server, tmp_path, capsys):
  data = safetensors_bytes(tmp_path, 0)
  path = _place_in_cache(tmp_path, AUGMIX_FILE, data)
  assert imagenet.fetch_imagenet("resnet50", "imagenet_augmix") == path
  assert server.requests == []
  assert imagenet.recorded_sha256(path) == hashlib.sha256(data).hexdigest()
  assert f"Recorded the SHA-256 of {path}" in capsys.readouterr().err


def test_augmix_weights_are_resnet50s_alone():
  with pytest.raises(ValueError, match=(
      "there are no imagenet_augmix weights of resnet18; timm's are those "
      "of resnet50")):
    imagenet.fetch_imagenet("resnet18", "imagenet_augmix")
  # Pinned to the hub's branch (no full commit hash of it was found): the
  # recorded SHA-256 is what holds a cache to one file.
  assert imagenet.published("resnet50", "imagenet_augmix").url == (
      "https://huggingface.co/timm/resnet50.ram_in1k/resolve/main/"
      "model.safetensors")
