"""Tests for experiments.models, through `build_model` (the classifiers, the
MNIST CNN and the ResNets), and experiments.weights.convert."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

from experiments import catalog
from experiments import models
from experiments.weights import convert
import torch_writer

FEATURES = {"mnist_cnn": 128, "resnet18": 512, "resnet50": 2048}
SIZE = 32  # Small images keep the ResNets fast.


def _new_model(name, channels=3, seed=0, **kwargs):
  return models.build_model(
      name,
      num_classes=5,
      input_shape=(SIZE, SIZE, channels),
      rngs=nnx.Rngs(seed),
      **kwargs,
  )


# Model options that change how a model runs, not its arrays: build_model
# draws the same keys in the same order whatever they are (ResNet-18s of
# every bn_mode and dropout rate have equal states, leaf by leaf).
RUN_OPTIONS = ("bn_mode", "dropout")


def _build(name, channels=3, seed=0, **kwargs):
  """A fresh concrete model: a copy of the arrays initialised once.

  Initialising a ResNet-18 takes about 2 CPU seconds of random-number
  generation under the tests' fast-compile XLA flags (conftest.py), and a
  dozen tests build one. The arrays are initialised once per model, channels,
  seed and option other than the `RUN_OPTIONS`, which the model of ``kwargs``
  takes in its own structure. Each test gets its own copy, so what one test
  changes (loaded weights, updated statistics) no other test sees. Abstract
  models come from `_abstract`, never from this cache.
  """
  init_kwargs = {k: v for k, v in kwargs.items() if k not in RUN_OPTIONS}
  model = nnx.clone(_cached_model(name, channels, seed,
                                  tuple(sorted(init_kwargs.items()))))
  if kwargs == init_kwargs:
    return model
  graphdef, _ = nnx.split(_abstract(name, channels, **kwargs))
  return nnx.merge(graphdef, nnx.state(model))


@functools.cache
def _cached_model(name, channels, seed, kwargs):
  return _new_model(name, channels, seed, **dict(kwargs))


def _abstract(name, channels=3, **kwargs):
  """`_new_model`'s abstract model (`nnx.eval_shape`): shapes and dtypes.

  Traced once per configuration (a ResNet-50's trace takes about a CPU
  second) and shared: the tests only read it, or split it to fill a copy.
  """
  return _cached_abstract(name, channels, tuple(sorted(kwargs.items())))


@functools.cache
def _cached_abstract(name, channels, kwargs):
  return nnx.eval_shape(lambda: _new_model(name, channels, **dict(kwargs)))


def _filled(name, channels=3, seed=0, **kwargs):
  """A concrete model for a test that loads its featurizer: the abstract
  model's arrays drawn from NumPy, not initialised.

  Loading overwrites the featurizer, whose init (about 2 CPU seconds for a
  ResNet-18, see `_build`) a test of loading would throw away. Every float
  is uniform in [0.5, 1.5) (positive, so also a valid variance), drawn
  with ``seed``: two models of different seeds differ everywhere, so a
  loader that left part of one alone would show.
  """
  graphdef, state = nnx.split(_abstract(name, channels, **kwargs))
  rng = np.random.default_rng(seed)

  def fill(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      return jnp.asarray(rng.uniform(0.5, 1.5, leaf.shape), leaf.dtype)
    return jnp.zeros(leaf.shape, leaf.dtype)

  return nnx.merge(graphdef, jax.tree.map(fill, state))


def _images(channels=3, n=2, seed=0):
  return jax.random.normal(jax.random.key(seed), (n, SIZE, SIZE, channels))


def _batch_stats(model):
  return jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


def _abstract_forward(name, channels=3, **kwargs):
  """(model, logits, features) of an abstract model: shapes and dtypes only.

  Abstract evaluation traces the same code as a real call without compiling
  it, which keeps shape checks on the large models fast.
  """
  model = _abstract(name, channels, **kwargs)
  graphdef, state = nnx.split(model)

  def forward(state, x):
    model = nnx.merge(graphdef, state)
    return model(x), model.features(x)

  x = jax.ShapeDtypeStruct((2, SIZE, SIZE, channels), jnp.float32)
  return model, *jax.eval_shape(forward, state, x)


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _trees_equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


# ---------------------------------------------------------------------------
# A torchvision-style ResNet state dict, written from torchvision's layer
# naming and shapes (OIHW kernels), independently of experiments.models.


def torchvision_resnet_shapes(depth):
  """Returns torchvision's ``resnet{depth}().state_dict()`` names and shapes."""
  bottleneck, stages = {18: (False, (2, 2, 2, 2)), 50: (True, (3, 4, 6, 3))}[depth]
  shapes = {}

  def conv(name, out_c, in_c, k):
    shapes[f"{name}.weight"] = (out_c, in_c, k, k)

  def bn(name, c):
    for leaf in ("weight", "bias", "running_mean", "running_var"):
      shapes[f"{name}.{leaf}"] = (c,)
    shapes[f"{name}.num_batches_tracked"] = ()

  conv("conv1", 64, 3, 7)
  bn("bn1", 64)
  in_c = 64
  for stage, num_blocks in enumerate(stages):
    width = 64 * 2**stage
    out_c = 4 * width if bottleneck else width
    for b in range(num_blocks):
      prefix = f"layer{stage + 1}.{b}"
      if bottleneck:
        convs = [(width, in_c, 1), (width, width, 3), (out_c, width, 1)]
      else:
        convs = [(width, in_c, 3), (out_c, width, 3)]
      for j, (o, i, k) in enumerate(convs, start=1):
        conv(f"{prefix}.conv{j}", o, i, k)
        bn(f"{prefix}.bn{j}", o)
      if b == 0 and (stage > 0 or in_c != out_c):
        conv(f"{prefix}.downsample.0", out_c, in_c, 1)
        bn(f"{prefix}.downsample.1", out_c)
      in_c = out_c
  shapes["fc.weight"] = (1000, in_c)
  shapes["fc.bias"] = (1000,)
  return shapes


