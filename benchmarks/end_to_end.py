"""The training loop end to end, against the update it runs.

For every model and algorithm, ``python -m experiments.train`` trains in a
subprocess, as a user runs it: first with an empty persistent compilation
cache ("cold"), then ``--warm-runs`` times, each in a fresh output directory,
with the cache the first run filled ("warm"). The models train on their
datasets:

* the digits CNN (``mnist_cnn``) on the embedded RotatedDigits, at its
  default width, 28 px;
* a ResNet (``resnet18``, ``resnet50``) on a synthetic PACS-like folder of
  JPEGs (`benchmarks.input_pipeline.write_photo_folder`: 4 domains of 7
  classes) at ``--image-size``, from scratch, with DomainBed's augmentation.

Both algorithms train on the same batch, the default ``batch_size`` of
PGrad-B on the dataset (33 images of each of PACS's 3 training domains, 63 of
RotatedDigits' 5), and PGrad-B with its default ``B`` and ``k``. Each run is
evaluated every ``--checkpoint-freq`` steps; its records
(`experiments.rundir.records`) give

* the steady step time: the mean ``step_time`` of every record but the
  first (whose interval holds the start-up), weighted by its steps;
* the data wait, ``data_wait_time`` of the same records, the part of the
  step spent waiting for the training batch, and the device wait,
  ``device_wait_time``, the part spent waiting for the device to end steps;
  the rest, the host time, is the loop's own work, which a device runs
  ahead of only while it is the shorter;
* ``init_time`` (the model's and the optimizer state's), ``compile_time``,
  ``first_batch_time`` and ``time_to_first_step``, where the loop records
  them (older loops do not: "n/a"), and the start-up ratio: the time to the
  first step over the compile and the first batch, the two things a run
  must wait for (the loop overlaps them, so at best the ratio is under 1).
  The initialisation comes before both, and the first step's own time is
  in the time to it.

The update is `benchmarks.step_time`'s (``erm`` and ``pgrad-B``,
`step_time.Methods`) on the same device, network, image size and
``domains x batch`` examples, compiled in this process before the runs and
timed ``--repeats`` calls right before the first run of its algorithm and
right after every run. A shared machine's speed drifts over minutes by more
than the loop's overhead, so every run is set against the update's calls
just before and just after it: its "loop / update" is its steady step time
over the mean of those calls (means, as a mean over the loop's steps holds
its slow steps). The row's "loop / update" is the median of its runs'
ratios, with their range beside it. The updates stay in memory while the
loop trains; on a GPU this process allocates what they need, not JAX's
default share of the memory, which the loop's process takes.

Run ``python -m benchmarks.end_to_end --help`` for the flags; the results go
to stdout as a table and, with ``--out``, to a JSON file.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optax

from benchmarks import common
from benchmarks import input_pipeline
from benchmarks import step_time
from experiments import catalog
from experiments import config as config_lib
from experiments import hparams_registry
from experiments.rundir import records as records_lib

REPO = Path(__file__).resolve().parents[1]
MODELS = ("mnist_cnn", "resnet18", "resnet50")
# The benchmark's algorithms, by their `step_time.Methods` builders.
ALGORITHMS = {"ERM": "erm", "PGrad-B": "pgrad"}
DIGITS, PHOTOS = "RotatedDigits", "PACS"
# The loop's records of its start-up, in seconds (missing in older loops).
START_UP_FIELDS = ("init_time", "compile_time", "first_batch_time",
                   "time_to_first_step")
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# JAX takes most of a GPU's memory when it starts, unless told not to: this
# process's updates would leave the loop's too little.
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
_USERS_PREALLOCATE = os.environ.get(PREALLOCATE_ENV)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", choices=MODELS,
                      default=["resnet18", "mnist_cnn"])
  parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS,
                      default=list(ALGORITHMS))
  parser.add_argument("--image-size", type=int, default=32,
                      help="The ResNets' image side (DomainBed: 224).")
  parser.add_argument("--photo-size", type=int, default=64,
                      help="Side of the generated JPEGs (PACS: 227), "
                      "resized to --image-size when read.")
  parser.add_argument("--per-class", type=int, default=6,
                      help="Generated images per class and domain.")
  parser.add_argument("--batch", type=int, default=None,
                      help="Examples per training domain and step. Default: "
                      "PGrad-B's batch_size on the dataset.")
  parser.add_argument("--steps", type=int, default=10,
                      help="Training steps of every run.")
  parser.add_argument("--checkpoint-freq", type=int, default=5,
                      help="Steps between evaluations; the intervals after "
                      "the first time the steady steps.")
  parser.add_argument("--num-workers", type=int, default=None,
                      help="The loop's --num_workers. Default: its own.")
  parser.add_argument("--eval-examples", type=int, default=64,
                      help="The loop's --eval_examples and --loss_examples.")
  parser.add_argument("--warm-runs", type=int, default=1,
                      help="Runs of every algorithm after the cold one, "
                      "each with the cache the runs before it filled.")
  parser.add_argument("--repeats", type=int, default=5,
                      help="Timed calls of the update before the first run "
                      "and after every run.")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--out", default=None, help="Write the results as JSON.")
  args = parser.parse_args(argv)
  if args.warm_runs < 1:
    parser.error("--warm-runs must be at least 1: a warm run is what a "
                 "compilation cache hit is measured on.")
  if args.repeats < 1:
    parser.error("--repeats must be at least 1: every run is set against "
                 "the update's calls around it.")
  if args.steps < 2 * args.checkpoint_freq:
    parser.error("--steps must be at least twice --checkpoint-freq: the "
                 "first interval holds the start-up, the others the steady "
                 "steps.")
  return args


@dataclasses.dataclass(frozen=True)
class Case:
  """One model on its dataset, as both the loop and the update run it.

  Attributes:
    model: a name of `MODELS`.
    dataset: the dataset the loop trains on.
    image_size: the images' side.
    domains: the training domains of a step.
    batch: examples per training domain and step.
    hparams: per algorithm, the loop's ``--hparams``.
    B: PGrad-B's chunks.
    k: PGrad-B's principal components.
  """

  model: str
  dataset: str
  image_size: int
  domains: int
  batch: int
  hparams: Mapping[str, Mapping[str, Any]]
  B: int
  k: int


def make_case(model: str, args: argparse.Namespace) -> Case:
  """The dataset, images and batch of ``model``; PGrad-B's defaults there."""
  dataset = DIGITS if model == "mnist_cnn" else PHOTOS
  pgrad = hparams_registry.default_hparams("PGrad-B", dataset)
  batch = args.batch or pgrad["batch_size"]
  image_size = (pgrad["image_size"] if dataset == DIGITS
                else args.image_size)
  shared = {"batch_size": batch, "image_size": image_size}
  return Case(
      model=model, dataset=dataset, image_size=image_size,
      # Domain 0 held out.
      domains=len(catalog.DATASETS[dataset].domains) - 1, batch=batch,
      hparams={"ERM": shared,
               "PGrad-B": {**shared, "B": pgrad["B"], "k": pgrad["k"]}},
      B=pgrad["B"], k=pgrad["k"])


