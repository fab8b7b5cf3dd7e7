"""Where one PGrad-B update spends its time, op by op, from a JAX trace.

`benchmarks.step_time` times a PGrad-B update whole and its parts each
jitted alone; the parts add up to less than the update costs over the bare
rollout. This traces the compiled programs themselves with
``jax.profiler.trace`` and sums the XLA ops' own time:

* ``pgrad-B``: one update of `step_time.Methods.pgrad`;
* ``rollout``: one call of the bare rollout (`step_time.Methods.rollout`,
  the trajectory kept), the inner steps PGrad-B runs before its principal
  step.

Each program is called ``--warmup`` times, then ``--calls`` times inside the
trace. The trace is read from the Chrome-format ``*.trace.json.gz`` that
``create_perfetto_trace=True`` makes JAX write next to its ``.xplane.pb``,
without TensorBoard: every event that names an HLO op of the program's
module (its ``hlo_op`` and ``hlo_module`` args) counts, on the device where
the trace has one (a GPU's or TPU's process), else on the host (XLA:CPU
runs its ops on host threads). Events nest (a loop's body inside the
loop), so each counts its own time, less that of the events inside it.
Every op is named with the source line its HLO metadata points at, read
from the compiled program's text; the ops of the library's principal step
point at ``pgrad_jax/_src/principal.py`` (its Gram matrix, centring,
orientation, calibration and projection).

The tables, by op and by source file, give the count (calls of the op over
the traced calls), the total and per-update milliseconds, and the share of
the program's summed op time. Two more isolate the principal step: PGrad-B's
ops from source lines the rollout's program has none of (`principal_step`),
and PGrad-B's ops against the rollout's, grouped by the op's name without
its number (``fusion.12`` and ``fusion.7`` are both ``fusion``).

Run ``python -m benchmarks.profile_update --help`` for the flags. The
tables go to stdout; with ``--out`` the record goes to a JSON file and the
tables to a Markdown file beside it (``.md`` for ``.json``).
"""

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from benchmarks import common
from benchmarks import step_time

REPO = Path(__file__).resolve().parents[1]

