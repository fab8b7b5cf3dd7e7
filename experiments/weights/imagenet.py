"""Published ImageNet weights: fetched once, cached, checked on every use.

Two ``--pretrained`` values name published weights (`PRETRAINED`):

* ``imagenet``: torchvision's ``IMAGENET1K_V1`` weights of the model
  (`entries.ModelEntry.imagenet_weights`: ``resnet18-f37072fd.pth``,
  ``resnet50-0676ba61.pth``, ``densenet121-a639ec97.pth``), the files that
  ``torchvision.models.resnet50(weights="IMAGENET1K_V1")`` downloads, which
  the paper and DomainBed before July 2024 start from. They are checked as
  ``torch.hub`` checks them, on download and on every use: the hexadecimal
  digits after the ``-`` in the file name start the SHA-256 of the file.
* ``imagenet_augmix``: timm's ``resnet50.ram_in1k`` weights
  (`entries.ModelEntry.augmix_weights`), a ResNet-50 trained with AugMix,
  which DomainBed starts from since commit 3dfdc8e (2024-07-25,
  ``resnet50_augmix``): the hub's ``model.safetensors`` at `HUB_REVISION`.
  No SHA-256 of it is published: its first download must read whole as a
  safetensors file, and its SHA-256 is then recorded beside it
  (``<file>.sha256``) and checked on every later use.

`fetch_imagenet` downloads a file once into the cache directory
`weights_dir`. Two environment variables change where they come from and
go: ``PGRAD_JAX_WEIGHTS_URL`` (a folder of the files by their cache names,
instead of the publishers' URLs; a ``file://`` URL or a path names a folder
on a shared disk) and ``PGRAD_JAX_WEIGHTS_DIR``.

This module fetches and checks files; `experiments.weights.torch_pickle`
reads torchvision's and `experiments.weights.convert` converts them.
"""
import dataclasses
import hashlib
import os
from pathlib import Path
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request

import pooch
import safetensors
import safetensors.numpy

from experiments import catalog


# Where torchvision's weights are (torchvision/models/resnet.py and
# densenet.py, the IMAGENET1K_V1 entries).
TORCHVISION_URL = "https://download.pytorch.org/models"
# Where timm's are: the Hugging Face hub's repositories timm/<name>
# (huggingface/pytorch-image-models at aa4b5850, timm/models/resnet.py,
# lines 934-936: "resnet50.ram_in1k", hf_hub_id="timm/"), each with a
# model.safetensors.
HUB_URL = "https://huggingface.co"
# The hub revision the URL names: the branch main, not a commit, since no
# full commit hash of timm/resnet50.ram_in1k could be found (its history
# lists the short hashes 7fbf385, "Add model", 2023-04-05, and beb6549,
# "Fix library_name."). The SHA-256 recorded at the first download holds
# every later use and download to that one file all the same.
HUB_REVISION = "main"
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


@dataclasses.dataclass(frozen=True)
class Published:
  """Weights of a model as their publisher serves them, and as cached here.

  Attributes:
    model: a name of ``catalog.MODELS``.
    pretrained: the ``--pretrained`` value that names them (a name of
      `PRETRAINED`).
    publisher: who publishes them.
    description: what they are, in messages.
    url: where the publisher serves the file.
    filename: its name in the cache, and under ``$PGRAD_JAX_WEIGHTS_URL``.
    recorded: no SHA-256 of the file is published, so the file is checked
      against the one recorded at its first download (`recorded_sha256`);
      otherwise the hex digits after the ``-`` in ``filename`` start its
      SHA-256, as ``torch.hub`` checks torchvision's files.
  """

  model: str
  pretrained: str
  publisher: str
  description: str
  url: str
  filename: str
  recorded: bool

  @property
  def fetch_command(self) -> str:
    """The command that downloads them again."""
    option = ("" if self.pretrained == "imagenet"
              else f" --weights {self.pretrained}")
    return f"python -m experiments.weights fetch {self.model}{option}"


