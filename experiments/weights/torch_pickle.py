"""Reads PyTorch's ``torch.save`` files of state dicts without PyTorch.

`read_torch_state_dict` reads a ``.pth`` file (torchvision's ImageNet
weights, or any ``model.state_dict()``) into NumPy arrays and runs no code
from it. A file is a pickle of the ``state_dict`` (an ``OrderedDict`` of
tensors) whose tensors' data, their "storages", are kept outside the pickle:
in the zip archive's ``data/`` records (``torch.save``'s format since PyTorch
1.6), or after the pickle in the older "legacy" format
(torch/serialization.py, ``_legacy_load`` and ``_load``). The unpickler
builds NumPy arrays and refuses every global but the few that a state dict
names: `_ALLOWED_GLOBALS`.

This module needs NumPy alone: no PyTorch, JAX or Flax.
"""

import collections
from collections.abc import Mapping
import dataclasses
import os
import pickle
from typing import Any, BinaryIO
import zipfile

import numpy as np

# The legacy format's first three pickles: its magic number, protocol
# version and system information (torch/serialization.py, MAGIC_NUMBER and
# PROTOCOL_VERSION).
_LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001
# How a pickle (of protocol 2 or more) writes the magic number: LONG1, 10
# bytes, little-endian.
_LEGACY_HEAD = b"\x8a\x0a" + _LEGACY_MAGIC_NUMBER.to_bytes(10, "little")
# How a zip archive starts: its first local file header's signature. (Its
# end, which a truncated file lacks, is what zipfile reads first.)
_ZIP_HEAD = b"PK\x03\x04"
# torch's storage classes (torch.FloatStorage ...; torch.cuda.FloatStorage in
# files saved from a GPU) and the NumPy dtypes of their elements.
_STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32,
    "HalfStorage": np.float16, "LongStorage": np.int64,
    "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class UnsafeCheckpointError(ValueError):
  """A ``.pth`` file names something other than a state dict's tensors."""


