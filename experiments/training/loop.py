"""The training loop of one run: `train` reads a resolved `config.RunSpec`
and its claimed run directory, and returns the run's last record; it prints
no result, and refuses nothing: resolving and claiming the run did.

It reads as Flax's ``train_and_evaluate`` (examples/imagenet/train.py):
set up the data, the model and its state (`_set_up`), resume from the last
checkpoint (`_resume`), then train, and evaluate and checkpoint every
``checkpoint_freq`` steps (`_Training`). The protocol is
`experiments.train`'s; what the run writes, and when, is
`experiments.rundir`'s contract.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from experiments import algorithms
from experiments import config as config_lib
from experiments import lr_plateau
from experiments import second_stage
from experiments.data import datasets
from experiments.data import photo_augmentation as augmentation
from experiments.data import pipeline as input_pipeline
from experiments.rundir import checkpoints
from experiments.rundir import claim
from experiments.rundir import records
from experiments.runs import environment
from experiments.training import compile_cache
from experiments.training import evaluate
from experiments.training import interrupts
from experiments.training import progress
from experiments.training import sharding
from experiments.training import steps
from experiments.training import stopping
from experiments.training import weight_averaging


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What a run trains with, once set up (`_set_up`).

  Attributes:
    dataset: its data (`config.RunSpec.dataset`).
    splits: every domain's in and out indices.
    augment: its training augmentation; None for none.
    network: the model's network.
    algorithm: the algorithm that updates it.
    state: the initial train state, on the devices.
    train_iter: the training batches.
    sharder: how batches and state go on the devices.
    batch_shape: a training batch's (domains, examples per domain).
    init_time: the seconds initialising the model and its state took.
    averaging: its weight averaging (``--averaging``), from the initial
      state; None without.
  """

  dataset: datasets.MultiDomainDataset
  splits: Sequence[input_pipeline.Split]
  augment: augmentation.Augmentation | None
  network: algorithms.Network
  algorithm: algorithms.Algorithm
  state: steps.TrainState
  train_iter: Any
  sharder: sharding.Sharder
  batch_shape: tuple[int, int]
  init_time: float
  averaging: weight_averaging.Averaging | None


def _set_up(spec: config_lib.RunSpec) -> _Setup:
  """The data, model, algorithm, initial state and batches of a run."""
  config, hparams = spec.config, dict(spec.hparams)
  sharder = sharding.Sharder(config.devices)
  dataset = spec.dataset
  train_domains = list(spec.train_domains)
  splits = input_pipeline.split_domains(
      dataset, holdout_fraction=config.holdout_fraction,
      seed=config.trial_seed)
  initialising = time.time()
  network, params, stats = algorithms.Network.split(
      steps.build_model(config, dataset, hparams, spec.weights))
  if config.init_params:
    params, stats = checkpoints.load_params(config.init_params, params, stats)
  batch_shape = (spec.domains_per_step, hparams["batch_size"])
  algorithm = algorithms.build_algorithm(
      config.algorithm, network, hparams, num_domains=batch_shape[0],
      seed=config.seed)
  progress.say(f"{config.algorithm} on {config.dataset}, held out "
               f"{config.test_envs}: {sharder.layout(batch_shape)}.")
  state = sharder.replicate(steps.TrainState(
      jnp.zeros((), jnp.int32), params, stats, algorithm.init(params)))
  # Timed to when its values are computed. The model initialises eagerly,
  # compiling one program per initializer and shape (or loading it from the
  # cache): on a cold cache that can take longer than the step's compile.
  jax.block_until_ready(state)
  init_time = time.time() - initialising
  augment = augmentation.training_augmentation(dataset, hparams)
  progress.say(progress.start_line(config, dataset, augment is not None))
  train_iter = input_pipeline.make_train_iterator(
      dataset if augment is None else augment.dataset, train_domains, splits,
      batch_size=hparams["batch_size"], seed=config.seed,
      num_workers=config.num_workers,
      domains_per_step=hparams.get("domains_per_step"),
      transform=None if augment is None else augment.transform)
  return _Setup(dataset, splits, augment, network, algorithm, state,
                train_iter, sharder, batch_shape, init_time,
                weight_averaging.build(config, hparams, network, state,
                                       sharder))