def random_state_dict(depth, seed=0):
  rng = np.random.default_rng(seed)
  state_dict = {}
  for name, shape in torchvision_resnet_shapes(depth).items():
    if name.endswith("num_batches_tracked"):
      state_dict[name] = np.array(100, np.int64)
    elif name.endswith(("running_var", "bn1.weight", "bn2.weight", "bn3.weight")):
      state_dict[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    else:
      state_dict[name] = (0.1 * rng.normal(size=shape)).astype(np.float32)
  return state_dict


@pytest.fixture(scope="module")
def resnet18_npz(tmp_path_factory):
  """A random torchvision resnet18 state dict and its converted .npz."""
  state_dict = random_state_dict(18)
  path = tmp_path_factory.mktemp("weights") / "resnet18.npz"
  converted = convert.convert_torchvision_state_dict(state_dict, 18)
  convert.save_npz(converted, path)
  return state_dict, path


def conv2d_oihw_reference(x_nhwc, weight_oihw, stride, pad):
  """PyTorch's Conv2d (cross-correlation, zero padding), by explicit loops."""
  x = np.pad(
      np.asarray(x_nhwc, np.float64).transpose(0, 3, 1, 2),
      ((0, 0), (0, 0), (pad, pad), (pad, pad)),
  )
  k = weight_oihw.shape[-1]
  out_h = (x.shape[2] - k) // stride + 1
  out_w = (x.shape[3] - k) // stride + 1
  out = np.zeros((x.shape[0], out_h, out_w, weight_oihw.shape[0]))
  for i in range(out_h):
    for j in range(out_w):
      patch = x[:, :, i * stride : i * stride + k, j * stride : j * stride + k]
      out[:, i, j] = np.einsum("nihw,oihw->no", patch, weight_oihw)
  return out


# ---------------------------------------------------------------------------
# Models.


@pytest.mark.parametrize("channels", [1, 2, 3, 8])
@pytest.mark.parametrize("name", ["mnist_cnn", "resnet18", "resnet50"])
def test_output_shapes(name, channels):
  model, logits, features = _abstract_forward(name, channels)
  assert logits.shape == (2, 5)
  assert features.shape == (2, FEATURES[name])
  assert model.featurizer.num_features == FEATURES[name]
  assert isinstance(model.head, nnx.Linear)


def test_mnist_cnn_forward():
  logits = _build("mnist_cnn", channels=2)(_images(2))
  assert logits.shape == (2, 5)
  assert np.isfinite(logits).all()


def test_mnist_cnn_layers():
  model = _build("mnist_cnn", channels=2)
  convs = model.featurizer.convs
  assert [c.kernel.shape for c in convs] == [
      (3, 3, 2, 64),
      (3, 3, 64, 128),
      (3, 3, 128, 128),
      (3, 3, 128, 128),
  ]
  assert [c.strides for c in convs] == [1, 2, 1, 1]
  assert all(n.num_groups == 8 for n in model.featurizer.norms)
  assert model.head.kernel.shape == (128, 5)


@pytest.mark.parametrize(
    "depth, featurizer_params, torchvision_total",
    [(18, 11_176_512, 11_689_512), (50, 23_508_032, 25_557_032)],
)
def test_resnet_parameter_counts(depth, featurizer_params, torchvision_total):
  shapes = torchvision_resnet_shapes(depth)
  buffers = ("running_mean", "running_var", "num_batches_tracked")
  sizes = {
      k: int(np.prod(s)) for k, s in shapes.items() if not k.endswith(buffers)
  }
  assert sum(sizes.values()) == torchvision_total  # torchvision's own count.
  without_fc = [v for k, v in sizes.items() if not k.startswith("fc.")]
  assert sum(without_fc) == featurizer_params

  model = _abstract(f"resnet{depth}")
  params = nnx.state(model.featurizer, nnx.Param)
  assert sum(p.size for p in jax.tree.leaves(params)) == featurizer_params


def test_frozen_bn_never_updates_and_stats_are_not_params():
  model = _build("resnet18")  # bn_mode="frozen" by default.
  before = _batch_stats(model)
  assert jax.tree.leaves(before)
  model.train()
  train_out = model(_images())
  model(_images(seed=1))
  _assert_trees_equal(_batch_stats(model), before)
  model.eval()
  np.testing.assert_array_equal(model(_images()), train_out)

  param_paths = [p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  assert param_paths
  assert not any(p[-1] in ("mean", "var") for p in param_paths)
  assert ("featurizer", "bn1", "scale") in param_paths  # BN affine trains.


def test_train_bn_updates_stats_in_train_mode_only():
  model = _build("resnet18", bn_mode="train")
  before = _batch_stats(model)
  train_out = model(_images())
  after = _batch_stats(model)
  assert not _trees_equal(after, before)
  model.eval()
  eval_out = model(_images())
  _assert_trees_equal(_batch_stats(model), after)
  assert not np.allclose(eval_out, train_out)


def test_dropout_only_in_train_mode():
  model = _build("resnet18", dropout=0.5)
  x = _images()
  model.eval()
  clean = np.asarray(model.features(x))
  np.testing.assert_array_equal(model.features(x), clean)
  model.train()  # Frozen BN: only dropout differs from eval mode.
  dropped = np.asarray(model.features(x))
  # The stored stream advances, so each call draws a new mask.
  assert not np.array_equal(model.features(x), dropped)
  # Kept features are scaled by 1 / (1 - rate).
  expected = np.where(dropped == 0, 0, 2 * clean)
  np.testing.assert_allclose(dropped, expected, rtol=1e-6)
  assert 0.3 < np.mean(dropped == 0) < 0.7
  key = jax.random.key(3)
  np.testing.assert_array_equal(
      model.features(x, rngs=key), model.features(x, rngs=key)
  )


@pytest.mark.parametrize("name", ["mnist_cnn", "resnet50"])
def test_bfloat16_compute_with_float32_params(name):
  model, logits, _ = _abstract_forward(name, dtype=jnp.bfloat16)
  assert logits.dtype == jnp.bfloat16
  param_dtypes = {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert param_dtypes == {jnp.dtype(jnp.float32)}


def test_functional_jit_step_with_dropout_keys_and_bn_updates():
  # bn_mode="train" is the demanding case: BN mutates state under jit + grad.
  model = _build("resnet18", bn_mode="train", dropout=0.5)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x, y = _images(), jnp.array([0, 3])

  def loss_fn(params, rest, key):
    # copy=True: fresh Variables at this trace level, so BN may update them.
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(x, rngs=key)
    loss = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), y])
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  step = jax.jit(jax.grad(loss_fn, has_aux=True))
  grads, new_rest = step(params, rest, jax.random.key(0))
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  grads_again, _ = step(params, rest, jax.random.key(0))
  _assert_trees_equal(grads_again, grads)
  grads_other, _ = step(params, rest, jax.random.key(1))
  assert not _trees_equal(grads_other, grads)

  def pure(state, variable_type):
    return nnx.to_pure_dict(nnx.filter_state(state, variable_type))

  assert not _trees_equal(pure(new_rest, nnx.BatchStat), pure(rest, nnx.BatchStat))
  # An explicit key leaves the model's stored dropout stream untouched.
  _assert_trees_equal(pure(new_rest, nnx.RngCount), pure(rest, nnx.RngCount))


