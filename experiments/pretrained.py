"""ImageNet-pretrained featurizer weights: torchvision's, or a local file.

``--pretrained`` takes one of:

* ``imagenet``: torchvision's ``IMAGENET1K_V1`` weights of the model
  (`catalog.ModelEntry.imagenet_weights`: ``resnet18-f37072fd.pth``,
  ``resnet50-0676ba61.pth``, ``densenet121-a639ec97.pth``), the files that
  ``torchvision.models.resnet50(weights="IMAGENET1K_V1")`` downloads.
  `fetch_imagenet` downloads a file once from torchvision's URL into the
  cache directory `weights_dir`, and checks it as ``torch.hub`` does, on
  download and on every use: the hexadecimal digits after the ``-`` in the
  file name start the SHA-256 of the file. Two environment variables change
  where they come from and go: ``PGRAD_JAX_WEIGHTS_URL`` (default
  `TORCHVISION_URL`; a ``file://`` URL or a path names a folder on a shared
  disk) and ``PGRAD_JAX_WEIGHTS_DIR``.
* a PyTorch ``.pth`` file of a torchvision ``state_dict``, read by
  `read_torch_state_dict` without PyTorch;
* a ``.npz`` converted from one (``python -m experiments.pretrained convert
  --in resnet50.pth --out resnet50.npz``, which does not need PyTorch
  either);
* an Orbax checkpoint directory of a featurizer's parameters and BatchNorm
  statistics, as written by :func:`save_featurizer`.

The last two hold a flat mapping from paths such as ``layer1/0/conv1/kernel``
(the featurizer's NNX state path, joined by ``/``) to arrays.

A run checks its weights before it builds its model (`checked_weights`):
ImageNet's are fetched and checked, any file is read whole, and weights of
another architecture than ``--model``'s are named as such. Its config file
records their file name and SHA-256 (`sha256`), which tells any two apart.

A ResNet with ``C != 3`` input channels gets an RGB stem adapted by
:func:`adapt_input_channels`, following DomainBed: input channel ``i`` takes
the pretrained kernel of RGB channel ``i % 3``. (WILDS's PovertyMap baseline
does not start from RGB weights: its 8-channel ResNet-18 is trained from a
Kaiming-normal initialisation, which is also what ``resnet18`` without
``--pretrained`` gives; see ``experiments.data.wilds``.)

Reading a ``.pth`` file runs no code from it. A file is a pickle of the
``state_dict`` (an ``OrderedDict`` of tensors) whose tensors' data, their
"storages", are kept outside the pickle: in the zip archive's ``data/``
records (``torch.save``'s format since PyTorch 1.6), or after the pickle in
the older "legacy" format (torch/serialization.py, ``_legacy_load`` and
``_load``). The unpickler builds NumPy arrays and refuses every global but
the few that a state dict names: `_ALLOWED_GLOBALS`.
"""

import argparse
import collections
from collections.abc import Callable, Collection, Mapping
import dataclasses
import hashlib
import os
from pathlib import Path
import pickle
import re
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
from typing import Any, BinaryIO
import zipfile

from flax import nnx
from flax import traverse_util
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pooch

from experiments import catalog
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
# What files are read as torch.save's whatever their first bytes, so that a
# damaged one is said to be a damaged PyTorch file.
_TORCH_SUFFIXES = (".pth", ".pt")
_HOW_TO_GET_WEIGHTS = (
    "Pass --pretrained imagenet for torchvision's IMAGENET1K_V1 weights "
    "(downloaded once), a .pth file of a torchvision state_dict, a .npz "
    "converted from one (python -m experiments.pretrained convert), or an "
    "Orbax directory of featurizer weights."
)


# ----------------------------------------------------------------------------
# Reading PyTorch files without PyTorch.

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


# ----------------------------------------------------------------------------
# torchvision's ImageNet weights.

# Where torchvision's weights are (torchvision/models/resnet.py and
# densenet.py, the IMAGENET1K_V1 entries).
TORCHVISION_URL = "https://download.pytorch.org/models"
URL_VARIABLE = "PGRAD_JAX_WEIGHTS_URL"
DIR_VARIABLE = "PGRAD_JAX_WEIGHTS_DIR"


# Bytes read from an HTTP connection at a time. pooch's default, 1 KiB, is a
# Python loop turn and a progress bar update per KiB: downloading ResNet-50's
# 100 MB from a server on the same machine took 1.9 s of CPU (the server's
# included), and 0.35 s with 256 KiB, which still updates the bar hundreds
# of times per file.
_DOWNLOAD_CHUNK = 256 * 1024


class WeightsUnavailableError(OSError):
  """ImageNet weights are neither cached nor downloadable, or the cached
  file is damaged; says how to fix."""


def _downloader(url: str) -> pooch.HTTPDownloader | None:
  """pooch's downloader of ``url``: HTTP(S) in `_DOWNLOAD_CHUNK` reads, with
  a progress bar; None (pooch's choice, by the URL's scheme) otherwise."""
  if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
    return None
  return pooch.HTTPDownloader(progressbar=True, chunk_size=_DOWNLOAD_CHUNK)


