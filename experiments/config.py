"""The configuration of one training run, its flags and its run directory.

Every field of `Config` is a flag of ``python -m experiments.train`` with the
same name (``--test_envs 0 1``, ``--hparams '{"lr": 1e-4}'``), but
``lr_schedule``, what ``--lr_schedule_from`` resolves to. Fields left as
``None`` are filled in per dataset by `Config.resolve`.

Everything a run reads is resolved and checked once, into a frozen
`RunSpec` (``experiments.train.resolve_run``): the flags and hyperparameters
here (`parse_flags`), then its run directory, then its data.

`Config.identity` is what a run directory belongs to (`experiments.rundir`
is the run directory's contract), and names the default directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import textwrap
import types
import typing
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import catalog
from experiments import hparams_registry
from experiments import averaging_flags
from experiments import second_stage
from experiments.data import datasets
from experiments import errors
from experiments.rundir import claim
from experiments.rundir import records

# Where runs go when no --output_dir is given, one folder per configuration.
DEFAULT_RUNS_DIR = Path("runs")
# Fields that say where files are or how to treat an existing run, not what
# is trained: runs that differ only in them are the same run.
# (A second stage's first stage, --lr_schedule_from, is one: its schedule,
# the ``lr_schedule`` field, is what the run is.)
LOCATION_FIELDS = ("output_dir", "data_dir", "overwrite", "lr_schedule_from")
# Fields that say how a run executes, not what it computes: out of its
# identity and of its records, so that a run resumed with other values is
# the same run with the same records.
EXECUTION_FIELDS = ("devices", "num_workers", "compile_cache_dir")
PROG = "python -m experiments.train"


def default_num_workers() -> int:
  """The CPU cores this process may run on: ``--num_workers``'s default."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def args_hash(args: Mapping[str, Any]) -> str:
  """The MD5 hex digest of ``args`` as sorted JSON: a run's directory name."""
  key = json.dumps(dict(args), sort_keys=True)
  return hashlib.md5(key.encode("utf-8")).hexdigest()


