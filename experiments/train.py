"""Trains one DomainBed run: ``python -m experiments.train [flags]``.

With no flags it trains PGrad-B on RotatedDigits with domain 0 held out, in a
few minutes on two CPU cores, and prints the held-out domain's accuracy. The
flags are `experiments.config.Config`'s fields.

The protocol is DomainBed's (Gulrajani & Lopez-Paz, ICLR 2021): a fraction
(``holdout_fraction``, 20%) of every domain is held out ("out" split) for
validation and the rest is the "in" split; every step samples one batch per
training domain from its "in" split, with replacement. Every
``checkpoint_freq`` steps and at the end, the run evaluates every domain and
appends a record of it to its results file. The held-out domains'
accuracy is their ``in`` split's, as DomainBed reports; the run ends by
printing the last step's, which no model selection has chosen.

On a WILDS dataset (``experiments.data.wilds``) the held-out domains are
WILDS's evaluation splits and the training domains are not split (see
`wilds_protocol`); every step trains on ``domains_per_step``
sampled domains; an epoch is a pass over the whole training split; and the
metrics are `tasks.split_metrics`'s: ``env{i}_in_mse``, ``env{i}_in_r`` and
``env{i}_in_worst_r`` for PovertyMap's regression, ``env{i}_in_acc`` and
``env{i}_in_worst_acc`` (worst region) for FMoW.

The run directory (its files, records, checkpoints, what a killed or
interrupted run leaves, and when a directory is refused) is
`experiments.rundir`'s contract. The command exits with status 2 and a
message, no traceback, on a run that cannot run (`errors.UsageError`), that
another process trains (`rundir.claim.RunDirectoryBusyError`), whose
records are damaged (`rundir.records.DamagedRunError`) or whose images stop
decoding as it trains (`data.datasets.UnreadableImageError`); and with 128 +
the signal's number on SIGINT or SIGTERM, after saying where a rerun
resumes. It alone turns these errors into exit statuses (`errors`).

With ``--devices`` N > 1, every domain's batch is split over N devices on a
``data`` mesh axis and the train state is replicated
(`training.sharding.Sharder`); the batch must divide, and the algorithm
must keep it split (``entries.AlgorithmEntry.data_parallel``).

The command reads: resolve the run (`resolve_run`), which refuses another
run's directory; claim it (`rundir.claim.claim_run`: its lock, and the
records of a run to resume, checked); train it (``training.loop.train``),
unless it is finished; print its result. Every setting is resolved and
checked once, before the training loop is imported, into the frozen
`config.RunSpec` that the loop reads: a bad name or value is refused at
once, the loop finds nothing left to refuse, and a finished run's result is
printed without importing JAX. (Resolving imports JAX only where a check
needs it: featurizer weights, several devices, ``--init_params``, a new
``image_size``.) `claim_and_train` is the claim and train steps, for a run
resolved in a test or a benchmark.
"""


from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments.data import datasets
from experiments.rundir import claim
from experiments.rundir import records
from experiments.data import wilds

if TYPE_CHECKING:
  # Imported where weights are checked: it imports JAX.
  from experiments.weights import convert

# The environment variable that JAX reads for its persistent compilation
# cache, and the cache's place under the user's cache directory otherwise.
COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
COMPILE_CACHE_SUBDIR = Path("pgrad_jax") / "jax_cache"


