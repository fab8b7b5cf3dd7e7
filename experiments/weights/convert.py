"""Featurizer weights converted from torchvision's layout, checked, loaded.

``--pretrained`` takes one of:

* ``imagenet``: torchvision's ImageNet weights of the model, fetched by
  `experiments.weights.imagenet`;
* a PyTorch ``.pth`` file of a torchvision ``state_dict``, read by
  `experiments.weights.torch_pickle` without PyTorch;
* a ``.npz`` converted from one (``python -m experiments.weights convert
  --in resnet50.pth --out resnet50.npz``, which does not need PyTorch
  either);
* an Orbax checkpoint directory of a featurizer's parameters and BatchNorm
  statistics, as written by :func:`save_featurizer`.

The last two hold a flat mapping from paths such as ``layer1/0/conv1/kernel``
(the featurizer's NNX state path, joined by ``/``) to arrays.

A run checks its weights before it builds its model (`checked_weights`):
ImageNet's are fetched and checked, any file is read whole, and weights of
another architecture than ``--model``'s are named as such. Its config file
records their file name and SHA-256 (`imagenet.sha256`), which tells any two
apart.

A ResNet with ``C != 3`` input channels gets an RGB stem adapted by
:func:`adapt_input_channels`, following DomainBed: input channel ``i`` takes
the pretrained kernel of RGB channel ``i % 3``. (WILDS's PovertyMap baseline
does not start from RGB weights: its 8-channel ResNet-18 is trained from a
Kaiming-normal initialisation, which is also what ``resnet18`` without
``--pretrained`` gives; see ``experiments.data.wilds``.)
"""

from collections.abc import Callable, Collection, Mapping
import dataclasses
import os
from pathlib import Path
import re
from typing import Any
import zipfile

from flax import nnx
from flax import traverse_util
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import safetensors
import safetensors.numpy

from experiments import models
from experiments.weights import imagenet
from experiments.weights import torch_pickle

_STEM_KERNEL = "conv1/kernel"
# torchvision leaf name -> NNX name, for 1-D tensors (BatchNorm). 4-D ``weight``
# tensors are conv kernels.
_BN_NAMES = {
    "weight": "scale",
    "bias": "bias",
    "running_mean": "mean",
    "running_var": "var",
}
# What files are read as torch.save's whatever their first bytes, so that a
# damaged one is said to be a damaged PyTorch file.
_TORCH_SUFFIXES = (".pth", ".pt")
# What files are read as safetensors (timm's weights on the hub).
_SAFETENSORS_SUFFIX = ".safetensors"
_HOW_TO_GET_WEIGHTS = (
    "Pass --pretrained imagenet for torchvision's IMAGENET1K_V1 weights "
    "(downloaded once), imagenet_augmix for timm's AugMix ResNet-50, a .pth "
    "file of a torchvision state_dict or timm's .safetensors, a .npz "
    "converted from either (python -m experiments.weights convert), an "
    "Orbax directory of featurizer weights, or none to train from scratch."
)



def _featurizer_state(featurizer: nnx.Module) -> nnx.State:
  """The state that pretrained weights cover: parameters and BN statistics."""
  return nnx.state(featurizer, (nnx.Param, nnx.BatchStat))


def _flatten(tree: Mapping[Any, Any]) -> dict[str, Any]:
  """Flattens a nested mapping into ``"a/0/b"``-keyed leaves."""
  return {
      "/".join(map(str, path)): leaf
      for path, leaf in traverse_util.flatten_dict(tree).items()
  }


def _check_compatible(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    source: str,
) -> None:
  """Raises a ValueError listing every missing, unexpected or misshapen key."""
  missing = sorted(expected.keys() - found.keys())
  unexpected = sorted(found.keys() - expected.keys())
  mismatched = sorted(
      f"{key}: expected {expected[key]}, found {found[key]}"
      for key in expected.keys() & found.keys()
      if tuple(expected[key]) != tuple(found[key])
  )
  if missing or unexpected or mismatched:
    problems = [
        f"  {title} ({len(keys)}): {'; '.join(keys)}"
        for title, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", mismatched),
        )
        if keys
    ]
    raise ValueError(
        f"Weights in {source} do not match the model:\n" + "\n".join(problems)
    )