def loop_flags() -> dict[str, str]:
  """The training command's flags in this version of the loop, with their
  help (`experiments.config.Config`'s fields but those that are no flag,
  such as ``lr_schedule``, which a flag resolves to)."""
  return {field.name: field.metadata["help"]
          for field in dataclasses.fields(config_lib.Config)
          if field.metadata.get("flag", True)}


def train_command(case: Case, algorithm: str, output_dir: Path,
                  cache_dir: Path, data_dir: Path | None,
                  args: argparse.Namespace) -> list[str]:
  """The command line of one run of the loop."""
  command = [
      sys.executable, "-m", "experiments.train", "--dataset", case.dataset,
      "--algorithm", algorithm, "--model", case.model, "--test_envs", "0",
      "--output_dir", str(output_dir), "--steps", str(args.steps),
      "--checkpoint_freq", str(args.checkpoint_freq),
      "--hparams", json.dumps(case.hparams[algorithm]),
      "--eval_examples", str(args.eval_examples),
      "--loss_examples", str(args.eval_examples)]
  if data_dir is not None:
    command += ["--data_dir", str(data_dir)]
  if args.num_workers is not None:
    command += ["--num_workers", str(args.num_workers)]
  flags = loop_flags()
  # The environment variable points the cache of any loop; a loop with the
  # flag is told the same.
  if "compile_cache_dir" in flags:
    command += ["--compile_cache_dir", str(cache_dir)]
  # A loop that starts a ResNet from ImageNet weights by default (and
  # downloads them) trains from scratch with "none"; an older one does so
  # without the flag.
  if case.dataset == PHOTOS and "imagenet" in flags["pretrained"]:
    command += ["--pretrained", "none"]
  return command


