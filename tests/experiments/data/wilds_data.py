"""Tiny PovertyMap and FMoW folders in WILDS's download layout, for tests.

Every image carries the metadata row it belongs to (`POVERTY_ROW_PIXEL`,
`FMOW_ROW_PIXEL`), so a test can read back which file an example came from.
"""

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from experiments import catalog
from experiments.data import wilds

POVERTY_SIZE = FMOW_SIZE = 8
# PovertyMap: every band of pixel (0, 0) holds the row.
POVERTY_ROW_PIXEL = (0, 0)
# FMoW: the red value of pixel (0, 0) is the row (rows < 256).
FMOW_ROW_PIXEL = (0, 0, 0)


def _write_csv(path: Path, rows: list[dict]) -> None:
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def write_poverty(data_dir: Path, *, per_country: int = 3,
                  seed: int = 0) -> list[dict]:
  """``poverty_v1.1``, and its metadata rows.

  Every country has ``per_country`` rows: fold A's training countries first,
  then its validation and its test countries.
  """
  root = data_dir / wilds.POVERTY_DIR
  (root / "images").mkdir(parents=True)
  rng = np.random.default_rng(seed)
  train, val, test = catalog.POVERTY_FOLDS["A"]
  countries = [c for c in train + val + test for _ in range(per_country)]
  rows = []
  for i, country in enumerate(countries):
    rows.append({"country": country, "lat": 0.0, "lon": 0.0,
                 "wealthpooled": round(float(rng.normal()), 4),
                 "year": 2012, "urban": bool(i % 3 == 0)})
    bands = rng.normal(size=(8, POVERTY_SIZE, POVERTY_SIZE)).astype(
        np.float32)
    bands[(slice(None),) + POVERTY_ROW_PIXEL] = i
    np.savez(root / "images" / f"landsat_poverty_img_{i}.npz", x=bands)
  _write_csv(root / "dhs_metadata.csv", rows)
  return rows


# (split column, timestamp, country code) of every FMoW row, in WILDS's
# layout: sequestered ("seq") rows sit among the others (the first row is
# one) and have images too. Timestamps reach the split's edges: WILDS's OOD
# validation years start at 2013-01-01 and its test years at 2016-01-01,
# both UTC; the -05:00 row is already 2016 in UTC. "XXX" maps to no region.
FMOW_ROWS = [
    ("seq", "2004-03-01T10:00:00Z", "USA"),
    ("train", "2005-06-01T10:00:00Z", "USA"),
    ("train", "2005-06-02T10:00:00Z", "FRA"),
    ("train", "2010-06-03T10:00:00Z", "KEN"),
    ("seq", "2008-06-04T10:00:00Z", "USA"),
    ("train", "2012-12-31T23:59:59Z", "CHN"),
    ("val", "2011-06-05T10:00:00Z", "AUS"),
    ("test", "2009-06-06T10:00:00Z", "BRA"),
    ("train", "2002-06-07T10:00:00Z", "XXX"),
    ("seq", "2016-06-08T10:00:00Z", "XXX"),
    ("val", "2013-01-01T00:00:00Z", "USA"),
    ("val", "2015-12-31T23:59:59Z", "XXX"),
    ("train", "2014-06-09T10:00:00Z", "FRA"),
    ("test", "2016-01-01T00:00:00Z", "KEN"),
    ("seq", "2012-06-10T10:00:00Z", "CHN"),
    ("test", "2017-06-11T10:00:00Z", "CHN"),
    ("val", "2016-06-12T10:00:00Z", "USA"),
    ("test", "2015-12-31T20:00:00-05:00", "XXX"),
]
FMOW_COUNTRIES = [("USA", "Americas"), ("FRA", "Europe"), ("KEN", "Africa"),
                  ("CHN", "Asia"), ("AUS", "Oceania"), ("BRA", "Americas")]
# The rows of every domain and split, by WILDS's rules on `FMOW_ROWS`.
FMOW_SPLIT_ROWS = {"2002": [8], "2005": [1, 2], "2010": [3], "2012": [5],
                   "id_val": [6], "id_test": [7], "val": [10, 11],
                   "test": [13, 15, 17]}


def write_fmow(data_dir: Path, seed: int = 0,
               table: Sequence[tuple[str, str, str]] = FMOW_ROWS
               ) -> list[dict]:
  """``fmow_v1.1`` with the rows of ``table``, laid out as `FMOW_ROWS`, and
  its metadata rows.

  As WILDS's download: the image of metadata row ``i`` is
  ``images/rgb_img_<i>.png``, sequestered rows included.
  """
  root = data_dir / wilds.FMOW_DIR
  (root / "images").mkdir(parents=True)
  rng = np.random.default_rng(seed)
  rows = []
  for i, (split, timestamp, country) in enumerate(table):
    rows.append({"split": split, "img_filename": f"x_{i}.jpg",
                 "category": wilds.FMOW_CATEGORIES[(7 * i) % 62],
                 "country_code": country, "timestamp": timestamp})
    pixels = rng.integers(0, 256, (FMOW_SIZE, FMOW_SIZE, 3), np.uint8)
    pixels[FMOW_ROW_PIXEL] = i
    Image.fromarray(pixels).save(root / "images" / f"rgb_img_{i}.png")
  _write_csv(root / "rgb_metadata.csv", rows)
  _write_csv(root / "country_code_mapping.csv",
             [{"name": c, "alpha-3": c, "region": r}
              for c, r in FMOW_COUNTRIES])
  return rows
