"""Trains one DomainBed run: ``python -m experiments.train [flags]``.

With no flags it trains PGrad-B on RotatedDigits with domain 0 held out, in a
few minutes on two CPU cores, and prints the held-out domain's accuracy. The
flags are `experiments.config.Config`'s fields.

The protocol is DomainBed's (Gulrajani & Lopez-Paz, ICLR 2021): a fraction
(``holdout_fraction``, 20%) of every domain is held out ("out" split) for
validation and the rest is the "in" split; every step samples one batch per
training domain from its "in" split, with replacement. Every
``checkpoint_freq`` steps and at the end, the run evaluates every domain and
appends a line to ``<output_dir>/results.jsonl``::

  {"args": {...the resolved config...}, "hparams": {...},
   "domains": [str],      # the dataset's domain names; domain i is env{i}
   "step": int,           # updates done
   "epoch": float,        # steps * batch_size / smallest training in split
   "loss": float,         # mean training loss since the previous line
   "step_time": float,    # mean seconds per step since the previous line
   "env{i}_in_acc", "env{i}_out_acc": float,   # every domain i
   "env{i}_in_loss": float,  # loss on a fixed subset of the in split
   ...}                   # the algorithm's other metrics; for PGrad:
                          # "eigenvalues" (mean normalised spectrum,
                          # descending), "ref_norm", "num_skipped"

The held-out domains' accuracy is their ``in`` split's, as DomainBed reports.

On a WILDS dataset (``experiments.wilds``) the held-out domains are WILDS's
evaluation splits and the training domains are not split (see
`training.wilds_protocol`); every step trains on ``domains_per_step``
sampled domains; an epoch is a pass over the whole training split; and the
metrics are `tasks.split_metrics`'s: ``env{i}_in_mse``, ``env{i}_in_r`` and
``env{i}_in_worst_r`` for PovertyMap's regression, ``env{i}_in_acc`` and
``env{i}_in_worst_acc`` (worst region) for FMoW.

Every evaluation is followed by an Orbax checkpoint (the last two are kept) of
the params, BatchNorm statistics, algorithm state, step and data iterator. The
same command resumes a killed run from its last checkpoint and finishes with
bit-for-bit the same params as an uninterrupted run; results.jsonl lines
newer than the checkpoint are dropped and recomputed. At the end the run
writes its final params to ``final_params.npz`` and an empty ``done`` file.

The output directory belongs to one configuration, recorded in its
``config.json`` at the first evaluation (the directory is created then, so a
run failing earlier leaves nothing). A run of another configuration there is
refused before any work, with exit status 2, unless ``--overwrite`` (see
`experiments.config`).

With ``trajectory_freq`` N > 0, the params after every N-th step (and at
step 0) are saved flattened as float32 ``trajectory/<step>.npy`` (see
`training.save_trajectory_point`), for the trajectory plots of
``experiments.claims``.
A resumed run rewrites the snapshots after its checkpoint with the same values.

With several devices, batches are split over a ``data`` mesh axis and the
train state is replicated.

Flags are parsed and checked before JAX is imported (the training loop is in
`experiments.training`), so a bad name or value is refused at once.
"""


from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments import config as config_lib


def main(argv: Sequence[str] | None = None) -> int:
  """Command-line entry point; see the module docstring.

  Returns:
    The exit status: 0, or 2 for a command line that cannot run (after a
    message saying why, as argparse's usage errors).
  """
  config = config_lib.parse_args(argv)
  # Imported once the flags are known good: importing JAX takes seconds.
  from experiments import training  # pylint: disable=import-outside-toplevel
  try:
    training.train(config)
  except config_lib.UsageError as e:
    print(f"{config_lib.PROG}: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