def loop_environment(cache_dir: Path,
                     users_preallocate: str | None = None) -> dict[str, str]:
  """The environment of the loop's process: this one's, its compilation
  cache in ``cache_dir``, and GPU memory allocated as the user's
  environment says (``users_preallocate``, `PREALLOCATE_ENV` as this
  process started; by default, JAX's own default), not as this process
  does."""
  env = {**{k: v for k, v in os.environ.items() if k != PREALLOCATE_ENV},
         CACHE_ENV: str(cache_dir)}
  if users_preallocate is not None:
    env[PREALLOCATE_ENV] = users_preallocate
  return env


def train(command: Sequence[str], cache_dir: Path,
          output_dir: Path) -> tuple[list[records_lib.Record], float]:
  """Runs the loop; returns its records and the command's wall time (s).

  Raises:
    RuntimeError: the run failed; the message ends with its output.
  """
  env = loop_environment(cache_dir, _USERS_PREALLOCATE)
  start = time.perf_counter()
  process = subprocess.run(command, cwd=REPO, env=env, capture_output=True,
                           text=True, check=False)
  wall = time.perf_counter() - start
  if process.returncode:
    raise RuntimeError(
        f"{' '.join(command)} exited with {process.returncode}:\n"
        f"{process.stderr[-3000:]}")
  lines = (output_dir / records_lib.RESULTS_FILE).read_text().splitlines()
  return [json.loads(line) for line in lines], wall


def steady(runs: Sequence[Sequence[records_lib.Record]],
           key: str) -> float | None:
  """The mean of ``record[key]`` (per step) over the steady intervals of the
  runs, every record but a run's first, weighted by its steps; None where a
  record lacks it."""
  total = steps = 0.0
  for run in runs:
    for before, record in zip(run[:-1], run[1:]):
      if key not in record:
        return None
      interval = record["step"] - before["step"]
      total += record[key] * interval
      steps += interval
  return total / steps if steps else None


def start_up(run: Sequence[records_lib.Record],
             wall_s: float) -> dict[str, float | None]:
  """A run's start-up as its records give it (None where they do not), its
  start-up ratio, time to first step / (compile + first batch), and its
  command's wall time."""
  first = next((r for r in run if "compile_time" in r), {})
  fields = {field: first.get(field) for field in START_UP_FIELDS}
  waited = (None if fields["first_batch_time"] is None
            else fields["compile_time"] + fields["first_batch_time"])
  return {**fields,
          "start_up_ratio": (None if not waited
                             else fields["time_to_first_step"] / waited),
          "wall_s": wall_s}


def _host_ms(step_s: float | None, data_wait_s: float | None,
             device_wait_s: float | None) -> float | None:
  """The loop's own work a step (ms): its time but the waits; None where
  its records lack one."""
  if None in (step_s, data_wait_s, device_wait_s):
    return None
  return 1e3 * (step_s - data_wait_s - device_wait_s)


