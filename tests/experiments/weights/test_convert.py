"""Tests for experiments.weights.convert: weights converted and checked.

The weights are random state dicts of torchvision's names and shapes,
written by tests/experiments/torch_writer.py.
"""

import hashlib
import sys
import zipfile

import numpy as np
import pytest

from experiments.weights import __main__ as weights_command
from experiments.weights import convert
from test_densenet import torchvision_densenet121_state
from test_imagenet import PACS_FLAGS
from test_imagenet import exits_2_at_resolution
from test_imagenet import fixture_data_dir  # pylint: disable=unused-import
from test_models import random_state_dict
from test_torch_pickle import FIXTURES
import torch_writer


def test_convert_cli_needs_no_torch(monkeypatch, tmp_path, capsys):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails.
  state_dict = random_state_dict(18)
  torch_writer.write_state_dict(tmp_path / "r.pth", state_dict)
  out = tmp_path / "r.npz"
  assert weights_command.main(["convert", "--in", str(tmp_path / "r.pth"),
                          "--out", str(out)]) == 0
  assert "resnet18" in capsys.readouterr().out
  with np.load(out) as converted:
    np.testing.assert_array_equal(
        converted["layer2/0/downsample/0/kernel"],
        state_dict["layer2.0.downsample.0.weight"].transpose(2, 3, 1, 0))


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
  error = exits_2_at_resolution(
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
    convert.save_npz(
        convert.convert_torchvision_state_dict(state_dict, 18), path)
  argv = [*PACS_FLAGS, "--data_dir", str(data_dir), "--output_dir",
          str(tmp_path / "run"), "--pretrained", str(path)]
  argv[argv.index("resnet18")] = "resnet50"
  error = exits_2_at_resolution(argv, capsys)
  assert (f"{path} holds ResNet-18 weights, and --model is resnet50: pass "
          "--model resnet18, or weights of resnet50.") in error


def test_densenet_weights_say_which_they_are(tmp_path):
  path = tmp_path / "densenet.pth"
  torch_writer.write_state_dict(
      path, torchvision_densenet121_state(num_classes=1000))
  with pytest.raises(ValueError, match=(
      "holds DenseNet-121 weights, and --model is resnet18: pass --model "
      "densenet121, or weights of resnet18")):
    convert.checked_weights(str(path), "resnet18")
  assert convert.checked_weights(str(path), "densenet121").sha256 == (
      hashlib.sha256(path.read_bytes()).hexdigest())