def _torchvision_weights(model: str) -> Published | None:
  filename = catalog.MODELS[model].imagenet_weights
  if filename is None:
    return None
  return Published(model, "imagenet", "torchvision",
                   f"torchvision's ImageNet weights of {model}",
                   f"{TORCHVISION_URL}/{filename}", filename, recorded=False)


def _timm_weights(model: str) -> Published | None:
  name = catalog.MODELS[model].augmix_weights
  if name is None:
    return None
  return Published(
      model, "imagenet_augmix", "timm",
      f"timm's {name} (AugMix) weights of {model}",
      f"{HUB_URL}/timm/{name}/resolve/{HUB_REVISION}/model.safetensors",
      f"{name}.safetensors", recorded=True)


# The --pretrained values that name published weights, and what they are.
PRETRAINED = {"imagenet": _torchvision_weights,
              "imagenet_augmix": _timm_weights}


def published(model: str, pretrained: str = "imagenet") -> Published:
  """The weights of ``model`` that ``pretrained`` names.

  Raises:
    ValueError: there are no such weights of ``model``.
  """
  weights = PRETRAINED[pretrained](model)
  if weights is None:
    known = [name for name in catalog.MODELS
             if PRETRAINED[pretrained](name) is not None]
    kind = ("ImageNet weights" if pretrained == "imagenet"
            else f"{pretrained} weights")
    publisher = "torchvision" if pretrained == "imagenet" else "timm"
    raise ValueError(f"there are no {kind} of {model}; {publisher}'s are "
                     f"those of {', '.join(known)}.")
  return weights


def _record_path(path: Path) -> Path:
  """Where the SHA-256 of a cached file without a published one is kept."""
  return path.with_name(path.name + ".sha256")


def recorded_sha256(path: Path) -> str | None:
  """The SHA-256 recorded at the first download of the cached ``path``;
  None if none was."""
  record = _record_path(path)
  return record.read_text().strip() if record.is_file() else None


def _record_sha256(path: Path, digest: str) -> None:
  """Records ``digest`` as the SHA-256 of the cached ``path``, atomically."""
  record = _record_path(path)
  partial = record.with_name(f".{record.name}.{os.getpid()}")
  partial.write_text(digest + "\n")
  os.replace(partial, record)


def _safetensors_problem(path: Path) -> str | None:
  """What is wrong with ``path`` as a safetensors file; None if nothing."""
  try:
    safetensors.numpy.load_file(path)
  except (safetensors.SafetensorError, OSError) as e:
    return f"it is not a whole safetensors file ({e})"
  return None


def _problem(path: Path, weights: Published, recorded: str | None
             ) -> str | None:
  """What is wrong with ``path`` as ``weights``; None if nothing.

  torchvision's file is checked against the SHA-256 prefix its name
  carries. A file without a published SHA-256 is checked against
  ``recorded``, the SHA-256 of its first download; before there is one,
  it must read whole as a safetensors file.
  """
  digest = sha256(path)
  if not weights.recorded:
    prefix = _hash_prefix(weights.filename)
    if digest.startswith(prefix):
      return None
    return (f"its SHA-256 {digest} does not start with {prefix}, as "
            f"torchvision's {weights.filename} does: it is damaged, "
            "truncated or another file")
  if recorded is None:
    return _safetensors_problem(path)
  if digest == recorded:
    return None
  return (f"its SHA-256 {digest} is not {recorded}, recorded at its first "
          f"download in {_record_path(weights_dir() / weights.filename)}: it "
          "is damaged, truncated or another file (delete the record too to "
          "accept another file)")