def _median(values: Sequence[float | None]) -> float | None:
  """The median, or None if any value is None or there is none."""
  return None if None in values or not values else statistics.median(values)


def run_summary(run: Sequence[records_lib.Record], wall_s: float,
                before_ms: Sequence[float], after_ms: Sequence[float]
                ) -> dict[str, Any]:
  """One run's start-up (`start_up`) and steady step, set against the
  update's calls just before and just after it (ms); None for what its
  records lack."""
  step_s = steady([run], "step_time")
  device_wait_s = steady([run], "device_wait_time")
  around_ms = statistics.mean([*before_ms, *after_ms])
  return {
      **start_up(run, wall_s),
      "loop_step_ms": None if step_s is None else 1e3 * step_s,
      "device_wait_ms": (None if device_wait_s is None
                         else 1e3 * device_wait_s),
      "host_ms": _host_ms(step_s, steady([run], "data_wait_time"),
                          device_wait_s),
      "update_ms": around_ms,
      "loop_over_update": (None if step_s is None
                           else 1e3 * step_s / around_ms)}


def summarize(case: Case, algorithm: str,
              runs: Sequence[Sequence[records_lib.Record]],
              walls: Sequence[float],
              update: Sequence[Sequence[float]],
              update_compile_ms: float) -> dict[str, Any]:
  """One row of the results: the loop's numbers against the update's.

  Args:
    case: the model and batch.
    algorithm: a name of `ALGORITHMS`.
    runs: the records of every run in order, the first with an empty
      compilation cache, the others with the cache the runs before filled.
    walls: the runs' wall times, in seconds.
    update: the update's times (ms), one list of calls before the first run
      and one after every run.
    update_compile_ms: the update's first call, compiling it.

  Returns:
    The row, with None for what the loop does not record.
  """
  if len(update) != len(runs) + 1 or len(walls) != len(runs):
    raise ValueError(f"{len(runs)} runs need {len(runs) + 1} sets of update "
                     f"calls and {len(runs)} wall times, not {len(update)} "
                     f"and {len(walls)}.")
  per_run = [{"cache": "warm" if i else "cold",
              **run_summary(run, wall, update[i], update[i + 1])}
             for i, (run, wall) in enumerate(zip(runs, walls))]
  cold, warm = per_run[0], per_run[1:]
  saved = {}
  for field in ("init_time", "compile_time", "time_to_first_step"):
    after = _median([run[field] for run in warm])
    saved[field] = (None if cold[field] is None or after is None
                    else cold[field] - after)
  ratios = [run["loop_over_update"] for run in per_run]
  step_s = steady(runs, "step_time")
  wait_s = steady(runs, "data_wait_time")
  device_wait_s = steady(runs, "device_wait_time")
  calls = [time for calls in update for time in calls]
  return {
      "model": case.model, "dataset": case.dataset,
      "image_size": case.image_size, "domains": case.domains,
      "batch": case.batch, "algorithm": algorithm,
      "hparams": dict(case.hparams[algorithm]),
      "loop_step_ms": None if step_s is None else 1e3 * step_s,
      "update_ms": statistics.mean(calls),
      "update_median_ms": statistics.median(calls),
      "update_compile_ms": update_compile_ms,
      "update_times_ms": [list(calls) for calls in update],
      # Every run against the update's calls around it, so that the
      # host's drift between runs cancels.
      "loop_over_update": _median(ratios),
      "loop_over_update_range": (None if None in ratios
                                 else [min(ratios), max(ratios)]),
      "data_wait_ms": None if wait_s is None else 1e3 * wait_s,
      "data_wait_share": (None if wait_s is None or not step_s
                          else wait_s / step_s),
      "device_wait_ms": None if device_wait_s is None else 1e3 * device_wait_s,
      "host_ms": _host_ms(step_s, wait_s, device_wait_s),
      "runs": per_run,
      # The cold run's against the warm runs' median.
      "warm_saves_s": saved,
      "steps": [r["step"] for r in runs[0]],
  }


