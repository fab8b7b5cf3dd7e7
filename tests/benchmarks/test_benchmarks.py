"""The benchmarks run end to end on a tiny config and write complete JSON.

Nothing here asserts on speed; memory only against its bound.
(The multi-device path of ``step_time`` runs in ``test_sharding.py``.)
"""

import json

import jax
import pytest

from benchmarks import common
from benchmarks import folder_fingerprint
from benchmarks import memory
from benchmarks import step_time
from benchmarks import trajectory_products
from pgrad_jax._src import layout

# A rolled scan compiles fastest.
TINY = ["--hidden", "8", "--domains", "2", "--batch", "4", "--B", "2",
        "--k", "2", "--unroll", "1"]
ENVIRONMENT = {"platform", "device_kind", "device_count", "process_count",
               "jax", "jaxlib", "optax"}


def run_json(main, argv, tmp_path):
  out = tmp_path / "result.json"
  returned = main(argv + ["--out", str(out)])
  written = json.loads(out.read_text())
  assert written == json.loads(json.dumps(returned))
  assert written["environment"].keys() == ENVIRONMENT
  return written


def test_step_time(tmp_path, capsys):
  record = run_json(step_time.main, ["--model", "mlp", *TINY, "--repeats",
                                     "2", "--warmup", "0"], tmp_path)
  assert record["config"]["m"] == 5
  assert record["config"]["devices"] == 1
  assert record["results"].keys() == {"erm", "rollout", "fish", "pgrad-B",
                                      "dann", "mldg"}
  assert record["results"]["dann"]["unroll"] is None
  for result in record["results"].values():
    assert len(result["times_ms"]) == 2
    assert {"median_ms", "compile_ms", "ratio_to_rollout", "ratio_to_erm",
            "unroll"} <= result.keys()
  assert record["results"]["rollout"]["ratio_to_rollout"] == 1
  assert record["split"].keys() == {"rollout (with trajectory)", "gram",
                                    "eigh (m x m)", "projection"}
  # The read rate: the trajectory's bytes over each reading part's time.
  trajectory_bytes = record["config"]["trajectory_bytes"]
  for name, part in record["split"].items():
    if name in ("gram", "projection"):
      assert part["read_gb_per_s"] == pytest.approx(
          trajectory_bytes / part["median_ms"] / 1e6)
    else:
      assert part["read_gb_per_s"] is None
  assert "pgrad-B" in capsys.readouterr().out


def test_step_time_times_the_other_domainbed_algorithms(tmp_path):
  record = run_json(step_time.main, [
      "--model", "mlp", *TINY, "--repeats", "1", "--warmup", "0",
      "--methods", "erm", "andmask", "sandmask", "iga", "rsc", "selfreg",
      "mtl", "--no-split"], tmp_path)
  assert record["results"].keys() == {"erm", "andmask", "sandmask", "iga",
                                      "rsc", "selfreg", "mtl"}
  for result in record["results"].values():
    assert result["median_ms"] > 0 and result["ratio_to_erm"] > 0


def test_step_time_times_only_the_methods_asked_for(tmp_path, capsys):
  record = run_json(step_time.main, [
      "--model", "mlp", *TINY, "--repeats", "1", "--warmup", "0",
      "--methods", "fish", "pgrad-B", "--no-split"], tmp_path)
  assert record["results"].keys() == {"fish", "pgrad-B"}
  for result in record["results"].values():
    # Without ERM or the rollout, no ratio to them.
    assert result["ratio_to_rollout"] is None
    assert result["ratio_to_erm"] is None
  assert "fish" in capsys.readouterr().out


def test_step_time_times_the_further_domainbed_baselines(tmp_path):
  # SagNet's model has its style head; CDANN's time is a cycle's mean.
  record = run_json(step_time.main, [
      "--model", "mlp", *TINY, "--repeats", "1", "--warmup", "0",
      "--methods", "erm", "sagnet", "cdann", "--no-split"], tmp_path)
  assert record["results"].keys() == {"erm", "sagnet", "cdann"}
  for name in ("sagnet", "cdann"):
    assert record["results"][name]["ratio_to_erm"] > 0