class _RunDirectory:
  """The run directory as the loop writes it, and its checkpoint manager.

  A fresh run starts it (`claim.start_run_directory`) before the first file
  it writes there, whichever that is: the step-0 params snapshot
  (``--trajectory_freq``) or the first evaluation's record. The config file
  is then there before any other, so that a run killed at any moment
  leaves a directory that the same command resumes rather than refuses.

  Attributes:
    path: the directory.
    manager: its checkpoint manager; None until a fresh run starts it.
  """

  def __init__(self, spec: config_lib.RunSpec, lock: claim.RunDirectoryLock):
    self.path = Path(spec.config.output_dir)
    self.manager = (checkpoints.checkpoint_manager(self.path) if spec.resume
                    else None)
    self._spec = spec
    self._lock = lock

  def started(self) -> ocp.CheckpointManager:
    """The checkpoint manager, the directory started first if it is not."""
    if self.manager is None:
      spec = self._spec
      claim.start_run_directory(
          self.path, dict(spec.run_record), spec.fingerprint,
          environment.describe(spec.config.devices), self._lock)
      self.manager = checkpoints.checkpoint_manager(self.path)
    return self.manager

  def close(self) -> None:
    """Waits for the last checkpoint, and closes the manager."""
    if self.manager is not None:  # None: a fresh run stopped before writing.
      self.manager.wait_until_finished()
      self.manager.close()


def _resume(
    setup: _Setup, directory: _RunDirectory, start: int | None,
    run: records.RunRecords | None
) -> tuple[steps.TrainState, list[records.Record], evaluate.MetricMeter]:
  """The state, records so far and metric sums that a run goes on from:
  restored from the checkpoint at ``start`` (the data iterator in place),
  with the ``run``'s records kept that the checkpoints hold. An interrupt's
  checkpoint and record are forgotten once restored
  (`checkpoints.forget_interrupt_checkpoint`), its metric sums carried on.
  A fresh run (``run`` None) goes on from ``setup``'s initial state.
  """
  state, written, meter = setup.state, [], evaluate.MetricMeter()
  if start is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    items = {}
    if setup.averaging is not None:
      items["averaging"] = ocp.args.StandardRestore(
          setup.averaging.abstract_item())
    # Restores the iterator in place and returns the train state.
    restored = directory.manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=grain.checkpoint.CheckpointRestore(setup.train_iter), **items))
    state = restored.state
    if setup.averaging is not None:
      setup.averaging.restore(restored.averaging)
    progress.say(f"Resuming from step {start}.")
  if run is None:
    return state, written, meter
  # What a killed run left after the checkpoint goes; it is computed again.
  for message in records.keep_checkpointed(run):
    progress.say(message)
  written = run.checkpointed
  if written and checkpoints.INTERRUPT_KEY in written[-1]:
    # Its metrics so far go on into the next record, as uninterrupted.
    meter = evaluate.MetricMeter.from_state(
        written[-1][checkpoints.METER_KEY], setup.sharder.replicate)
    directory.manager, written = checkpoints.forget_interrupt_checkpoint(
        directory.manager, directory.path, start)
  return state, written, meter


