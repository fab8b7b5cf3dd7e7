"""Domain generalization algorithms as pure update functions.

An algorithm's builder ``builder(network, hparams, *, num_domains, seed)``,
registered by name in ``experiments.catalog``, returns an `Algorithm` of
pure functions:

* ``init(params) -> state``: the algorithm's state (its optimizer state and
  anything else it tracks, PRNG keys included);
* ``update(params, stats, state, batches, key) -> (params, stats, state,
  metrics)``: one training step on ``batches``, one batch per training domain
  stacked on a leading axis: ``{"image": (n, b, H, W, C), "label": (n, b)}``;
* optionally ``predict(params, stats, images, count) -> outputs``: the
  algorithm's own prediction rule at evaluation (ARM adapts to the batch);
* optionally ``evaluated(params, stats, state) -> (params, stats)``: the
  network that evaluation runs, where it is not the one trained (ERM++
  evaluates its moving average);
* optionally ``set_learning_rate(state, lr) -> state``: the state stepping
  at ``lr`` from then on, for a learning rate that the training loop
  schedules (ERM++'s ``auto_lr``).

``params`` are the model's ``nnx.Param`` and ``stats`` its ``nnx.BatchStat``
(BatchNorm's running statistics, which only train-mode BatchNorm updates: a
ResNet's with ``bn_mode="train"``, ARM's context network's). ``update`` has
no side effects, so a training loop jits it once; every random draw it makes
comes from its ``key``, so a test can replay it. Its ``metrics`` are scalars
or arrays; a loop averages them over the steps between evaluations, except
the running totals named in `COUNTERS`, whose latest value it reports.

The algorithms are grouped as the paper's related work groups them, a
module each, the invariant ones in two: `invariance` (IRM, VREx, IB_ERM,
MMD, CORAL) and `adversarial` (DANN, CDANN, SagNet); then `optimization`
(ERM, ERM++, SD, GroupDRO, MLDG), `mixing` (MixUp, ARM, SelfReg, MTL),
`gradient_manipulation` (Fish, Fishr, ANDMask, SANDMask, IGA, RSC) and
`principal_gradients` (PGrad and its variants), on the shared pieces of
`base`. Adding one is a builder in its module and a block in
``experiments/catalog.py``: its entry and its hparams
(``experiments/README.md`` lists every file).

Each follows DomainBed's class of the same name; line numbers are of
DomainBed's ``domainbed/algorithms.py`` at commit b93c22a1
(facebookresearch/DomainBed) unless another file is named, and every
builder's docstring gives them for its terms. Conventions shared by all:

* Weight decay is ``optax.add_decayed_weights`` (``wd * params`` added to the
  direction) placed where the reference implementation applies it. PyTorch's
  ``Adam(weight_decay=wd)`` adds ``wd * param`` to the gradient before the
  moments, which is ``optax.chain(optax.add_decayed_weights(wd), adam)``
  (`base.torch_adam`):

  - ERM, MixUp, IRM, CORAL, MMD, GroupDRO, ARM and MLDG's outer step: on the
    gradient fed to Adam (ERM's ``torch.optim.Adam(..., weight_decay=...)``,
    lines 107-111, which the others inherit).
  - VREx, IB_ERM and SD: as ERM's, whose Adam they inherit.
  - MLDG's inner step: its own fresh Adam, decayed alike (lines 897-901).
  - DANN and CDANN: ``weight_decay_g`` on the generator's Adam and
    ``weight_decay_d`` on the discriminator's (lines 502-514).
  - SagNet: on each of its three Adams' gradients (lines 1175-1181).
  - Fishr: on the gradient fed to Adam, restarted with it (``_init_optimizer``,
    lines 1597-1602).
  - ANDMask, SANDMask, IGA, RSC, SelfReg: on the gradient fed to ERM's Adam
    (SANDMask builds its own, alike, lines 1517-1523), after ANDMask's and
    SANDMask's masks. MTL: on its Adam over the featurizer and the head
    (lines 1086-1091).
  - Fish: by default inside the inner Adam of every rollout step, the meta
    step undecayed (``create_clone``'s ``Adam(..., weight_decay=...)``, lines
    415-419; ``fish``, lines 423-427). ``fish_weight_decay="outer"`` moves it
    onto the meta step instead, as this module did before it matched
    DomainBed.
  - PGrad and its variants: on the outer step (``theta_0 - p`` before the
    outer SGD); the inner Adam that builds the trajectory is undecayed, as
    the paper builds its trajectories "without weight decay" (its WILDS setup)
    while drawing a weight decay in its search (appendix A.10). DomainBed
    has no PGrad.
* Fish visits the training domains in DomainBed's fixed order (``for x, y in
  minibatches``, line 432) unless ``fish_order="random"``.
* Dropout: every example gets a key split from the step's key, and a forward
  pass over a batch uses its first example's key, so every inner step of a
  rollout draws fresh masks.
* BatchNorm in ``"train"`` mode: the forward passes are DomainBed's, and
  the running statistics are those of the loss's own passes. ERM, IRM,
  DANN, Fishr, ARM, RSC and SelfReg run the network once over all domains
  pooled, as DomainBed; GroupDRO, MMD, CORAL, ANDMask, SANDMask, IGA and
  MTL once per domain in turn, and MixUp once per mixed pair in DomainBed's
  order of the pairs (`base.domain_features`;
  where no BatchNorm trains, one pooled pass gives the same outputs and is
  taken). A gradient step keeps the statistics of its passes (MLDG's passes
  are of DomainBed's throw-away copies, so it keeps none); a rollout hands
  them to `pgrad_jax` as its model state, so every inner step updates them in
  turn and the update returns the statistics of the rollout's last step, as a
  sequence of train-mode steps of the network would. (With frozen BatchNorm
  there are no statistics to carry.) VREx, IB_ERM, SD and CDANN run it once
  over all domains pooled, as DomainBed, and SagNet three times in turn
  (content, style, adversary).
"""

