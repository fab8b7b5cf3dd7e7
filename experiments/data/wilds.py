"""WILDS's PovertyMap and FMoW, read from WILDS's own download layout.

Koh et al. (ICML 2021) define both datasets' splits, domains and evaluation
groups in the ``wilds`` package (``wilds/datasets/poverty_dataset.py`` and
``fmow_dataset.py``; followed here at 2.0.0, which downloads the datasets'
v1.1). This module reads the files that package downloads and follows the
same definitions without importing it (it needs PyTorch)::

    <data_dir>/poverty_v1.1/dhs_metadata.csv          # one row per image
    <data_dir>/poverty_v1.1/images/landsat_poverty_img_<row>.npz  # "x": (8, H, W)
    <data_dir>/fmow_v1.1/rgb_metadata.csv             # one row per image
    <data_dir>/fmow_v1.1/country_code_mapping.csv     # alpha-3 -> region
    <data_dir>/fmow_v1.1/images/rgb_img_<row>.png     # "seq" rows too

A `WildsDataset` is a `MultiDomainDataset` whose domains are the training
domains that have rows (PovertyMap: the fold's training countries, of
`catalog.POVERTY_FOLDS`; FMoW: the years of the training split), followed by
WILDS's four evaluation splits, `catalog.WILDS_EVAL_SPLITS` (``val`` and
``test`` are out of distribution): the catalog's ``domains``, where the data
are whole. Its ``test_envs`` are the evaluation splits; its training length,
in epochs, is the catalog's too. Every element carries ``"group"``, the
evaluation group of WILDS's worst-group metric (PovertyMap: 0 rural, 1 urban;
FMoW: the region, -1 for "Other", which WILDS leaves out of the worst
region).

Normalisation, as WILDS: PovertyMap's arrays are stored already normalised per
band (WILDS's ``_MEANS_2009_17`` / ``_STD_DEVS_2009_17``) and are used as they
are; FMoW's RGB images are scaled to [0, 1] and normalised with the ImageNet
mean and standard deviation (WILDS's ``image_base`` transform). Neither is
resized. The domains serve the images untransformed, for evaluation and
training alike; a dataset's ``train_transform`` is WILDS's training
augmentation, for the training batches only: PovertyMap's flips and colour
jitter (`wilds_augmentation`), none for FMoW, as in WILDS. docs/wilds.md
lists the WILDS lines each rule follows.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import threading
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from experiments import catalog
from experiments.data import datasets
from experiments.data import wilds_augmentation

POVERTY_DIR = "poverty_v1.1"
FMOW_DIR = "fmow_v1.1"
# The split whose metric selects the model (WILDS's OOD validation split).
SELECTION_SPLIT = "val"

_DOWNLOAD_HINT = (
    "Download it with WILDS's script (pip install wilds; python -m"
    " wilds.download_datasets --root_dir <data_dir> --datasets {dataset}) on"
    " a machine with network access and copy the {folder} folder to"
    " <data_dir>. Nothing is downloaded at run time.")

# WILDS takes 2,000 examples of the training countries for id_val (the first
# half) and id_test, shuffled by numpy's default_rng(ord(fold) + 541433)
# (its subsample_idxs).
POVERTY_ID_EVAL_SIZE = 2000
_SUBSAMPLE_SEED_OFFSET = 541433
POVERTY_GROUPS = ("rural", "urban")

# WILDS's FMoW classes, in its label order (fmow_dataset.py, categories).
FMOW_CATEGORIES = (
    "airport", "airport_hangar", "airport_terminal", "amusement_park",
    "aquaculture", "archaeological_site", "barn", "border_checkpoint",
    "burial_site", "car_dealership", "construction_site", "crop_field", "dam",
    "debris_or_rubble", "educational_institution", "electric_substation",
    "factory_or_powerplant", "fire_station", "flooded_road", "fountain",
    "gas_station", "golf_course", "ground_transportation_station", "helipad",
    "hospital", "impoverished_settlement", "interchange", "lake_or_pond",
    "lighthouse", "military_facility", "multi-unit_residential",
    "nuclear_powerplant", "office_building", "oil_or_gas_facility", "park",
    "parking_lot_or_garage", "place_of_worship", "police_station", "port",
    "prison", "race_track", "railway_bridge", "recreational_facility",
    "road_bridge", "runway", "shipyard", "shopping_mall",
    "single-unit_residential", "smokestack", "solar_farm", "space_facility",
    "stadium", "storage_tank", "surface_mine", "swimming_pool", "toll_booth",
    "tower", "tunnel_opening", "waste_disposal", "water_treatment_facility",
    "wind_farm", "zoo")
FMOW_REGIONS = ("Africa", "Americas", "Asia", "Europe", "Oceania")
# WILDS's official split ("time_after_2016"): test from 2016 on, validation
# the three years before, training the years before that.
FMOW_TEST_YEAR = 2016
FMOW_VAL_YEAR = FMOW_TEST_YEAR - 3


@dataclasses.dataclass(frozen=True)
class WildsDataset(datasets.MultiDomainDataset):
  """A WILDS dataset: training domains, then the evaluation splits.

  Attributes:
    num_train_domains: the number of training domains, which come first.
    group_names: the names of the evaluation groups of ``"group"``.
    train_transform: WILDS's training augmentation of one example,
      ``(example, rng) -> example`` with ``rng`` a NumPy Generator seeded
      per (seed, step, example); ``None`` where WILDS augments nothing.
      The domains never apply it: only training batches go through it.
  """

  num_train_domains: int
  group_names: tuple[str, ...]
  train_transform: Callable[[datasets.Element, np.random.Generator],
                            datasets.Element] | None = None

  @property
  def test_envs(self) -> tuple[int, ...]:
    """The evaluation splits' domain indices: never trained on."""
    return tuple(range(self.num_train_domains, len(self.domains)))

  @property
  def selection_env(self) -> int:
    """The domain index of the split that selects the model."""
    return self.domain_names.index(SELECTION_SPLIT)