def train(spec: config_lib.RunSpec,
          claimed: claim.ClaimedRun) -> records.Record:
  """Trains (or resumes) one run and returns its last results record.

  Args:
    spec: the run, resolved and checked (``experiments.train.resolve_run``).
    claimed: its run directory, claimed (`claim.claim_run`) and not
      finished: its lock held where the directory exists, and the records
      of a run to resume checked.

  Returns:
    The record of the final evaluation.

  Raises:
    claim.RunDirectoryBusyError: another process started this fresh run's
      directory first, between the claim and the run's first write there;
      nothing was written.
    datasets.UnreadableImageError: an image read when the run was resolved
      no longer decodes; the run's last checkpoint stays.
    records.DamagedRunError: the records were damaged while the run
      trained (found when an interrupt's checkpoint is forgotten, and at
      the end, before ``done``).
    KeyboardInterrupt: on Ctrl-C, once the checkpoint being written is
      complete; `interrupts.Interrupted` on a signal of
      `interrupts.STOP_SIGNALS`, from its arrival on, once the step in
      progress (if any) is checkpointed.
  """
  started = time.time()
  config = spec.config
  output_dir = Path(config.output_dir)
  # From the start: a signal before the first step stops the run there.
  with interrupts.StopRequests() as stop:
    compile_cache.use_compile_cache(spec.compile_cache)
    # A fresh run creates its directory when it first writes there
    # (`_RunDirectory.started`), so a run that fails before leaves nothing.
    directory = _RunDirectory(spec, claimed.lock)
    run = claimed.run
    start = None if run is None else run.checkpoint_step
    setup = _set_up(spec)
    state, written, meter = _resume(setup, directory, start, run)
    # Whether the state holds steps that no checkpoint has (after one
    # resumed from an interrupt's, deleted, it does): a signal stops the run
    # at once only where that loses none.
    unsaved = run is not None and start != directory.manager.latest_step()
    training = _Training(spec, setup, directory, stop, started, start)
    images_per_step = setup.batch_shape[0] * setup.batch_shape[1]
    with progress.progress_bar(config.steps, int(state.step), started) as bar, (
        interrupts.checkpoint_kept_on_interrupt(lambda: directory.manager)):
      state = training.run(progress.Screen(bar, images_per_step), state,
                           written, meter, unsaved)
    setup.train_iter.close()  # Stops its workers, freeing batches read ahead.
    directory.close()
    step = int(state.step)
    if stop.signum is not None and step < config.steps and not (
        stopping.stops_at(config, written, step)):
      raise interrupts.Interrupted(stop.signum)
    checkpoints.save_params(output_dir / records.FINAL_PARAMS_FILE,
                            state.params, state.stats)
    # Done only on records that check, whatever touched them meanwhile.
    records.read_run(output_dir)
    records.mark_done(output_dir)
    if step < config.steps:
      progress.say(f"Stopped at step {step} of at most {config.steps}: "
                   f"{stopping.stop_reason(written)}.")
    return written[-1]