from experiments.algorithms.mixing import ARM_EVAL_BATCH
from experiments.algorithms.mixing import MTLState
from experiments.algorithms.mixing import SelfRegDraws
from experiments.algorithms.mixing import SelfRegState
from experiments.algorithms.mixing import arm
from experiments.algorithms.mixing import mixup_algorithm
from experiments.algorithms.mixing import mtl
from experiments.algorithms.mixing import project
from experiments.algorithms.mixing import selfreg
from experiments.algorithms.mixing import selfreg_draws
from experiments.algorithms.mixing import support_context
from experiments.algorithms.adversarial import DANNState
from experiments.algorithms.adversarial import SAGNET_EPS
from experiments.algorithms.adversarial import SagNetDraws
from experiments.algorithms.adversarial import SagNetState
from experiments.algorithms.adversarial import cdann
from experiments.algorithms.adversarial import dann
from experiments.algorithms.adversarial import dann_step_kind
from experiments.algorithms.adversarial import sagnet
from experiments.algorithms.adversarial import sagnet_draws
from experiments.algorithms.adversarial import sagnet_randomize
from experiments.algorithms.base import Algorithm
from experiments.algorithms.base import AnnealState
from experiments.algorithms.base import Batches
from experiments.algorithms.base import COUNTERS
from experiments.algorithms.base import HParams
from experiments.algorithms.base import Metrics
from experiments.algorithms.base import Network
from experiments.algorithms.base import Params
from experiments.algorithms.base import Stats
from experiments.algorithms.base import batch_loss
from experiments.algorithms.base import build_algorithm
from experiments.algorithms.base import domain_gradients
from experiments.algorithms.base import domain_losses
from experiments.algorithms.base import merge_domains
from experiments.algorithms.base import mixup
from experiments.algorithms.base import restart_at_anneal
from experiments.algorithms.base import with_example_keys
from experiments.algorithms.gradient_manipulation import FISH_WEIGHT_DECAY
from experiments.algorithms.gradient_manipulation import FishrState
from experiments.algorithms.gradient_manipulation import and_mask
from experiments.algorithms.gradient_manipulation import andmask
from experiments.algorithms.gradient_manipulation import fish
from experiments.algorithms.gradient_manipulation import fishr
from experiments.algorithms.gradient_manipulation import fishr_penalty
from experiments.algorithms.gradient_manipulation import head_gradients
from experiments.algorithms.gradient_manipulation import iga
from experiments.algorithms.gradient_manipulation import numpy_percentile
from experiments.algorithms.gradient_manipulation import rsc
from experiments.algorithms.gradient_manipulation import sand_mask
from experiments.algorithms.gradient_manipulation import sandmask
from experiments.algorithms.invariance import MMD_GAMMAS
from experiments.algorithms.invariance import coral
from experiments.algorithms.invariance import coral_penalty
from experiments.algorithms.invariance import ib_erm
from experiments.algorithms.invariance import irm
from experiments.algorithms.invariance import irm_penalty
from experiments.algorithms.invariance import mmd
from experiments.algorithms.invariance import mmd_penalty
from experiments.algorithms.invariance import vrex
from experiments.algorithms.optimization import ERM_PLUS_PLUS_SMA_START
from experiments.algorithms.optimization import ErmPlusPlusState
from experiments.algorithms.optimization import GroupDROState
from experiments.algorithms.optimization import MLDG_PAIRS
from experiments.algorithms.optimization import erm
from experiments.algorithms.optimization import erm_plus_plus
from experiments.algorithms.optimization import group_dro
from experiments.algorithms.optimization import meta_pairs
from experiments.algorithms.optimization import mldg
from experiments.algorithms.optimization import sd
from experiments.algorithms.principal_gradients import pgrad
