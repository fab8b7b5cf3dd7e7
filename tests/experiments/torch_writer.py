"""Writes NumPy arrays as a ``torch.save``'d state dict, without PyTorch.

The tests need torchvision-shaped ``.pth`` files of full-size networks,
too big to commit, and files as old PyTorch versions wrote them, which no
current PyTorch writes: this writes both. By default a file is in
``torch.save``'s zip format (a ``data.pkl`` pickle whose tensors are
``torch._utils._rebuild_tensor_v2`` calls on persistent storages, and each
storage's bytes in ``data/<key>``); the options write what torchvision's
files of 2017 (``densenet121-a639ec97.pth``) may hold instead:

* ``legacy``: the format before PyTorch 1.6 (torch/serialization.py,
  ``_legacy_save``): pickles of the magic number, the protocol version and
  system information, then the state dict, then its sorted storage keys,
  then each storage as its element count (int64) and its bytes;
* ``python2``: the pickles as Python 2 wrote them: strings as byte strings
  (``SHORT_BINSTRING``, ``BINSTRING``) and the ``OrderedDict`` as Python 2
  reduces it, a call on a list of ``[key, value]`` pairs;
* ``location="cuda:0"``: storages saved from a GPU, ``torch.cuda``'s
  storage classes at that location;
* ``rebuild="_rebuild_tensor"``: tensors as torch < 0.4 pickled them,
  ``torch._utils._rebuild_tensor(storage, offset, size, stride)``.

What ``experiments.weights.torch_pickle.read_torch_state_dict`` reads is checked on
files that PyTorch itself wrote (tests/data/); this writer is checked by
reading its files back.
"""

import collections
import io
import pickle
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# torch's storage classes by NumPy dtype.
_STORAGE_TYPES = {np.dtype(np.float32): "FloatStorage",
                  np.dtype(np.float64): "DoubleStorage",
                  np.dtype(np.int64): "LongStorage"}
# torch/serialization.py: MAGIC_NUMBER and PROTOCOL_VERSION of the legacy
# format.
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL_VERSION = 1001
# What torch < 0.4 and torch >= 0.4 name their tensors' rebuild function.
REBUILDS = ("_rebuild_tensor", "_rebuild_tensor_v2")


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


def _save_python2_str(pickler: pickle._Pickler, text: str) -> None:
  """Writes ``text`` as Python 2 wrote a ``str``: a byte string."""
  data = text.encode("latin-1")
  if len(data) < 256:
    pickler.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
  else:
    pickler.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
  pickler.memoize(text)


class _Pickler(pickle._Pickler):  # The Python one, whose globals it writes.
  """Pickles a state dict of `np.ndarray` as torch.save does.

  Attributes:
    keys: each array's storage key, by the array's id.
    location: where its storages were, ``"cpu"`` or ``"cuda:<i>"``.
    legacy: whether the persistent ids are the legacy format's.
    rebuild: the tensors' rebuild function, one of `REBUILDS`.
    python2: whether to write strings and ``OrderedDict`` as Python 2 did.
  """

  def __init__(self, file, *, keys=None, location="cpu", legacy=False,
               rebuild="_rebuild_tensor_v2", python2=False):
    super().__init__(file, protocol=2)
    self.keys, self.location, self.legacy = keys or {}, location, legacy
    self.rebuild, self.python2 = rebuild, python2
    if python2:
      self.dispatch = {**pickle._Pickler.dispatch, str: _save_python2_str}

  def persistent_id(self, obj):
    if isinstance(obj, _Tensor):
      module = "torch" if self.location == "cpu" else "torch.cuda"
      pid = ("storage", _Global(module, _STORAGE_TYPES[obj.array.dtype]),
             obj.key, self.location, obj.array.size)
      return pid + (None,) if self.legacy else pid  # No view.
    return None

  def reducer_override(self, obj):
    if isinstance(obj, _Global):
      return obj.name  # A name: pickled by save_global, below.
    if isinstance(obj, np.ndarray):
      strides = tuple(s // obj.itemsize for s in obj.strides)
      args = (_Tensor(self.keys[id(obj)], obj), 0, obj.shape, strides)
      if self.rebuild == "_rebuild_tensor_v2":
        args += (False, collections.OrderedDict())
      return _Global("torch._utils", self.rebuild), args
    if self.python2 and type(obj) is collections.OrderedDict:
      # Python 2's OrderedDict.__reduce__.
      return collections.OrderedDict, ([[k, v] for k, v in obj.items()],)
    return NotImplemented

  def save_global(self, obj, name=None):
    if isinstance(obj, _Global):
      self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
      return
    super().save_global(obj, name)


def _pickle(obj, **options) -> bytes:
  buffer = io.BytesIO()
  _Pickler(buffer, **options).dump(obj)
  return buffer.getvalue()


def write_state_dict(path: Path, arrays: Mapping[str, np.ndarray], *,
                     legacy: bool = False, python2: bool = False,
                     location: str = "cpu",
                     rebuild: str = "_rebuild_tensor_v2") -> None:
  """Writes ``arrays`` as torch.save writes a state dict of tensors.

  Args:
    path: the ``.pth`` file to write.
    arrays: names to float32, float64 or int64 arrays.
    legacy: write the legacy format rather than the zip archive.
    python2: write the pickles as Python 2 did (with ``legacy``).
    location: where the storages are said to have been saved from.
    rebuild: the tensors' rebuild function, one of `REBUILDS`.
  """
  if python2 and not legacy:
    raise ValueError("Python 2's PyTorch wrote the legacy format only")
  # (np.ascontiguousarray would make 0-d arrays 1-d.)
  contiguous = {name: np.array(a, order="C") for name, a in arrays.items()}
  keys = {id(a): str(i) for i, a in enumerate(contiguous.values())}
  options = dict(keys=keys, location=location, legacy=legacy,
                 rebuild=rebuild, python2=python2)
  state_dict = _pickle(collections.OrderedDict(contiguous), **options)
  little = lambda a: a.astype(a.dtype.newbyteorder("<")).tobytes()
  if not legacy:
    with zipfile.ZipFile(path, "w") as archive:
      archive.writestr("archive/data.pkl", state_dict)
      archive.writestr("archive/byteorder", "little")
      for array in contiguous.values():
        archive.writestr(f"archive/data/{keys[id(array)]}", little(array))
      archive.writestr("archive/version", "3\n")
    return
  system = {"protocol_version": LEGACY_PROTOCOL_VERSION,
            "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
  by_key = {keys[id(a)]: a for a in contiguous.values()}
  with open(path, "wb") as file:
    for header in (LEGACY_MAGIC_NUMBER, LEGACY_PROTOCOL_VERSION, system):
      file.write(_pickle(header, python2=python2))
    file.write(state_dict)
    file.write(_pickle(sorted(by_key), python2=python2))
    for key in sorted(by_key):
      file.write(struct.pack("<q", by_key[key].size) + little(by_key[key]))
