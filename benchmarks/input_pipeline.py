"""How many images a second the photo input pipeline delivers, per CPU core.

It writes a PACS-like folder of JPEGs (DomainBed's layout,
``PACS/<domain>/<class>/<image>.jpg``, 227x227 like PACS's photos), then
times the training batches of PGrad-B's default on PACS (33 images from each
of the 3 training domains, as in
``benchmarks/results/step_time_gpu_resnet50_224px.json``), with and without
DomainBed's augmentation, for 1, 2 and the default number of workers (the
host's cores, ``--num_workers``'s default) of two kinds, each building
whole batches:

* ``processes``: the pipeline as training runs it
  (`experiments.data.pipeline.make_train_iterator`), Grain worker
  processes;
* ``threads``: the same batches built by Grain's threads
  (``ReadOptions.num_threads``) in the training process.

Every configuration is timed over ``--batches`` batches once its buffers
are drained (start-up excluded: see `measure`), round-robin over
``--repeats`` rounds so that drifting load hits all alike; the median and
the best round are reported.

Set against the accelerator step times of ``--step-times`` (by default the
H100's ResNet-50 224 px times), the CPU time one worker spends per augmented
image says how many cores keep the accelerator fed (`accelerator_needs`).

Run ``python -m benchmarks.input_pipeline --help`` for the flags; results go
to stdout and, with ``--out``, to a JSON file.
"""

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFilter

from benchmarks import common
from experiments.data import photo_augmentation as augmentation
from experiments import config as config_lib
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house",
                "person")
BACKENDS = ("processes", "threads")
REPO = Path(__file__).resolve().parents[1]
# Relative to REPO.
STEP_TIMES = "benchmarks/results/step_time_gpu_resnet50_224px.json"
# The step times' algorithms, by their keys there.
ACCELERATOR_ALGORITHMS = {"ERM": "erm", "PGrad-B": "pgrad-B"}


def synthetic_photo(rng: np.random.Generator, size: int) -> Image.Image:
  """A photo-like RGB image: colour gradients, shapes, grain, slight blur.

  Its JPEG is about as large as a PACS photo's (15 KB at 227x227), so it
  decodes about as fast; white noise would compress far worse.
  """
  y, x = np.mgrid[0:size, 0:size] / size
  gradient = (rng.uniform(0, 255, 3) + x[..., None] * rng.uniform(-120, 120, 3)
              + y[..., None] * rng.uniform(-120, 120, 3))
  image = Image.fromarray(np.clip(gradient, 0, 255).astype(np.uint8))
  draw = ImageDraw.Draw(image)
  for _ in range(12):
    x0, y0 = rng.integers(0, size, 2)
    w, h = rng.integers(size // 20 + 1, size // 2 + 2, 2)
    fill = tuple(int(c) for c in rng.integers(0, 256, 3))
    shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
    shape((x0, y0, x0 + w, y0 + h), fill=fill)
  grain_noise = rng.normal(0, 12, (size, size, 3))
  pixels = np.clip(np.asarray(image, np.float32) + grain_noise, 0, 255)
  return Image.fromarray(pixels.astype(np.uint8)).filter(
      ImageFilter.GaussianBlur(0.6))


def write_photo_folder(
    root: str | os.PathLike, *, name: str = "PACS",
    domains: Sequence[str] = PACS_DOMAINS,
    classes: Sequence[str] = PACS_CLASSES, per_class: int = 5,
    size: int = 227, seed: int = 0) -> Path:
  """Writes ``root/<name>/<domain>/<class>/<i>.jpg``, DomainBed's layout.

  Returns:
    ``root``, the folder to pass as ``--data_dir``.
  """
  rng = np.random.default_rng(seed)
  for domain in domains:
    for label in classes:
      folder = Path(root, name, domain, label)
      folder.mkdir(parents=True, exist_ok=True)
      for i in range(per_class):
        synthetic_photo(rng, size).save(folder / f"{i}.jpg", quality=90)
  return Path(root)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data-dir", default=None,
                      help="A folder holding PACS/ in DomainBed's layout. "
                      "Default: a generated one, deleted afterwards.")
  parser.add_argument("--per-class", type=int, default=5,
                      help="Images per class and domain of the generated "
                      "folder (4 domains, 7 classes).")
  parser.add_argument("--size", type=int, default=227,
                      help="Side of the generated images (PACS: 227).")
  parser.add_argument("--batch", type=int, default=33,
                      help="Images per training domain per step.")
  parser.add_argument("--workers", type=int, nargs="+", default=None,
                      help="Worker counts. Default: 1, 2 and the host's "
                      f"cores ({config_lib.default_num_workers()} here).")
  parser.add_argument("--backends", nargs="+", choices=BACKENDS,
                      default=list(BACKENDS))
  parser.add_argument("--batches", type=int, default=4,
                      help="Batches timed per round and configuration.")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--step-times", default=STEP_TIMES,
                      help="A step_time benchmark's JSON on an accelerator "
                      "(relative to the repository, or absolute).")
  parser.add_argument("--out", default=None, help="JSON file for results.")
  args = parser.parse_args(argv)
  for name in ("per_class", "size", "batch", "batches", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1.")
  if args.workers is None:
    args.workers = sorted({1, 2, config_lib.default_num_workers()})
  if min(args.workers) < 1:
    parser.error(f"--workers must be at least 1, got {args.workers}.")
  return args


def _batches(backend: str, workers: int, augment: bool,
             dataset: datasets.MultiDomainDataset,
             args: argparse.Namespace) -> grain.DatasetIterator:
  """PACS's training batches (domain 0 held out) from ``workers`` workers."""
  augmented = augmentation.training_augmentation(
      dataset, {"data_augmentation": augment})
  splits = input_pipeline.split_domains(dataset, seed=0)
  kwargs = dict(
      dataset=dataset if augmented is None else augmented.dataset,
      train_domains=[1, 2, 3], splits=splits, batch_size=args.batch, seed=0,
      transform=None if augmented is None else augmented.transform)
  if backend == "processes":
    return input_pipeline.make_train_iterator(num_workers=workers, **kwargs)
  batches = input_pipeline.train_batches(**kwargs)
  return iter(batches.to_iter_dataset(
      grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers)))


