"""Time one update of ERM, Fish, PGrad-B, the bare rollout and baselines.

Every method takes the same ``domains x batch`` examples: ERM in one Adam step
on all of them, the others in ``domains * B`` sequential Adam steps on chunks
of ``batch / B``. The bare rollout is those inner steps alone
(``pgrad_jax.rollout``, storing the trajectory in the layout PGrad's
rollout uses), so "ratio to rollout" is what PGrad's principal components
cost on top. Fish keeps only the rollout's end point, so it can come in under
the bare rollout. A PGrad-B update is also split into its parts, each jitted
and timed on its own: rollout (storing the trajectory), Gram matrix, the
``m x m`` eigendecomposition and coefficients, and the weighted sum
(projection). The Gram matrix and the projection each read the whole
trajectory once, so they also report that read's rate, trajectory bytes per
second, to set against the device's memory bandwidth. Where the trajectory
is contiguous (one GPU, ``pgrad_jax._src.layout``), both are also timed on
the same trajectory stored leaf by leaf, the layout it replaces there.

The baselines are the study's own updates (``experiments.algorithms``) with
DomainBed's default hparams, on the same network (the MLP as a DomainBed
``MLP`` featurizer of the same widths and a linear head, with SagNet's style
head or MTL's embedding head where they need one) and examples: by default
DANN and MLDG, which the paper's appendix times against PGrad-B; with
``--methods``, also VREx, IB_ERM, SD, CDANN, SagNet, ANDMask, SANDMask, IGA,
RSC, SelfReg and MTL. DANN and CDANN alternate generator and discriminator
updates (``d_steps_per_g_step`` = 1), which cost differently: their time is
the mean update of one such cycle. MLDG pairs every domain once
(``mldg_pairs="random_pairs"``, DomainBed's MLDG before commit 960f6a2, that
of DomainBed's published results), two passes of one domain's batch per
pair.

With ``--devices N`` the batch axis is sharded over the first ``N`` devices
and every method runs data-parallel under ``shard_map`` (gradients averaged
over the ``data`` axis), each device chunking its own rows. The baselines
are timed on one device only: the study runs them unsharded.

Run ``python -m benchmarks.step_time --help`` for the flags; the results go to
stdout as a table and, with ``--out``, to a JSON file.
"""

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import pgrad_jax
from benchmarks import common
from pgrad_jax._src import principal
from pgrad_jax._src import trajectory as trajectory_lib

INNER_LR = 1e-3
# The experiments' algorithms timed beside PGrad-B, by their names here, with
# the hparams that differ from DomainBed's defaults. DANN and MLDG are timed
# by default; the others when asked for (``--methods``). SANDMask at
# DomainBed's tau = 1 masks every gradient, which costs as much as any tau.
BASELINES = {"dann": ("DANN", {}),
             "mldg": ("MLDG", {"mldg_pairs": "random_pairs"}),
             "vrex": ("VREx", {}), "ib_erm": ("IB_ERM", {}), "sd": ("SD", {}),
             "cdann": ("CDANN", {}), "sagnet": ("SagNet", {}),
             "andmask": ("ANDMask", {}), "sandmask": ("SANDMask", {}),
             "iga": ("IGA", {}), "rsc": ("RSC", {}),
             "selfreg": ("SelfReg", {}), "mtl": ("MTL", {})}
METHODS = ("erm", "rollout", "fish", "pgrad-B", *BASELINES)
# The paper's appendix times DANN and MLDG against PGrad-B.
DEFAULT_METHODS = ("erm", "rollout", "fish", "pgrad-B", "dann", "mldg")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", choices=common.MODELS, default="mlp")
  parser.add_argument("--hidden", type=int, default=2048,
                      help="MLP hidden width (2048: 4.2M parameters).")
  parser.add_argument("--image-size", type=int, default=None,
                      help="Image side for the CNNs (default 28 / 224).")
  parser.add_argument("--domains", type=int, default=5)
  parser.add_argument("--batch", type=int, default=63,
                      help="Examples per domain, split into B chunks.")
  parser.add_argument("--B", type=int, default=3)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--dtype", choices=common.DTYPES, default="float32",
                      help="Compute dtype; params stay float32.")
  parser.add_argument("--devices", type=int, default=1,
                      help="Data-parallel over the first N devices.")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--unroll", default="auto",
                      help="Scan unroll: auto (library default), full, or N.")
  parser.add_argument("--compare-unroll", action="store_true",
                      help="Time the rollout and PGrad-B rolled (unroll=1) "
                      "and fully unrolled instead of the default set.")
  parser.add_argument("--methods", nargs="+", choices=METHODS,
                      default=list(DEFAULT_METHODS),
                      help="The methods to time (default: "
                      f"{' '.join(DEFAULT_METHODS)}).")
  parser.add_argument("--no-split", action="store_true",
                      help="Skip timing the parts of a PGrad-B update.")
  parser.add_argument("--out", default=None, help="Write the results as JSON.")
  return parser.parse_args(argv)


