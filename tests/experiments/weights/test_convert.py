"""Tests for experiments.weights.convert: weights converted and checked.

The weights are random state dicts of torchvision's names and shapes,
written by tests/experiments/torch_writer.py.
"""

import hashlib
import sys
import zipfile

from flax import traverse_util
import numpy as np
import pytest
import safetensors.numpy

from experiments import train
from experiments.weights import __main__ as weights_command
from experiments.weights import convert
from test_densenet import torchvision_densenet121_state
from test_imagenet import AUGMIX_FILE
from test_imagenet import PACS_FLAGS
from test_imagenet import exits_2_at_resolution
from test_imagenet import fixture_data_dir  # pylint: disable=unused-import
from test_imagenet import fixture_server  # pylint: disable=unused-import
from test_models import random_state_dict
from test_models import torchvision_resnet_shapes
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
  if name.endswith(".npz"):  # Not weights at all: what would be, each kind.
    for kind in ("imagenet ", "imagenet_augmix", ".pth", ".safetensors",
                 "Orbax", "none"):
      assert kind in error.split(said)[1], kind


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


# ---------------------------------------------------------------------------
# timm's AugMix ResNet-50 (resnet50.ram_in1k), as the hub's model.safetensors.


def timm_resnet50_shapes():
  """The names and shapes of timm's ``resnet50().state_dict()``, written
  from timm's architecture (huggingface/pytorch-image-models at aa4b5850,
  timm/models/resnet.py), not from torchvision's or ours: the stem's
  ``conv1``/``bn1`` (lines 555-556); stages ``layer1``..``layer4`` of
  3, 4, 6, 3 bottlenecks (line 1552) of planes 64..512 (line 485) and
  expansion 4 (line 159), each ``conv1``/``bn1`` 1x1, ``conv2``/``bn2``
  3x3, ``conv3``/``bn3`` 1x1 (lines 208-229); a stage's first block
  downsampled where the stride or width changes (line 398) by
  ``downsample.0`` (1x1 conv) and ``downsample.1`` (BN, lines 291-302); and
  the head ``fc`` (line 606). Its activations and pooling hold no tensors.
  """
  shapes = {"conv1.weight": (64, 3, 7, 7)}

  def batch_norm(name, channels):
    shapes.update({f"{name}.{leaf}": (channels,) for leaf in (
        "weight", "bias", "running_mean", "running_var")})
    shapes[f"{name}.num_batches_tracked"] = ()

  batch_norm("bn1", 64)
  inplanes = 64
  for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512),
                                               (3, 4, 6, 3))):
    for block in range(blocks):
      name = f"layer{stage + 1}.{block}"
      stride = 2 if stage > 0 and block == 0 else 1
      for index, (out, inp, size) in enumerate(
          [(planes, inplanes, 1), (planes, planes, 3),
           (4 * planes, planes, 1)], start=1):
        shapes[f"{name}.conv{index}.weight"] = (out, inp, size, size)
        batch_norm(f"{name}.bn{index}", out)
      if block == 0 and (stride != 1 or inplanes != 4 * planes):
        shapes[f"{name}.downsample.0.weight"] = (4 * planes, inplanes, 1, 1)
        batch_norm(f"{name}.downsample.1", 4 * planes)
      inplanes = 4 * planes
  shapes.update({"fc.weight": (1000, 2048), "fc.bias": (1000,)})
  return shapes


def timm_resnet50_state(seed=0):
  """Random values of timm's ResNet-50 names and shapes, as timm saves them
  (float32, num_batches_tracked int64)."""
  rng = np.random.default_rng(seed)
  return {name: (np.asarray(7, np.int64) if name.endswith("tracked") else
                 rng.standard_normal(shape, dtype=np.float32))
          for name, shape in timm_resnet50_shapes().items()}


def test_timm_resnet50_is_the_published_architecture():
  # timm's model card gives 25.6 M parameters; torchvision's ResNet-50 has
  # 25,557,032, and timm's must name and shape every one as torchvision's.
  shapes = timm_resnet50_shapes()
  parameters = {name: shape for name, shape in shapes.items()
                if not name.endswith(("running_mean", "running_var",
                                      "num_batches_tracked"))}
  assert sum(int(np.prod(shape)) for shape in parameters.values()) == (
      25_557_032)
  assert shapes == torchvision_resnet_shapes(50)