def _convert(
    state_dict: Mapping[str, np.ndarray],
    module_path: Callable[[list[str]], tuple[str | int, ...] | None],
    abstract_featurizer: Callable[[], nnx.Module],
    source: str,
) -> dict[str, Any]:
  """Renames and transposes a torchvision ``state_dict`` for a featurizer.

  Conv kernels go from OIHW to HWIO; BatchNorm ``weight``/``bias``/
  ``running_mean``/``running_var`` become ``scale``/``bias``/``mean``/``var``;
  ``num_batches_tracked`` is dropped.

  Args:
    state_dict: torchvision names to arrays.
    module_path: maps a name's module parts (e.g. ``["layer1", "0",
      "conv1"]``) to the featurizer's path, or to ``None`` to drop the tensor
      (the classification layer, trained anew).
    abstract_featurizer: builds the 3-channel featurizer the weights must fit.
    source: names the weights in error messages.

  Returns:
    The nested dict of the featurizer's ``nnx.Param`` and ``nnx.BatchStat``.

  Raises:
    ValueError: if the names or shapes do not match the featurizer.
  """
  flat = {}
  for name, value in state_dict.items():
    *module, leaf = name.split(".")
    path = module_path(module)
    if path is None or leaf == "num_batches_tracked":
      continue
    value = np.asarray(value)
    if leaf == "weight" and value.ndim == 4:
      leaf, value = "kernel", value.transpose(2, 3, 1, 0)
    else:
      # Unknown names pass through unchanged and are reported below.
      leaf = _BN_NAMES.get(leaf, leaf)
    flat[path + (leaf,)] = value
  abstract_state = nnx.to_pure_dict(
      _featurizer_state(nnx.eval_shape(abstract_featurizer)))
  expected = {key: leaf.shape for key, leaf in _flatten(abstract_state).items()}
  _check_compatible(
      expected,
      {"/".join(map(str, path)): v.shape for path, v in flat.items()},
      source,
  )
  return traverse_util.unflatten_dict(flat)


def _int_parts(module: list[str]) -> tuple[str | int, ...]:
  return tuple(int(p) if p.isdigit() else p for p in module)


def convert_torchvision_state_dict(
    state_dict: Mapping[str, np.ndarray], depth: int
) -> dict[str, Any]:
  """Converts a torchvision ResNet ``state_dict`` to the featurizer's layout.

  See `_convert` for the renaming; ``fc.*`` (the head is trained anew) is
  dropped.

  Args:
    state_dict: torchvision names (e.g. ``layer1.0.downsample.0.weight``) to
      arrays.
    depth: the ResNet depth (18 or 50) the weights must match.

  Returns:
    A nested dict shaped like
    ``nnx.to_pure_dict(nnx.state(featurizer, (nnx.Param, nnx.BatchStat)))``
    for a 3-channel ``models.ResNet(depth=depth)``: block indices are ints.

  Raises:
    ValueError: if the names or shapes do not match a ResNet of ``depth``.
  """
  return _convert(
      state_dict,
      lambda module: None if module[:1] == ["fc"] else _int_parts(module),
      lambda: models.ResNet(3, depth=depth, rngs=nnx.Rngs(0)),
      f"the torchvision resnet{depth} state_dict")


# torchvision's densenet121-a639ec97.pth predates its module names: it names
# ``denselayer1.norm.1.weight`` what the module calls
# ``denselayer1.norm1.weight``. torchvision renames them as it loads the file
# (torchvision/models/densenet.py, _load_state_dict); so does this.
_OLD_DENSELAYER_NAME = re.compile(
    r"(denselayer\d+\.(?:norm|relu|conv))\.([12])\.")


def _densenet_path(module: list[str]) -> tuple[str | int, ...] | None:
  """``features.denseblock1.denselayer2.conv1`` -> ``denseblock1/1/conv1``."""
  if module[:1] == ["classifier"]:
    return None
  if module[:1] == ["features"]:
    module = module[1:]
  return tuple(int(p.removeprefix("denselayer")) - 1
               if p.startswith("denselayer") else p for p in module)