# Events on a process with one of these names ran on an accelerator.
DEVICE_PROCESS_PREFIXES = ("/device:GPU", "/device:TPU")
# A GPU trace repeats the ops of its kernels on a line of their own; where a
# device has it, only that line counts, so no op is counted twice.
XLA_OPS_THREAD = "XLA Ops"
_NUMBER_SUFFIX = re.compile(r"([._-]\d+)+$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_METADATA = re.compile(r"metadata=\{([^}]*)\}")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", choices=common.MODELS, default="resnet50")
  parser.add_argument("--hidden", type=int, default=2048,
                      help="MLP hidden width.")
  parser.add_argument("--image-size", type=int, default=None,
                      help="Image side for the CNNs (default 28 / 224).")
  parser.add_argument("--domains", type=int, default=3)
  parser.add_argument("--batch", type=int, default=33,
                      help="Examples per domain, split into B chunks.")
  parser.add_argument("--B", type=int, default=3)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--warmup", type=int, default=2,
                      help="Calls of each program before the trace.")
  parser.add_argument("--calls", type=int, default=1,
                      help="Calls of each program inside the trace.")
  parser.add_argument("--top", type=int, default=25,
                      help="Rows of the tables printed and written as "
                      "Markdown (the JSON holds every row).")
  parser.add_argument("--rows", type=int, default=200,
                      help="Ops the JSON keeps, the longest (the shares "
                      "and totals count them all).")
  parser.add_argument("--trace-dir", default=None,
                      help="Keep the traces here (default: a temporary "
                      "directory, removed after).")
  parser.add_argument("--out", default=None, help="Write the results as JSON "
                      "and the tables as Markdown beside it.")
  args = parser.parse_args(argv)
  for name in ("domains", "batch", "B", "k", "calls", "top", "rows"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1.")
  if args.warmup < 0:
    parser.error("--warmup must be at least 0.")
  if args.batch % args.B:
    parser.error(f"--batch ({args.batch}) must be a multiple of --B "
                 f"({args.B}): every inner step takes batch / B examples.")
  return args


def _short_path(path: str) -> str:
  """A source file as the tables name it: relative to this repository or
  to the installed packages, so no machine's own paths get into a result."""
  for root in (str(REPO) + "/", "site-packages/", "dist-packages/"):
    if root in path:
      return path.split(root, 1)[1]
  return path


def hlo_sources(hlo_text: str) -> dict[str, str]:
  """Each instruction of a compiled program's text, by name, to the source
  its metadata points at: ``file:line`` of its innermost stack frame (the
  text's ``StackFrames`` tables, or an older ``source_file``), else its
  ``op_name`` (JAX's name stack); a fusion without metadata gets its fused
  computation's root's."""
  tables = {"FileNames": {}, "FileLocations": {}, "StackFrames": {}}
  table = None
  for line in hlo_text.splitlines():
    if line.strip() in tables:
      table = tables[line.strip()]
      continue
    entry = re.match(r"^(\d+)\s+(.*)$", line) if table is not None else None
    if entry:
      table[entry.group(1)] = entry.group(2)
    else:
      table = None
  files = {i: v.strip('"') for i, v in tables["FileNames"].items()}

  def field(text, name):
    found = re.search(name + r"=(\d+)", text)
    return found and found.group(1)

  def frame_source(frame_id):
    location = tables["FileLocations"].get(
        field(tables["StackFrames"].get(frame_id, ""), "file_location_id"))
    if location is None:
      return None
    name = files.get(field(location, "file_name_id"))
    return name and f"{_short_path(name)}:{field(location, 'line')}"

  sources, calls, roots, computation = {}, {}, {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction and line.lstrip().startswith("ROOT"):
      roots[computation] = instruction.group(1)
    called = instruction and re.search(r"calls=%?([\w.\-]+)",
                                       instruction.group(2))
    if called:
      calls[instruction.group(1)] = called.group(1)
    metadata = instruction and _METADATA.search(instruction.group(2))
    if not metadata:
      continue
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', metadata.group(1)))
    fields = {k: v.strip('"') for k, v in fields.items()}
    source = frame_source(fields.get("stack_frame_id"))
    if source is None and "source_file" in fields:
      source = (f"{_short_path(fields['source_file'])}:"
                f"{fields.get('source_line', '?')}")
    if source is None:
      source = fields.get("op_name")
    if source is not None:
      sources[instruction.group(1)] = source
  # A fusion without metadata of its own: its fused computation's root's.
  for name, computation in calls.items():
    root_source = sources.get(roots.get(computation))
    if name not in sources and root_source is not None:
      sources[name] = root_source
  return sources


def hlo_module_name(hlo_text: str) -> str:
  """The ``HloModule`` name a compiled program's text starts with."""
  found = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
  if not found:
    raise ValueError("No HloModule line in the program's text.")
  return found.group(1)


def load_trace(trace_dir: str | Path) -> list[dict[str, Any]]:
  """The events of the one ``*.trace.json.gz`` under ``trace_dir``."""
  files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
  if len(files) != 1:
    raise FileNotFoundError(
        f"Expected one *.trace.json.gz under {trace_dir}, found "
        f"{[str(f) for f in files]}: trace with "
        "jax.profiler.trace(..., create_perfetto_trace=True), once per "
        "directory.")
  with gzip.open(files[0], "rt") as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def _names(events: Sequence[Mapping[str, Any]]
           ) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
  """The trace's process names by pid and thread names by (pid, tid)."""
  processes, threads = {}, {}
  for event in events:
    if event.get("ph") != "M":
      continue
    name = (event.get("args") or {}).get("name", "")
    if event.get("name") == "process_name":
      processes[event["pid"]] = name
    elif event.get("name") == "thread_name":
      threads[event["pid"], event.get("tid")] = name
  return processes, threads


def of_module(name: str | None, module: str) -> bool:
  """Whether an event's ``hlo_module`` is ``module``, which a trace may
  write with the program's id after it (``jit_step(12)``, ``jit_step.3``)."""
  return name is not None and re.fullmatch(
      re.escape(module) + r"([.(].*)?", name) is not None


def op_events(events: Iterable[Mapping[str, Any]],
              module: str) -> list[dict[str, Any]]:
  """The complete (``"X"``) events of ``module``'s HLO ops, each with its
  own time (``self_us``: its duration less that of the events nested in
  it on its thread), from the device's processes where the trace has any,
  else from every process."""
  events = list(events)
  processes, threads = _names(events)
  ops = [e for e in events if e.get("ph") == "X"
         and of_module((e.get("args") or {}).get("hlo_module"), module)
         and (e.get("args") or {}).get("hlo_op")]
  on_device = [e for e in ops if processes.get(e["pid"], "").startswith(
      DEVICE_PROCESS_PREFIXES)]
  if on_device:
    op_lines = {e["pid"] for e in on_device
                if threads.get((e["pid"], e.get("tid"))) == XLA_OPS_THREAD}
    ops = [e for e in on_device if e["pid"] not in op_lines
           or threads.get((e["pid"], e.get("tid"))) == XLA_OPS_THREAD]
  # Own time: an event's duration less its children's, thread by thread.
  ops.sort(key=lambda e: (e["pid"], e.get("tid"), e["ts"], -e["dur"]))
  result, stack = [], []
  for event in ops:
    event = {**event, "self_us": event["dur"]}
    while stack and (stack[-1]["pid"], stack[-1].get("tid")) == (
        event["pid"], event.get("tid")) and (
            event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]):
      stack.pop()
    if stack and (stack[-1]["pid"], stack[-1].get("tid")) == (
        event["pid"], event.get("tid")):
      stack[-1]["self_us"] -= event["dur"]
    else:
      stack.clear()
    stack.append(event)
    result.append(event)
  return result


def summarize(ops: Sequence[Mapping[str, Any]], calls: int,
              sources: Mapping[str, str] | None = None,
              key: str = "op") -> list[dict[str, Any]]:
  """Rows of the ops' own time grouped by ``key``, longest first.

  Args:
    ops: `op_events`.
    calls: the traced calls of the program, for the per-update time.
    sources: `hlo_sources` of the program.
    key: ``"op"`` (the HLO op), ``"kind"`` (its name without its number) or
      ``"source"`` (the source file its metadata points at).

  Returns:
    Rows ``{name, count, total_ms, ms_per_update, share}`` (with the op's
    ``source`` where grouped by op), ``share`` of the summed own time.
  """
  sources = sources or {}

  def group(op):
    if key == "op":
      return op
    if key == "kind":
      return op_kind(op)
    return sources.get(op, "unknown").rsplit(":", 1)[0]

  total_us = collections.Counter()
  count = collections.Counter()
  for event in ops:
    name = group(event["args"]["hlo_op"])
    total_us[name] += event["self_us"]
    count[name] += 1
  summed = sum(total_us.values())
  rows = []
  for name, us in total_us.most_common():
    row = {"name": name, "count": count[name], "total_ms": us / 1e3,
           "ms_per_update": us / 1e3 / calls,
           "share": us / summed if summed else 0.0}
    if key == "op":
      row["source"] = sources.get(name)
    rows.append(row)
  return rows


def op_kind(op: str) -> str:
  """An op's name without the numbers XLA appends (``fusion.12``:
  ``fusion``)."""
  return _NUMBER_SUFFIX.sub("", op)


def principal_step(pgrad: Sequence[Mapping[str, Any]],
                   rollout: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """PGrad-B's ops from source lines the bare rollout's program has none
  of (rows of `summarize` by op): the principal step's, and its glue.

  The two programs run the same inner steps from the same lines, so what
  PGrad-B runs from other lines is what it adds. Ops without a source (a
  layout's copy, say) cannot be told apart and are left out.
  """
  rollout_sources = {r["source"] for r in rollout}
  ops = [dict(r) for r in pgrad
         if r["source"] is not None and r["source"] not in rollout_sources]
  return {"ms_per_update": sum(r["ms_per_update"] for r in ops),
          "ops": ops}


def difference(pgrad: Sequence[Mapping[str, Any]],
               rollout: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """PGrad-B's per-update time over the rollout's, kind by kind (rows of
  `summarize` with ``key="kind"``), the largest excess first."""
  ms = {"pgrad": {r["name"]: r["ms_per_update"] for r in pgrad},
        "rollout": {r["name"]: r["ms_per_update"] for r in rollout}}
  rows = [{"name": name, "pgrad_ms": ms["pgrad"].get(name, 0.0),
           "rollout_ms": ms["rollout"].get(name, 0.0),
           "excess_ms": ms["pgrad"].get(name, 0.0)
           - ms["rollout"].get(name, 0.0)}
          for name in ms["pgrad"].keys() | ms["rollout"].keys()]
  return sorted(rows, key=lambda r: -r["excess_ms"])


def trace_overview(events: Sequence[Mapping[str, Any]],
                   sample: int = 10) -> dict[str, Any]:
  """The trace's processes and threads, the ``hlo_module`` names its
  events carry, and its first ``sample`` complete events of a device (or
  of the host, where it has no device)."""
  processes, threads = _names(events)
  complete = [e for e in events if e.get("ph") == "X"]
  on_device = [e for e in complete if processes.get(e.get("pid"), "")
               .startswith(DEVICE_PROCESS_PREFIXES)]
  return {
      "threads": sorted({f"{processes.get(pid, pid)}: {name}"
                         for (pid, _), name in threads.items()}),
      "hlo_modules": sorted({str(e["args"]["hlo_module"]) for e in complete
                             if "hlo_module" in (e.get("args") or {})}),
      "first_events": [{k: e.get(k) for k in ("name", "dur", "args")}
                       for e in (on_device or complete)[:sample]],
  }


def trace_program(fn, call_args: Sequence[Any], warmup: int, calls: int,
                  trace_dir: Path) -> dict[str, Any]:
  """Compiles ``fn``, calls it ``warmup`` times, then traces ``calls``
  calls to ``trace_dir``; returns its module, the op rows and totals."""
  compiled = fn.lower(*call_args).compile()
  hlo_text = compiled.as_text()
  module = hlo_module_name(hlo_text)
  for _ in range(warmup):
    common.block(compiled(*call_args))
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    for _ in range(calls):
      common.block(compiled(*call_args))
  events = load_trace(trace_dir)
  ops = op_events(events, module)
  if not ops:
    print(f"The trace under {trace_dir} has no op of module {module}; its "
          "lines and first events are in the record.", file=sys.stderr)
  sources = hlo_sources(hlo_text)
  return {
      "module": module,
      # What the trace holds, for a trace that does not read as expected.
      "trace_overview": trace_overview(events),
      "op_ms_per_update": sum(e["self_us"] for e in ops) / 1e3 / calls,
      "num_ops": len({e["args"]["hlo_op"] for e in ops}),
      "by_op": summarize(ops, calls, sources, "op"),
      "by_kind": summarize(ops, calls, sources, "kind"),
      "by_source": summarize(ops, calls, sources, "source"),
  }


def run(args: argparse.Namespace, trace_root: Path) -> dict[str, Any]:
  """Traces both programs; returns the JSON record."""
  flags = step_time.parse_args([
      "--model", args.model, "--hidden", str(args.hidden),
      "--domains", str(args.domains), "--batch", str(args.batch),
      "--B", str(args.B), "--k", str(args.k)]
      + ([] if args.image_size is None
         else ["--image-size", str(args.image_size)]))
  model = common.build_model(args.model, image_size=args.image_size,
                             hidden=args.hidden)
  mesh = common.make_mesh()
  methods = step_time.Methods(model, flags, mesh)
  params = common.place(model.params, mesh)
  batches = common.shard_batches(
      common.random_batches(model, args.domains, args.batch), mesh)
  unroll = common.default_unroll(model, args.batch, args.B)
  programs = {"pgrad-B": methods.pgrad(unroll),
              "rollout": methods.rollout(unroll, trajectory=True)}
  traced = {}
  for name, (fn, state) in programs.items():
    print(f"Tracing {name}.", file=sys.stderr, flush=True)
    traced[name] = trace_program(
        fn, (params, common.place(state, mesh), batches), args.warmup,
        args.calls, trace_root / name.lower())
  principal = principal_step(traced["pgrad-B"]["by_op"],
                             traced["rollout"]["by_op"])
  for program in traced.values():
    program["by_op"] = program["by_op"][:args.rows]
  return {
      "benchmark": "profile_update",
      "environment": common.environment(),
      "config": vars(args) | {"num_params": model.num_params,
                              "m": args.domains * args.B + 1,
                              "unroll": common.unroll_name(unroll)},
      "programs": traced,
      "principal_step": principal | {"ops": principal["ops"][:args.rows]},
      "pgrad_over_rollout": difference(traced["pgrad-B"]["by_kind"],
                                       traced["rollout"]["by_kind"]),
  }


def _markdown_table(header: Sequence[str],
                    rows: Sequence[Sequence[Any]]) -> str:
  def cell(v):
    if v is None:
      return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "/")

  lines = ["| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def report(record: dict[str, Any], top: int) -> str:
  """The tables as Markdown: each program's ops and source files, then
  PGrad-B's kinds of op over the rollout's."""
  config, env = record["config"], record["environment"]
  parts = [
      f"{config['model']} ({config['num_params']:,} params), "
      f"{config['domains']} domains x {config['batch']}, B={config['B']}, "
      f"k={config['k']}, {env['device_kind']} ({env['platform']}), jax "
      f"{env['jax']}; {config['calls']} traced call(s) of each program"]
  for name, traced in record["programs"].items():
    parts.append(f"### {name}: {traced['op_ms_per_update']:.4g} ms of ops "
                 f"per update, {traced['num_ops']} ops (module "
                 f"{traced['module']})")
    parts.append(_markdown_table(
        ["op", "count", "total ms", "ms per update", "share", "source"],
        [[r["name"], r["count"], r["total_ms"], r["ms_per_update"],
          r["share"], r["source"]] for r in traced["by_op"][:top]]))
    parts.append(_markdown_table(
        ["source file", "count", "ms per update", "share"],
        [[r["name"], r["count"], r["ms_per_update"], r["share"]]
         for r in traced["by_source"][:top]]))
  principal = record["principal_step"]
  parts.append(f"### The principal step: {principal['ms_per_update']:.4g} ms "
               "per update in pgrad-B's ops from lines the rollout lacks")
  parts.append(_markdown_table(
      ["op", "count", "ms per update", "share of pgrad-B", "source"],
      [[r["name"], r["count"], r["ms_per_update"], r["share"], r["source"]]
       for r in principal["ops"][:top]]))
  parts.append("### pgrad-B over the rollout, by kind of op")
  parts.append(_markdown_table(
      ["kind of op", "pgrad-B ms", "rollout ms", "excess ms"],
      [[r["name"], r["pgrad_ms"], r["rollout_ms"], r["excess_ms"]]
       for r in record["pgrad_over_rollout"][:top]]))
  return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.trace_dir is None:
    with tempfile.TemporaryDirectory() as trace_root:
      record = run(args, Path(trace_root))
  else:
    record = run(args, Path(args.trace_dir))
  table = report(record, args.top)
  common.publish(record, table, args.out)
  if args.out:
    Path(args.out).with_suffix(".md").write_text(table + "\n")
  empty = [name for name, traced in record["programs"].items()
           if not traced["by_op"]]
  if empty:
    raise RuntimeError(f"No XLA op of {empty} in the traces; the record's "
                       "trace_overview shows what they hold.")
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
