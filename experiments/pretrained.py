"""ImageNet-pretrained featurizer weights, loaded from a local file.

Nothing is downloaded. Two formats are accepted by :func:`load_pretrained`:

* a ``.npz`` converted from a torchvision ``state_dict``. To make one, on a
  machine with PyTorch and torchvision, save the weights in Python::

    import torch, torchvision
    net = torchvision.models.resnet50(weights="IMAGENET1K_V1")
    # Or resnet18, or densenet121 (FMoW's network in WILDS).
    torch.save(net.state_dict(), "resnet50.pth")

  then convert them (still where PyTorch is installed)::

    python -m experiments.pretrained convert --in resnet50.pth --out resnet50.npz

* an Orbax checkpoint directory of a featurizer's parameters and BatchNorm
  statistics, as written by :func:`save_featurizer`.

Both hold a flat mapping from paths such as ``layer1/0/conv1/kernel`` (the
featurizer's NNX state path, joined by ``/``) to arrays.

A ResNet with ``C != 3`` input channels gets an RGB stem adapted by
:func:`adapt_input_channels`, following DomainBed: input channel ``i`` takes
the pretrained kernel of RGB channel ``i % 3``. (WILDS's PovertyMap baseline
does not start from RGB weights: its 8-channel ResNet-18 is trained from a
Kaiming-normal initialisation, which is also what ``resnet18`` without
``--pretrained`` gives; see ``experiments.wilds``.)
"""

import argparse
from collections.abc import Callable, Mapping
import os
import sys
from typing import Any
import zipfile

from flax import nnx
from flax import traverse_util
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from experiments import models

_STEM_KERNEL = "conv1/kernel"
# torchvision leaf name -> NNX name, for 1-D tensors (BatchNorm). 4-D ``weight``
# tensors are conv kernels.
_BN_NAMES = {
    "weight": "scale",
    "bias": "bias",
    "running_mean": "mean",
    "running_var": "var",
}
_HOW_TO_GET_WEIGHTS = (
    "Pretrained weights are read from a local file only. On a machine with "
    "PyTorch and torchvision, save torchvision.models.resnet50("
    "weights='IMAGENET1K_V1').state_dict() (or resnet18) with torch.save, then "
    "run `python -m experiments.pretrained convert --in resnet50.pth --out "
    "resnet50.npz` and pass the .npz path."
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
  dropped; see `_convert` for the rest.

  Args:
    state_dict: torchvision names (e.g.
      ``features.denseblock1.denselayer1.norm1.weight``) to arrays.

  Returns:
    A nested dict shaped like the featurizer state of a 3-channel
    ``models.DenseNet``.

  Raises:
    ValueError: if the names or shapes do not match DenseNet-121.
  """
  return _convert(state_dict, _densenet_path,
                  lambda: models.DenseNet(3, rngs=nnx.Rngs(0)),
                  "the torchvision densenet121 state_dict")


def convert_torchvision(state_dict: Mapping[str, np.ndarray]) -> tuple[
    str, dict[str, Any]]:
  """Converts a torchvision ResNet-18/50 or DenseNet-121 ``state_dict``.

  Returns:
    The model's name in ``models.MODELS`` and the converted weights.
  """
  if any(name.startswith("features.denseblock") for name in state_dict):
    return "densenet121", convert_torchvision_densenet121(state_dict)
  depth = _infer_depth(state_dict)
  return f"resnet{depth}", convert_torchvision_state_dict(state_dict, depth)


def save_npz(tree: Mapping[Any, Any], path: str | os.PathLike) -> None:
  """Writes a nested dict of arrays (e.g. a converted state dict) to ``.npz``."""
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
    return {key: loaded[key] for key in loaded.files}


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
  if path.endswith((".pth", ".pt")):
    raise ValueError(
        f"{path!r} is a PyTorch file; convert it to .npz first with "
        "`python -m experiments.pretrained convert`."
    )
  try:
    return read_npz(path)
  except ValueError as e:
    raise ValueError(f"{e}; pretrained weights are a .npz file or an Orbax "
                     f"directory. {_HOW_TO_GET_WEIGHTS}") from None


def load_pretrained(model: models.Classifier, path: str | os.PathLike) -> None:
  """Loads featurizer weights into ``model`` in place; the head is untouched.

  Args:
    model: a model whose featurizer matches the weights (up to the number of
      input channels of the stem, see :func:`adapt_input_channels`).
    path: a converted torchvision ``.npz`` or a :func:`save_featurizer`
      directory.

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


def _infer_depth(state_dict: Mapping[str, Any]) -> int:
  """Finds the ResNet depth from the block counts of a torchvision state dict."""

  def num_blocks(stage: str) -> int:
    names = [k for k in state_dict if k.startswith(f"{stage}.")]
    return 1 + max((int(k.split(".")[1]) for k in names), default=-1)

  stage_sizes = tuple(num_blocks(s) for s in models.RESNET_STAGES)
  bottleneck = any(k.endswith(".conv3.weight") for k in state_dict)
  for depth, (block, sizes) in models.RESNET_SPECS.items():
    if sizes == stage_sizes and (block is models.Bottleneck) == bottleneck:
      return depth
  raise ValueError(
      f"Not a supported ResNet (stages {stage_sizes}); supported depths: "
      f"{sorted(models.RESNET_SPECS)}."
  )


def _convert_command(args: argparse.Namespace) -> int:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    print(
        "Converting a .pth file needs PyTorch, which is not installed here. "
        "Run this command on a machine with PyTorch (no GPU needed) and copy "
        "the resulting .npz here.",
        file=sys.stderr,
    )
    return 1
  state_dict = torch.load(args.input, map_location="cpu", weights_only=True)
  arrays = {k: v.detach().cpu().numpy() for k, v in state_dict.items()}
  name, converted = convert_torchvision(arrays)
  save_npz(converted, args.output)
  print(f"Wrote {name} featurizer weights to {args.output}.")
  return 0


def main(argv: list[str] | None = None) -> int:
  """Command-line entry point; see the module docstring."""
  parser = argparse.ArgumentParser(prog="python -m experiments.pretrained")
  commands = parser.add_subparsers(dest="command", required=True)
  convert = commands.add_parser(
      "convert", help="convert a torchvision ResNet or DenseNet-121 "
      "state_dict (.pth) to .npz"
  )
  convert.add_argument("--in", dest="input", required=True, help="input .pth")
  convert.add_argument("--out", dest="output", required=True, help="output .npz")
  convert.set_defaults(run=_convert_command)
  args = parser.parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