def resolve_run(argv: Sequence[str] | None = None) -> config_lib.RunSpec:
  """The run that a command line asks for, every setting resolved and
  checked once.

  In turn: the flags and hyperparameters (`config.parse_flags`, which exits
  with status 2 and a usage message on a mistake), the run directory
  (`rundir.claim.claim_run_directory`), the data, from which WILDS's protocol
  (`wilds_protocol`), the held-out domains and the epoch's steps follow;
  then, for a run to train, its images' size, the featurizer weights it
  starts from (`_checked_weights`), its compilation cache, its devices and
  the fit of its ``--init_params``, before any model is built.

  Args:
    argv: the flags; ``None`` reads ``sys.argv[1:]``.

  Returns:
    The run's frozen spec.

  Raises:
    errors.UsageError: the run directory holds another run or cannot be
      written, or the data are missing or are not the run's, or the
      held-out domains, the plateau checks or ``auto_lr`` do not fit them,
      or the
      weights are damaged or not ``--model``'s, or the compilation cache
      named cannot be written, or the devices are not there, or the
      ``--init_params`` do not fit the model; nothing was written (only what
      ``--overwrite`` deletes, weights fetched into their cache and the
      compilation cache's directory).
    rundir.claim.RunDirectoryBusyError: with ``--overwrite``, another
      process trains the run there; nothing was deleted.
  """
  config, hparams = config_lib.parse_flags(argv)
  config_lib.check_outside_data(config)
  resume = claim.claim_run_directory(config.output_dir, config.identity(),
                                     hparams, overwrite=config.overwrite)
  try:
    dataset = datasets.get_dataset(config.dataset, data_dir=config.data_dir,
                                   seed=config.trial_seed)
  except datasets.DatasetNotFoundError as e:
    raise errors.UsageError(str(e)) from None
  # A run goes on, or reports its result, only on its own data.
  fingerprint = datasets.fingerprint(dataset)
  if resume:
    check_run_data(Path(config.output_dir), fingerprint)
  # The run directory records the configuration as asked for: the
  # protocol's changes follow from it.
  protocol = config
  if catalog.DATASETS[config.dataset].wilds is not None:
    protocol = wilds_protocol(config, dataset, hparams)
  train_domains = _train_domains(protocol, dataset)
  _check_validation_examples(protocol, dataset, train_domains, hparams)
  domains_per_step = hparams.get("domains_per_step") or len(train_domains)
  # Last, once the data are there: fetching the weights can download
  # 100 MB. A finished run reports its result, which needs nothing more.
  weights = compile_cache = None
  if not (resume and records.is_done(config.output_dir)):
    if "image_size" in hparams:
      dataset = datasets.resized(dataset, hparams["image_size"])
    weights = _checked_weights(config, resume)
    compile_cache = checked_compile_cache(config.compile_cache_dir)
    _check_devices(config.devices)
    if config.init_params is not None:
      _check_init_params(protocol, dataset, hparams)
  return config_lib.RunSpec(
      config=protocol, hparams=hparams,
      run_record=claim.run_record(
          config.identity(), hparams,
          None if weights is None else weights.record()),
      train_domains=train_domains, resume=resume, dataset=dataset,
      fingerprint=fingerprint, domains_per_step=domains_per_step,
      steps_per_epoch=_steps_per_epoch(protocol, dataset, train_domains,
                                       hparams["batch_size"],
                                       domains_per_step),
      weights=None if weights is None else weights.path,
      compile_cache=compile_cache)


def _train_domains(config: config_lib.Config,
                   dataset: datasets.MultiDomainDataset) -> tuple[int, ...]:
  """The domains that a run of ``config`` trains on: those not held out.

  Raises:
    errors.UsageError: the held-out domains are out of the dataset's range,
      or are all of them, or ``--plateau_check_freq`` asks for a criterion
      on accuracy of a regression.
  """
  num_domains = len(dataset.domains)
  if not set(config.test_envs) <= set(range(num_domains)):
    raise errors.UsageError(
        f"--test_envs {config.test_envs} out of range for "
        f"{config.dataset}'s {num_domains} domains (0 to "
        f"{num_domains - 1}).")
  train_domains = tuple(d for d in range(num_domains)
                        if d not in config.test_envs)
  if not train_domains:
    raise errors.UsageError(
        "Every domain is a test domain; none is left to train on.")
  # Floating-point labels are regression targets, as `tasks` scores them.
  label = np.asarray(dataset.domains[0][0]["label"])
  if config.plateau_check_freq and np.issubdtype(label.dtype, np.floating):
    raise errors.UsageError(
        f"--plateau_check_freq: {config.dataset} is a regression, and the "
        "convergence criterion is on validation accuracy; train a fixed "
        "--steps instead.")
  return train_domains