def test_registry():
  with pytest.raises(KeyError, match="resnet50"):
    _new_model("no_such_model")
  with pytest.raises(ValueError, match="already registered"):
    catalog.MODELS.register("resnet18", models.ResNet)
  with pytest.raises(ValueError, match="bn_mode"):
    nnx.eval_shape(lambda: _new_model("resnet18", bn_mode="eval"))

  class Tiny(nnx.Module):

    def __init__(self, in_channels, *, rngs, dtype, param_dtype):
      self.num_features = in_channels

    def __call__(self, x, *, rngs=None):
      return x.mean(axis=(1, 2))

  catalog.MODELS.register("tiny_test_model", Tiny)
  try:
    assert _new_model("tiny_test_model", channels=4)(_images(4)).shape == (2, 5)
  finally:
    del catalog.MODELS["tiny_test_model"]


# ---------------------------------------------------------------------------
# Pretrained weights.


def test_convert_torchvision_state_dict_layout(resnet18_npz):
  state_dict, _ = resnet18_npz
  tree = convert.convert_torchvision_state_dict(state_dict, 18)
  assert "fc" not in tree
  assert set(tree["bn1"]) == {"scale", "bias", "mean", "var"}
  np.testing.assert_array_equal(
      tree["layer2"][0]["downsample"][0]["kernel"],
      state_dict["layer2.0.downsample.0.weight"].transpose(2, 3, 1, 0),
  )
  np.testing.assert_array_equal(
      tree["layer3"][1]["bn2"]["var"], state_dict["layer3.1.bn2.running_var"]
  )
  abstract = _abstract("resnet18")
  expected = nnx.to_pure_dict(
      nnx.state(abstract.featurizer, (nnx.Param, nnx.BatchStat))
  )
  assert jax.tree.structure(tree) == jax.tree.structure(expected)
  assert jax.tree.map(np.shape, tree) == jax.tree.map(np.shape, expected)