def _local_source(url: str) -> str | None:
  """The path that ``url`` names on this machine: a ``file://`` URL's, or
  ``url`` itself if it has no scheme; None for a URL to download."""
  parts = urllib.parse.urlsplit(url)
  if parts.scheme == "file":
    return urllib.request.url2pathname(parts.path)
  return url if not parts.scheme else None


def weights_dir() -> Path:
  """Where downloaded weights are cached: ``$PGRAD_JAX_WEIGHTS_DIR``, else
  ``pgrad_jax/weights`` in the user's cache directory (``$XDG_CACHE_HOME``,
  else ``~/.cache``, on Linux)."""
  if os.environ.get(DIR_VARIABLE):
    return Path(os.environ[DIR_VARIABLE])
  return Path(pooch.os_cache("pgrad_jax")) / "weights"


def _hash_prefix(filename: str) -> str:
  """torch.hub's check: the hex digits after the last ``-`` of the name."""
  return filename.rsplit(".", 1)[0].rsplit("-", 1)[-1]


def sha256(path: str | os.PathLike) -> str:
  """The hexadecimal SHA-256 of a file; of a directory (an Orbax
  checkpoint), that of its files' ``sha256sum`` lines, sorted by path
  (``find . -type f | sort | xargs sha256sum | sha256sum`` in it)."""
  path = Path(path)
  if path.is_dir():
    lines = "".join(f"{sha256(file)}  ./{file.relative_to(path)}\n"
                    for file in sorted(path.rglob("*")) if file.is_file())
    return hashlib.sha256(lines.encode()).hexdigest()
  with open(path, "rb") as file:
    return hashlib.file_digest(file, "sha256").hexdigest()


def imagenet_file(model: str) -> str:
  """The name of torchvision's ImageNet weights file of ``model``.

  Raises:
    ValueError: torchvision has no ImageNet weights of ``model``.
  """
  filename = catalog.MODELS[model].imagenet_weights
  if filename is None:
    known = [name for name, entry in catalog.MODELS.items()
             if entry.imagenet_weights]
    raise ValueError(f"there are no ImageNet weights of {model}; "
                     f"torchvision's are those of {', '.join(known)}.")
  return filename


def _hash_problem(path: Path, filename: str) -> str | None:
  """What is wrong with ``path`` as torchvision's ``filename``, whose name
  starts its SHA-256; None if nothing."""
  digest = sha256(path)
  if digest.startswith(_hash_prefix(filename)):
    return None
  return (f"its SHA-256 {digest} does not start with "
          f"{_hash_prefix(filename)}, as torchvision's {filename} does: it is "
          "damaged, truncated or another file")


def fetch_imagenet(model: str, *, replace_damaged: bool = False) -> Path:
  """torchvision's ImageNet weights of ``model``, downloaded once, checked
  on every use.

  The file is checked as ``torch.hub`` checks a download: the hexadecimal
  digits after the ``-`` in its name start its SHA-256 (hashing ResNet-50's
  98 MB takes about 0.1 s). A file in `weights_dir`, downloaded or placed
  there by hand, is checked so too. A missing one is downloaded (with a
  progress bar) from ``$PGRAD_JAX_WEIGHTS_URL`` (default `TORCHVISION_URL`)
  into a temporary folder there, checked, and only then renamed into place,
  so that a failed or interrupted download leaves nothing behind and runs
  that download at once do not see each other's partial files. The
  variable may also name a folder on this machine (a ``file://`` URL or a
  path), such as a cluster's shared disk: its file is copied and checked as
  a download is.

  Args:
    model: a name of ``catalog.MODELS`` with ImageNet weights.
    replace_damaged: download a cached file that does not check again,
      instead of refusing it (what ``python -m experiments.pretrained
      fetch`` does).

  Returns:
    The path of the cached file.

  Raises:
    ValueError: there are no ImageNet weights of ``model``.
    WeightsUnavailableError: the cached file does not check, or the cache
      cannot be written, or the download failed or did not check; nothing
      was cached. The message names the fix: the command that downloads the
      file again, or the URL and where to place the file by hand, or the
      variable that moves the cache, and ``--pretrained none``.
  """
  filename = imagenet_file(model)
  cache = weights_dir()
  path = cache / filename
  if path.is_file():
    problem = _hash_problem(path, filename)
    if problem is None:
      return path
    if not replace_damaged:
      raise WeightsUnavailableError(
          f"The cached ImageNet weights {path} cannot be used: {problem}. "
          f"Delete it, or run `python -m experiments.pretrained fetch "
          f"{model}` to download it again.")
    print(f"{path}: {problem}; replacing it.", file=sys.stderr)
  try:
    cache.mkdir(parents=True, exist_ok=True)
    # Where the download goes first: a failed one leaves nothing behind.
    download_dir = tempfile.TemporaryDirectory(prefix=".download-", dir=cache)
  except OSError as e:
    raise WeightsUnavailableError(
        f"Cannot write the weights cache {cache} ({e.strerror or e}): set "
        f"${DIR_VARIABLE} to a writable directory, or pass --pretrained none "
        "to train from scratch.") from None
  source = os.environ.get(URL_VARIABLE) or TORCHVISION_URL
  url = f"{source.rstrip('/')}/{filename}"
  local = _local_source(url)
  fix = (f"Download {url} (e.g. on a machine with network access) and place "
         f"it at {path}, or pass --pretrained none to train from scratch.")
  if local:
    fix = (f"Place torchvision's {TORCHVISION_URL}/{filename} at {local} "
           f"(or at {path}), or pass --pretrained none to train from "
           "scratch.")
  print(f"{'Copying' if local else 'Downloading'} torchvision's ImageNet "
        f"weights of {model} from {url} to {path}.", file=sys.stderr)
  logger = pooch.get_logger()
  level = logger.level
  # pooch's own lines would suggest a full hash; torch.hub checks a prefix.
  logger.setLevel("WARNING")
  try:
    with download_dir as tmp:
      if local:
        downloaded = shutil.copyfile(local, os.path.join(tmp, filename))
      else:
        downloaded = pooch.retrieve(
            url, known_hash=None, fname=filename, path=tmp, progressbar=True,
            downloader=_downloader(url))
      problem = _hash_problem(Path(downloaded), filename)
      if problem is not None:
        raise WeightsUnavailableError(
            f"The file {'copied' if local else 'downloaded'} from {url} "
            f"cannot be used: {problem}; it was not kept. {fix}")
      os.replace(downloaded, path)
  except WeightsUnavailableError:
    raise
  except OSError as e:  # requests' errors are OSErrors too.
    # requests wraps the reason (e.g. connection refused) in urllib3's
    # retries; the reason says it.
    reason = getattr(e.args[0] if e.args else None, "reason", None) or e
    raise WeightsUnavailableError(
        f"Cannot {'copy' if local else 'download'} ImageNet weights of "
        f"{model}: {reason}. {fix}") from None
  finally:
    logger.setLevel(level)
  return path


