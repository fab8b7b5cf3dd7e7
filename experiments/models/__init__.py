"""Flax NNX networks for the DomainBed experiments, built by name.

Every model is a :class:`Classifier`: a ``featurizer`` that maps channels-last
images ``(N, H, W, C)`` to a feature vector, followed by a linear ``head``.
Keeping the two apart (as DomainBed does) lets algorithms such as Fishr work
on the head alone.

The networks, one module each kind: `classifiers` (`Classifier`,
`build_model` and the heads some algorithms add), `resnet`, `densenet`,
`small_networks` (the MNIST CNN and the MLP) and `layers` (BatchNorm and
the convs they share). This package re-exports their public names, so
``models.build_model`` and ``models.ResNet`` name them here.

Train/eval modes follow the NNX convention: a freshly built model is in train
mode; ``model.eval()`` switches dropout off and makes ``bn_mode="train"``
BatchNorm use its running statistics; ``model.train()`` switches back.

BatchNorm (the ResNets' and DenseNet's) has two modes:

* ``bn_mode="frozen"`` (default, as DomainBed when fine-tuning): normalizes with
  the running statistics in both modes and never updates them. BN scale and
  bias stay trainable ``nnx.Param``; the statistics are ``nnx.BatchStat``, so
  an optimizer over ``nnx.Param`` never sees them.
* ``bn_mode="train"``: in train mode, normalizes with the batch statistics and
  updates the running averages (``nnx.BatchStat``) on every forward pass,
  the variance's with the unbiased batch variance as PyTorch's
  (:class:`BatchNorm`).

Either way the statistics are in the model's dtype (`statistics_dtype`).

Every module takes ``dtype`` (computation) and ``param_dtype``, float32 by
default as DomainBed's; `build_model` hands its own to every part, and the
parts with state of their own follow the parameters: BatchNorm's statistics
(`statistics_dtype`) and, in ``experiments.algorithms``, DANN's
discriminator and GroupDRO's and Fishr's state.

Dropout on the pooled features (DomainBed's ``resnet_dropout``) draws its mask
from the ``rngs`` passed to ``__call__`` when given (an ``nnx.Rngs`` or a raw
key), else from the ``dropout`` stream (or ``default``) of the ``rngs`` the
model was built with.

Purely functional use (e.g. under ``jax.jit`` with an Optax optimizer)::

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, rest, x, y, key):
    # copy=True gives fresh Variables at this trace level, which BatchNorm
    # (bn_mode="train") needs to update its statistics inside jax.grad.
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(x, rngs=key)  # A fresh key per step drives dropout.
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  @jax.jit
  def train_step(params, rest, opt_state, x, y, key):
    grads, rest = jax.grad(loss_fn, has_aux=True)(params, rest, x, y, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state

Returning ``rest`` carries the running averages updated by ``bn_mode="train"``
to the next step (with ``bn_mode="frozen"`` it comes back unchanged). Passing
the key explicitly matters: the dropout stream stored in ``rest`` would only
advance if ``rest`` were returned, so without a key every step could reuse
one mask. Evaluation is ``nnx.merge(graphdef, params, rest)`` then
``.eval()`` (or the stateful model after ``nnx.update(model, params, rest)``).
"""


# The public names of the package's modules, re-exported.
from experiments.models.classifiers import Classifier
from experiments.models.classifiers import ContextClassifier
from experiments.models.classifiers import ContextNet
from experiments.models.classifiers import EmbeddingClassifier
from experiments.models.classifiers import StyleClassifier
from experiments.models.classifiers import build_model
from experiments.models.densenet import DENSENET121_BLOCKS
from experiments.models.densenet import DENSENET_BOTTLENECK
from experiments.models.densenet import DENSENET_GROWTH
from experiments.models.densenet import DENSENET_STEM
from experiments.models.densenet import DenseLayer
from experiments.models.densenet import DenseNet
from experiments.models.densenet import Transition
from experiments.models.layers import BNMode
from experiments.models.layers import BatchNorm
from experiments.models.layers import FrozenBatchNorm
from experiments.models.layers import Rng
from experiments.models.layers import statistics_dtype
from experiments.models.layers import torch_default_init
from experiments.models.resnet import RESNET_SPECS
from experiments.models.resnet import RESNET_STAGES
from experiments.models.resnet import BasicBlock
from experiments.models.resnet import Bottleneck
from experiments.models.resnet import ResNet
from experiments.models.small_networks import MLP
from experiments.models.small_networks import MNISTCNN