def benchmark_model(case: Case) -> common.Model:
  """The network of ``case`` as `benchmarks.step_time` times it: the
  digits CNN at the width the loop builds, a ResNet as `common` builds it."""
  if case.model != "mnist_cnn":
    return common.build_model(case.model, image_size=case.image_size)
  width = hparams_registry.default_hparams("PGrad-B", DIGITS)["cnn_width"]
  network, params, stats = common.digits_cnn(case.image_size, width)

  def loss_fn(params, batch):
    logits, _ = network.logits(params, stats, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()

  return common.Model(params, loss_fn, (case.image_size, case.image_size, 1))


def update_calls(
    case: Case, algorithms: Sequence[str], args: argparse.Namespace
) -> tuple[dict[str, Callable[[], Any]], dict[str, common.Timing]]:
  """`step_time`'s updates of ``algorithms`` on the case's batch, as calls
  of no arguments, compiled and warmed up: their `common.Timing`s hold the
  compile times alone."""
  model = benchmark_model(case)
  flags = step_time.parse_args([
      "--domains", str(case.domains), "--batch", str(case.batch),
      "--B", str(case.B), "--k", str(case.k)])
  mesh = common.make_mesh()
  methods = step_time.Methods(model, flags, mesh)
  params = common.place(model.params, mesh)
  batches = common.shard_batches(
      common.random_batches(model, case.domains, case.batch), mesh)
  unroll = common.default_unroll(model, case.batch, case.B)
  calls = {}
  for algorithm in algorithms:
    build = getattr(methods, ALGORITHMS[algorithm])
    fn, state = build() if algorithm == "ERM" else build(unroll)
    state = common.place(state, mesh)
    calls[algorithm] = lambda fn=fn, state=state: fn(params, state, batches)
  return calls, common.time_interleaved(calls, 0, args.warmup)


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Trains and times everything ``args`` asks for; returns the record."""
  load = os.getloadavg()
  results = []
  with tempfile.TemporaryDirectory() as scratch:
    scratch = Path(scratch)
    for model in args.models:
      case = make_case(model, args)
      data_dir = None
      if case.dataset == PHOTOS:
        data_dir = input_pipeline.write_photo_folder(
            scratch / "photos", per_class=args.per_class,
            size=args.photo_size)
      print(f"Compiling the updates of {model}.", file=sys.stderr,
            flush=True)
      calls, compiled = update_calls(case, args.algorithms, args)

      def time_update(algorithm):
        # --repeats calls, after one that time_interleaved sets apart (as its
        # compile time): the caches a run left behind warm up again.
        return common.time_interleaved(
            {algorithm: calls[algorithm]}, args.repeats, 0)[algorithm].times_ms

      for algorithm in args.algorithms:
        cache_dir = scratch / f"cache_{model}_{algorithm}"
        runs, walls = [], []
        update_ms = [time_update(algorithm)]
        for i in range(1 + args.warm_runs):
          name = f"warm {i}" if i else "cold"
          print(f"Training {algorithm} with {model}, {name} cache.",
                file=sys.stderr, flush=True)
          output_dir = scratch / f"run_{model}_{algorithm}_{i}"
          records, wall = train(
              train_command(case, algorithm, output_dir, cache_dir,
                            data_dir, args), cache_dir, output_dir)
          runs.append(records)
          walls.append(wall)
          update_ms.append(time_update(algorithm))
          # Each run as it ends, so a benchmark cut short keeps what ran.
          ran = run_summary(records, wall, update_ms[-2], update_ms[-1])
          print(f"  {wall:.1f} s; init {_rounded(ran['init_time'])} s, "
                f"compile {_rounded(ran['compile_time'])} s, first step "
                f"{_rounded(ran['time_to_first_step'])} s; steady step "
                f"{_rounded(ran['loop_step_ms'])} ms, data wait "
                f"{_rounded(steady([records], 'data_wait_time'), 1e3)} ms, "
                f"host {_rounded(ran['host_ms'])} ms; update "
                f"{ran['update_ms']:.1f} ms around the run.",
                file=sys.stderr, flush=True)
          row = summarize(case, algorithm, runs, walls, update_ms,
                          compiled[algorithm].compile_ms)
          # The row so far after every run, so a benchmark cut short keeps
          # what ran (a row without warm runs has None for what they give).
          if args.out:
            common.write_json(make_record(args, load, [*results, row]),
                              args.out)
        results.append(row)
  return make_record(args, load, results)


def make_record(args: argparse.Namespace, load: Sequence[float],
                results: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The JSON record of the ``results`` so far; ``load``: the load
  averages when the benchmark started."""
  return {
      "benchmark": "end_to_end",
      "environment": common.environment(),
      # Other programs' load on the cores, over 1 minute.
      "host": {"cpu_cores": config_lib.default_num_workers(),
               "load_average_before": load[0],
               "load_average_after": os.getloadavg()[0]},
      "config": vars(args),
      "results": list(results),
  }


def _rounded(value: float | None, scale: float = 1.0) -> str:
  return "n/a" if value is None else f"{scale * value:.1f}"


def _cell(value: float | None, scale: float = 1.0) -> float | str:
  return "n/a" if value is None else scale * value


def _warm(row: dict[str, Any], field: str) -> float | None:
  """The median of ``field`` over a row's warm runs."""
  return _median([run[field] for run in row["runs"] if run["cache"] == "warm"])


def _range(bounds: Sequence[float] | None) -> str:
  return "n/a" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}"