def convert_torchvision_densenet121(
    state_dict: Mapping[str, np.ndarray]
) -> dict[str, Any]:
  """Converts a torchvision DenseNet-121 ``state_dict`` to `models.DenseNet`.

  ``features.`` is dropped from the names, ``denselayer<k>`` becomes the
  0-based index ``k - 1`` and ``classifier.*`` (the head is trained anew) is
  dropped; see `_convert` for the rest. The old names of torchvision's file
  (``norm.1`` for ``norm1``) are renamed as torchvision renames them.

  Args:
    state_dict: torchvision names (e.g.
      ``features.denseblock1.denselayer1.norm1.weight``) to arrays.

  Returns:
    A nested dict shaped like the featurizer state of a 3-channel
    ``models.DenseNet``.

  Raises:
    ValueError: if the names or shapes do not match DenseNet-121.
  """
  state_dict = {_OLD_DENSELAYER_NAME.sub(r"\1\2.", name): value
                for name, value in state_dict.items()}
  return _convert(state_dict, _densenet_path,
                  lambda: models.DenseNet(3, rngs=nnx.Rngs(0)),
                  "the torchvision densenet121 state_dict")


def convert_torchvision(state_dict: Mapping[str, np.ndarray]) -> tuple[
    str, dict[str, Any]]:
  """Converts a torchvision ResNet-18/50 or DenseNet-121 ``state_dict``.

  Returns:
    The model's name in ``catalog.MODELS`` and the converted weights.
  """
  if any(name.startswith("features.denseblock") for name in state_dict):
    return "densenet121", convert_torchvision_densenet121(state_dict)
  depth = _infer_depth(state_dict)
  return f"resnet{depth}", convert_torchvision_state_dict(state_dict, depth)


def save_npz(tree: Mapping[Any, Any], path: str | os.PathLike) -> None:
  """Writes a nested dict of arrays (a converted state dict) to ``.npz``."""
  np.savez(path, **{k: np.asarray(v) for k, v in _flatten(tree).items()})


def save_featurizer(
    model: models.Classifier, directory: str | os.PathLike
) -> None:
  """Saves the featurizer's parameters and BN statistics with Orbax.

  Args:
    model: the model whose featurizer to save.
    directory: a directory that must not exist yet.
  """
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
      os.path.abspath(directory),
      nnx.to_pure_dict(_featurizer_state(model.featurizer)),
  )
  checkpointer.wait_until_finished()


def adapt_input_channels(kernel: np.ndarray, in_channels: int) -> np.ndarray:
  """Adapts an HWIO stem kernel to ``in_channels`` inputs, as DomainBed does.

  Input channel ``i`` takes the kernel of pretrained channel ``i % I`` (``I``
  = 3 for RGB), so e.g. an 8-band image sees the RGB filters cyclically.

  Args:
    kernel: ``(H, W, I, O)`` kernel.
    in_channels: the wanted number of input channels.

  Returns:
    The ``(H, W, in_channels, O)`` kernel.
  """
  return kernel[:, :, np.arange(in_channels) % kernel.shape[2], :]


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The named arrays of a ``.npz`` file.

  Raises:
    FileNotFoundError: there is no such file.
    ValueError: the file is not a ``.npz`` archive (say, a text file or a
      single ``.npy`` array).
  """
  try:
    loaded = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise
  except (OSError, ValueError, zipfile.BadZipFile):
    # numpy takes any other file for a pickle, which it refuses to load.
    raise ValueError(f"{os.fspath(path)!r} is not a .npz file of arrays "
                     "(not a zip archive)") from None
  if not isinstance(loaded, np.lib.npyio.NpzFile):
    raise ValueError(f"{os.fspath(path)!r} holds a single array (.npy), not "
                     "a .npz file of named arrays")
  with loaded:
    # numpy gives the bytes of a member that is not a .npy array.
    others = [name for name in loaded.zip.namelist()
              if not name.endswith(".npy")]
    if others:
      raise ValueError(f"{os.fspath(path)!r} is a zip archive of "
                       f"{', '.join(others[:3])}, not a .npz file of arrays")
    return {key: loaded[key] for key in loaded.files}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The tensors of a safetensors file (as timm publishes its weights).

  Raises:
    FileNotFoundError: there is no such file.
    ValueError: the file is not a whole safetensors file.
  """
  try:
    return safetensors.numpy.load_file(path)
  except safetensors.SafetensorError as e:
    raise ValueError(f"{os.fspath(path)!r} is damaged or not a safetensors "
                     f"file ({e})") from None


