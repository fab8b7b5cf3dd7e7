"""Tests for models.DenseNet (experiments/models/densenet.py) and its
torchvision weight conversion."""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from flax import traverse_util

from experiments import models
from experiments.weights import __main__ as weights_command
from experiments.weights import convert
import torch_writer

BLOCKS, GROWTH, STEM = (6, 12, 24, 16), 32, 64

# Every abstract DenseNet-121 (nnx.eval_shape) takes seconds to trace, its
# own and in each conversion, which builds one to check the shapes against:
# the tests share one model and one conversion where they can.


@pytest.fixture(name="abstract_densenet121", scope="module")
def fixture_abstract_densenet121():
  """torchvision's densenet121 as `models.build_model` builds it, abstract:
  a 1000-class head."""
  return nnx.eval_shape(lambda: models.build_model(
      "densenet121", num_classes=1000, input_shape=(224, 224, 3),
      rngs=nnx.Rngs(0)))


@pytest.fixture(name="converted_state", scope="module")
def fixture_converted_state():
  """A random torchvision densenet121 state_dict and its conversion."""
  state = torchvision_densenet121_state(num_classes=1000)
  return state, convert.convert_torchvision_densenet121(state)


def test_densenet121_has_the_published_parameter_count(abstract_densenet121):
  # torchvision's densenet121: 7,978,856 parameters (BatchNorm statistics
  # are buffers, not parameters).
  assert sum(leaf.size for leaf in jax.tree.leaves(
      nnx.state(abstract_densenet121, nnx.Param))) == 7_978_856
  assert abstract_densenet121.featurizer.num_features == 1024


def _bn(rng, name, channels, state):
  state[f"{name}.weight"] = rng.uniform(0.5, 1.5, channels)
  state[f"{name}.bias"] = rng.normal(0, 0.1, channels)
  state[f"{name}.running_mean"] = rng.normal(0, 0.1, channels)
  state[f"{name}.running_var"] = rng.uniform(0.5, 1.5, channels)
  state[f"{name}.num_batches_tracked"] = np.array(7)


def _conv(rng, name, out_channels, in_channels, size, state):
  state[f"{name}.weight"] = rng.normal(
      0, np.sqrt(2 / (in_channels * size * size)),
      (out_channels, in_channels, size, size))


def torchvision_densenet121_state(seed=0, num_classes=10):
  """A random state_dict with torchvision's densenet121 names and shapes."""
  rng = np.random.default_rng(seed)
  state = {}
  _conv(rng, "features.conv0", STEM, 3, 7, state)
  _bn(rng, "features.norm0", STEM, state)
  channels = STEM
  for b, num_layers in enumerate(BLOCKS, start=1):
    for k in range(1, num_layers + 1):
      name = f"features.denseblock{b}.denselayer{k}"
      _bn(rng, f"{name}.norm1", channels, state)
      _conv(rng, f"{name}.conv1", 4 * GROWTH, channels, 1, state)
      _bn(rng, f"{name}.norm2", 4 * GROWTH, state)
      _conv(rng, f"{name}.conv2", GROWTH, 4 * GROWTH, 3, state)
      channels += GROWTH
    if b < len(BLOCKS):
      _bn(rng, f"features.transition{b}.norm", channels, state)
      _conv(rng, f"features.transition{b}.conv", channels // 2, channels, 1,
            state)
      channels //= 2
  _bn(rng, "features.norm5", channels, state)
  state["classifier.weight"] = rng.normal(0, 0.05, (num_classes, channels))
  state["classifier.bias"] = rng.normal(0, 0.05, num_classes)
  return {k: np.asarray(v, np.float32) for k, v in state.items()}


def _np_conv(x, weight, stride=1):
  """float64 cross-correlation of NHWC ``x`` with an OIHW torch weight."""
  size = weight.shape[-1]
  pad = size // 2
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  height = (x.shape[1] - size) // stride + 1
  width = (x.shape[2] - size) // stride + 1
  out = 0
  for i in range(size):
    for j in range(size):
      window = x[:, i:i + stride * height:stride, j:j + stride * width:stride]
      out = out + window @ weight[:, :, i, j].T.astype(np.float64)
  return out


def _np_bn_relu(x, state, name):
  gamma, beta = state[f"{name}.weight"], state[f"{name}.bias"]
  mean, var = state[f"{name}.running_mean"], state[f"{name}.running_var"]
  y = (x - mean) / np.sqrt(var.astype(np.float64) + 1e-5) * gamma + beta
  return np.maximum(y, 0)