# ----------------------------------------------------------------------------
# Converting torchvision's names and layouts.


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
    # numpy gives the bytes of a member that is not a .npy array.
    others = [name for name in loaded.zip.namelist()
              if not name.endswith(".npy")]
    if others:
      raise ValueError(f"{os.fspath(path)!r} is a zip archive of "
                       f"{', '.join(others[:3])}, not a .npz file of arrays")
    return {key: loaded[key] for key in loaded.files}


def _read_as_torch(path: str | os.PathLike) -> bool:
  """Whether to read ``path`` as a ``torch.save``'d file: it is one, or is
  named as one (a damaged one is then said to be a damaged PyTorch file)."""
  return os.path.isfile(path) and (is_torch_file(path) or
                                   Path(path).suffix in _TORCH_SUFFIXES)


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
  if _read_as_torch(path):
    _, converted = convert_torchvision(read_torch_state_dict(path))
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
    sha256: its `sha256`, which tells any two files apart.
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
      ``"none"`` for none, ``"imagenet"`` (fetched first: `fetch_imagenet`),
      or a path.
    model: the ``--model`` they are for.

  Returns:
    The weights' file and SHA-256; None for none.

  Raises:
    WeightsUnavailableError: ImageNet weights cannot be fetched, or the
      cached file does not check.
    FileNotFoundError: there is no such file.
    ValueError: the file is not weights (a damaged or truncated file, or
      not a state dict), or they are another architecture's: the message
      says which.
  """
  if pretrained in (None, "none"):
    return None
  path = (fetch_imagenet(model) if pretrained == "imagenet"
          else Path(pretrained))
  if _read_as_torch(path):
    # Read, not converted: converting ResNet-50's weights takes a second
    # (their model's shapes are traced), which loading them spends again.
    names = [name.replace(".", "/") for name in read_torch_state_dict(path)]
  else:
    names = list(_read(os.fspath(path)))
  found = _architecture(names)
  if found is not None and found != model:
    raise ValueError(
        f"{path} holds {_described(found)} weights, and --model is {model}: "
        f"pass --model {found}, or weights of {model}.")
  return Weights(path, sha256(path))


def _convert_command(args: argparse.Namespace) -> int:
  try:
    name, converted = convert_torchvision(read_torch_state_dict(args.input))
  except (OSError, ValueError) as e:
    print(f"{args.input}: {e}", file=sys.stderr)
    return 2
  save_npz(converted, args.output)
  print(f"Wrote {name} featurizer weights to {args.output}.")
  return 0


def _fetch_command(args: argparse.Namespace) -> int:
  try:
    path = fetch_imagenet(args.model, replace_damaged=True)
  except (OSError, ValueError) as e:
    print(e, file=sys.stderr)
    return 2
  print(path)
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
  fetch = commands.add_parser(
      "fetch", help="download torchvision's ImageNet weights of a model to "
      "the cache (as --pretrained imagenet does) and print their path")
  fetch.add_argument("model", choices=[
      name for name, entry in catalog.MODELS.items()
      if entry.imagenet_weights])
  fetch.set_defaults(run=_fetch_command)
  args = parser.parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