@pytest.mark.parametrize(
    "name, stride, pad, input_hw, channels",
    [("conv1", 2, 3, 11, 3), ("layer2.0.conv1", 2, 1, 6, 64)],
)
def test_converted_conv_matches_oihw_convolution(
    resnet18_npz, name, stride, pad, input_hw, channels
):
  state_dict, path = resnet18_npz
  model = _build("resnet18")
  convert.load_pretrained(model, path)
  conv = model.featurizer  # Walk the torchvision name down the NNX modules.
  for part in name.split("."):
    conv = conv[int(part)] if part.isdigit() else getattr(conv, part)
  x = jax.random.normal(jax.random.key(0), (2, input_hw, input_hw, channels))
  weight = state_dict[f"{name}.weight"]
  expected = conv2d_oihw_reference(x, weight, stride, pad)
  np.testing.assert_allclose(conv(x), expected, rtol=1e-4, atol=1e-4)


def test_load_pretrained_npz_sets_featurizer_and_keeps_head(resnet18_npz):
  state_dict, path = resnet18_npz
  model = _build("resnet18")
  head = nnx.to_pure_dict(nnx.clone(nnx.state(model.head)))
  convert.load_pretrained(model, path)
  bn = model.featurizer.layer4[1].bn2
  np.testing.assert_array_equal(
      bn.mean[...], state_dict["layer4.1.bn2.running_mean"]
  )
  np.testing.assert_array_equal(bn.scale[...], state_dict["layer4.1.bn2.weight"])
  _assert_trees_equal(nnx.to_pure_dict(nnx.state(model.head)), head)

  # Frozen BN applies PyTorch's eval-mode formula with the loaded statistics.
  x = np.random.default_rng(0).normal(size=(2, 3, 3, 64)).astype(np.float32)
  mean, var, scale, bias = (
      state_dict[f"bn1.{leaf}"]
      for leaf in ("running_mean", "running_var", "weight", "bias")
  )
  expected = (x - mean) / np.sqrt(var + 1e-5) * scale + bias
  actual = model.featurizer.bn1(x)
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels", [1, 8])
def test_load_pretrained_adapts_stem_channels(resnet18_npz, channels):
  state_dict, path = resnet18_npz
  model = _filled("resnet18", channels)
  convert.load_pretrained(model, path)
  rgb = state_dict["conv1.weight"].transpose(2, 3, 1, 0)
  kernel = np.asarray(model.featurizer.conv1.kernel[...])
  assert kernel.shape == (7, 7, channels, 64)
  for c in range(channels):  # DomainBed's rule: channel c copies RGB c % 3.
    np.testing.assert_array_equal(kernel[:, :, c], rgb[:, :, c % 3])
  assert model(_images(channels)).shape == (2, 5)


