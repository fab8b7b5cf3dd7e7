"""The kinds of entries the catalog registers, and the facts each holds.

A dataset's, a model's and an algorithm's facts live on their entries in
``experiments/catalog.py``; this module says what those facts are. It
imports no builder, as the catalog does not (see `registry`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from experiments import registry
from experiments import search_space


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetEntry(registry.Entry):
  """A dataset; its builder is ``builder(*, data_dir, seed, **options)``.

  Attributes:
    domains: its domains' names, in the order the builder builds them, as
      DomainBed's ``ENVIRONMENTS``: a sweep counts them without reading the
      data. A WILDS dataset's are its training domains, then
      `WILDS_EVAL_SPLITS`; a copy of its data that lacks a training domain's
      rows builds without that domain.
    steps: training steps by default; ``None`` for WILDS's datasets, which
      train for their `epochs`.
    epochs: a WILDS dataset's training length, the paper's, in passes over
      its whole training split (``train.wilds_protocol`` turns them into steps
      once the data are read); ``None`` for the others.
    checkpoint_freq: steps between evaluations and checkpoints by default.
    model: the default network, a name of `MODELS`.
    small_images: digits trained from scratch by DomainBed's MNIST CNN, with
      its hparams; otherwise photos for an ImageNet network.
    upsampled: the images are 8x8 scans upsampled to 28x28, which a quarter
      of the MNIST CNN's width learns as well.
    small_batches: memory limits its batches (DomainNet's 345-class head):
      DomainBed draws batch sizes up to 2^5 rather than 2^5.5, and the
      paper's PGrad trains on 24 rather than 32, its "-B" variants in 2
      chunks rather than 3 (``search_space.domainbed_training``, PGrad's
      block below).
    from_scratch: WILDS trains its network from scratch (PovertyMap's 8
      bands fit no ImageNet weights), so its runs start from no weights by
      default; the other photo datasets start from ImageNet weights
      (``--pretrained imagenet``), as DomainBed's and WILDS's FMoW do.
    wilds: the WILDS dataset it is (every PovertyMap fold is
      ``"PovertyMap"``), or ``None``.
  """

  domains: tuple[str, ...]
  steps: int | None = 5000
  epochs: int | None = None
  checkpoint_freq: int = 300
  model: str = "resnet50"
  small_images: bool = False
  upsampled: bool = False
  small_batches: bool = False
  from_scratch: bool = False
  wilds: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelEntry(registry.Entry):
  """A featurizer network, the part of a model before its linear head.

  Its builder is called as ``builder(in_channels, *, rngs, dtype,
  param_dtype, **options, **hparams_options(hparams))``.

  Attributes:
    hparams_options: the builder's keyword arguments that a run's hparams
      set.
    imagenet_weights: the file name of torchvision's ImageNet weights
      (``IMAGENET1K_V1``) of the network, which the paper and DomainBed
      before commit 3dfdc8e start it from (``--pretrained imagenet``,
      ``experiments.weights.imagenet.fetch_imagenet``); ``None`` for none.
    augmix_weights: the timm name of the AugMix ImageNet weights of the
      network on the Hugging Face hub, which DomainBed starts its ResNet-50
      from since commit 3dfdc8e (``--pretrained imagenet_augmix``, with
      BatchNorm trained); ``None`` for none.
  """

  hparams_options: Callable[[Mapping[str, Any]], dict[str, Any]] = (
      lambda hparams: {})
  imagenet_weights: str | None = None
  augmix_weights: str | None = None

  @property
  def imagenet(self) -> bool:
    """Whether it is an ImageNet network, with torchvision's weights."""
    return self.imagenet_weights is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmEntry(registry.Entry):
  """A training algorithm.

  Its builder is called as ``builder(network, hparams, *, num_domains, seed,
  **options)``, with its `typed_hparams`, and returns an
  ``algorithms.Algorithm``.

  Its hparams are declared by blocks, functions that add to a
  ``search_space.SearchSpace``: its `training_hparams` (or DomainBed's),
  the dataset's, then its own `hparams`, in that order. A family's member
  takes its head's blocks and adds its own.

  Attributes:
    variant_of: for an ablation of the claims, the algorithm whose search
      space it takes, with `fixed_hparams` fixed. Each ablation is its own
      name, so that model selection and the report never pool it with its
      base.
    fixed_hparams: the hparams the ablation fixes.
    model_options: keyword arguments of ``models.build_model`` that the
      algorithm's model needs (ARM's ``context_net``).
    data_parallel: its update keeps every domain's batch split over an
      Explicit ``data`` mesh axis, so ``--devices`` can split it
      (``training.sharding.Sharder``). The others pool or re-slice the batch in ways
      that the axis cannot carry.
    family: the algorithm whose hparams blocks it takes, as DomainBed's
      subclasses have their base class's hparams: ``"PGrad"`` for the
      algorithms built on PGrad's rollout (the paper's search space),
      ``"MMD"`` for CORAL; ``None`` for its own.
    training_hparams: its block of training hparams (learning rates, batch
      size, weight decay, any outer loop's), in place of DomainBed's
      (``search_space.domainbed_training``); ``None`` for DomainBed's.
    hparams: its block of its own terms' hparams; ``None`` for none.
    hparams_type: the type its builder takes its hparams as, made by
      ``hparams_type.from_hparams(hparams)`` and saying its
      ``batch_chunks``; ``None`` for the dict of hparams itself.
    chunked: it cuts every domain's batch into ``B`` chunks, by default
      `PGRAD_B` (the "-B" variants; fewer where
      ``DatasetEntry.small_batches``).
  """

  variant_of: str | None = None
  fixed_hparams: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  model_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  data_parallel: bool = False
  family: str | None = None
  training_hparams: Callable[[search_space.SearchSpace], None] | None = None
  hparams: Callable[[search_space.SearchSpace], None] | None = None
  hparams_type: type | None = None
  chunked: bool = False

  def typed_hparams(self, hparams: Mapping[str, Any]) -> Any:
    """``hparams`` as its builder takes them: as its `hparams_type`, or as
    they are."""
    if self.hparams_type is None:
      return hparams
    return self.hparams_type.from_hparams(hparams)

  def batch_chunks(self, hparams: Mapping[str, Any]) -> int:
    """The equal chunks its update cuts every domain's batch into (PGrad's
    ``B``): its typed hparams' ``batch_chunks``, or 1."""
    if self.hparams_type is None:
      return 1
    return self.typed_hparams(hparams).batch_chunks
