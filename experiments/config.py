"""The configuration of one training run, and its command-line flags.

Every field of `Config` is a flag of ``python -m experiments.train`` with the
same name (``--test_envs 0 1``, ``--hparams '{"lr": 1e-4}'``). Fields left as
``None`` are filled in per dataset by `Config.resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Sequence
from typing import Any

from experiments import hparams_registry

# Per dataset: (steps, checkpoint_freq). The built-in digit datasets get a
# short schedule that trains in a few minutes on two CPU cores (their domains
# hold ~240 training images, so 100 steps of 63 images are ~25 epochs); the
# others follow the paper (5,000 steps; DomainNet 6,000) and DomainBed's
# evaluation frequency.
SCHEDULES = {
    "RotatedDigits": (300, 50),
    "ColoredDigits": (300, 50),
    "RotatedMNIST": (5000, 100),
    "ColoredMNIST": (5000, 100),
    "DomainNet": (6000, 1000),
}
DEFAULT_SCHEDULE = (5000, 300)


def _field(default: Any, help: str) -> Any:  # pylint: disable=redefined-builtin
  # Lists are copied per instance, as dataclasses require.
  if isinstance(default, list):
    return dataclasses.field(default_factory=default.copy,
                             metadata={"help": help})
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Config:
  """What to train, on what, for how long, and where to write it.

  Each field's ``help`` metadata documents it (and is its flag's help).
  """

  dataset: str = _field("RotatedDigits", "Dataset name.")
  algorithm: str = _field("PGrad-B", "Algorithm name.")
  test_envs: list[int] = _field([0], "Held-out (test) domain indices.")
  data_dir: str | None = _field(None, "Where the dataset files are.")
  output_dir: str = _field("runs/train", "Where results and checkpoints go.")
  steps: int | None = _field(
      None, "Training steps. Default: per dataset (SCHEDULES).")
  checkpoint_freq: int | None = _field(
      None, "Steps between evaluations and checkpoints. Default: per dataset.")
  seed: int = _field(0, "Seeds model init, data sampling and the algorithm.")
  hparams_seed: int = _field(0, "Hyperparameter draw; 0 means the defaults.")
  trial_seed: int = _field(
      0, "Seeds the dataset and its train/validation splits, and the draw.")
  holdout_fraction: float = _field(
      0.2, "Fraction of every domain held out for validation.")
  hparams: str | None = _field(
      None, "JSON object of hyperparameters overriding the drawn ones.")
  model: str | None = _field(
      None, "Model name. Default: mnist_cnn for digits, resnet50 otherwise.")
  pretrained: str | None = _field(
      None, "Featurizer weights (.npz or Orbax directory) to start from.")
  init_params: str | None = _field(
      None, "A run's final_params.npz to start the whole model from (e.g. "
      "FMoW's ERM phase before PGrad).")
  eval_examples: int | None = _field(
      None, "Evaluate at most this many examples per split (fixed random "
      "subset). Default: all.")
  loss_examples: int = _field(
      512, "Examples of every domain's training split for env{i}_in_loss.")
  eval_batch_size: int = _field(256, "Batch size of evaluation.")

  def resolve(self) -> Config:
    """A copy with the per-dataset defaults filled in, checked."""
    steps, freq = SCHEDULES.get(self.dataset, DEFAULT_SCHEDULE)
    config = dataclasses.replace(
        self,
        steps=steps if self.steps is None else self.steps,
        checkpoint_freq=freq if self.checkpoint_freq is None
        else self.checkpoint_freq,
        model=self.model or hparams_registry.default_model(self.dataset),
        test_envs=list(self.test_envs))
    if config.steps < 1 or config.checkpoint_freq < 1:
      raise ValueError("steps and checkpoint_freq must be positive, got "
                       f"{config.steps} and {config.checkpoint_freq}.")
    return config

  def hyperparameters(self) -> dict[str, Any]:
    """The drawn hyperparameters with the ``hparams`` overrides applied.

    Returns:
      ``random_hparams(algorithm, dataset, hparams_seed, trial_seed)`` updated
      with the overrides.

    Raises:
      ValueError: ``hparams`` is not a JSON object, or names a hyperparameter
        the algorithm lacks.
    """
    hparams = hparams_registry.random_hparams(
        self.algorithm, self.dataset, self.hparams_seed, self.trial_seed)
    overrides = json.loads(self.hparams) if self.hparams else {}
    if not isinstance(overrides, dict):
      raise ValueError(f"--hparams must be a JSON object, got {self.hparams}.")
    unknown = sorted(overrides.keys() - hparams.keys())
    if unknown:
      raise ValueError(f"Unknown hparams {unknown} for {self.algorithm} on "
                       f"{self.dataset}; known: {sorted(hparams)}.")
    return {**hparams, **overrides}


def _flag_type(annotation: Any) -> Any:
  """A field's argparse ``type``: its non-None type, or its list's items'."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  return args[0] if args else annotation


def parse_args(argv: Sequence[str] | None = None) -> Config:
  """Parses command-line flags, one per `Config` field.

  Args:
    argv: the flags; ``None`` reads ``sys.argv[1:]``.

  Returns:
    The (unresolved) configuration.
  """
  parser = argparse.ArgumentParser(
      prog="python -m experiments.train",
      description="Trains one DomainBed run and writes results.jsonl.")
  hints = typing.get_type_hints(Config)
  defaults = Config()
  for field in dataclasses.fields(Config):
    hint = hints[field.name]
    kwargs = {"type": _flag_type(hint)}
    if typing.get_origin(hint) is list:
      kwargs["nargs"] = "+"
    default = getattr(defaults, field.name)
    help_text = field.metadata["help"]
    if default is not None:
      help_text += f" Default: {default}."
    parser.add_argument(f"--{field.name}", default=default, help=help_text,
                        **kwargs)
  return Config(**vars(parser.parse_args(argv)))