class RowSource:
  """A `DomainSource` over rows of a WILDS metadata table."""

  def __init__(
      self,
      load: Callable[[int], np.ndarray],
      rows: np.ndarray,
      labels: np.ndarray,
      groups: np.ndarray,
  ):
    """Wraps the rows of one domain or split.

    Args:
      load: reads the float32 ``(H, W, C)`` image of a metadata row.
      rows: the metadata rows of the examples.
      labels: every row's label (all rows of the table).
      groups: every row's evaluation group (all rows of the table).
    """
    self.load = load
    self.rows = np.asarray(rows, np.int64)
    self.labels = labels
    self.groups = groups

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> datasets.Element:
    row = int(self.rows[index])
    return {"image": self.load(row), "label": self.labels[row],
            "group": self.groups[row]}


# np.load parses a .npy header with ast.literal_eval. CPython before 3.11.8
# and 3.12.2 keeps one AST recursion count per interpreter, so two threads
# parsing at once (the read-ahead threads do) can fail with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905). Headers are
# therefore parsed one at a time; the arrays still inflate in parallel.
_NPY_HEADER_LOCK = threading.Lock()


def _read_npz_array(path: Path, key: str) -> np.ndarray:
  """The array ``key`` of the ``.npz`` at ``path``, as ``np.load(path)[key]``.

  Raises:
    OSError: the file is not a readable ``.npz`` holding ``key``.
  """
  try:
    with zipfile.ZipFile(path) as archive, \
        archive.open(f"{key}.npy") as member:
      with _NPY_HEADER_LOCK:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
          header = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
          header = np.lib.format.read_array_header_2_0(member)
        else:
          raise ValueError(f".npy format version {version} is not 1.0 or 2.0")
      shape, fortran_order, dtype = header
      if dtype.hasobject:
        raise ValueError("it holds Python objects; only numeric arrays load")
      data = member.read()
  except (zipfile.BadZipFile, KeyError, ValueError) as err:
    raise OSError(f"not an .npz holding {key!r}: {err}") from err
  count = int(np.prod(shape))
  if len(data) != count * dtype.itemsize:
    raise OSError(f"{key!r} has {len(data)} bytes; its header says "
                  f"{count * dtype.itemsize}")
  return np.frombuffer(data, dtype, count).reshape(
      shape, order="F" if fortran_order else "C")


def _read_csv(path: Path) -> list[dict[str, str]]:
  with path.open(newline="") as f:
    return list(csv.DictReader(f))


def _dataset_root(name: str, folder: str, wilds_name: str,
                  data_dir: str | Path | None, files: Sequence[str]) -> Path:
  root = Path(datasets.DEFAULT_FOLDER_DATA_DIR if data_dir is None
              else data_dir) / folder
  missing = [f for f in files if not (root / f).exists()]
  if missing:
    raise datasets.DatasetNotFoundError(
        f"{name} not found: {', '.join(str(root / f) for f in missing)} "
        "missing. " + _DOWNLOAD_HINT.format(dataset=wilds_name, folder=folder))
  return root