def report(record: dict[str, Any]) -> str:
  """The table a run prints: "n/a" where the loop records nothing; the warm
  columns are the medians of the warm runs."""
  env = record["environment"]
  rows = []
  for r in record["results"]:
    cold = r["runs"][0]
    rows.append([
        f"{r['model']} {r['image_size']}px", r["algorithm"],
        f"{r['domains']} x {r['batch']}", _cell(r["loop_step_ms"]),
        r["update_ms"], _cell(r["loop_over_update"]),
        _range(r["loop_over_update_range"]), _cell(r["data_wait_ms"]),
        _cell(r["host_ms"]),
        _cell(cold["time_to_first_step"]),
        _cell(_warm(r, "time_to_first_step")), _cell(cold["init_time"]),
        _cell(_warm(r, "init_time")), _cell(cold["compile_time"]),
        _cell(_warm(r, "compile_time")), _cell(cold["first_batch_time"]),
        _cell(cold["start_up_ratio"]), _cell(_warm(r, "start_up_ratio")),
        cold["wall_s"], _warm(r, "wall_s")])
  return (f"{env['device_kind']} ({env['platform']}), jax {env['jax']}, "
          f"{record['config']['steps']} steps, evaluated every "
          f"{record['config']['checkpoint_freq']}; 1 cold and "
          f"{record['config']['warm_runs']} warm runs\n\n"
          + common.format_table(
              ["model", "algorithm", "batch", "loop step ms", "update ms",
               "loop / update", "range over runs", "data wait ms",
               "host ms",
               "first step s (cold)", "first step s (warm)",
               "init s (cold)", "init s (warm)",
               "compile s (cold)", "compile s (warm)", "first batch s (cold)",
               "start-up ratio (cold)", "start-up ratio (warm)",
               "run s (cold)", "run s (warm)"],
              rows))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  record = run(args)
  common.publish(record, report(record), args.out)
  return record


if __name__ == "__main__":
  # Read when JAX starts its backend, after this.
  os.environ[PREALLOCATE_ENV] = "false"
  main(sys.argv[1:])
