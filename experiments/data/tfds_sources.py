"""Prepared TFDS datasets, opened offline.

``RotatedMNIST``, ``ColoredMNIST`` (TFDS ``mnist``) and ``DomainNet`` (TFDS
``domainnet/<domain>``) read TFDS datasets prepared beforehand, on a machine
with network access, in the ``array_record`` format, whose data sources are
read by index. `prepared_sources` opens them without ever starting a
download, and says how to prepare what is missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.data import datasets


def _missing_message(
    name: str, tfds_names: Sequence[str], data_dir: str, problem: str
) -> str:
  names = list(tfds_names)
  prepare = (
      f"tfds.builder(n, data_dir='{data_dir}')"
      f".download_and_prepare(file_format='array_record') for n in {names}"
  )
  return (
      f"{name} needs the TFDS dataset(s) {', '.join(tfds_names)} in {data_dir},"
      f" {problem}. Nothing is downloaded at run time. On a machine with"
      " network access, in this project's checkout, run\n"
      '  pip install -e ".[experiments,tfds-prepare]"\n'
      f'  python -c "import tensorflow_datasets as tfds; [{prepare}]"\n'
      "then copy that directory here and pass it as data_dir."
  )


def prepared_sources(
    name: str, tfds_names: Sequence[str], data_dir: str | Path | None
) -> list[Sequence[Mapping[str, Any]]]:
  """Opens all examples (train+test) of prepared TFDS datasets, offline.

  Args:
    name: the dataset needing them, for messages.
    tfds_names: TFDS names such as ``"mnist"`` or ``"domainnet/real"``.
    data_dir: the TFDS data directory; ``None`` means the TFDS default.

  Returns:
    One TFDS data source per name.

  Raises:
    datasets.DatasetNotFoundError: some are not prepared as array_record
      files.
  """
  import tensorflow_datasets as tfds  # Slow import; only needed here.

  data_dir = None if data_dir is None else str(data_dir)
  builders = [
      tfds.builder(n, data_dir=data_dir, try_gcs=False) for n in tfds_names
  ]
  root = str(builders[0].data_dir_root)
  # Checked up front so that tfds never starts a download.
  missing = [n for n, b in zip(tfds_names, builders) if not b.is_prepared()]
  if missing:
    raise datasets.DatasetNotFoundError(
        _missing_message(name, missing, root, "which are not prepared")
    )
  try:
    return [b.as_data_source(split="train+test") for b in builders]
  except NotImplementedError as err:  # Prepared, but not as array_record.
    raise datasets.DatasetNotFoundError(
        _missing_message(
            name, tfds_names, root, "which are not in the array_record format"
        )
    ) from err