def test_trajectory_products_match_float64(tmp_path):
  record = run_json(trajectory_products.main, [
      "--steps", "3", "--params", "1000", "--blocks", "64", "4096",
      "--repeats", "1"], tmp_path)
  results = record["results"]
  assert set(results) == {
      "gram, one block", "projection, one block", "gram, blocks of 64",
      "projection, blocks of 64", "gram, blocks of 4096",
      "projection, blocks of 4096", "gram, one block, default precision",
      "projection, matrix-vector product", "eigh (m x m)"}
  for name, row in results.items():
    if name != "eigh (m x m)":
      # float32 products of float32 numbers: a few float32 roundings off.
      assert row["max_relative_error"] < 1e-5, name


def test_step_time_compare_unroll(tmp_path):
  # One domain, one chunk: the unrolled scan compiles as fast as the rolled.
  record = run_json(step_time.main, [
      "--model", "mlp", *TINY, "--domains", "1", "--B", "1", "--repeats", "1",
      "--warmup", "0", "--compare-unroll"], tmp_path)
  assert record["results"].keys() == {
      "erm", "rollout [unroll=1]", "pgrad-B [unroll=1]",
      "rollout [unroll=full]", "pgrad-B [unroll=full]"}
  results = record["results"]
  for unroll in ("1", "full"):
    pgrad, rollout = (results[f"{name} [unroll={unroll}]"]
                      for name in ("pgrad-B", "rollout"))
    assert pgrad["unroll"] == unroll
    assert pgrad["ratio_to_rollout"] == pytest.approx(
        pgrad["median_ms"] / rollout["median_ms"])
  assert record["split"] == {}


@pytest.fixture(name="memory_record", scope="module")
def fixture_memory_record(tmp_path_factory):
  """One run of the memory benchmark: a 0.3M-parameter MLP with m = 16."""
  return run_json(memory.main, ["--hidden", "256", "--domains", "5"],
                  tmp_path_factory.mktemp("memory"))


def test_memory(memory_record):
  (row,) = memory_record["rows"]
  assert (row["hidden"], row["m"]) == (256, 16)
  sizes = [x.size for x in jax.tree.leaves(common.mlp(256).params)]
  # On one CPU device the leaves whose size the block divides are stored
  # interleaved, theta_0 included; the others stack the m - 1 steps.
  points = [row["m"] if size % layout.CPU_INTERLEAVE_BLOCK == 0 else row["m"] - 1
            for size in sizes]
  assert row["trajectory_bytes"] == 4 * sum(
      p * size for p, size in zip(points, sizes))
  assert points.count(row["m"]) >= 1
  assert row["compiled"]["peak"] > 0
  assert row["bound_bytes"] > row["trajectory_bytes"]
  bf16 = memory_record["bfloat16_trajectory"]
  assert 0 <= bf16["relative_error"] < 1
  assert -1 <= bf16["cosine_similarity"] <= 1 + 1e-9


def test_step_peak_is_the_rows_own_or_unknown():
  # The high-water mark rose during the step: the step's peak is the new mark
  # above what was in use before it, plus its arguments.
  before = {"bytes_in_use": 300, "peak_bytes_in_use": 900}
  after = {"bytes_in_use": 350, "peak_bytes_in_use": 1000}
  assert memory.step_peak_bytes(before, after, argument_bytes=100) == 800
  # It did not rise (compilation or an earlier row set it): unknown.
  after = {"bytes_in_use": 350, "peak_bytes_in_use": 900}
  assert memory.step_peak_bytes(before, after, argument_bytes=100) is None


def test_mesh_helpers_on_one_device():
  mesh = common.make_mesh()
  assert dict(mesh.shape) == {common.DATA: 1, common.FSDP: 1}
  model = common.mlp(8)
  placed = common.place(model.params, mesh, fsdp=True)
  batches = common.shard_batches(common.random_batches(model, 2, 4), mesh)
  assert batches["x"].shape == (2, 4, common.MLP_INPUTS)
  assert tuple(batches["x"].sharding.spec) == (None, common.DATA)
  assert all(x.sharding.mesh == mesh for x in placed.values()
             for x in x.values())