class Methods:
  """The timed updates of one model and config, as jitted functions.

  Each takes ``(params, state, batches)`` with global arrays and runs under
  ``shard_map`` over the mesh's ``data`` axis: params and state replicated,
  batches split on their per-domain batch axis.
  """

  def __init__(self, model: common.Model, args: argparse.Namespace,
               mesh: jax.sharding.Mesh):
    self.model, self.args, self.mesh = model, args, mesh
    self.inner = optax.adam(INNER_LR)

  def data_parallel(self, fn):
    return jax.jit(jax.shard_map(
        fn, mesh=self.mesh, in_specs=(P(), P(), P(None, common.DATA)),
        out_specs=P()))

  def erm(self):
    """One Adam step on all ``domains x batch`` examples."""
    def step(params, opt_state, batches):
      flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batches)
      # Each device's own gradient (of a varying copy of the params; the
      # gradient of the replicated ones would come back summed), averaged
      # below.
      varying = jax.tree.map(
          lambda x: jax.lax.pcast(x, common.DATA, to="varying"), params)
      loss, grads = jax.value_and_grad(self.model.loss_fn)(varying, flat)
      loss, grads = jax.lax.pmean((loss, grads), common.DATA)
      updates, opt_state = self.inner.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return self.data_parallel(step), self.inner.init(self.model.params)

  def transform(self, tx: optax.GradientTransformationExtraArgs):
    """One outer step of a pgrad/fish chain, applied to the params."""
    def step(params, state, batches):
      updates, state = tx.update(None, state, params,
                                 loss_fn=self.model.loss_fn, batches=batches)
      return optax.apply_updates(params, updates), state

    return self.data_parallel(step), tx.init(self.model.params)

  def fish(self, unroll):
    return self.transform(optax.chain(
        pgrad_jax.fish(self.inner, self.args.B, unroll=unroll,
                       axis_name=common.DATA), optax.sgd(0.5)))

  def pgrad(self, unroll):
    return self.transform(optax.chain(
        pgrad_jax.pgrad(self.inner, self.args.k, self.args.B, unroll=unroll,
                        axis_name=common.DATA), optax.sgd(0.1)))

  def rollout(self, unroll, trajectory: bool = False):
    """The inner steps alone: the end point, or the whole trajectory."""
    args = self.args

    def step(params, inner_state, batches):
      domains, chunks = pgrad_jax.domain_schedule(
          jax.random.key(0), args.domains, args.B, "random")
      out = pgrad_jax.rollout(
          self.model.loss_fn, self.inner, params, inner_state, batches,
          domains, chunks, pgrad_jax.RolloutOptions(
              B=args.B, unroll=unroll, axis_name=common.DATA))
      if trajectory:
        return out
      end = jax.tree.map(lambda p, d: p + d, params, out.point(-1))
      return end, out.inner_state, out.losses

    return self.data_parallel(step), self.inner.init(self.model.params)