def test_arm_resnet_stem_takes_the_red_filters_for_the_context(resnet18_npz):
  # DomainBed's ARM on photos: a ResNet for 3 + 1 channels, whose pretrained
  # stem is adapted as any other (networks.py lines 125-135).
  state_dict, path = resnet18_npz
  model = _filled("resnet18", 3, context_net=True)
  assert isinstance(model, models.ContextClassifier)
  convert.load_pretrained(model, path)
  rgb = state_dict["conv1.weight"].transpose(2, 3, 1, 0)
  kernel = np.asarray(model.featurizer.conv1.kernel[...])
  assert kernel.shape == (7, 7, 4, 64)
  np.testing.assert_array_equal(kernel[:, :, 3], rgb[:, :, 0])
  assert model(_images(3)).shape == (2, 5)


def _featurizer_state(model):
  return nnx.to_pure_dict(
      nnx.state(model.featurizer, (nnx.Param, nnx.BatchStat))
  )


def test_orbax_round_trip(tmp_path):
  source = _build("resnet18", bn_mode="train")  # test_train_bn's, too.
  source(_images())  # Moves the BN statistics away from their init.
  convert.save_featurizer(source, tmp_path / "featurizer")
  target = _filled("resnet18", seed=2)
  convert.load_pretrained(target, tmp_path / "featurizer")
  _assert_trees_equal(_featurizer_state(target), _featurizer_state(source))


def test_orbax_checkpoint_of_an_nnx_state_loads(tmp_path):
  source = _build("mnist_cnn", seed=1)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", nnx.state(source.featurizer, nnx.Param))
  checkpointer.wait_until_finished()
  target = _filled("mnist_cnn", seed=2)
  convert.load_pretrained(target, tmp_path / "state")
  _assert_trees_equal(_featurizer_state(target), _featurizer_state(source))


def test_mismatched_weights_raise_clear_errors(resnet18_npz, tmp_path):
  state_dict, path = resnet18_npz
  with pytest.raises(ValueError, match=r"missing[\s\S]*layer1/0/conv3/kernel"):
    # Shapes suffice to detect the mismatch, so the model can stay abstract.
    convert.load_pretrained(_abstract("resnet50"), path)

  tree = convert.convert_torchvision_state_dict(state_dict, 18)
  tree["layer1"][0]["conv2"]["kernel"] = np.zeros((3, 3, 64, 32), np.float32)
  convert.save_npz(tree, tmp_path / "bad.npz")
  with pytest.raises(ValueError, match=r"shape mismatch.*layer1/0/conv2/kernel"):
    convert.load_pretrained(_build("resnet18"), tmp_path / "bad.npz")

  incomplete = dict(state_dict)
  del incomplete["layer3.0.bn1.running_mean"]
  incomplete["layer5.0.conv1.weight"] = np.zeros((1, 1, 1, 1), np.float32)
  with pytest.raises(ValueError) as error:
    convert.convert_torchvision_state_dict(incomplete, 18)
  assert "missing (1): layer3/0/bn1/mean" in str(error.value)
  assert "unexpected (1): layer5/0/conv1/kernel" in str(error.value)


def test_missing_file_explains_how_to_get_weights(tmp_path):
  path = tmp_path / "resnet50.npz"
  with pytest.raises(FileNotFoundError, match="IMAGENET1K_V1") as error:
    convert.load_pretrained(_build("mnist_cnn"), path)
  assert str(path) in str(error.value)
  assert "experiments.weights convert" in str(error.value)


@pytest.mark.parametrize("depth", [18, 50])
def test_infer_depth(depth):
  shapes = torchvision_resnet_shapes(depth)
  assert convert._infer_depth(shapes) == depth


def test_load_pretrained_reads_a_torchvision_pth(resnet18_npz, tmp_path):
  # The .pth is read without torch (experiments.weights.torch_pickle, tested
  # in test_torch_pickle.py) and converted as the .npz was.
  state_dict, npz = resnet18_npz
  torch_writer.write_state_dict(tmp_path / "resnet18.pth", state_dict)
  # Two different models, so that a loader that left either alone would
  # show.
  from_pth, from_npz = _build("resnet18"), _filled("resnet18", seed=2)
  convert.load_pretrained(from_pth, tmp_path / "resnet18.pth")
  convert.load_pretrained(from_npz, npz)
  _assert_trees_equal(_featurizer_state(from_pth),
                      _featurizer_state(from_npz))
  np.testing.assert_array_equal(
      from_pth.featurizer.conv1.kernel[...],
      state_dict["conv1.weight"].transpose(2, 3, 1, 0))