def measure(dataset: datasets.MultiDomainDataset,
            args: argparse.Namespace) -> list[dict]:
  """Images a second of every configuration, timed round-robin.

  A worker, process or thread, holds up to two batches ahead (one done,
  one being built). The batches taken before timing outnumber those, so
  every batch timed is one the caller waited for: the rate is the workers'
  own.
  """
  configs = [(backend, workers, augment) for augment in (False, True)
             for backend in args.backends for workers in args.workers]
  rates = {config: [] for config in configs}
  cpu_times = {config: [] for config in configs}
  images = 3 * args.batch * args.batches
  for _ in range(args.repeats):
    for config in configs:
      backend, workers, _ = config
      iterator = _batches(*config, dataset, args)
      for _ in range(2 * workers + 1):  # Start-up, and the batches built ahead.
        next(iterator)
      start, cpu_start = time.perf_counter(), time.process_time()
      for _ in range(args.batches):
        next(iterator)
      rates[config].append(images / (time.perf_counter() - start))
      cpu_times[config].append(
          1e3 * (time.process_time() - cpu_start) / images)
      iterator.close()
  return [{"backend": backend, "workers": workers, "augment": augment,
           "median_images_per_s": statistics.median(rates[config]),
           "best_images_per_s": max(rates[config]),
           "images_per_s": rates[config],
           # This process's CPU time: the worker processes' is not in it.
           "median_cpu_ms_per_image": (statistics.median(cpu_times[config])
                                       if backend == "threads" else None)}
          for config in configs for backend, workers, augment in [config]]


def accelerator_needs(results: list[dict], step_times: dict) -> dict:
  """Cores that keep the accelerator of ``step_times`` fed, per algorithm.

  A core delivers ``1000 / cpu_ms`` images a second, ``cpu_ms`` being the
  CPU time one thread spends per image with augmentation (CPU time, unlike
  wall time, does not grow when other programs share the cores); a step of
  ``domains * batch`` images every ``median_ms`` consumes
  ``1000 * domains * batch / median_ms`` a second. Worker processes scale
  with the cores (no GIL between them).
  """
  (one,) = [r for r in results if r["backend"] == "threads"
            and r["workers"] == 1 and r["augment"]]
  per_core = 1000 / one["median_cpu_ms_per_image"]
  config = step_times["config"]
  images = config["domains"] * config["batch"]
  needs = {}
  for name, key in ACCELERATOR_ALGORITHMS.items():
    step_ms = step_times["results"][key]["median_ms"]
    rate = 1000 * images / step_ms
    needs[name] = {"step_ms": step_ms, "images_per_step": images,
                   "images_per_s": rate,
                   "cores": math.ceil(rate / per_core)}
  return {"device": step_times["environment"]["device_kind"],
          "model": config["model"], "images_per_s_per_core": per_core,
          "algorithms": needs}


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  with tempfile.TemporaryDirectory() as scratch:
    data_dir = args.data_dir or write_photo_folder(
        scratch, per_class=args.per_class, size=args.size)
    dataset = datasets.get_dataset("PACS", data_dir=data_dir)
    load = os.getloadavg()
    results = measure(dataset, args)
  step_times = json.loads((REPO / args.step_times).read_text())
  needs = accelerator_needs(results, step_times)
  record = {"benchmark": "input_pipeline", "args": vars(args),
            "environment": common.environment(),
            # Other programs' load on the cores, over 1 minute.
            "host": {"cpu_cores": config_lib.default_num_workers(),
                     "load_average_before": load[0],
                     "load_average_after": os.getloadavg()[0]},
            "results": results, "accelerator": needs}
  one = {r["augment"]: r["median_images_per_s"] for r in results
         if r["backend"] == "processes" and r["workers"] == 1}
  rows = [[r["backend"], r["workers"], "on" if r["augment"] else "off",
           r["median_images_per_s"], r["best_images_per_s"],
           r["median_images_per_s"] / one[r["augment"]],
           r["median_cpu_ms_per_image"] or "-"] for r in results]
  table = common.format_table(
      ["backend", "workers", "augment", "median img/s", "best img/s",
       "/ 1 process", "CPU ms/img"], rows)
  table += "\n\n" + common.format_table(
      ["algorithm", f"{needs['device']} step ms", "img/s needed",
       f"cores at {needs['images_per_s_per_core']:.0f} img/s"],
      [[name, n["step_ms"], n["images_per_s"], n["cores"]]
       for name, n in needs["algorithms"].items()])
  common.publish(record, table, args.out)
  return record


if __name__ == "__main__":
  main()