def test_timm_safetensors_convert_to_our_resnet50(tmp_path, capsys):
  state = timm_resnet50_state()
  path = tmp_path / "model.safetensors"
  safetensors.numpy.save_file(state, path)
  read = convert.read_state_dict(path)
  assert read.keys() == state.keys()
  name, tree = convert.convert_torchvision(read)
  assert name == "resnet50"
  flat = {"/".join(map(str, key)): value
          for key, value in traverse_util.flatten_dict(tree).items()}
  # Every tensor but the head and the batch counts, each once, renamed and
  # (conv kernels) transposed from OIHW to HWIO.
  expected = {}
  for torch_name, value in state.items():
    *module, leaf = torch_name.split(".")
    if module == ["fc"] or leaf == "num_batches_tracked":
      continue
    path_name = "/".join(module)
    if leaf == "weight" and value.ndim == 4:
      expected[f"{path_name}/kernel"] = value.transpose(2, 3, 1, 0)
    else:
      expected[f"{path_name}/" + {"weight": "scale", "running_mean": "mean",
                                  "running_var": "var"}.get(leaf, leaf)] = value
  assert flat.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_array_equal(flat[key], value, strict=True, err_msg=key)
  # The command converts it as well.
  assert weights_command.main(["convert", "--in", str(path), "--out",
                               str(tmp_path / "m.npz")]) == 0
  assert "resnet50" in capsys.readouterr().out
  with np.load(tmp_path / "m.npz") as converted:
    np.testing.assert_array_equal(converted["layer4/2/bn3/var"],
                                  state["layer4.2.bn3.running_var"])


def test_a_small_safetensors_file_reads_back_and_a_cut_one_is_named(tmp_path):
  arrays = {"conv1.weight": np.arange(24, dtype=np.float32).reshape(
      2, 3, 2, 2), "bn1.num_batches_tracked": np.asarray(3, np.int64)}
  path = tmp_path / "w.safetensors"
  safetensors.numpy.save_file(arrays, path)
  read = convert.read_state_dict(path)
  assert read.keys() == arrays.keys()
  for name, array in arrays.items():
    np.testing.assert_array_equal(read[name], array, strict=True)
  cut = tmp_path / "cut.safetensors"
  cut.write_bytes(path.read_bytes()[:-8])
  with pytest.raises(ValueError, match=(
      f"{str(cut)!r} is damaged or not a safetensors file")):
    convert.read_state_dict(cut)


def test_augmix_run_starts_from_timm_weights_with_batchnorm_trained(
    data_dir, server, tmp_path):
  state_path = tmp_path / "timm.safetensors"
  safetensors.numpy.save_file(timm_resnet50_state(), state_path)
  served = state_path.read_bytes()
  server.files[AUGMIX_FILE] = served
  flags = [*PACS_FLAGS, "--data_dir", str(data_dir), "--output_dir",
           str(tmp_path / "run"), "--pretrained", "imagenet_augmix"]
  flags[flags.index("resnet18")] = "resnet50"
  spec = train.resolve_run(flags)
  assert spec.run_record["weights"] == {
      "file": AUGMIX_FILE, "sha256": hashlib.sha256(served).hexdigest()}
  # DomainBed's freeze_bn=False with these weights; --hparams still rules.
  assert spec.hparams["bn_mode"] == "train"
  frozen = train.resolve_run(
      [*flags[:-2], "--hparams", '{"batch_size": 2, "image_size": 32, '
       '"bn_mode": "frozen"}', "--pretrained", "imagenet_augmix"])
  assert frozen.hparams["bn_mode"] == "frozen"
  # The paper's default keeps BatchNorm frozen.
  assert train.resolve_run(flags[:-2] + ["--pretrained", "none"]).hparams[
      "bn_mode"] == "frozen"


def test_the_convert_command_names_a_file_that_is_not_weights_once(
    tmp_path, capsys):
  path = tmp_path / "notes.txt"
  path.write_text("not weights")
  assert weights_command.main(["convert", "--in", str(path), "--out",
                               str(tmp_path / "m.npz")]) == 2
  error = capsys.readouterr().err
  assert "is not a PyTorch file" in error
  assert error.count(str(path)) == 1, error
  assert not (tmp_path / "m.npz").exists()