def test_load_pretrained_reads_timms_safetensors(resnet18_npz, tmp_path):
  # timm names a ResNet's tensors as torchvision does (test_convert.py
  # checks ResNet-50's against timm's architecture), and publishes them as
  # safetensors: such a file loads as the .npz does.
  state_dict, npz = resnet18_npz
  safetensors.numpy.save_file(state_dict, tmp_path / "model.safetensors")
  from_timm, from_npz = _build("resnet18"), _filled("resnet18", seed=2)
  convert.load_pretrained(from_timm, tmp_path / "model.safetensors")
  convert.load_pretrained(from_npz, npz)
  _assert_trees_equal(_featurizer_state(from_timm),
                      _featurizer_state(from_npz))


@pytest.mark.parametrize("channels, size", [(1, 7), (3, 8)])
def test_context_classifier_adds_a_context_channel(channels, size):
  model = models.build_model("mnist_cnn", num_classes=5,
                             input_shape=(size, size, channels),
                             rngs=nnx.Rngs(0), widths=(16, 16, 16, 16),
                             context_net=True)
  assert model.featurizer.convs[0].in_features == channels + 1
  x = jax.random.normal(jax.random.key(0), (4, size, size, channels))
  maps = model.context_net(x)
  assert maps.shape == (4, size, size, 1)  # 5x5 convs padded by 2.
  # By default the whole batch is one support set.
  context = jnp.broadcast_to(maps.mean(0), maps.shape)
  np.testing.assert_allclose(model(x), model(x, context=context), rtol=1e-6)
  # A context of its own per image changes the logits (of size 0.1).
  assert np.abs(model(x) - model(x, context=maps)).max() > 1e-3
  # The context network's BatchNorm learns statistics in train mode only:
  # the passes above moved them from their start; eval-mode passes do not.
  before = _batch_stats(model.context_net)
  assert not _trees_equal(before, _batch_stats(
      models.ContextNet(channels, rngs=nnx.Rngs(0))))
  model.eval()
  model(x)
  assert _trees_equal(before, _batch_stats(model.context_net))


@pytest.mark.parametrize("dtype, stats_dtype", [
    (jnp.float64, jnp.float64), (jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("bn_mode", ["frozen", "train"])
def test_batch_norm_statistics_take_the_models_dtype(bn_mode, dtype,
                                                     stats_dtype):
  with jax.enable_x64(True):
    model = nnx.eval_shape(lambda: _new_model(
        "resnet18", bn_mode=bn_mode, dtype=dtype, param_dtype=dtype))
  norms = [m for _, m in nnx.iter_graph(model)
           if isinstance(m, nnx.BatchNorm)]
  assert len(norms) == 20
  # Trained BatchNorm follows PyTorch's running variance (the references
  # of every trained one here, WILDS's and DomainBed's, are PyTorch).
  assert {(type(m), m.unbiased_running_var) for m in norms} == {
      "frozen": {(models.FrozenBatchNorm, False)},
      "train": {(models.BatchNorm, True)}}[bn_mode]
  assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.BatchStat))
          } == {jnp.dtype(stats_dtype)}


def test_context_net_follows_pytorchs_running_variance():
  context_net = models.ContextNet(1, rngs=nnx.Rngs(0))
  assert [m.unbiased_running_var for m in context_net.norms] == [True, True]


def test_mtl_head_takes_the_features_and_a_domain_embedding():
  model = models.build_model("mnist_cnn", num_classes=5,
                             input_shape=(8, 8, 1), rngs=nnx.Rngs(0),
                             widths=(8, 8, 8, 8), domain_embedding=True)
  assert isinstance(model, models.EmbeddingClassifier)
  assert model.head.in_features == 2 * model.featurizer.num_features
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
  features = model.features(x)
  # By default the embedding is the batch's mean features.
  np.testing.assert_allclose(
      model(x), model(x, embedding=jnp.broadcast_to(features.mean(0),
                                                    features.shape)),
      rtol=1e-6)
  embedding = jnp.ones_like(features)
  np.testing.assert_allclose(
      model(x, embedding=embedding),
      model.head(jnp.concatenate([features, embedding], axis=1)), rtol=1e-6)
