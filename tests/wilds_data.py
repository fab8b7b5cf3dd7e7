"""Tiny PovertyMap and FMoW folders in WILDS's download layout, for tests."""

import csv
from pathlib import Path

import numpy as np
from PIL import Image

from experiments import wilds

POVERTY_SIZE = FMOW_SIZE = 8


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
  train, val, test = wilds.POVERTY_FOLDS["A"]
  countries = [c for c in train + val + test for _ in range(per_country)]
  rows = []
  for i, country in enumerate(countries):
    rows.append({"country": country, "lat": 0.0, "lon": 0.0,
                 "wealthpooled": round(float(rng.normal()), 4),
                 "year": 2012, "urban": bool(i % 3 == 0)})
    np.savez(root / "images" / f"landsat_poverty_img_{i}.npz",
             x=rng.normal(size=(8, POVERTY_SIZE, POVERTY_SIZE)).astype(
                 np.float32))
  _write_csv(root / "dhs_metadata.csv", rows)
  return rows


# (split column, year, country code) of every FMoW row.
# A sequestered ("seq") row, which has no image, sits among the others.
FMOW_ROWS = [
    ("train", 2005, "USA"), ("train", 2005, "FRA"), ("train", 2010, "KEN"),
    ("seq", 2008, "USA"),
    ("train", 2012, "CHN"), ("val", 2011, "AUS"), ("test", 2009, "BRA"),
    ("val", 2014, "USA"), ("val", 2013, "XXX"), ("train", 2014, "FRA"),
    ("test", 2016, "KEN"), ("test", 2017, "CHN"), ("val", 2016, "USA"),
]
FMOW_COUNTRIES = [("USA", "Americas"), ("FRA", "Europe"), ("KEN", "Africa"),
                  ("CHN", "Asia"), ("AUS", "Oceania"), ("BRA", "Americas")]


def write_fmow(data_dir: Path, seed: int = 0) -> list[dict]:
  """``fmow_v1.1`` with `FMOW_ROWS`, and its metadata rows."""
  root = data_dir / wilds.FMOW_DIR
  (root / "images").mkdir(parents=True)
  rng = np.random.default_rng(seed)
  rows, image_number = [], 0
  for i, (split, year, country) in enumerate(FMOW_ROWS):
    rows.append({"split": split, "img_filename": f"x_{i}.jpg",
                 "category": wilds.FMOW_CATEGORIES[(7 * i) % 62],
                 "country_code": country,
                 "timestamp": f"{year}-06-0{1 + i % 9}T10:00:00Z"})
    if split == "seq":
      continue
    # Images are numbered among the rows that are not sequestered.
    pixels = rng.integers(0, 256, (FMOW_SIZE, FMOW_SIZE, 3), np.uint8)
    Image.fromarray(pixels).save(
        root / "images" / f"rgb_img_{image_number}.png")
    image_number += 1
  _write_csv(root / "rgb_metadata.csv", rows)
  _write_csv(root / "country_code_mapping.csv",
             [{"name": c, "alpha-3": c, "region": r}
              for c, r in FMOW_COUNTRIES])
  return rows