def _field(default: Any, help: str) -> Any:  # pylint: disable=redefined-builtin
  # Lists are copied per instance, as dataclasses require.
  if isinstance(default, list):
    return dataclasses.field(default_factory=default.copy,
                             metadata={"help": help})
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train, on what, for how long, and where to write it.

  Each field's ``help`` metadata documents it (and is its flag's help).
  """

  dataset: str = _field("RotatedDigits", "Dataset name.")
  algorithm: str = _field("PGrad-B", "Algorithm name.")
  test_envs: list[int] = _field([0], "Held-out (test) domain indices.")
  data_dir: str | None = _field(None, "Where the dataset files are.")
  output_dir: str | None = _field(
      None, "Where results and checkpoints go. Default: "
      f"{DEFAULT_RUNS_DIR}/<dataset>-<algorithm>-test<envs>-<hash of the "
      "flags>, one directory per configuration.")
  overwrite: bool = _field(
      False, "Delete what output_dir holds and start over (without it, a "
      "run resumes a run of the same configuration, and refuses a "
      "directory of another).")
  steps: int | None = _field(
      None, "Training steps. Default: per dataset (its entry in "
      "experiments/catalog.py).")
  checkpoint_freq: int | None = _field(
      None, "Steps between evaluations and checkpoints. Default: per dataset.")
  plateau_check_freq: int = _field(
      0, "Every this many steps, stop if the run has plateaued (the "
      "criterion of experiments/runs/convergence.py); --steps is then the "
      "most it trains. A multiple of --checkpoint_freq. 0: train --steps "
      "steps.")
  seed: int = _field(0, "Seeds model init, data sampling and the algorithm.")
  hparams_seed: int = _field(0, "Hyperparameter draw; 0 means the defaults.")
  trial_seed: int = _field(
      0, "Seeds the dataset and its train/validation splits, and the draw.")
  holdout_fraction: float = _field(
      0.2, "Fraction of every domain held out for validation.")
  hparams: str | None = _field(
      None, "JSON object of hyperparameters overriding the drawn ones; "
      "--list_hparams lists them.")
  model: str | None = _field(
      None, "Model name. Default: per dataset (mnist_cnn for digits, "
      "resnet50 for photos, WILDS's networks on WILDS).")
  pretrained: str | None = _field(
      None, "Featurizer weights to start from: imagenet (torchvision's "
      "IMAGENET1K_V1 weights of --model, downloaded once; see "
      "experiments/weights/), imagenet_augmix (timm's resnet50.ram_in1k, "
      "DomainBed's ResNet-50 since July 2024, with BatchNorm trained: "
      "bn_mode \"train\" unless --hparams says otherwise), a torchvision "
      "state_dict (.pth) or timm's (.safetensors), a .npz converted from "
      "one, an Orbax directory, or none (from scratch). Default: imagenet for an ImageNet network on "
      "photos, as the paper, DomainBed before July 2024 and WILDS's FMoW; "
      "none for the digits, PovertyMap and --init_params.")
  init_params: str | None = _field(
      None, f"A run's {records.FINAL_PARAMS_FILE} to start the whole model "
      "from (e.g. FMoW's ERM phase before PGrad).")
  eval_examples: int | None = _field(
      None, "Evaluate at most this many examples per split (fixed random "
      "subset). Default: all.")
  loss_examples: int = _field(
      512, "Examples of every domain's training split for env{i}_in_loss.")
  eval_batch_size: int = _field(
      256, "Largest batch of evaluation (smaller when the splits are).")
  trajectory_freq: int = _field(
      0, "Steps between snapshots of the params in trajectory/ (0: none).")
  averaging: str = _field(
      "none", "Weight averaging along the run, evaluated and recorded beside "
      "the trained weights (averaged_* keys), and read by model selection: "
      "ema (an exponential moving average), sma (DomainBed's ERM++ moving "
      "average from step --sma_start_iter), swad (khanrc/swad's dense "
      "averaging over the loss valley of the training domains' validation "
      "loss; the run stops where the valley ends), or none.")
  ema_decay: float | None = _field(
      None, "--averaging ema's decay. Default: 0.999.")
  sma_start_iter: int | None = _field(
      None, "--averaging sma: the update from which the average is an equal-"
      "weight mean (DomainBed's sma_start_iter). Default: 600.")
  swad_n_converge: int | None = _field(
      None, "--averaging swad: the evaluations of its convergence window. "
      "Default: 3.")
  swad_n_tolerance: int | None = _field(
      None, "--averaging swad: the evaluations of its tolerance window. "
      "Default: 6.")
  swad_tolerance_ratio: float | None = _field(
      None, "--averaging swad: the valley ends when the least validation "
      "loss of the tolerance window exceeds the convergence window's mean "
      "times 1 + this. Default: 0.3.")
  devices: int = _field(
      1, "Devices to split every domain's batch over, on a data mesh axis; "
      "the batch must be a multiple of devices (times B for PGrad's "
      "chunks). The run's results are the same up to the order of "
      "floating-point sums, and it resumes on any number.")
  num_workers: int | None = _field(
      None, "Worker processes that build the training batches (read, "
      "decode and augment their images; the digits, in memory, need none) "
      "ahead of the training step, and threads that read the evaluation "
      "batches; 0 builds every batch when it is needed. The results do not "
      "depend on it. Default: the CPU cores of this host.")
  lr_schedule_from: str | None = _field(
      None, "ERM++'s second stage (DomainBed's train_autolr.py): the "
      "directory of a finished run of hparam auto_lr, its first stage, whose "
      "learning rates this run sets at the same evaluations, to its last "
      "step. Pass the first stage's flags and hparams, with "
      "--holdout_fraction 0 (training on every example) and another "
      "--output_dir.")
  # Not a flag: the schedule that --lr_schedule_from resolves to
  # (`second_stage.resolve`), [step, lr] per first-stage record, part of
  # the run's identity.
  lr_schedule: list[list[float]] | None = dataclasses.field(
      default=None, metadata={"flag": False})
  compile_cache_dir: str | None = _field(
      None, "Where compiled steps are kept for later runs of the same shape "
      "to load instead of compiling (JAX's persistent compilation cache); "
      "none: off. Default: $JAX_COMPILATION_CACHE_DIR, else "
      "$XDG_CACHE_HOME/pgrad_jax/jax_cache, else "
      "~/.cache/pgrad_jax/jax_cache. A directory named here or by the "
      "variable must be writable; a default one that is not leaves the run "
      "without a cache, with a warning.")

  def resolve(self) -> Config:
    """A copy with the per-dataset defaults filled in, checked.

    Raises:
      errors.UsageError: a name is not registered or a number is out of range.
    """
    try:
      facts = catalog.DATASETS[self.dataset]
      algorithm = catalog.ALGORITHMS[self.algorithm].name
      model = catalog.MODELS[self.model or facts.model].name
    except KeyError as e:  # registry.UnknownNameError names the known names.
      raise errors.UsageError(str(e)) from None
    config = dataclasses.replace(
        self, pretrained=_resolve_pretrained(self, model),
        steps=facts.steps if self.steps is None else self.steps,
        checkpoint_freq=facts.checkpoint_freq if self.checkpoint_freq is None
        else self.checkpoint_freq,
        algorithm=algorithm, model=model, test_envs=list(self.test_envs),
        num_workers=default_num_workers() if self.num_workers is None
        else self.num_workers)
    positive = ("steps", "checkpoint_freq", "loss_examples", "eval_batch_size",
                "eval_examples", "devices")
    for name in positive:
      value = getattr(config, name)
      if value is not None and value < 1:
        raise errors.UsageError(
            f"--{name} must be a positive integer, got {value}.")
    for name in ("seed", "hparams_seed", "trial_seed", "trajectory_freq",
                 "plateau_check_freq", "num_workers"):
      if getattr(config, name) < 0:
        raise errors.UsageError(
            f"--{name} must be >= 0, got {getattr(config, name)}.")
    if config.plateau_check_freq % config.checkpoint_freq:
      raise errors.UsageError(
          "--plateau_check_freq must be a multiple of --checkpoint_freq "
          f"({config.checkpoint_freq}): the criterion reads the evaluations; "
          f"got {config.plateau_check_freq}.")
    if config.holdout_fraction == 0 and not config.lr_schedule_from:
      raise errors.UsageError(
          "--holdout_fraction 0 holds out no validation data, which only "
          "ERM++'s second stage (--lr_schedule_from) trains without; pass a "
          "fraction in (0, 1).")
    if not 0 <= config.holdout_fraction < 1:
      raise errors.UsageError("--holdout_fraction must be in (0, 1), got "
                              f"{config.holdout_fraction}.")
    if not config.test_envs or min(config.test_envs) < 0:
      raise errors.UsageError("--test_envs must be domain indices >= 0, got "
                              f"{config.test_envs}.")
    if config.data_dir is not None and Path(config.data_dir).is_file():
      raise errors.UsageError(
          f"--data_dir {config.data_dir} is a file; pass the directory that "
          "holds the datasets.")
    config = averaging_flags.resolve(config)
    if config.lr_schedule_from is not None:
      config = second_stage.resolve(config, config.hyperparameters())
    if config.output_dir is None:
      envs = "_".join(map(str, config.test_envs))
      name = f"{config.dataset}-{config.algorithm}-test{envs}"
      config = dataclasses.replace(config, output_dir=str(
          DEFAULT_RUNS_DIR / f"{name}-{args_hash(config.identity())[:8]}"))
    return config

  def identity(self) -> dict[str, Any]:
    """The fields that determine the run's results: all but LOCATION_FIELDS
    and EXECUTION_FIELDS.

    A new field therefore names every run afresh: committed runs are then
    trained again by the command that made them (a study's ``launch`` or
    ``longer``), never renamed or edited in place.
    """
    return {name: value for name, value in self.record_args().items()
            if name not in LOCATION_FIELDS}

  def record_args(self) -> dict[str, Any]:
    """The fields a results record holds as its ``args``: all but
    EXECUTION_FIELDS, and the ``--averaging`` fields that the run does not
    use (all of them without averaging, `averaging_flags.FIELDS`), and the
    second stage's unless it is one (`second_stage.FIELDS`)."""
    return {name: value for name, value in dataclasses.asdict(self).items()
            if name not in EXECUTION_FIELDS and not (
                name in averaging_flags.FIELDS and value in (None, "none"))
            and not (name in second_stage.FIELDS and value is None)}

  def check_batch_split(self, hparams: Mapping[str, Any]) -> None:
    """Checks that every domain's batch splits as the step splits it.

    The algorithm cuts every domain's ``batch_size`` examples into equal
    chunks (PGrad's ``B``, ``entries.AlgorithmEntry.batch_chunks``), and a
    step on several ``devices`` splits each chunk over them on a data axis
    (`training.sharding.Sharder`, docs/scaling.md).

    Raises:
      errors.UsageError: the batch is no multiple of the chunks, or the
        algorithm cannot split its batch over the devices, or the batch does
        not divide; the message names the batch sizes and device counts that do.
    """
    entry = catalog.ALGORITHMS[self.algorithm]
    batch, chunks = hparams["batch_size"], entry.batch_chunks(hparams)
    if batch % chunks:
      raise errors.UsageError(
          f"--hparams: hparam 'batch_size' must be a multiple of B = "
          f"{chunks}, got {batch}. See --list_hparams.")
    if self.devices == 1:
      return
    if not entry.data_parallel:
      splitting = [name for name, e in catalog.ALGORITHMS.items()
                   if e.data_parallel]
      raise errors.UsageError(
          f"--devices {self.devices}: {self.algorithm}'s update pools or "
          "re-slices the domains' batches, which a data axis cannot split; "
          f"train it with --devices 1. These split their batch: "
          f"{', '.join(splitting)}.")
    multiple = chunks * self.devices
    if batch % multiple:
      sizes = [size for size in (batch // multiple * multiple,
                                 -(-batch // multiple) * multiple) if size]
      devices = [d for d in range(1, self.devices)
                 if batch % (chunks * d) == 0]
      in_chunks = (f" in B = {chunks} chunks" if chunks > 1 else "")
      times = " (B x devices)" if chunks > 1 else ""
      raise errors.UsageError(
          f"--devices {self.devices}: {self.algorithm}'s batch of {batch} "
          f"examples per domain{in_chunks} does not split over "
          f"{self.devices} devices: it must be a multiple of {multiple}"
          f"{times}. Pass --hparams '{{\"batch_size\": {sizes[0]}}}'"
          + "".join(f" or {size}" for size in sizes[1:])
          + f", or --devices {' or '.join(map(str, devices))}.")

  def hyperparameters(self) -> dict[str, Any]:
    """The drawn hyperparameters with the ``hparams`` overrides applied.

    Returns:
      ``random_hparams(algorithm, dataset, hparams_seed, trial_seed)`` updated
      with the overrides.

    Raises:
      errors.UsageError: ``hparams`` is not a JSON object, or names a
        hyperparameter the algorithm lacks, or gives one a value out of its
        range (each alone: `check_batch_split` checks the batch).
    """
    hparams = hparams_registry.random_hparams(
        self.algorithm, self.dataset, self.hparams_seed, self.trial_seed)
    try:
      overrides = json.loads(self.hparams) if self.hparams else {}
    except json.JSONDecodeError as e:
      raise errors.UsageError(
          f"--hparams is not valid JSON ({e}): {self.hparams}; "
          """write e.g. --hparams '{"lr": 1e-4}'.""") from None
    if not isinstance(overrides, dict):
      raise errors.UsageError(
          f"--hparams must be a JSON object, got {self.hparams}.")
    hparams = {**hparams, **self._weights_hparams(hparams), **overrides}
    try:
      hparams_registry.check_hparams(self.algorithm, self.dataset, hparams)
    except ValueError as e:
      raise errors.UsageError(f"--hparams: {e} See --list_hparams.") from None
    return hparams

  def _weights_hparams(self, hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The hparam defaults that the weights set: DomainBed trains BatchNorm
    with its AugMix ResNet-50 (hparams_registry.py at b93c22a, line 36:
    freeze_bn False since commit 3dfdc8e), so ``imagenet_augmix`` runs'
    ``bn_mode`` defaults to ``"train"``. The paper's frozen BatchNorm stays
    the default of every other run."""
    if self.pretrained == "imagenet_augmix" and "bn_mode" in hparams:
      return {"bn_mode": "train"}
    return {}


def _resolve_pretrained(config: Config, model: str) -> str | None:
  """``--pretrained`` with its default filled in, checked before any work.

  From scratch is ``None`` where that is the default (so that such runs'
  identities stay what they were before the flag had a default), and
  ``"none"`` where ImageNet weights are.

  Raises:
    errors.UsageError: ``imagenet`` for a network without ImageNet weights, or a
      path that does not exist or holds a run's params.
  """
  facts, model_facts = catalog.DATASETS[config.dataset], catalog.MODELS[model]
  imagenet_default = (model_facts.imagenet and not facts.small_images
                      and not facts.from_scratch and not config.init_params)
  if config.pretrained is None:
    return "imagenet" if imagenet_default else None
  if config.pretrained == "none":
    return "none" if imagenet_default else None
  if config.pretrained == "imagenet":
    if not model_facts.imagenet:
      with_weights = [name for name, entry in catalog.MODELS.items()
                      if entry.imagenet]
      raise errors.UsageError(
          f"--pretrained imagenet: there are no ImageNet weights of {model}; "
          f"there are of {', '.join(with_weights)}.")
    return config.pretrained
  if config.pretrained == "imagenet_augmix":
    if model_facts.augmix_weights is None:
      with_weights = [name for name, entry in catalog.MODELS.items()
                      if entry.augmix_weights]
      raise errors.UsageError(
          f"--pretrained imagenet_augmix: there are no AugMix weights of "
          f"{model}; there are of {', '.join(with_weights)} (pass --model "
          f"{with_weights[0]}).")
    return config.pretrained
  path = Path(config.pretrained)
  if not path.exists():
    raise errors.UsageError(
        f"--pretrained {path}: no such file or directory. Pass imagenet for "
        "torchvision's ImageNet weights (downloaded once), imagenet_augmix "
        "for timm's AugMix ResNet-50, a .pth, .safetensors or .npz file or "
        "an Orbax directory of featurizer weights, or none to train from "
        "scratch.")
  if path.is_file() and zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as archive:
      names = archive.namelist()
    # A run's final params (records.FINAL_PARAMS_FILE) are keyed like
    # params/featurizer/... and stats/....
    if any(name.split("/", 1)[0] in ("params", "stats") for name in names):
      raise errors.UsageError(
          f"--pretrained {path} holds a whole model's params, as a run's "
          f"{records.FINAL_PARAMS_FILE} does, not featurizer weights: start "
          f"from it with --init_params {path} instead.")
  return config.pretrained


def _flag_type(annotation: Any) -> Any:
  """A field's argparse ``type``: its non-None type, or its list's items'."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  return args[0] if args else annotation


class _HelpFormatter(argparse.HelpFormatter):
  """Wraps help at spaces only, so registered names such as ``PGrad-kall``
  stay whole."""

  def _split_lines(self, text: str, width: int) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width,
                         break_on_hyphens=False)


def make_parser() -> argparse.ArgumentParser:
  """The flags of `Config`, with the registered names as choices."""
  parser = argparse.ArgumentParser(
      prog=PROG, formatter_class=_HelpFormatter,
      description="Trains one DomainBed run and writes "
      f"{records.RESULTS_FILE}.",
      epilog="An algorithm's hparams on a dataset, with their defaults, "
      "search ranges and allowed values: --list_hparams --algorithm A "
      "--dataset D.")
  choices = {"dataset": catalog.DATASETS, "algorithm": catalog.ALGORITHMS,
             "model": catalog.MODELS}
  hints = typing.get_type_hints(Config)
  defaults = Config()
  for field in dataclasses.fields(Config):
    if not field.metadata.get("flag", True):
      continue
    hint = hints[field.name]
    default = getattr(defaults, field.name)
    help_text = field.metadata["help"]
    if hint is bool:
      parser.add_argument(f"--{field.name}", action="store_true",
                          help=help_text)
      continue
    kwargs = {"type": _flag_type(hint)}
    if typing.get_origin(hint) is list:
      kwargs["nargs"] = "+"
    if field.name in choices:
      kwargs["choices"] = list(choices[field.name])
      kwargs["metavar"] = field.name.upper()
      help_text += f" One of: {', '.join(choices[field.name])}."
    if default is not None:
      help_text += f" Default: {default}."
    parser.add_argument(f"--{field.name}", default=default, help=help_text,
                        **kwargs)
  parser.add_argument(
      "--list_hparams", action="store_true",
      help="Print the hparams of --algorithm on --dataset (default, random "
      "search, allowed values) and exit.")
  return parser


def parse_flags(
    argv: Sequence[str] | None = None,
) -> tuple[Config, dict[str, Any]]:
  """Parses and checks command-line flags, one per `Config` field.

  The configuration is resolved (`Config.resolve`), its hyperparameters
  drawn and checked (`Config.hyperparameters`), and its batch's split
  (`Config.check_batch_split`). A bad flag or hparam exits with a usage
  message and status 2, as argparse does; so does ``--help``, with status
  0, and ``--list_hparams``.

  Args:
    argv: the flags; ``None`` reads ``sys.argv[1:]``.

  Returns:
    The resolved configuration and its hyperparameters.
  """
  parser = make_parser()
  args = vars(parser.parse_args(argv))
  if args.pop("list_hparams"):
    print(hparams_registry.describe_hparams(args["algorithm"], args["dataset"]))
    parser.exit(0)
  try:
    config = Config(**args).resolve()
    hparams = config.hyperparameters()
    config.check_batch_split(hparams)
    # Checked here rather than in `Config.resolve`: a sweep lists runs whose
    # --init_params an earlier phase of it writes.
    if config.init_params is not None and not Path(
        config.init_params).is_file():
      raise errors.UsageError(
          f"--init_params {config.init_params}: no such file; pass a run's "
          f"{records.FINAL_PARAMS_FILE}.")
  except errors.UsageError as e:
    parser.error(str(e))
  return config, hparams


def parse_args(argv: Sequence[str] | None = None) -> Config:
  """The configuration of `parse_flags`, for what needs nothing else."""
  return parse_flags(argv)[0]


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run, every setting resolved and checked once
  (``experiments.train.resolve_run``); ``training.loop.train`` reads only
  this and the run's claimed directory (``rundir.claim.claim_run``), and
  finds nothing in them to refuse.

  Attributes:
    config: the configuration it trains by, which its records hold: the
      flags resolved, and on a WILDS dataset WILDS's protocol applied
      (``train.wilds_protocol``: held-out splits and steps).
    hparams: its hyperparameters, checked: the draw of ``hparams_seed``
      updated with ``--hparams`` (read-only).
    run_record: what its config file holds (``rundir.claim.run_record``):
      the identity of the configuration asked for, which names the run
      (before WILDS's protocol), its hyperparameters and the weights it
      starts from (read-only).
    train_domains: the domains it trains on: the others are held out.
    resume: whether ``config.output_dir`` holds this run, to go on with
      (``rundir.claim.claim_run_directory``).
    dataset: its data, as it trains on them: resized to the ``image_size``
      hparam, where there is one.
    fingerprint: the data's as read (``datasets.fingerprint``), which the run
      records.
    domains_per_step: how many training domains a step's batch holds: all,
      or the ``domains_per_step`` hparam's sample.
    steps_per_epoch: the steps of an epoch, which its records count in:
      DomainBed's epoch is a pass over the smallest training domain's "in"
      split, WILDS's over the whole training split.
    weights: the file of featurizer weights it starts from, fetched and
      checked (``weights.convert.checked_weights``); None for none, and for
      a finished run, which needs none.
    compile_cache: where it keeps its compiled programs
      (`checked_compile_cache`); None for none.
  """

  config: Config
  hparams: Mapping[str, Any]
  run_record: Mapping[str, Any]
  train_domains: tuple[int, ...]
  resume: bool
  dataset: Any
  fingerprint: Mapping[str, Any]
  domains_per_step: int
  steps_per_epoch: float
  weights: Path | None = None
  compile_cache: Path | None = None

  def __post_init__(self):
    # Frozen through: no reader can change what it was given.
    for name in ("hparams", "run_record"):
      object.__setattr__(self, name,
                         types.MappingProxyType(dict(getattr(self, name))))


def check_outside_data(config: Config) -> None:
  """Refuses an output directory inside a folder dataset's folder, before
  anything is written: the run's files would be read as the dataset's (an
  unexpected folder), and every later run on the data would stop on them."""
  if config.dataset not in catalog.FOLDER_DATASETS:
    return
  folder, _ = catalog.FOLDER_DATASETS[config.dataset]
  data = Path(datasets.DEFAULT_FOLDER_DATA_DIR if config.data_dir is None
              else config.data_dir) / folder
  output = Path(config.output_dir).resolve()
  if data.resolve() in (output, *output.parents):
    raise errors.UsageError(
        f"--output_dir {config.output_dir} is inside {config.dataset}'s "
        f"folder {data}, where its files would be read as the dataset's; "
        "pass an --output_dir outside it.")