def numpy_densenet121_logits(state, images):
  """torchvision's DenseNet-121 forward pass in eval mode, in float64."""
  x = _np_conv(np.asarray(images, np.float64), state["features.conv0.weight"],
               stride=2)
  x = _np_bn_relu(x, state, "features.norm0")
  # Max pooling 3x3, stride 2, padding 1 (padded with -inf).
  x = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
  size = (x.shape[1] - 3) // 2 + 1
  x = np.max([x[:, i:i + 2 * size:2, j:j + 2 * size:2]
              for i in range(3) for j in range(3)], axis=0)
  for b, num_layers in enumerate(BLOCKS, start=1):
    for k in range(1, num_layers + 1):
      name = f"features.denseblock{b}.denselayer{k}"
      y = _np_conv(_np_bn_relu(x, state, f"{name}.norm1"),
                   state[f"{name}.conv1.weight"])
      y = _np_conv(_np_bn_relu(y, state, f"{name}.norm2"),
                   state[f"{name}.conv2.weight"])
      x = np.concatenate([x, y], axis=-1)
    if b < len(BLOCKS):
      name = f"features.transition{b}"
      x = _np_conv(_np_bn_relu(x, state, f"{name}.norm"),
                   state[f"{name}.conv.weight"])
      n, h, w, c = x.shape
      x = x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
  features = _np_bn_relu(x, state, "features.norm5").mean(axis=(1, 2))
  return features @ state["classifier.weight"].T + state["classifier.bias"]


def _model_with_head(abstract_model, state):
  """A DenseNet-121 in eval mode with the classifier of ``state`` as head.

  ``abstract_model``'s structure filled with zeros (the featurizer's weights
  are then loaded), since initialising 8M random parameters takes long on a
  CPU.
  """
  graphdef, abstract_state = nnx.split(abstract_model)

  def concrete(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key(0)
    return np.zeros(leaf.shape, leaf.dtype)

  model = nnx.merge(graphdef, jax.tree.map(concrete, abstract_state))
  model.head.kernel[...] = state["classifier.weight"].T
  model.head.bias[...] = state["classifier.bias"]
  model.eval()
  return model


def test_converted_densenet_matches_a_numpy_forward_pass(
    abstract_densenet121, converted_state, tmp_path):
  state, converted = converted_state
  path = tmp_path / "densenet121.npz"
  convert.save_npz(converted, path)
  model = _model_with_head(abstract_densenet121, state)
  convert.load_pretrained(model, path)
  images = np.random.default_rng(1).normal(size=(2, 32, 32, 3))
  expected = numpy_densenet121_logits(state, images)
  logits = np.asarray(nnx.jit(lambda model, x: model(x))(
      model, images.astype(np.float32)))
  assert np.std(expected) > 0.1
  np.testing.assert_allclose(logits, expected, rtol=2e-3,
                             atol=2e-3 * np.abs(expected).max())
  # The statistics went to BatchStat variables, not parameters.
  np.testing.assert_array_equal(
      model.featurizer.denseblock2[3].norm2.mean[...],
      state["features.denseblock2.denselayer4.norm2.running_mean"])


def test_densenet_conversion_reports_wrong_shapes():
  state = torchvision_densenet121_state()
  state["features.norm5.weight"] = np.ones(7, np.float32)
  with pytest.raises(ValueError, match="norm5/scale: expected"):
    convert.convert_torchvision_densenet121(state)


def test_convert_cli_recognises_densenet_and_its_old_layer_names(
    converted_state, tmp_path, capsys):
  # torchvision's densenet121-a639ec97.pth, the file the CLI converts,
  # names norm1 "norm.1", as DenseNets did before PyTorch refused dots in
  # module names: its conversion is that of the same state with the new
  # names.
  state, converted_new = converted_state
  old = {re.sub(r"(denselayer\d+\.(norm|conv))([12])\.", r"\1.\3.", k): v
         for k, v in state.items()}
  assert "features.denseblock1.denselayer1.norm.1.weight" in old
  torch_writer.write_state_dict(tmp_path / "d.pth", old)
  out = tmp_path / "d.npz"
  assert weights_command.main(["convert", "--in", str(tmp_path / "d.pth"),
                          "--out", str(out)]) == 0
  assert "densenet121" in capsys.readouterr().out
  expected = {"/".join(map(str, path)): leaf for path, leaf in
              traverse_util.flatten_dict(converted_new).items()}
  with np.load(out) as converted:
    assert set(converted.files) == set(expected)
    for key, leaf in expected.items():
      np.testing.assert_array_equal(converted[key], leaf, err_msg=key)
    np.testing.assert_array_equal(
        converted["conv0/kernel"],
        state["features.conv0.weight"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(
        converted["denseblock4/15/norm1/var"],
        state["features.denseblock4.denselayer16.norm1.running_var"])
    assert not any(key.startswith("classifier") for key in converted.files)