class _Training:
  """The steps of a run from where it goes on, evaluated and checkpointed
  every ``checkpoint_freq`` steps, at the end, and at a stop request.

  The loop is never more than one step ahead of the device, so that a
  signal stops the run at most one step after the step running then.
  """

  def __init__(self, spec: config_lib.RunSpec, setup: _Setup,
               directory: _RunDirectory, stop: interrupts.StopRequests,
               started: float, start: int | None):
    self.config = spec.config
    self.hparams = dict(spec.hparams)
    self.setup = setup
    self.directory = directory
    self.stop = stop
    self.started = started
    self.resumed = spec.resume
    self.steps_per_epoch = spec.steps_per_epoch
    self.start = start
    self.train_domains = list(spec.train_domains)
    # Stream 1 of the seed; the model's initialisation uses nnx.Rngs(seed).
    self.step_program = steps.make_train_step(
        setup.algorithm,
        jax.random.fold_in(jax.random.PRNGKey(self.config.seed), 1))
    self.train_step = setup.sharder.on_mesh(self.step_program)
    self.eval_step = setup.sharder.on_mesh(
        steps.make_eval_step(setup.network, setup.algorithm.predict))
    self.evaluated = setup.sharder.on_mesh(
        steps.make_evaluated(setup.algorithm))
    self.sets = evaluate.eval_sets(setup.splits, self.config)
    # A run whose learning rate follows its validation loss (ERM++'s
    # auto_lr; `_schedule_lr`) sets it with this; others have none.
    self.set_learning_rate = (
        None if setup.algorithm.set_learning_rate is None
        else jax.jit(setup.algorithm.set_learning_rate))
    self.on_cpu_photos = (jax.default_backend() == "cpu"
                          and datasets.is_photo_dataset(setup.dataset))
    self.timer = progress.StepTimer()
    # The times of the start of training in this process, which its every
    # record holds (`_compile`, `_after_step`).
    self.startup: dict[str, float] = {}
    self.screen = None
    self._estimate_start = None

  def _trains_on(self, step: int, written: Sequence[records.Record]) -> bool:
    return step < self.config.steps and not stopping.stops_at(
        self.config, written, step)

  def _next_batch(self) -> Any:
    """The next training batch, on the devices, its reading timed."""
    return self.timer.read(
        lambda: self.setup.sharder.batch(next(self.setup.train_iter), 1))

  def _compile(self, state: steps.TrainState) -> Any:
    """Records where a resumed run trains on, and compiles the step while
    it reads the first batch, which it returns."""
    setup = self.setup
    if self.resumed:
      # A resumed run trains on here: this machine joins the record of
      # where it trained, unless it was the last there. (A fresh run
      # records it as it starts its directory.) Checkpoints without an
      # entry are of a run from before runs recorded theirs.
      records.append_environment(
          self.directory.path, environment.describe(self.config.devices),
          unrecorded_before=self.start is not None)
    self.screen.phase("compiling")
    example = steps.training_example(setup.dataset, setup.augment,
                                     self.train_domains, setup.splits)
    compile_time, first_batch_time, batch = steps.compile_while_reading(
        self.step_program, state, setup.sharder, example, setup.batch_shape,
        lambda: setup.sharder.batch(next(setup.train_iter), 1))
    self.startup.update(init_time=setup.init_time, compile_time=compile_time,
                        first_batch_time=first_batch_time)
    return batch

  def run(self, screen: progress.Screen, state: steps.TrainState,
          written: list[records.Record], meter: evaluate.MetricMeter,
          unsaved: bool) -> steps.TrainState:
    """Trains from ``state`` to the last step, or a stop, appending the
    records it writes to ``written``; returns the last state.

    Args:
      screen: the progress bar.
      state: the state to go on from.
      written: the run's records so far.
      meter: the metric sums since the last record.
      unsaved: whether ``state`` holds steps that no checkpoint has: a stop
        request stops the run at once only where that loses none.
    """
    self.screen = screen
    step = int(state.step)
    if self.config.trajectory_freq and step == 0:
      # A fresh run's first file: the later snapshots follow it.
      self.directory.started()
      checkpoints.save_trajectory_point(self.directory.path, 0, state.params)
    batch = None  # The next step's, on the device.
    if self._trains_on(step, written) and (self.stop.signum is None
                                           or unsaved):
      batch = self._compile(state)
    steps_run = 0  # By this process.
    in_flight = None  # The metrics of the step dispatched before this one.
    self.timer.restart()
    while self._trains_on(step, written):
      if self.stop.signum is not None and not unsaved:
        break
      if batch is None:  # The first step after a checkpoint.
        batch = self._next_batch()
      state, metrics = self.train_step(state, batch)
      if self.setup.averaging is not None:
        self.setup.averaging.update(state)
      # Nothing holds a batch once its step has it: a worker's batch is in
      # shared memory, freed when the last reference goes.
      batch = None
      meter.add(metrics)
      # At most this step runs ahead of the loop: left to itself, JAX
      # dispatches all the steps to the next checkpoint before the device
      # has run them, and a signal meanwhile stopped the run only there
      # (or let it finish), that many steps later.
      self.timer.wait_for_device(in_flight)
      in_flight = metrics
      unsaved = True
      step += 1
      steps_run += 1
      self.timer.steps += 1
      self._after_step(state, step, steps_run)
      scheduled = (not step % self.config.checkpoint_freq
                   or step == self.config.steps)
      if not scheduled and self.stop.signum is None:
        # The next step's batch goes to the device while this step runs.
        # (At a checkpoint none is read ahead: the iterator's state saved
        # is that of the batches trained on.)
        batch = self._next_batch()
        continue
      self.timer.wait_for_device(state)
      state, schedule = self._schedule_lr(state, step, written, scheduled)
      written.append(self._checkpoint(state, step, meter, scheduled,
                                      schedule, written))
      unsaved = False
      meter = evaluate.MetricMeter()
      self.timer.restart()
    return state

  def _after_step(self, state: steps.TrainState, step: int,
                  steps_run: int) -> None:
    """Shows a step's progress, and saves its params snapshot if due; after
    the first step, says how the start went, and after a few more on a CPU,
    warns of a long run."""
    config = self.config
    if steps_run == 1:
      self.timer.wait_for_device(state)
      self.startup["time_to_first_step"] = time.time() - self.started
      self.screen.phase("training")
      progress.say(
          f"Initialised the model in {self.startup['init_time']:.1f} s; "
          f"compiled the step in {self.startup['compile_time']:.1f} s while "
          "reading the first batch in "
          f"{self.startup['first_batch_time']:.1f} s; the first step ended "
          f"{self.startup['time_to_first_step']:.1f} s after the run "
          "started.")
      self._estimate_start = time.time()
    elif steps_run == 1 + progress.ESTIMATE_STEPS and self.on_cpu_photos:
      self.timer.wait_for_device(state)
      progress.warn_if_long(
          (config.steps - step) * (time.time() - self._estimate_start)
          / progress.ESTIMATE_STEPS, config)
    # The steps known to have ended: the loop has just waited for the one
    # before this, not for this one, which may have only been dispatched.
    self.screen.training(self.timer.steps - 1, self.timer.seconds(),
                         self.timer.data_wait)
    self.screen.bar.update()
    if config.trajectory_freq and step % config.trajectory_freq == 0:
      checkpoints.save_trajectory_point(self.directory.path, step,
                                        state.params)

  def _schedule_lr(self, state: steps.TrainState, step: int,
                   written: Sequence[records.Record], scheduled: bool
                   ) -> tuple[steps.TrainState, records.Record]:
    """ERM++'s learning rate (hparam ``auto_lr``) at an evaluation: the
    state stepping at its schedule's learning rate, and the record's
    entries (none without ``auto_lr``). An interrupt's evaluation records
    the schedule as it stands.

    As DomainBed's ``set_lr`` (``algorithms.py`` lines 208-229), after the
    linear probe (``step > linear_steps``) the averaged network's
    validation loss (`evaluate.validation_loss`) steps the schedule
    (`lr_plateau`), whose state the run's last record holds. Every record
    has ``lr``, the full optimizer's learning rate from this step on, and
    ``lr_schedule``; those that stepped it ``sma_val_loss``. A second
    stage (``--lr_schedule_from``) replays its first stage's instead
    (`_replay_lr`).
    """
    if self.set_learning_rate is None:
      return state, {}
    if self.config.lr_schedule is not None:
      return self._replay_lr(state, step, written, scheduled)
    schedule = next(
        (lr_plateau.from_record(r[stopping.LR_SCHEDULE_KEY])
         for r in reversed(written) if stopping.LR_SCHEDULE_KEY in r),
        lr_plateau.plateau_init(self.hparams["lr"]))
    entries = {}
    if scheduled and step > self.hparams["linear_steps"]:
      setup = self.setup
      self.screen.phase("evaluating")
      loss = evaluate.validation_loss(
          self.eval_step, self.evaluated(state), setup.dataset, setup.splits,
          self.train_domains, self.config, setup.sharder, setup.augment)
      before, schedule = schedule, lr_plateau.plateau_step(schedule, loss)
      entries["sma_val_loss"] = loss
      lr = setup.sharder.replicate(np.float32(schedule.lr))
      state = state._replace(algorithm_state=self.set_learning_rate(
          state.algorithm_state, lr))
      if schedule.lr != before.lr:
        progress.say(f"Step {step}: learning rate {before.lr:.6g} -> "
                     f"{schedule.lr:.6g} (change {schedule.changes}), the "
                     f"averaged network's validation loss at {loss:.6g}.")
      if schedule.stopped:
        progress.say(f"Step {step}: the learning rate's third change ends "
                     "the run here, finished (DomainBed's train_autolr.py).")
    return state, {"lr": schedule.lr,
                   stopping.LR_SCHEDULE_KEY: lr_plateau.to_record(schedule),
                   **entries}

  def _replay_lr(self, state: steps.TrainState, step: int,
                 written: Sequence[records.Record], scheduled: bool
                 ) -> tuple[steps.TrainState, records.Record]:
    """A second stage's learning rate (``--lr_schedule_from``) at an
    evaluation: at each of its first stage's, the learning rate that the
    first stage set there; an interrupt's records the one it steps at.

    DomainBed's second stage sets, at each evaluation, the first stage's
    learning rates in turn (``train_autolr.py`` line 381, ``set_lr`` lines
    231-232 of ``algorithms.py``); the record's ``lr``, as the first
    stage's, is the one from this step on.
    """
    if not scheduled:
      return state, {"lr": written[-1]["lr"] if written
                     else self.hparams["lr"]}
    lr = second_stage.learning_rates(self.config)[step]
    state = state._replace(algorithm_state=self.set_learning_rate(
        state.algorithm_state, self.setup.sharder.replicate(np.float32(lr))))
    if written and lr != written[-1]["lr"]:
      progress.say(f"Step {step}: learning rate {written[-1]['lr']:.6g} -> "
                   f"{lr:.6g}, as the first stage's.")
    return state, {"lr": lr}

  def _evaluate(self, state: steps.TrainState) -> records.Record:
    """The metrics of ``state``'s model on every split."""
    setup = self.setup
    return evaluate.evaluate(
        self.eval_step, self.evaluated(state), setup.dataset, self.sets,
        self.config, setup.sharder, setup.augment,
        out_loss=self.config.averaging == "swad")

  def _training_batches(self) -> Iterator[Any]:
    """The next training batches, on the devices."""
    while True:
      yield self.setup.sharder.batch(next(self.setup.train_iter), 1)

  def _checkpoint(self, state: steps.TrainState, step: int,
                  meter: evaluate.MetricMeter, scheduled: bool,
                  schedule: records.Record,
                  written: Sequence[records.Record]) -> records.Record:
    """Evaluates ``step``, appends its record and checkpoints it; returns
    the record. ``scheduled``: a ``checkpoint_freq`` step or the last, else
    an interrupt's. ``schedule``: the learning rate's entries
    (`_schedule_lr`). ``written``: the records before."""
    setup = self.setup
    timing = self.timer.record()
    manager = self.directory.started()
    self.screen.phase("evaluating")
    record = {
        "args": self.config.record_args(), "hparams": self.hparams,
        "domains": list(setup.dataset.domain_names), "step": step,
        "epoch": step / self.steps_per_epoch,
        **meter.result(), **timing, **self.startup, **schedule,
        **self._evaluate(state)}
    averaging = setup.averaging
    if averaging is not None:
      record.update(averaging.record(
          state, record, self.train_domains, scheduled,
          lambda: scheduled and not self._trains_on(step, [*written, record]),
          self._evaluate, self._training_batches))
      if averaging.final is not None:
        # Before the last record: a run killed between them computes it
        # again, from the last checkpoint.
        checkpoints.save_params(
            self.directory.path / records.AVERAGED_PARAMS_FILE,
            averaging.final["params"], averaging.final["stats"])
    if not scheduled:
      # An interrupt's record, between the --checkpoint_freq steps: the
      # run that resumes from it carries its meter on and drops it.
      record.update({
          checkpoints.INTERRUPT_KEY: signal.Signals(self.stop.signum).name,
          checkpoints.METER_KEY: meter.state()})
    # The previous checkpoint is complete before the next record, so a
    # killed run leaves at most one record after its last checkpoint.
    manager.wait_until_finished()
    records.append_record(self.directory.path, record)
    items = {}
    if averaging is not None:
      items["averaging"] = ocp.args.StandardSave(averaging.checkpoint_item())
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(setup.train_iter), **items))
    self.screen.results(record, self.config.test_envs)
    self.screen.phase("training")
    return record