def _make_dataset(name, load, splits, train_domains, labels, groups, *,
                  num_classes, group_names, train_transform=None):
  """Builds a `WildsDataset` from row indices of every domain and split."""
  if not train_domains:
    raise ValueError(f"{name} has no training examples: every row is in an "
                     "evaluation split.")
  domain_names = tuple(train_domains) + catalog.WILDS_EVAL_SPLITS
  row_sets = [train_domains[d] for d in train_domains] + [
      splits[s] for s in catalog.WILDS_EVAL_SPLITS]
  return WildsDataset(
      name=name,
      domain_names=domain_names,
      domains=tuple(RowSource(load, rows, labels, groups)
                    for rows in row_sets),
      num_classes=num_classes,
      input_shape=tuple(load(int(row_sets[0][0])).shape),
      num_train_domains=len(train_domains),
      group_names=group_names,
      train_transform=train_transform,
  )


def poverty_splits(
    countries: Sequence[str], fold: str = "A",
    id_eval_size: int = POVERTY_ID_EVAL_SIZE
) -> dict[str, np.ndarray]:
  """WILDS's PovertyMap splits of the metadata rows, for one fold.

  The fold's test and validation countries are the OOD ``test`` and ``val``
  splits; ``id_eval_size`` shuffled rows of the training countries form
  ``id_val`` (first half) and ``id_test``, and the rest is ``train``.

  Args:
    countries: every row's country.
    fold: ``"A"`` to ``"E"``.
    id_eval_size: the in-distribution evaluation rows (WILDS: 2,000).

  Returns:
    ``split name -> row indices``, ``train`` included.
  """
  if fold not in catalog.POVERTY_FOLDS:
    raise ValueError("PovertyMap fold must be one of "
                     f"{sorted(catalog.POVERTY_FOLDS)}, got {fold!r}.")
  _, val, test = catalog.POVERTY_FOLDS[fold]
  countries = np.asarray(countries)
  rows = np.arange(len(countries))
  is_test, is_val = np.isin(countries, test), np.isin(countries, val)
  in_distribution = rows[~is_test & ~is_val]
  shuffled = in_distribution.copy()
  np.random.default_rng(ord(fold) + _SUBSAMPLE_SEED_OFFSET).shuffle(shuffled)
  evaluation = shuffled[:id_eval_size]
  return {"train": shuffled[id_eval_size:],
          "id_val": evaluation[:id_eval_size // 2],
          "id_test": evaluation[id_eval_size // 2:],
          "val": rows[is_val], "test": rows[is_test]}


def poverty_map(
    *, data_dir: str | Path | None = None, seed: int = 0, fold: str = "A",
    id_eval_size: int | None = None
) -> WildsDataset:
  """PovertyMap (WILDS v1.1): asset wealth regression, 8-band images.

  Training domains are the fold's training countries; labels are the float32
  ``wealthpooled`` index; groups are rural (0) and urban (1). Its
  ``train_transform`` is `wilds_augmentation.augment_poverty`.

  Args:
    data_dir: the folder holding ``poverty_v1.1``; ``None`` means ``./data``.
    seed: unused; WILDS's splits are fixed.
    fold: WILDS's country fold, ``"A"`` (its default) to ``"E"``.
    id_eval_size: the in-distribution evaluation rows; ``None`` means
      `POVERTY_ID_EVAL_SIZE` (WILDS's 2,000).

  Returns:
    The dataset.

  Raises:
    DatasetNotFoundError: the metadata or the image folder is missing.
  """
  del seed
  name = "PovertyMap" if fold == "A" else f"PovertyMap-{fold}"
  root = _dataset_root(name, POVERTY_DIR, "poverty", data_dir,
                       ("dhs_metadata.csv", "images"))
  metadata = _read_csv(root / "dhs_metadata.csv")
  countries = [row["country"] for row in metadata]
  labels = np.array([float(row["wealthpooled"]) for row in metadata],
                    np.float32)
  # The CSV writes urban as True/False (or 1.0/0.0).
  groups = np.array([row["urban"].strip().lower() in ("true", "1", "1.0")
                     for row in metadata], np.int32)
  splits = poverty_splits(countries, fold, POVERTY_ID_EVAL_SIZE
                          if id_eval_size is None else id_eval_size)

  def load(row: int) -> np.ndarray:
    path = root / "images" / f"landsat_poverty_img_{row}.npz"
    try:
      bands = _read_npz_array(path, "x")
    except OSError as err:
      raise OSError(f"Cannot read PovertyMap image {path}: {err}") from err
    # Stored channels-first; the models take channels-last.
    return np.ascontiguousarray(np.moveaxis(bands, 0, -1), np.float32)

  train_countries = np.asarray(countries)[splits["train"]]
  train_domains = {c: splits["train"][train_countries == c]
                   for c in catalog.POVERTY_FOLDS[fold][0]
                   if np.any(train_countries == c)}
  return _make_dataset(name, load, splits, train_domains, labels, groups,
                       num_classes=1, group_names=POVERTY_GROUPS,
                       train_transform=wilds_augmentation.augment_poverty)


def _timestamp_year(timestamp: str) -> int:
  """The UTC year of an ISO 8601 timestamp, as WILDS compares timestamps
  with UTC New Year (``fmow_dataset.py``, ``time_after_{year}``)."""
  # Python 3.10's fromisoformat does not read the "Z" of UTC.
  parsed = datetime.datetime.fromisoformat(
      timestamp[:-1] + "+00:00" if timestamp.endswith("Z") else timestamp)
  if parsed.tzinfo is not None:
    parsed = parsed.astimezone(datetime.timezone.utc)
  return parsed.year


def fmow_splits(
    split: Sequence[str], years: Sequence[int]
) -> dict[str, np.ndarray]:
  """WILDS's official FMoW splits of the metadata rows.

  Rows of the metadata's ``train``/``val``/``test`` split dated before 2013
  form ``train``/``id_val``/``id_test``; ``val`` rows from 2013 to 2015 form
  the OOD ``val``; ``test`` rows from 2016 on the OOD ``test``. Other rows
  (e.g. ``seq``, WILDS's sequestered images) are left out.

  Args:
    split: every row's ``split`` column.
    years: every row's year.

  Returns:
    ``split name -> row indices``, ``train`` included.
  """
  split, years = np.asarray(split), np.asarray(years)
  rows = np.arange(len(split))
  is_test = years >= FMOW_TEST_YEAR
  is_val = (years >= FMOW_VAL_YEAR) & ~is_test
  in_distribution = ~is_test & ~is_val
  return {"train": rows[in_distribution & (split == "train")],
          "id_val": rows[in_distribution & (split == "val")],
          "id_test": rows[in_distribution & (split == "test")],
          "val": rows[is_val & (split == "val")],
          "test": rows[is_test & (split == "test")]}


def fmow(*, data_dir: str | Path | None = None, seed: int = 0) -> WildsDataset:
  """FMoW (WILDS v1.1): land use in 62 classes from RGB satellite images.

  Training domains are the years of the training split (2002 to 2012);
  groups are the regions of `FMOW_REGIONS`, by WILDS's country-to-region
  table, and -1 for a country it maps to no region ("Other"). It has no
  ``train_transform``: WILDS trains FMoW on its images as they are.

  Args:
    data_dir: the folder holding ``fmow_v1.1``; ``None`` means ``./data``.
    seed: unused; WILDS's splits are fixed.

  Returns:
    The dataset.

  Raises:
    DatasetNotFoundError: a metadata file or the image folder is missing.
    ValueError: a row names a class that is not one of WILDS's 62.
  """
  del seed
  root = _dataset_root("FMoW", FMOW_DIR, "fmow", data_dir,
                       ("rgb_metadata.csv", "country_code_mapping.csv",
                        "images"))
  metadata = _read_csv(root / "rgb_metadata.csv")
  region_of = {row["alpha-3"]: row["region"]
               for row in _read_csv(root / "country_code_mapping.csv")}
  class_index = {c: i for i, c in enumerate(FMOW_CATEGORIES)}
  unknown = sorted({row["category"] for row in metadata} - class_index.keys())
  if unknown:
    raise ValueError(f"FMoW: {root / 'rgb_metadata.csv'} has unknown "
                     f"categories {unknown}.")
  labels = np.array([class_index[row["category"]] for row in metadata],
                    np.int32)
  regions = [region_of.get(row["country_code"], "Other") for row in metadata]
  groups = np.array([FMOW_REGIONS.index(r) if r in FMOW_REGIONS else -1
                     for r in regions], np.int32)
  years = np.array([_timestamp_year(row["timestamp"]) for row in metadata])
  split_column = np.array([row["split"] for row in metadata])
  splits = fmow_splits(split_column, years)

  def load(row: int) -> np.ndarray:
    # Image files are numbered by metadata row, sequestered ("seq") rows
    # included: WILDS reads rgb_img_<full_idxs[idx]>.png, full_idxs the rows
    # that are not "seq".
    path = root / "images" / f"rgb_img_{row}.png"
    try:
      with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), np.float32) / 255.0
    except OSError as err:
      raise OSError(f"Cannot read FMoW image {path}: {err}") from err
    return (pixels - datasets.IMAGENET_MEAN) / datasets.IMAGENET_STD

  train_years = years[splits["train"]]
  train_domains = {str(y): splits["train"][train_years == y]
                   for y in sorted(set(train_years.tolist()))}
  return _make_dataset("FMoW", load, splits, train_domains, labels, groups,
                       num_classes=len(FMOW_CATEGORIES),
                       group_names=FMOW_REGIONS)