def _check_validation_examples(config: config_lib.Config,
                               dataset: datasets.MultiDomainDataset,
                               train_domains: Sequence[int],
                               hparams: Mapping[str, Any]) -> None:
  """Checks that a run whose learning rate follows the training domains'
  validation loss (ERM++'s ``auto_lr``) holds out examples of each.

  Raises:
    errors.UsageError: ``--holdout_fraction`` holds out none of a training
      domain.
  """
  if not hparams.get("auto_lr") or config.lr_schedule is not None:
    # A second stage replays its first stage's rates: it needs none.
    return
  empty = [d for d in train_domains if datasets.held_out_size(
      len(dataset.domains[d]), config.holdout_fraction) == 0]
  if empty:
    raise errors.UsageError(
        "auto_lr follows the training domains' validation loss, but "
        f"--holdout_fraction {config.holdout_fraction} holds out no example "
        f"of domains {empty}: raise it, or set hparam auto_lr to false.")


def _steps_per_epoch(config: config_lib.Config,
                     dataset: datasets.MultiDomainDataset,
                     train_domains: Sequence[int], batch_size: int,
                     domains_per_step: int) -> float:
  """The steps of an epoch (`config.RunSpec.steps_per_epoch`): DomainBed's,
  a pass over the smallest training domain's "in" split; WILDS's, over the
  whole training split (`wilds_protocol`)."""
  sizes = [len(dataset.domains[d]) - datasets.held_out_size(
      len(dataset.domains[d]), config.holdout_fraction)
           for d in train_domains]
  if catalog.DATASETS[config.dataset].wilds is not None:
    return sum(sizes) / (batch_size * domains_per_step)
  return min(sizes) / batch_size


def _check_devices(devices: int) -> None:
  """Refuses more ``--devices`` than there are here.

  Raises:
    errors.UsageError: there are fewer; the message says how a CPU makes
      more.
  """
  if devices == 1:
    return
  # Only a run on several devices needs JAX to be resolved.
  import jax  # pylint: disable=import-outside-toplevel
  available = jax.device_count()
  if devices > available:
    # A CPU host has one device unless XLA is told to make several.
    hint = ("" if jax.default_backend() != "cpu" else
            " On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{devices} before the command makes {devices} devices of its "
            "cores.")
    raise errors.UsageError(
        f"--devices {devices}: only {available} {jax.default_backend()} "
        f"device{'s' if available > 1 else ''} here.{hint}")


def _check_init_params(config: config_lib.Config,
                       dataset: datasets.MultiDomainDataset,
                       hparams: Mapping[str, Any]) -> None:
  """Refuses ``--init_params`` that do not fit the run's model, checked on
  the model's shapes (none of its values computed).

  Raises:
    errors.UsageError: the file cannot be read, or its keys or shapes are
      not the model's.
  """
  # Only a run from another's params needs JAX to be resolved.
  # pylint: disable=import-outside-toplevel
  from experiments.rundir import checkpoints
  from experiments.training import steps
  # pylint: enable=import-outside-toplevel
  try:
    checkpoints.check_params_fit(config.init_params,
                                 *steps.model_shapes(config, dataset, hparams))
  except (OSError, ValueError) as e:  # Unreadable or misfit.
    raise errors.UsageError(f"--init_params: {e}") from None


def check_run_data(run_dir: str | Path, data: dict[str, Any]) -> None:
  """Refuses to go on with a run recorded on other data than ``data``.

  Args:
    run_dir: the run's directory.
    data: the ``datasets.fingerprint`` of the dataset as it is now.

  Raises:
    errors.UsageError: the run recorded another fingerprint; the
      message says what changed. A run without one (written before runs
      recorded them) is accepted.
  """
  try:
    records.check_fingerprint(run_dir, data)
  except records.DatasetChangedError as e:
    raise errors.UsageError(
        f"{e}. Train it again on these data with the same command and "
        "--overwrite, or pass another --output_dir.") from None