@pytest.mark.parametrize("shape, size, spec", [
    ((16, 64), 8, (None, common.FSDP)),
    ((64,), 8, (common.FSDP,)),
    ((10,), 8, ()),
    ((), 8, ()),
    ((16, 64), 1, ()),
])
def test_fsdp_spec(shape, size, spec):
  assert tuple(common.fsdp_spec(shape, size)) == spec


def test_memory_peak_stays_near_the_bound(memory_record):
  # XLA:CPU's compiled memory analysis is deterministic. The trajectory is
  # written in place and the Gram product does not copy it, so the peak is
  # the trajectory plus 5 d plus small buffers, and the default
  # nonfinite="skip" adds the previous Adam state it may restore.
  (row,) = memory_record["rows"]
  adam_state = 2 * row["param_bytes"]
  assert row["compiled_propagate"]["peak"] <= 1.1 * row["bound_bytes"]
  assert row["compiled"]["peak"] <= 1.1 * (row["bound_bytes"] + adam_state)


def test_input_pipeline_times_every_configuration_and_feeds_the_h100(
    tmp_path):
  from benchmarks import input_pipeline
  record = run_json(input_pipeline.main, [
      "--per-class", "1", "--size", "40", "--batch", "2", "--workers", "1",
      "--batches", "1", "--repeats", "1"], tmp_path)
  results = record["results"]
  assert {(r["backend"], r["workers"], r["augment"]) for r in results} == {
      (backend, 1, augment) for backend in ("threads", "processes")
      for augment in (False, True)}
  for result in results:
    assert result["median_images_per_s"] > 0
    assert (result["median_cpu_ms_per_image"] is None) == (
        result["backend"] == "processes")
  (one,) = [r for r in results if r["backend"] == "threads"
            and r["workers"] == 1 and r["augment"]]
  per_core = 1000 / one["median_cpu_ms_per_image"]
  accelerator = record["accelerator"]
  assert accelerator["images_per_s_per_core"] == per_core
  steps = json.loads((input_pipeline.REPO / input_pipeline.STEP_TIMES)
                     .read_text())["results"]
  for name, key in (("ERM", "erm"), ("PGrad-B", "pgrad-B")):
    need = accelerator["algorithms"][name]
    # 3 domains x 33 images per step on the H100.
    assert need["images_per_s"] == pytest.approx(
        99_000 / steps[key]["median_ms"])
    assert need["cores"] == -(-need["images_per_s"] // per_core)


def _records(step_times, **start_up):
  """A run's records, evaluated every 5 steps: (step_time, data_wait_time)
  or (step_time, data_wait_time, device_wait_time) of each interval, and the
  start-up fields on the first record."""
  return [{"step": 5 * (i + 1), "step_time": times[0],
           "data_wait_time": times[1],
           **({"device_wait_time": times[2]} if len(times) > 2 else {}),
           **(start_up if i == 0 else {})}
          for i, times in enumerate(step_times)]


def test_end_to_end_ratios_come_from_the_measured_times(capsys):
  from benchmarks import end_to_end
  case = end_to_end.make_case("mnist_cnn", end_to_end.parse_args([]))
  # PGrad-B's default batch on RotatedDigits, 5 training domains.
  assert (case.dataset, case.domains, case.batch) == ("RotatedDigits", 5, 63)
  cold = _records([(9.0, 2.0, 6.0), (0.30, 0.01, 0.25), (0.50, 0.03, 0.40)],
                  init_time=2.0, compile_time=6.0, first_batch_time=2.5,
                  time_to_first_step=8.5)
  warm = [_records([(4.0, 2.0, 1.0), (0.40, 0.02, 0.30)], init_time=0.5,
                   compile_time=1.5, first_batch_time=0.5,
                   time_to_first_step=3.0),
          _records([(3.0, 2.0, 0.5), (0.20, 0.02, 0.10)], init_time=0.25,
                   compile_time=1.0, first_batch_time=0.5,
                   time_to_first_step=2.0)]
  # Calls before the cold run, then after each run: the host slows down.
  update = [[300.0, 200.0], [400.0], [800.0, 600.0], [200.0]]
  row = end_to_end.summarize(case, "PGrad-B", [cold, *warm],
                             [20.0, 12.0, 11.0], update, 5000.0)
  # Every interval but a run's first, 5 steps each.
  step_s = (0.30 + 0.50 + 0.40 + 0.20) / 4
  assert row["loop_step_ms"] == pytest.approx(1e3 * step_s)
  # Means of both: the loop's holds its slow steps, as the update's its
  # slow calls.
  assert row["update_ms"] == pytest.approx(2500.0 / 6)
  assert row["update_median_ms"] == 350.0
  assert row["update_times_ms"] == update
  assert row["update_compile_ms"] == 5000.0
  # Each run over the update's calls just before and after it.
  ratios = [400.0 / (900.0 / 3), 400.0 / (1800.0 / 3), 200.0 / (1600.0 / 3)]
  assert [run["loop_over_update"] for run in row["runs"]] == pytest.approx(
      ratios)
  assert [run["update_ms"] for run in row["runs"]] == pytest.approx(
      [300.0, 600.0, 1600.0 / 3])
  assert row["loop_over_update"] == pytest.approx(ratios[1])
  assert row["loop_over_update_range"] == pytest.approx(
      [ratios[2], ratios[0]])
  wait_s = (0.01 + 0.03 + 0.02 + 0.02) / 4
  assert row["data_wait_ms"] == pytest.approx(1e3 * wait_s)
  assert row["data_wait_share"] == pytest.approx(wait_s / step_s)
  device_s = (0.25 + 0.40 + 0.30 + 0.10) / 4
  assert row["device_wait_ms"] == pytest.approx(1e3 * device_s)
  # The loop's own work: the step but its waits.
  assert row["host_ms"] == pytest.approx(1e3 * (step_s - wait_s - device_s))
  assert [run["host_ms"] for run in row["runs"]] == pytest.approx(
      [1e3 * (0.40 - 0.02 - 0.325), 1e3 * (0.40 - 0.02 - 0.30),
       1e3 * (0.20 - 0.02 - 0.10)])
  assert [run["cache"] for run in row["runs"]] == ["cold", "warm", "warm"]
  assert {k: row["runs"][0][k] for k in end_to_end.START_UP_FIELDS} == {
      "init_time": 2.0, "compile_time": 6.0, "first_batch_time": 2.5,
      "time_to_first_step": 8.5}
  assert [run["start_up_ratio"] for run in row["runs"]] == pytest.approx(
      [1.0, 1.5, 4 / 3])
  assert [run["wall_s"] for run in row["runs"]] == [20.0, 12.0, 11.0]
  # The cold run's against the warm runs' median.
  assert row["warm_saves_s"] == pytest.approx(
      {"init_time": 1.625, "compile_time": 4.75, "time_to_first_step": 6.0})
  assert row["hparams"] == {"batch_size": 63, "image_size": 28, "B": 3,
                            "k": 4}
  with pytest.raises(ValueError, match="2 runs need 3 sets"):
    end_to_end.summarize(case, "ERM", [cold, warm[0]], [1.0, 1.0],
                         update[:2], 1.0)

  # A benchmark cut short after the cold run: its row so far, the warm runs'
  # numbers None, its own as with warm runs.
  cut = end_to_end.summarize(case, "PGrad-B", [cold], [20.0], update[:2],
                             5000.0)
  assert cut["warm_saves_s"] == {"init_time": None, "compile_time": None,
                                 "time_to_first_step": None}
  assert [run["cache"] for run in cut["runs"]] == ["cold"]
  assert cut["loop_over_update"] == pytest.approx(ratios[0])
  assert cut["loop_step_ms"] == pytest.approx(1e3 * (0.30 + 0.50) / 2)
  assert " n/a " in end_to_end.report(
      {"environment": common.environment(),
       "config": {"steps": 10, "checkpoint_freq": 5, "warm_runs": 1},
       "results": [cut]})

  # Records of a loop that does not time its start-up: "n/a", no crash.
  old = end_to_end.summarize(
      case, "ERM", [_records([(9.0, 2.0), (0.3, 0.0)]),
                    _records([(4.0, 2.0), (0.3, 0.0)])],
      [20.0, 12.0], update[:3], 5000.0)
  assert old["runs"][0]["compile_time"] is None
  assert old["runs"][0]["start_up_ratio"] is None
  assert old["host_ms"] is None and old["runs"][0]["host_ms"] is None
  assert old["warm_saves_s"] == {"init_time": None, "compile_time": None,
                                 "time_to_first_step": None}
  record = {"environment": common.environment(),
            "config": {"steps": 10, "checkpoint_freq": 5, "warm_runs": 1},
            "results": [row, old]}
  json.dumps(record)
  table = end_to_end.report(record)
  (pgrad_line,) = [line for line in table.splitlines() if "PGrad-B" in line]
  # The warm columns are the warm runs' medians.
  assert " 2.5 " in pgrad_line and " 1.25 " in pgrad_line
  assert " 0.375 " in pgrad_line
  assert f"{ratios[2]:.3f}-{ratios[0]:.3f}" in pgrad_line
  (erm_line,) = [line for line in table.splitlines() if " ERM " in line]
  assert erm_line.count("n/a") == 10


def test_end_to_end_loop_allocates_as_the_user_says(monkeypatch, tmp_path):
  from benchmarks import end_to_end
  # As the command sets it for itself, so that its updates take little of a
  # GPU's memory while the loop trains.
  monkeypatch.setenv(end_to_end.PREALLOCATE_ENV, "false")
  env = end_to_end.loop_environment(tmp_path)
  assert end_to_end.PREALLOCATE_ENV not in env
  assert env[end_to_end.CACHE_ENV] == str(tmp_path)
  env = end_to_end.loop_environment(tmp_path, users_preallocate="true")
  assert env[end_to_end.PREALLOCATE_ENV] == "true"


@pytest.mark.parametrize("flags", [
    ["--steps", "9", "--checkpoint-freq", "5"],
    ["--warm-runs", "0"],
    ["--repeats", "0"],
])
def test_end_to_end_refuses_what_it_cannot_measure(flags):
  from benchmarks import end_to_end
  with pytest.raises(SystemExit) as raised:
    end_to_end.parse_args(flags)
  assert raised.value.code == 2


@pytest.mark.slow
def test_end_to_end_trains_and_times_a_toy_run(tmp_path, capsys):
  from benchmarks import end_to_end
  record = run_json(end_to_end.main, [
      "--models", "mnist_cnn", "--algorithms", "ERM", "--batch", "4",
      "--steps", "2", "--checkpoint-freq", "1", "--eval-examples", "8",
      "--repeats", "1", "--warmup", "0"], tmp_path)
  (row,) = record["results"]
  assert (row["model"], row["algorithm"], row["steps"]) == (
      "mnist_cnn", "ERM", [1, 2])
  assert row["loop_step_ms"] > 0 and row["update_ms"] > 0
  # The loop records its waits, and they are parts of its steps.
  assert row["device_wait_ms"] >= 0 and row["host_ms"] >= 0
  # Timed before, between and after the two runs, once each.
  assert [len(calls) for calls in row["update_times_ms"]] == [1, 1, 1]
  assert [run["cache"] for run in row["runs"]] == ["cold", "warm"]
  for run, before, after in zip(row["runs"], row["update_times_ms"],
                                row["update_times_ms"][1:]):
    assert run["wall_s"] > 0
    assert run["loop_over_update"] == pytest.approx(
        run["loop_step_ms"] / ((before[0] + after[0]) / 2))
  assert "loop / update" in capsys.readouterr().out


def test_folder_fingerprint_times_its_passes_and_multiplies_them_out(
    tmp_path, capsys):
  out = tmp_path / "result.json"
  folder_fingerprint.main(["--files", "12", "--size", "16", "--repeats", "2",
                           "--extrapolate_to", "1000", "--out", str(out)])
  record = json.loads(out.read_text())
  passes = {"listing", "headers", "headers and digests"}
  assert record["seconds"].keys() == passes
  for name, rounds in record["seconds"].items():
    assert len(rounds) == 2
    median = sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2
    assert record["per_file_us"][name] == pytest.approx(median / 12 * 1e6)
    assert record["extrapolated_s_for_1000_files"][name] == pytest.approx(
        median / 12 * 1000)
  assert "12 files of" in capsys.readouterr().out
