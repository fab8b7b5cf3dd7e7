"""Writes the PyTorch fixtures of tests/experiments/weights/test_torch_pickle.py.

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

No PyTorch of today writes what torchvision's files of 2017 (such as
``densenet121-a639ec97.pth``) may hold, so one more fixture is written by
hand, without PyTorch, by

    python tests/data/make_torch_state_dicts.py --2017 tests/data

* ``basic_block_2017.pth``: the same tensors (views as contiguous copies),
  in the legacy format as Python 2 pickled it, with storages saved from a
  GPU (``torch.cuda.FloatStorage`` at ``cuda:0``) and tensors pickled by
  ``torch._utils._rebuild_tensor`` (PyTorch < 0.4); see
  tests/experiments/torch_writer.py, which writes it from
  ``basic_block_expected.npz``.
"""

import sys
from pathlib import Path

import numpy as np


def state_dict():
  """A trained-mode BasicBlock's state dict, with three views added."""
  # pylint: disable=import-outside-toplevel
  import torch
  from torchvision.models import resnet
  torch.manual_seed(0)
  block = resnet.BasicBlock(4, 4)
  block.train()
  block(torch.randn(2, 4, 5, 5))
  tensors = block.state_dict()
  tensors["views.transposed"] = tensors["conv1.weight"].transpose(0, 1)
  tensors["views.offset"] = tensors["bn1.running_mean"][1:]
  tensors["views.strided"] = tensors["conv2.weight"][:, ::2, 1]
  return tensors


def write_torch_fixtures(out: Path) -> None:
  """Writes the files that PyTorch writes, and what torch.load reads."""
  import torch  # pylint: disable=import-outside-toplevel
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


def write_2017_fixture(out: Path) -> None:
  """Writes ``basic_block_2017.pth`` by hand from the expected tensors."""
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
  import torch_writer  # pylint: disable=import-outside-toplevel
  with np.load(out / "basic_block_expected.npz") as npz:
    tensors = {k: npz[k] for k in npz.files if not k.startswith("strides/")}
  torch_writer.write_state_dict(
      out / "basic_block_2017.pth", tensors, legacy=True, python2=True,
      location="cuda:0", rebuild="_rebuild_tensor")


if __name__ == "__main__":
  if sys.argv[1] == "--2017":
    write_2017_fixture(Path(sys.argv[2]))
  else:
    write_torch_fixtures(Path(sys.argv[1]))
