"""Writes NumPy arrays as a ``torch.save``'d state dict, without PyTorch.

The tests need torchvision-shaped ``.pth`` files of full-size networks,
too big to commit: this writes them in ``torch.save``'s zip format (a
``data.pkl`` pickle whose tensors are ``torch._utils._rebuild_tensor_v2``
calls on persistent storages, and each storage's bytes in ``data/<key>``).
What ``experiments.pretrained.read_torch_state_dict`` reads is checked on
files that PyTorch itself wrote (tests/data/); this writer is checked by
reading its files back.
"""

import collections
import io
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# torch's storage classes by NumPy dtype.
_STORAGE_TYPES = {np.dtype(np.float32): "FloatStorage",
                  np.dtype(np.float64): "DoubleStorage",
                  np.dtype(np.int64): "LongStorage"}


class _Global:
  """A global of torch's that the pickle names, e.g. ``torch.FloatStorage``.

  Callable only so that the pickler accepts it as a reduce function.
  """

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def __call__(self, *args):
    raise NotImplementedError


class _Tensor:

  def __init__(self, key: str, array: np.ndarray):
    self.key, self.array = key, array


class _Pickler(pickle._Pickler):  # The Python one, whose globals it writes.

  def persistent_id(self, obj):
    if isinstance(obj, _Tensor):
      return ("storage", _Global("torch", _STORAGE_TYPES[obj.array.dtype]),
              obj.key, "cpu", obj.array.size)
    return None

  def reducer_override(self, obj):
    if isinstance(obj, _Global):
      return obj.name  # A name: pickled by save_global, below.
    if isinstance(obj, np.ndarray):
      strides = [s // obj.itemsize for s in obj.strides]
      return (_Global("torch._utils", "_rebuild_tensor_v2"),
              (_Tensor(self.keys[id(obj)], obj), 0, obj.shape, strides,
               False, collections.OrderedDict()))
    return NotImplemented

  def save_global(self, obj, name=None):
    if isinstance(obj, _Global):
      self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
      return
    super().save_global(obj, name)


def write_state_dict(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
  """Writes ``arrays`` as torch.save writes a state dict of tensors.

  Args:
    path: the ``.pth`` file to write.
    arrays: names to float32, float64 or int64 arrays.
  """
  # (np.ascontiguousarray would make 0-d arrays 1-d.)
  contiguous = {name: np.array(a, order="C") for name, a in arrays.items()}
  buffer = io.BytesIO()
  pickler = _Pickler(buffer, protocol=2)
  pickler.keys = {id(a): str(i) for i, a in enumerate(contiguous.values())}
  pickler.dump(collections.OrderedDict(contiguous))
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("archive/data.pkl", buffer.getvalue())
    archive.writestr("archive/byteorder", "little")
    for array in contiguous.values():
      archive.writestr(f"archive/data/{pickler.keys[id(array)]}",
                       array.astype(array.dtype.newbyteorder("<")).tobytes())
    archive.writestr("archive/version", "3\n")