def _read_as_torch(path: str | os.PathLike) -> bool:
  """Whether to read ``path`` as a ``torch.save``'d file: it is one, or is
  named as one (a damaged one is then said to be a damaged PyTorch file)."""
  return os.path.isfile(path) and (torch_pickle.is_torch_file(path) or
                                   Path(path).suffix in _TORCH_SUFFIXES)


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray] | None:
  """The PyTorch-named state dict in ``path``, as published.

  A ``torch.save``'d file (torchvision's weights) is read by
  `torch_pickle.read_torch_state_dict`; a ``.safetensors`` file (timm's
  weights, whose ResNet names are torchvision's) by `read_safetensors`.

  Returns:
    Its names (``layer1.0.conv1.weight``) to arrays; None if ``path`` is
    neither (a ``.npz`` file, or an Orbax directory).

  Raises:
    ValueError: the file is damaged: see the readers.
  """
  if _read_as_torch(path):
    return torch_pickle.read_torch_state_dict(path)
  if os.path.isfile(path) and Path(path).suffix == _SAFETENSORS_SUFFIX:
    return read_safetensors(path)
  return None


def _read(path: str) -> dict[str, np.ndarray]:
  """Reads a ``.npz`` file or an Orbax directory into ``"a/b"``-keyed arrays."""
  if os.path.isdir(path):
    try:
      tree = ocp.StandardCheckpointer().restore(os.path.abspath(path))
    except (OSError, ValueError) as e:
      raise ValueError(f"{path!r} is a directory but not an Orbax checkpoint "
                       f"of featurizer weights ({e}). {_HOW_TO_GET_WEIGHTS}"
                       ) from None
    flat = _flatten(tree)
    # A saved nnx.State (rather than a pure dict) wraps each leaf in "value".
    return {k.removesuffix("/value"): np.asarray(v) for k, v in flat.items()}
  state_dict = read_state_dict(path)
  if state_dict is not None:
    _, converted = convert_torchvision(state_dict)
    return {key: np.asarray(v) for key, v in _flatten(converted).items()}
  try:
    arrays = read_npz(path)
  except ValueError as e:
    raise ValueError(f"{e}. {_HOW_TO_GET_WEIGHTS}") from None
  if any(key.split("/", 1)[0] in ("params", "stats") for key in arrays):
    raise ValueError(f"{path!r} holds a whole model's params (a run's "
                     "final_params.npz), not featurizer weights: pass it as "
                     "--init_params.")
  return arrays


