"""Writes the PyTorch fixtures of tests/experiments/test_pretrained.py; needs
PyTorch.

The project never imports PyTorch: these files were written once, with
torch 2.14.1 and torchvision 0.29.1 (CPU), by

    python tests/data/make_torch_state_dicts.py tests/data

in a separate environment (``pip install torch torchvision``), and are
committed. They hold the state dict of a real torchvision module, a
``BasicBlock`` of 4 channels after one forward pass in training mode (so
that its BatchNorm statistics and ``num_batches_tracked`` moved), and three
tensors that share its storages the way views do: a transposed kernel
(non-contiguous), a slice at a storage offset and a strided slice. They are
saved in both of ``torch.save``'s formats:

* ``basic_block.pth``: the zip archive (PyTorch >= 1.6, the default);
* ``basic_block_legacy.pth``: the legacy format
  (``_use_new_zipfile_serialization=False``), which files saved before
  PyTorch 1.6 are in;

and ``basic_block_expected.npz`` holds what ``torch.load`` returns for them:
each tensor's values under its name, and its strides (in elements) under
``strides/<name>``.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from torchvision.models import resnet


def state_dict() -> dict[str, torch.Tensor]:
  """A trained-mode BasicBlock's state dict, with three views added."""
  torch.manual_seed(0)
  block = resnet.BasicBlock(4, 4)
  block.train()
  block(torch.randn(2, 4, 5, 5))
  tensors = block.state_dict()
  tensors["views.transposed"] = tensors["conv1.weight"].transpose(0, 1)
  tensors["views.offset"] = tensors["bn1.running_mean"][1:]
  tensors["views.strided"] = tensors["conv2.weight"][:, ::2, 1]
  return tensors


def main(out_dir: str) -> None:
  out = Path(out_dir)
  tensors = state_dict()
  assert not tensors["views.transposed"].is_contiguous()
  assert not tensors["views.strided"].is_contiguous()
  torch.save(tensors, out / "basic_block.pth")
  torch.save(tensors, out / "basic_block_legacy.pth",
             _use_new_zipfile_serialization=False)
  expected = {}
  for file in ("basic_block.pth", "basic_block_legacy.pth"):
    loaded = torch.load(out / file, weights_only=True)
    assert list(loaded) == list(tensors)
    for name, tensor in loaded.items():
      assert torch.equal(tensor, tensors[name]), (file, name)
      assert tensor.stride() == tensors[name].stride(), (file, name)
      expected[name] = tensor.numpy()
      expected[f"strides/{name}"] = np.array(tensor.stride(), np.int64)
  np.savez(out / "basic_block_expected.npz", **expected)


if __name__ == "__main__":
  main(sys.argv[1])