def fetch_imagenet(model: str, pretrained: str = "imagenet", *,
                   replace_damaged: bool = False) -> Path:
  """Published weights of ``model``, downloaded once, checked on every use.

  torchvision's file (``pretrained="imagenet"``) is checked as
  ``torch.hub`` checks a download: the hexadecimal digits after the ``-``
  in its name start its SHA-256 (hashing ResNet-50's 98 MB takes about
  0.1 s). timm's (``"imagenet_augmix"``), whose SHA-256 is not published,
  must read whole as a safetensors file at its first download, whose
  SHA-256 is then recorded beside it and checked on every later use. A
  file in `weights_dir`, downloaded or placed there by hand, is checked so
  too (one placed by hand without a record is recorded when first used). A
  missing one is downloaded (with a progress bar) from the publisher's URL,
  or from ``$PGRAD_JAX_WEIGHTS_URL/<its cache name>``, into a temporary
  folder there, checked, and only then renamed into place, so that a failed
  or interrupted download leaves nothing behind and runs that download at
  once do not see each other's partial files. The variable may also name a
  folder on this machine (a ``file://`` URL or a path), such as a cluster's
  shared disk: its file is copied and checked as a download is.

  Args:
    model: a name of ``catalog.MODELS`` with such weights.
    pretrained: a name of `PRETRAINED`.
    replace_damaged: download a cached file that does not check again,
      instead of refusing it (what ``python -m experiments.weights
      fetch`` does).

  Returns:
    The path of the cached file.

  Raises:
    ValueError: there are no such weights of ``model``.
    WeightsUnavailableError: the cached file does not check, or the cache
      cannot be written, or the download failed or did not check; nothing
      was cached. The message names the fix: the command that downloads the
      file again, or the URL and where to place the file by hand, or the
      variable that moves the cache, and ``--pretrained none``.
  """
  weights = published(model, pretrained)
  path = weights_dir() / weights.filename
  recorded = recorded_sha256(path) if weights.recorded else None
  if path.is_file():
    problem = _problem(path, weights, recorded)
    if problem is None:
      if weights.recorded and recorded is None:
        _record_sha256(path, sha256(path))
        print(f"Recorded the SHA-256 of {path}, placed there by hand.",
              file=sys.stderr)
      return path
    if not replace_damaged:
      raise WeightsUnavailableError(
          f"The cached ImageNet weights {path} cannot be used: {problem}. "
          f"Delete it, or run `{weights.fetch_command}` to download it "
          "again.")
    print(f"{path}: {problem}; replacing it.", file=sys.stderr)
  _download(weights, path, recorded)
  if weights.recorded and recorded is None:
    _record_sha256(path, sha256(path))
  return path


def _download(weights: Published, path: Path, recorded: str | None) -> None:
  """Downloads ``weights`` to ``path`` through a temporary folder beside it,
  checked as `fetch_imagenet` says.

  Raises:
    WeightsUnavailableError: see `fetch_imagenet`.
  """
  cache = path.parent
  try:
    cache.mkdir(parents=True, exist_ok=True)
    # Where the download goes first: a failed one leaves nothing behind.
    download_dir = tempfile.TemporaryDirectory(prefix=".download-", dir=cache)
  except OSError as e:
    raise WeightsUnavailableError(
        f"Cannot write the weights cache {cache} ({e.strerror or e}): set "
        f"${DIR_VARIABLE} to a writable directory, or pass --pretrained none "
        "to train from scratch.") from None
  url = weights.url
  if os.environ.get(URL_VARIABLE):
    url = f"{os.environ[URL_VARIABLE].rstrip('/')}/{weights.filename}"
  local = _local_source(url)
  fix = (f"Download {url} (e.g. on a machine with network access) and place "
         f"it at {path}, or pass --pretrained none to train from scratch.")
  if local:
    fix = (f"Place {weights.publisher}'s {weights.url} at {local} (or at "
           f"{path}), or pass --pretrained none to train from scratch.")
  print(f"{'Copying' if local else 'Downloading'} {weights.description} "
        f"from {url} to {path}.", file=sys.stderr)
  logger = pooch.get_logger()
  level = logger.level
  # pooch's own lines would suggest a full hash, which this checks itself.
  logger.setLevel("WARNING")
  try:
    with download_dir as tmp:
      if local:
        downloaded = shutil.copyfile(local, os.path.join(tmp, path.name))
      else:
        downloaded = pooch.retrieve(
            url, known_hash=None, fname=path.name, path=tmp, progressbar=True,
            downloader=_downloader(url))
      problem = _problem(Path(downloaded), weights, recorded)
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
        f"{weights.model}: {reason}. {fix}") from None
  finally:
    logger.setLevel(level)