@dataclasses.dataclass(frozen=True)
class _StorageType:
  """What the unpickler gives for ``torch.FloatStorage`` and the like."""

  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Storage:
  """A storage the pickle refers to: ``numel`` elements from element
  ``offset`` of the file's storage ``key``, read once the pickle is read."""

  key: str
  dtype: np.dtype
  offset: int
  numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """A tensor the pickle rebuilds: a strided view of a storage."""

  storage: _Storage
  offset: int
  shape: tuple[int, ...]
  strides: tuple[int, ...]

  def array(self, storages: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensor as torch.load gives it: a view of its storage's array.

    Raises:
      ValueError: the tensor reaches outside its storage.
    """
    if not isinstance(self.storage, _Storage):
      raise UnsafeCheckpointError("a tensor whose storage is "
                                  f"{type(self.storage).__name__}")
    data = storages[self.storage.key]
    start = self.storage.offset + self.offset
    end = self.storage.offset + self.storage.numel
    if len(self.shape) != len(self.strides) or min(
        (*self.shape, *self.strides, self.offset), default=0) < 0:
      raise ValueError(f"a tensor of shape {self.shape} and strides "
                       f"{self.strides}")
    # The last element it reads; an empty tensor reads none.
    last = start + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
    if 0 not in self.shape and not last < min(end, len(data)):
      raise ValueError(
          f"a tensor of shape {self.shape} and strides {self.strides} at "
          f"offset {self.offset} reaches past its storage of "
          f"{self.storage.numel} elements")
    # In bounds, as checked above.
    return np.lib.stride_tricks.as_strided(
        data[start:], shape=self.shape,
        strides=[s * data.itemsize for s in self.strides])


def _rebuild_tensor(storage, storage_offset, size, stride, *unused):
  """Stands for torch._utils._rebuild_tensor and _rebuild_tensor_v2, whose
  further arguments (requires_grad, hooks, metadata) do not matter here."""
  del unused
  return _Tensor(storage, int(storage_offset), tuple(map(int, size)),
                 tuple(map(int, stride)))


def _rebuild_parameter(data, *unused):
  """Stands for torch._utils._rebuild_parameter(data, requires_grad, hooks)."""
  del unused
  return data


# What a state dict's pickle names, and what stands for it here.
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{(module, name): _StorageType(np.dtype(dtype))
       for module in ("torch", "torch.cuda")
       for name, dtype in _STORAGE_DTYPES.items()},
}


class _StateDictUnpickler(pickle.Unpickler):
  """Unpickles a state dict, refusing every global but `_ALLOWED_GLOBALS`.

  Storages are recorded as `_Storage` and tensors as `_Tensor`; their data
  are read afterwards.
  """

  def __init__(self, file: BinaryIO, source: str, legacy: bool):
    # A file written by Python 2 holds its strings as byte strings, which
    # torch.load decodes as UTF-8 unless told otherwise (pytorch/pytorch at
    # 000a1a54, torch/serialization.py, load: pickle_load_args["encoding"]
    # = "utf-8"); so does this.
    super().__init__(file, encoding="utf-8")
    self.source = source
    self.legacy = legacy

  def find_class(self, module: str, name: str) -> Any:
    try:
      return _ALLOWED_GLOBALS[module, name]
    except KeyError:
      raise UnsafeCheckpointError(
          f"{self.source} refers to {module}.{name}, which a state dict of "
          "tensors does not hold; it is not read, since unpickling it could "
          "run any code.") from None

  def persistent_load(self, pid: Any) -> _Storage:
    # torch.save's persistent ids: ("storage", storage type, key, location,
    # numel), and in the legacy format a view's (key, offset, numel) last.
    if not (isinstance(pid, tuple) and pid[:1] == ("storage",)
            and len(pid) == (6 if self.legacy else 5)
            and isinstance(pid[1], _StorageType)):
      raise UnsafeCheckpointError(
          f"{self.source} holds a persistent id {pid!r:.80}, not a storage.")
    storage = _Storage(str(pid[2]), pid[1].dtype, 0, int(pid[4]))
    view = pid[5] if self.legacy else None
    if view is not None:
      _, offset, numel = view
      storage = dataclasses.replace(storage, offset=int(offset),
                                    numel=int(numel))
    return storage


def _state_dict_arrays(
    loaded: Any, storages: Mapping[str, np.ndarray], source: str
) -> dict[str, np.ndarray]:
  """The arrays of an unpickled state dict of `_Tensor` values.

  Args:
    loaded: the unpickled object.
    storages: the file's storages by key, as read (maybe read-only and
      big-endian).
    source: names the file in error messages.

  Returns:
    Its names to arrays that are views, as torch.load's tensors are, of
    writeable native-endian copies of the storages.

  Raises:
    ValueError: ``loaded`` is not a state dict, or a tensor reaches out of
      its storage or has no storage in the file.
  """
  storages = {key: data.astype(data.dtype.newbyteorder("="))
              for key, data in storages.items()}
  if not isinstance(loaded, dict) or not all(
      isinstance(k, str) and isinstance(v, _Tensor)
      for k, v in loaded.items()):
    raise ValueError(f"{source} is not a state dict (a dict of tensors by "
                     "name); save model.state_dict().")
  try:
    return {name: tensor.array(storages) for name, tensor in loaded.items()}
  except KeyError as e:
    raise ValueError(f"{source} has no data for storage {e}") from None
  except ValueError as e:
    raise ValueError(f"{source} is damaged: {e}") from None


def _read_zip_state_dict(path: str) -> dict[str, np.ndarray]:
  """Reads torch.save's zip format: ``<folder>/data.pkl`` and the storages
  in ``<folder>/data/<key>``."""
  with zipfile.ZipFile(path) as archive:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    if len(pickles) != 1:
      raise ValueError(f"{path!r} is a zip archive but not a PyTorch file "
                       "(no one <folder>/data.pkl in it)")
    folder = pickles[0].removesuffix("data.pkl")
    byteorder = "little"
    if f"{folder}byteorder" in archive.namelist():
      byteorder = archive.read(f"{folder}byteorder").decode()
    with archive.open(pickles[0]) as file:
      loaded = _StateDictUnpickler(file, repr(path), legacy=False).load()
    keys = {tensor.storage.key: tensor.storage.dtype
            for tensor in (loaded.values() if isinstance(loaded, dict)
                           else ()) if isinstance(tensor, _Tensor)}
    storages = {}
    for key, dtype in keys.items():
      name = f"{folder}data/{key}"
      if name not in archive.namelist():
        continue  # Reported as missing data by _state_dict_arrays.
      dtype = dtype.newbyteorder("<" if byteorder == "little" else ">")
      raw = archive.read(name)
      storages[key] = np.frombuffer(raw, dtype, len(raw) // dtype.itemsize)
  return _state_dict_arrays(loaded, storages, repr(path))


def _read_legacy_state_dict(path: str) -> dict[str, np.ndarray]:
  """Reads the format before PyTorch 1.6: pickles of the magic number, the
  protocol version, system information, the object and its storage keys,
  then each storage as its element count (int64) and its bytes."""
  with open(path, "rb") as file:
    header = []
    for _ in range(3):
      try:
        header.append(_StateDictUnpickler(file, repr(path), True).load())
      except (pickle.UnpicklingError, EOFError, ValueError):
        header.append(None)
        break
    if header[0] != _LEGACY_MAGIC_NUMBER:
      raise ValueError(f"{path!r} is not a PyTorch file (neither a zip "
                       "archive nor the legacy format's magic number)")
    if header[1] != _LEGACY_PROTOCOL_VERSION or not isinstance(
        header[2], dict):
      raise ValueError(f"{path!r} is a PyTorch file of protocol version "
                       f"{header[1]}, not {_LEGACY_PROTOCOL_VERSION}")
    byteorder = "<" if header[2].get("little_endian", True) else ">"
    loaded = _StateDictUnpickler(file, repr(path), legacy=True).load()
    keys = _StateDictUnpickler(file, repr(path), legacy=True).load()
    if not isinstance(keys, list):
      raise ValueError(f"{path!r} lists its storages as {type(keys)}")
    dtypes = {tensor.storage.key: tensor.storage.dtype
              for tensor in (loaded.values() if isinstance(loaded, dict)
                             else ()) if isinstance(tensor, _Tensor)}
    storages = {}
    for key in keys:
      if key not in dtypes:
        raise ValueError(f"{path!r} holds storage {key!r}, which no tensor "
                         "uses")
      dtype = dtypes[key].newbyteorder(byteorder)
      numel = int(np.frombuffer(file.read(8), byteorder + "i8")[0])
      raw = file.read(numel * dtype.itemsize)
      if len(raw) != numel * dtype.itemsize:
        raise ValueError(f"{path!r} is truncated (storage {key!r})")
      storages[str(key)] = np.frombuffer(raw, dtype)
  return _state_dict_arrays(loaded, storages, repr(path))


def is_torch_file(path: str | os.PathLike) -> bool:
  """Whether ``path`` is in one of ``torch.save``'s formats (by its first
  bytes or its zip records; ``.npz`` files are zip archives too)."""
  with open(path, "rb") as file:
    head = file.read(len(_LEGACY_HEAD) + 2)
  if zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as archive:
      return any(n.endswith("/data.pkl") for n in archive.namelist())
  # A pickle's protocol opcode (2 bytes), then the magic number.
  return head[2:] == _LEGACY_HEAD


def read_torch_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The tensors of a ``torch.save``'d state dict, as NumPy arrays.

  Reads both of ``torch.save``'s formats (the zip archive, and the legacy
  one of files saved before PyTorch 1.6) without PyTorch, and runs no code
  from the file: see the module docstring.

  Args:
    path: a ``.pth`` file of a ``state_dict``, e.g. torchvision's.

  Returns:
    The state dict's names, as in the file (``num_batches_tracked``
    included), to arrays with its tensors' dtypes, shapes and values; a
    non-contiguous tensor keeps the order of its strides.

  Raises:
    FileNotFoundError: there is no such file.
    UnsafeCheckpointError: the pickle names anything but a state dict's
      tensors (e.g. a function to call).
    ValueError: the file is not a PyTorch file of a state dict, or is
      damaged.
  """
  path = os.fspath(path)
  try:
    if zipfile.is_zipfile(path):
      return _read_zip_state_dict(path)
    with open(path, "rb") as file:
      if file.read(len(_ZIP_HEAD)) == _ZIP_HEAD:
        raise ValueError(
            f"{path!r} is truncated or damaged: it starts as a zip archive "
            "(torch.save's format) but has no end of one")
    return _read_legacy_state_dict(path)
  except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile,
          UnicodeDecodeError,  # A Python 2 byte string that is not UTF-8.
          TypeError) as e:  # TypeError: a rebuild's arguments were wrong.
    raise ValueError(f"{path!r} is damaged or not a PyTorch file ({e})"
                     ) from None
