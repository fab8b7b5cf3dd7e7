"""torchvision's ImageNet weights: fetched once, cached, checked on every use.

``--pretrained imagenet`` names torchvision's ``IMAGENET1K_V1`` weights of
the model (`catalog.ModelEntry.imagenet_weights`: ``resnet18-f37072fd.pth``,
``resnet50-0676ba61.pth``, ``densenet121-a639ec97.pth``), the files that
``torchvision.models.resnet50(weights="IMAGENET1K_V1")`` downloads.
`fetch_imagenet` downloads a file once from torchvision's URL into the cache
directory `weights_dir`, and checks it as ``torch.hub`` does, on download
and on every use: the hexadecimal digits after the ``-`` in the file name
start the SHA-256 of the file. Two environment variables change where they
come from and go: ``PGRAD_JAX_WEIGHTS_URL`` (default `TORCHVISION_URL`; a
``file://`` URL or a path names a folder on a shared disk) and
``PGRAD_JAX_WEIGHTS_DIR``.

This module fetches and checks files; `experiments.weights.torch_pickle`
reads them and `experiments.weights.convert` converts them.
"""

import hashlib
import os
from pathlib import Path
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request

import pooch

from experiments import catalog


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
      instead of refusing it (what ``python -m experiments.weights
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
          f"Delete it, or run `python -m experiments.weights fetch "
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