def wilds_protocol(
    config: config_lib.Config, dataset: wilds.WildsDataset,
    hparams: Mapping[str, Any]
) -> config_lib.Config:
  """WILDS's protocol: ``config`` as a run on ``dataset`` follows it.

  Its evaluation splits are the test domains, its training domains are not
  split (WILDS has its own in-distribution splits), and without ``--steps``
  the run lasts the catalog's ``epochs`` (PovertyMap 200, FMoW 10) of its
  training split, at ``batch_size * domains_per_step`` examples per step.
  """
  steps = config.steps
  if steps is None:
    train_examples = sum(len(dataset.domains[d])
                         for d in range(dataset.num_train_domains))
    per_step = hparams["batch_size"] * hparams["domains_per_step"]
    epochs = catalog.DATASETS[config.dataset].epochs
    steps = max(1, -(-epochs * train_examples // per_step))
  return dataclasses.replace(config, test_envs=list(dataset.test_envs),
                             holdout_fraction=0.0, steps=steps)


def _checked_weights(config: config_lib.Config,
                     resume: bool) -> convert.Weights | None:
  """The featurizer weights that the run starts from (their file and
  SHA-256), checked before the model is built: fetched if they are
  ImageNet's, read whole, and of ``--model``'s architecture
  (``convert.checked_weights``). None for none.

  Raises:
    errors.UsageError: they cannot be fetched, or are damaged, or are
      not weights of ``--model``; or the run to resume started from other
      weights.
  """
  if config.pretrained in (None, "none"):
    return None
  # Imported for weights only: it imports JAX, which resolving a run that
  # has none does not need.
  # pylint: disable-next=import-outside-toplevel
  from experiments.weights import convert, imagenet
  try:
    weights = convert.checked_weights(config.pretrained, config.model)
  except imagenet.WeightsUnavailableError as e:
    raise errors.UsageError(str(e)) from None
  except (OSError, ValueError) as e:
    raise errors.UsageError(f"--pretrained: {e}") from None
  record = weights.record()
  config_file = Path(config.output_dir) / records.CONFIG_FILE
  started = (json.loads(config_file.read_text()).get("weights")
             if resume else None)
  if started is not None and started != record:
    raise errors.UsageError(
        f"{config.output_dir} started from weights {started['file']} "
        f"(SHA-256 {started['sha256']}), but --pretrained "
        f"{config.pretrained} now gives {record['file']} (SHA-256 "
        f"{record['sha256']}). Pass the weights it started from, or "
        "--overwrite to train it again from these.")
  return weights


def compile_cache_path(flag: str | None) -> Path | None:
  """Where a run keeps its compiled programs (``--compile_cache_dir``'s
  help), or None for no cache (``none``)."""
  if flag is not None:
    return None if flag.lower() == "none" else Path(flag)
  if os.environ.get(COMPILE_CACHE_ENV):
    return Path(os.environ[COMPILE_CACHE_ENV])
  cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(cache_home) / COMPILE_CACHE_SUBDIR


def checked_compile_cache(flag: str | None) -> Path | None:
  """`compile_cache_path`, created and written to once, so that a run that
  cannot keep its programs there is told before it trains, not by JAX's
  warnings on every program.

  Returns:
    The directory; None for no cache: asked for (``none``), or the default
    directory cannot be written, which is warned about on stderr.

  Raises:
    errors.UsageError: the directory that ``flag`` or `COMPILE_CACHE_ENV` names
      cannot be written.
  """
  path = compile_cache_path(flag)
  if path is None:
    return None
  try:
    path.mkdir(parents=True, exist_ok=True)
    claim.write_in(path)
  except OSError as e:
    reason = e.strerror or str(e)
    if flag is not None or os.environ.get(COMPILE_CACHE_ENV):
      named = ("--compile_cache_dir" if flag is not None
               else f"${COMPILE_CACHE_ENV}")
      raise errors.UsageError(
          f"{named} {path}: cannot write the compilation cache there "
          f"({reason}); pass a writable --compile_cache_dir, or "
          "--compile_cache_dir none to compile every run afresh.") from None
    print(f"Warning: cannot write the compilation cache {path} ({reason}): "
          "this run compiles its programs afresh and keeps none. "
          "--compile_cache_dir DIR keeps them in DIR; --compile_cache_dir "
          "none says no cache without this warning.", file=sys.stderr)
    return None
  return path


def claim_and_train(spec: config_lib.RunSpec) -> records.Record:
  """The command's claim and train steps, for a resolved ``spec``: claims
  its run directory (`rundir.claim.claim_run`) and trains the run
  (``training.loop.train``), or says on stderr that it is finished; returns
  its last record.

  Raises:
    rundir.claim.RunDirectoryBusyError: another process trains the run.
    rundir.records.DamagedRunError: its records are damaged.
    data.datasets.UnreadableImageError: an image stopped decoding as the
      run trained.
    KeyboardInterrupt: as ``training.loop.train`` raises it.
  """
  with claim.claim_run(spec.config.output_dir,
                       resume=spec.resume) as claimed:
    if claimed.finished:
      print("Already finished.", file=sys.stderr)
      return claimed.run.records[-1]
    # Imported for a run to train: a finished run's result needs no JAX,
    # whose import takes seconds.
    # pylint: disable-next=import-outside-toplevel
    from experiments.training import loop
    return loop.train(spec, claimed)


class _Stopped(KeyboardInterrupt):
  """SIGTERM before the run trains (resolving it can read a large folder)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _stop(signum: int, frame) -> None:
  del frame
  raise _Stopped(signum)


def main(argv: Sequence[str] | None = None) -> int:
  """Command-line entry point; see the module docstring.

  Returns:
    The exit status: 0; 2 for a command line that cannot run, or a run
    directory or data that the run cannot go on with (after a message
    saying why, as argparse's usage errors); 128 + the signal's number when
    stopped by SIGINT (130, Ctrl-C) or SIGTERM (143), after saying where a
    rerun resumes.
  """
  # Until training takes the signals over (to stop at a checkpointed step),
  # SIGTERM stops the command as Ctrl-C does; one ignored (nohup) stays so,
  # and the handler before is back on return (main may run in a process
  # that goes on, as tests run it).
  previous = None
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN):
    previous = signal.signal(signal.SIGTERM, _stop)
  try:
    return _run(argv)
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)


def _run(argv: Sequence[str] | None) -> int:
  """`main` with its signal handler in place."""
  spec = None
  try:
    spec = resolve_run(argv)
    record = claim_and_train(spec)
    claim.print_result(record, spec.config.output_dir)
  except records.DamagedRunError as e:
    return _refuse(f"{e}. Train it again from scratch: the same command "
                   "with --overwrite.")
  except (errors.UsageError, claim.RunDirectoryBusyError,
          datasets.UnreadableImageError) as e:
    return _refuse(str(e))
  except KeyboardInterrupt as e:
    # Ctrl-C's SIGINT, unless the run says which
    # (training.interrupts.Interrupted, or _Stopped before it trains).
    signum = getattr(e, "signum", signal.SIGINT)
    if spec is None:
      where = "before the run started; rerun the same command to run it"
    else:
      output_dir = spec.config.output_dir
      steps = records.checkpoint_steps(output_dir)
      where = (f"checkpoint at step {steps[-1]} in {output_dir}; rerun the "
               "same command to resume from it" if steps else
               "no checkpoint yet; rerun the same command to start again")
    print(f"\nstopped by {signal.Signals(signum).name}; {where}.",
          file=sys.stderr)
    return 128 + signum
  return 0


def _refuse(message: str) -> int:
  """Prints ``message`` as argparse prints a usage error; returns 2."""
  print(f"{config_lib.PROG}: error: {message}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
