"""The run directory: what ``python -m experiments.train`` writes for one run,
and the contract that training, sweeps, reruns and reports keep with it.

This docstring is the one description of the contract; the modules implement
it: `records` (the record files: results, config, dataset fingerprint,
environment, done), `claim` (identity, refusal, and the claim of a run: its
lock and the records it goes on from), `checkpoints` (params files, params
snapshots, Orbax checkpoints and interrupts' checkpoints) and `pack` (a
sweep's finished runs in one file). None imports the run's configuration,
its command or its training loop.

**One directory, one configuration.** A run directory belongs to one
configuration: its ``config.json`` holds the run's identity (its resolved
arguments but those that say where files are or how the run executes, and
its hyperparameters), and a later run in the same directory resumes only
if its own identity is the same and its records check
(`claim.claim_run_directory`). A run of another configuration there, run
files without a ``config.json``, or a directory that cannot be written is
refused before any work, with exit status 2, unless ``--overwrite``, which
deletes the run's files there (and only those) and starts over. The default
directory is ``runs/<dataset>-<algorithm>-test<envs>-<hash>``, the hash
being that of the identity, so every configuration gets its own.

**Created at the first write.** The directory is created when the run first
writes there: at the first evaluation, or with ``--trajectory_freq`` at the
step-0 snapshot. It then writes ``config.json`` before anything else
(`claim.start_run_directory`), so a run failing earlier leaves nothing, and
a run killed later leaves a directory that the same command resumes. While
a process trains there it holds the directory's lock
(`claim.RunDirectoryLock`), taken when the run is claimed (`claim.claim_run`)
where the directory exists, before the model is built: a second process is
refused, exit status 2.

A run directory holds::

  config.json           the run's identity: its resolved arguments and
                        hyperparameters (`claim.run_record`),
                        and the file name and SHA-256 of the weights it
                        started from, if any
  dataset.json          the fingerprint of the data it trains on
                        (`experiments.data.datasets.fingerprint`); runs from
                        before fingerprints have none
  environment.json      where it trained (`records.append_environment`): a
                        list of `experiments.runs.environment.describe`
                        entries, the machine that started it, then one
                        more each time it resumed on another (a first
                        null: it trained before, unrecorded); runs from
                        before this file have none
  results.jsonl         one record per evaluation, a JSON object per line
  checkpoints/<step>/   Orbax checkpoints of the last evaluations
  trajectory/<step>.npy params snapshots, with --trajectory_freq
  final_params.npz      the params and statistics at the end
  averaged_params.npz   with --averaging: the averaged params and
                        statistics at the end, keyed as final_params.npz
  training.lock         held (flock) by the process training the run, while
                        it does (`claim.RunDirectoryLock`); empty
  done                  written last: the run finished

A *record* is one evaluation::

  {"args": {...the resolved config...}, "hparams": {...},
   "domains": [str],      # the dataset's domain names; domain i is env{i}
   "step": int,           # updates done
   "epoch": float,        # steps * batch_size / smallest training in split
   "loss": float,         # mean training loss since the previous record
   "step_time": float,    # mean seconds per step since the previous record,
                          # compiling excepted
   "data_wait_time": float,  # of which reading the next training batch
   "device_wait_time": float,  # of which waiting for the device to end
                          # steps; the rest is the loop's work on the host
   "init_time": float,    # seconds initialising the model and the
                          # optimizer state (loading weights, if any)
   "compile_time": float,    # seconds compiling the step (a cache hit: less)
   "first_batch_time": float,  # seconds reading the first training batch,
                          # which the step's compiling overlaps
   "time_to_first_step": float,  # from the start of training to the end of
                          # its first step in this process
   "interrupted": str,    # only on a record written at SIGINT or SIGTERM
   "meter": {...},        # with it: the metric sums since the last record,
                          # carried on when the run resumes
   "env{i}_in_acc", "env{i}_out_acc": float,   # every domain i
   "env{i}_in_loss": float,  # loss on a fixed subset of the in split
   ...,                   # the algorithm's other metrics; for PGrad:
                          # "eigenvalues" (mean normalised spectrum,
                          # descending), "ref_norm", "num_skipped"
   # With --averaging ema or sma, at every evaluation:
   "averaged_env{i}_{split}_{metric}": ...,  # every env{i}_ key above, of
                          # the averaged model (records.AVERAGED_PREFIX)
   # With --averaging swad, at every evaluation:
   "env{i}_out_loss": float,  # mean loss on every domain's out split
   # and at every evaluation but an interrupt's:
   "swad_loss": float,    # the training domains' mean of it: the valley's
   "swad_dead": bool,     # whether the valley has died: the run stops
   # and in its last record only (the valley dead, or the last step):
   "averaged_env{i}_{split}_{metric}": ...,  # of SWAD's final model
   "averaged_segments": int,  # how many segment means it averages
   "averaged_first_step", "averaged_last_step": int | None,  # the steps
                          # of the params it spans
  }

Its per-domain keys are ``env{i}_{split}_{metric}`` (`records.env_key`), the
metrics being `experiments.data.tasks.split_metrics`'s: ``acc`` (and
``worst_acc`` on WILDS) of classes, ``mse``, ``r`` and ``worst_r`` of
regression values, and ``examples``, how many examples they are over.

How a run writes, so that a run killed at any moment leaves a state the next
one recognises: once the previous checkpoint is on disk, the run appends the
record of an evaluation (flushed and synced to disk) and then checkpoints
that step; at the end it writes ``done`` whole or not at all. A killed run
therefore leaves at most one record after its last checkpoint, and maybe a
last line cut short; the run that resumes it drops those, says so, and
computes them again. Anything else is damage that no run leaves:
`records.read_run` refuses it with `records.DamagedRunError`, and training,
sweeps and reports alike refuse or skip the run, saying why.

A sweep's finished runs can be *packed* into one compressed file beside
them, ``runs.jsonl.gz`` (`pack.pack_runs`), which is how a study is
committed: its thousands of run files become one, without checkpoints or
params. Each line
is one run, in name order::

  {"run": str,            # its directory's name
   "config": {...},       # its config.json
   "environment": [...],  # its environment.json, where it has one
   "records": [...],      # its records, as in results.jsonl
   "trajectory": {...}}   # only for a run that saved params snapshots:
                          # what the paper's claims read of them
                          # (`experiments.analysis.claims.ProjectedPath`),
                          # kept in their place

A packed run is finished. Where its directory holds a results file, that
directory is the run (`pack.packed_run`); reports, sweeps and studies otherwise
read the packed run as they read a finished directory.


**Checkpoints and resuming.** Every evaluation is followed by an Orbax
checkpoint (the last two are kept) of the params, BatchNorm statistics,
algorithm state, step and data iterator (`checkpoints.checkpoint_manager`),
and with ``--averaging`` of the averaging's state (an item ``averaging``:
its arrays and SWAD's valley, in NumPy).
The same command resumes a killed or stopped run from its last checkpoint
and finishes with bit-for-bit the same params as an uninterrupted run; a
record newer than the checkpoint is dropped and recomputed. Records that
contradict themselves or the checkpoints (which no run, even killed,
leaves) are refused with exit status 2 before anything else
(`claim.claim_run`), as is a finished run's; the same command with
``--overwrite`` trains again from scratch. At the end the run writes its
final params (`checkpoints.save_params`; with ``--averaging`` the averaged
params before the last record) and its ``done`` file; the same
command then prints its result again, without importing JAX.

**Interrupts.** SIGINT (Ctrl-C) and SIGTERM (e.g. SLURM's preemption, or its
time limit) lose no work: the run finishes its step, evaluates and
checkpoints it, and exits with status 130 or 143, saying where the rerun
resumes; a second signal stops it at once, from the last checkpoint. The
loop is never more than one step ahead of the device, so that step is at
most the one after the step running when the signal came; a signal before
the first step, or once a step is checkpointed, stops the run there.
Between the ``checkpoint_freq`` steps, the record of such an interrupt is
marked ``"interrupted"`` (the signal's name) and holds the metrics summed
since the previous record under ``"meter"``; the run resumed from it sums
on, then deletes that checkpoint and record
(`checkpoints.forget_interrupt_checkpoint`), so that its records and params
are those of a run never interrupted. The interrupt evaluates, as every
checkpoint does, so that the record of a run left interrupted reads as any
other: ask the scheduler for the signal at least two steps and an
evaluation before the end (SLURM: ``--signal=TERM@<seconds>``, its default
grace period being 30 s).

**Params snapshots.** With ``--trajectory_freq`` N > 0, the params after
every N-th step (and at step 0) are saved flattened as float32 snapshots
(`checkpoints.save_trajectory_point`), for the trajectory plots of
``experiments.analysis.claims``. A resumed run rewrites the snapshots after
its checkpoint with the same values.
"""
