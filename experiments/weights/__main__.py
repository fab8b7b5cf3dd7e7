"""Fetches ImageNet weights into the cache, or converts a ``.pth`` to ``.npz``.

``python -m experiments.weights fetch resnet50`` downloads torchvision's
ImageNet weights of a model into the cache (as ``--pretrained imagenet``
does, replacing a cached file that does not check) and prints their path;
``--weights imagenet_augmix`` fetches timm's AugMix ResNet-50 instead.
``python -m experiments.weights convert --in resnet50.pth --out
resnet50.npz`` converts a torchvision state dict (or timm's
``.safetensors``) to the featurizer's ``.npz``. Neither needs PyTorch.
"""

import argparse
import sys

from experiments import catalog
from experiments.weights import convert
from experiments.weights import imagenet
from experiments.weights import torch_pickle


def _convert_command(args: argparse.Namespace) -> int:
  try:
    state_dict = convert.read_state_dict(args.input)
    if state_dict is None:  # Read as PyTorch's, which says what it is not.
      state_dict = torch_pickle.read_torch_state_dict(args.input)
  except (OSError, ValueError) as e:  # The readers' messages name the file.
    print(e, file=sys.stderr)
    return 2
  try:
    name, converted = convert.convert_torchvision(state_dict)
  except ValueError as e:
    print(f"{args.input}: {e}", file=sys.stderr)
    return 2
  convert.save_npz(converted, args.output)
  print(f"Wrote {name} featurizer weights to {args.output}.")
  return 0


def _fetch_command(args: argparse.Namespace) -> int:
  try:
    path = imagenet.fetch_imagenet(args.model, args.weights,
                                   replace_damaged=True)
  except (OSError, ValueError) as e:
    print(e, file=sys.stderr)
    return 2
  print(path)
  return 0


def main(argv: list[str] | None = None) -> int:
  """Command-line entry point; see the module docstring."""
  parser = argparse.ArgumentParser(prog="python -m experiments.weights")
  commands = parser.add_subparsers(dest="command", required=True)
  convert_parser = commands.add_parser(
      "convert", help="convert a torchvision ResNet or DenseNet-121 "
      "state_dict (.pth, or timm's .safetensors) to .npz"
  )
  convert_parser.add_argument("--in", dest="input", required=True,
                              help="input .pth or .safetensors")
  convert_parser.add_argument("--out", dest="output", required=True,
                              help="output .npz")
  convert_parser.set_defaults(run=_convert_command)
  fetch_parser = commands.add_parser(
      "fetch", help="download torchvision's ImageNet weights of a model to "
      "the cache (as --pretrained imagenet does) and print their path")
  fetch_parser.add_argument("model", choices=[
      name for name, entry in catalog.MODELS.items()
      if entry.imagenet_weights])
  fetch_parser.add_argument(
      "--weights", choices=list(imagenet.PRETRAINED), default="imagenet",
      help="which: torchvision's (imagenet, the default) or timm's AugMix "
      "ResNet-50 (imagenet_augmix)")
  fetch_parser.set_defaults(run=_fetch_command)
  args = parser.parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