def load_pretrained(model: models.Classifier, path: str | os.PathLike) -> None:
  """Loads featurizer weights into ``model`` in place; the head is untouched.

  Args:
    model: a model whose featurizer matches the weights (up to the number of
      input channels of the stem, see :func:`adapt_input_channels`).
    path: a torchvision ``.pth`` state dict, a converted ``.npz`` or a
      :func:`save_featurizer` directory.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: ``path`` is not a weights file, or its keys are missing,
      unexpected or misshapen (listed).
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"No pretrained weights at {path!r}. {_HOW_TO_GET_WEIGHTS}"
    )
  loaded = _read(path)
  state = _featurizer_state(model.featurizer)
  target = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  shapes = {"/".join(map(str, k)): v.shape for k, v in target.items()}
  stem, stem_shape = loaded.get(_STEM_KERNEL), shapes.get(_STEM_KERNEL)
  if stem is not None and stem_shape is not None:
    rgb_stem, in_channels = stem.shape[2] == 3, stem_shape[2]
    if rgb_stem and in_channels != 3:
      loaded[_STEM_KERNEL] = adapt_input_channels(stem, in_channels)
  _check_compatible(shapes, {k: v.shape for k, v in loaded.items()}, repr(path))
  values = {
      key: jnp.asarray(loaded["/".join(map(str, key))], dtype=leaf.dtype)
      for key, leaf in target.items()
  }
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(values))
  nnx.update(model.featurizer, state)


def _infer_depth(state_dict: Mapping[str, Any], sep: str = ".") -> int:
  """Finds the ResNet depth from the block counts of a torchvision state
  dict, or of converted weights (``sep="/"``)."""

  def num_blocks(stage: str) -> int:
    names = [k for k in state_dict if k.startswith(f"{stage}{sep}")]
    return 1 + max((int(k.split(sep)[1]) for k in names), default=-1)

  stage_sizes = tuple(num_blocks(s) for s in models.RESNET_STAGES)
  bottleneck = any(f"{sep}conv3{sep}" in k for k in state_dict)
  for depth, (block, sizes) in models.RESNET_SPECS.items():
    if sizes == stage_sizes and (block is models.Bottleneck) == bottleneck:
      return depth
  raise ValueError(
      f"Not a supported ResNet (stages {stage_sizes}); supported depths: "
      f"{sorted(models.RESNET_SPECS)}."
  )


# How the papers name the networks whose weights `_architecture` finds.
_FAMILY_NAMES = {"resnet": "ResNet", "densenet": "DenseNet"}


def _architecture(names: Collection[str]) -> str | None:
  """The model of ``catalog.MODELS`` that weights' ``names`` are of: a
  torchvision state dict's (``features/denseblock1/...``) or converted
  weights' (``layer1/0/conv1/kernel``), joined by ``/``; None if none that
  they name."""
  if any(part.startswith("denseblock") for name in names
         for part in name.split("/")[:2]):
    return "densenet121"
  if not any(name.startswith(f"{models.RESNET_STAGES[0]}/")
             for name in names):
    return None
  try:
    return f"resnet{_infer_depth(dict.fromkeys(names), sep='/')}"
  except ValueError:  # Not a ResNet of ours: the full check says more.
    return None


def _described(model: str) -> str:
  """``ResNet-50`` for ``resnet50``, ``DenseNet-121`` for ``densenet121``."""
  family, depth = re.fullmatch(r"([a-z]+?)(\d+)", model).groups()
  return f"{_FAMILY_NAMES[family]}-{depth}"


@dataclasses.dataclass(frozen=True)
class Weights:
  """Featurizer weights that a run starts from, checked.

  Attributes:
    path: the file (or Orbax directory).
    sha256: its `imagenet.sha256`, which tells any two files apart.
  """

  path: Path
  sha256: str

  def record(self) -> dict[str, str]:
    """What a run's config file says of them: the file's name and SHA-256."""
    return {"file": self.path.name, "sha256": self.sha256}


def checked_weights(pretrained: str | None, model: str) -> Weights | None:
  """The weights that ``--pretrained`` names for ``model``, read and checked
  before the model is built.

  Args:
    pretrained: the resolved flag (``config.Config.pretrained``): None or
      ``"none"`` for none, a name of `imagenet.PRETRAINED` (fetched first:
      `imagenet.fetch_imagenet`), or a path.
    model: the ``--model`` they are for.

  Returns:
    The weights' file and SHA-256; None for none.

  Raises:
    imagenet.WeightsUnavailableError: published weights cannot be fetched,
      or the cached file does not check.
    FileNotFoundError: there is no such file.
    ValueError: the file is not weights (a damaged or truncated file, or
      not a state dict), or they are another architecture's: the message
      says which.
  """
  if pretrained in (None, "none"):
    return None
  path = (imagenet.fetch_imagenet(model, pretrained)
          if pretrained in imagenet.PRETRAINED else Path(pretrained))
  state_dict = read_state_dict(path)
  if state_dict is not None:
    # Read, not converted: converting ResNet-50's weights takes a second
    # (their model's shapes are traced), which loading them spends again.
    names = [name.replace(".", "/") for name in state_dict]
  else:
    names = list(_read(os.fspath(path)))
  found = _architecture(names)
  if found is not None and found != model:
    raise ValueError(
        f"{path} holds {_described(found)} weights, and --model is {model}: "
        f"pass --model {found}, or weights of {model}.")
  return Weights(path, imagenet.sha256(path))