def baseline_calls(args: argparse.Namespace, input_shape: tuple[int, ...],
                   host_batches: dict[str, Any],
                   names: Sequence[str]) -> dict[str, Any]:
  """Zero-argument calls of the `BASELINES` ``names``, each a cycle of
  updates, and each cycle's number of updates."""
  if not names:
    return {}
  # Only these baselines need flax, an optional dependency.
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from experiments import algorithms
  from experiments import catalog
  from experiments import hparams_registry
  from experiments import models
  # pylint: enable=g-import-not-at-top

  dtype = common.DTYPES[args.dtype]

  def split_model(style_head=False, domain_embedding=False):
    """The network, with SagNet's style head or MTL's embedding head if
    asked for, split as the algorithms take it."""
    if args.model != "mlp":
      return algorithms.Network.split(models.build_model(
          args.model, num_classes=common.NUM_CLASSES, input_shape=input_shape,
          rngs=nnx.Rngs(0), dtype=dtype, style_head=style_head,
          domain_embedding=domain_embedding))
    featurizer = models.MLP(common.MLP_INPUTS, max(args.hidden // 2, 1),
                            width=args.hidden, depth=2, rngs=nnx.Rngs(0),
                            dtype=dtype)
    model_class = (models.StyleClassifier if style_head else
                   models.EmbeddingClassifier if domain_embedding else
                   models.Classifier)
    return algorithms.Network.split(model_class(
        featurizer, common.NUM_CLASSES, rngs=nnx.Rngs(0), dtype=dtype))

  batches = jax.device_put({"image": host_batches["x"],
                            "label": host_batches["y"]})
  dataset = "PACS" if args.model.startswith("resnet") else "RotatedDigits"
  calls = {}
  for name in names:
    algorithm, hparams = BASELINES[name]
    # The network the training loop builds for it (SagNet's style head,
    # MTL's embedding head).
    network, params, stats = split_model(
        **catalog.ALGORITHMS[algorithm].model_options)
    hparams = {**hparams_registry.default_hparams(algorithm, dataset),
               **hparams}
    built = algorithms.build_algorithm(algorithm, network, hparams,
                                       num_domains=args.domains)
    cycle = 1 + hparams.get("d_steps_per_g_step", 0)

    def run_cycle(params, stats, state, batches, update=built.update,
                  cycle=cycle):
      for step in range(cycle):
        params, stats, state, _ = update(params, stats, state, batches,
                                         jax.random.PRNGKey(step))
      return params, stats, state

    fn, state = jax.jit(run_cycle), built.init(params)
    calls[name] = (lambda fn=fn, params=params, stats=stats, state=state: fn(
        params, stats, state, batches), cycle)
  return calls


def split_calls(methods: Methods, params, batches,
                unroll) -> tuple[dict[str, Any], int]:
  """Zero-argument calls for the four parts of a PGrad-B update (and the
  leaf-by-leaf Gram matrix and projection, where the trajectory is
  contiguous), and the trajectory's size in bytes."""
  args = methods.args
  step, inner_state = methods.rollout(unroll, trajectory=True)
  inner_state = common.place(inner_state, methods.mesh)
  displacements = step(params, inner_state, batches).displacements
  trajectory_bytes = common.num_bytes(displacements)
  gram = jax.jit(pgrad_jax.gram)
  centring = principal.centring_matrix(displacements)

  def eigh_to_weights(gram_matrix):
    """Steps 3 (after the Gram matrix) to 5: all on ``m x m`` matrices."""
    eigenvalues, eigenvectors, gram_matrix = principal.gram_and_eigh(
        gram_matrix, centring)
    signs, ref_norm = principal.orient(eigenvectors, gram_matrix, centring,
                                       "end")
    weights = principal.weight_and_calibrate(
        eigenvalues, signs, ref_norm, args.k, pgrad_jax.PrincipalOptions())
    return weights, eigenvalues, eigenvectors

  eigh_to_weights = jax.jit(eigh_to_weights)
  gram_matrix = gram(displacements)
  small = eigh_to_weights(gram_matrix)
  project_back = jax.jit(lambda small, d: principal.project_back(
      *small, centring, d))
  calls = {
      "rollout (with trajectory)": lambda: step(params, inner_state, batches),
      "gram": lambda: gram(displacements),
      "eigh (m x m)": lambda: eigh_to_weights(gram_matrix),
      "projection": lambda: project_back(small, displacements),
  }
  if isinstance(displacements, trajectory_lib.ContiguousTrajectory):
    steps = trajectory_lib.num_steps(displacements)
    leaf_by_leaf = jax.jit(lambda d: jax.tree.map(
        lambda *points: jnp.stack(points),
        *[trajectory_lib.point(d, i) for i in range(steps)]))(displacements)
    calls["gram (leaf by leaf)"] = lambda: gram(leaf_by_leaf)
    calls["projection (leaf by leaf)"] = lambda: project_back(small,
                                                              leaf_by_leaf)
  return calls, trajectory_bytes


def reads_trajectory(part: str) -> bool:
  """Whether a part of the split reads the whole trajectory once."""
  return part.startswith(("gram", "projection"))


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Times everything ``args`` asks for and returns the JSON record."""
  model = common.build_model(args.model, dtype=common.DTYPES[args.dtype],
                             image_size=args.image_size, hidden=args.hidden)
  mesh = common.make_mesh(data=args.devices)
  methods = Methods(model, args, mesh)
  params = common.place(model.params, mesh)
  host_batches = common.random_batches(model, args.domains, args.batch)
  batches = common.shard_batches(host_batches, mesh)

  default = common.default_unroll(model, args.batch, args.B)
  chosen = common.parse_unroll(args.unroll)
  unrolls = [1, True] if args.compare_unroll else [
      default if chosen is None else chosen]
  # name -> (builder, unroll name); each method is compared with the bare
  # rollout of the same unroll, ERM with the first.
  chosen_methods = set(args.methods)
  builders = {}
  if "erm" in chosen_methods:
    builders["erm"] = (methods.erm, common.unroll_name(unrolls[0]))
  names = ("rollout", "pgrad-B") if args.compare_unroll else (
      "rollout", "fish", "pgrad-B")
  build = {"rollout": methods.rollout, "fish": methods.fish,
           "pgrad-B": methods.pgrad}
  for unroll in unrolls:
    unroll_name = common.unroll_name(unroll)
    suffix = f" [unroll={unroll_name}]" if args.compare_unroll else ""
    for name in names:
      if name in chosen_methods:
        builders[name + suffix] = (
            lambda b=build[name], u=unroll: b(u), unroll_name)
  rollout_of = {unroll: name for name, (_, unroll) in builders.items()
                if name.startswith("rollout")}

  calls = {}
  for name, (build, _) in builders.items():
    fn, state = build()
    state = common.place(state, mesh)
    calls[name] = lambda fn=fn, state=state: fn(params, state, batches)
  cycles = {}
  if args.devices == 1 and not args.compare_unroll:
    for name, (call, cycle) in baseline_calls(
        args, model.input_shape, host_batches,
        [b for b in BASELINES if b in chosen_methods]).items():
      calls[name], cycles[name] = call, cycle
  timings = common.time_interleaved(calls, args.repeats, args.warmup)
  # A cycle of updates, timed as one call: per update.
  for name, cycle in cycles.items():
    timings[name] = common.Timing(
        timings[name].compile_ms, [t / cycle for t in timings[name].times_ms])

  split, trajectory_bytes = {}, None
  if not (args.no_split or args.compare_unroll):
    parts, trajectory_bytes = split_calls(methods, params, batches,
                                          unrolls[0])
    split = common.time_interleaved(parts, args.repeats, args.warmup)

  def ratio(timing, denominator):
    """None where the denominator's method was not timed."""
    return (timing.median_ms / timings[denominator].median_ms
            if denominator in timings else None)

  results = {}
  for name, timing in timings.items():
    # ERM and the baselines run no rollout; they compare with the first.
    unroll = builders[name][1] if name in builders else common.unroll_name(
        unrolls[0])
    results[name] = timing.as_dict() | {
        "unroll": None if name == "erm" or name in cycles else unroll,
        "ratio_to_rollout": ratio(timing, rollout_of.get(unroll)),
        "ratio_to_erm": ratio(timing, "erm"),
    }
  update_ms = next((t.median_ms for n, t in timings.items()
                    if n.startswith("pgrad-B")), None)
  return {
      "benchmark": "step_time",
      "environment": common.environment(),
      "config": vars(args) | {
          "num_params": model.num_params,
          "m": args.domains * args.B + 1,
          "unroll_default": common.unroll_name(default),
          "unrolls": [common.unroll_name(u) for u in unrolls],
          "inner_opt": f"adam({INNER_LR})",
          "trajectory_bytes": trajectory_bytes,
      },
      "results": results,
      "split": {name: t.as_dict() | {
          "share_of_update": update_ms and t.median_ms / update_ms,
          "read_gb_per_s": (trajectory_bytes / t.median_ms / 1e6
                            if reads_trajectory(name) else None)}
                for name, t in split.items()},
  }


def report(record: dict[str, Any]) -> str:
  """The tables a run prints."""
  config, env = record["config"], record["environment"]
  lines = [
      f"{config['model']} ({config['num_params']:,} params), "
      f"{config['domains']} domains x {config['batch']}, B={config['B']}, "
      f"k={config['k']}, m={config['m']}, {config['dtype']}, "
      f"{config['devices']} x {env['device_kind']} ({env['platform']}), "
      f"jax {env['jax']}, median of {config['repeats']}",
      common.format_table(
          ["method", "median ms", "x rollout", "x ERM", "compile ms"],
          [[name, r["median_ms"], r["ratio_to_rollout"], r["ratio_to_erm"],
            r["compile_ms"]] for name, r in record["results"].items()]),
  ]
  if record["split"]:
    lines.append(common.format_table(
        ["part of pgrad-B", "median ms", "share of update",
         "trajectory read GB/s"],
        [[name, r["median_ms"], r["share_of_update"],
          r.get("read_gb_per_s")]
         for name, r in record["split"].items()]))
  return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  record = run(args)
  if jax.process_index() != 0:  # Every process times; one reports.
    return record
  common.publish(record, report(record), args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
