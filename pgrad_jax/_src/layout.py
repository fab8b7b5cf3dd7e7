"""The one place where the devices decide how a rollout runs and stores.

Both are made once, when the update is traced (:func:`default_layout`); the
rollout and the trajectory take the :class:`TrajectoryLayout` it returns.

* **Unroll.** On GPU and TPU the rollout's ``lax.scan`` stays rolled (an
  unrolled one compiles slowly). On XLA:CPU a loop whose body holds a
  convolution runs dozens of times slower than the same steps unrolled (a
  0.37M-parameter convolutional network: 39 s rolled, 1.5 s unrolled per
  rollout), so such a loss is fully unrolled there; others stay rolled.
* **Interleaving.** XLA:CPU multiplies a stacked trajectory leaf ``(s, n)``
  by its transpose on one thread, after copying it transposed; interleaved
  (``trajectory.py``), the Gram matrix needs no copy and runs about twice as
  fast (2-core CPU, 4.2M-parameter MLP, 16 points: 40 ms against 77 ms).
  Only on a single CPU device: slicing a leaf sharded over several devices
  would gather it.
* **Contiguity.** On a single GPU the whole trajectory is one array of
  blocks of `GPU_BLOCK` parameters (``trajectory.py``), so that the Gram
  matrix is one batch of products and the projection one elementwise pass,
  rather than one of each per leaf: a ResNet-50's 161 leaves made 161 small
  products that read the trajectory at about a fifteenth of the memory
  bandwidth (docs/design.md gives the measurements). Not on CPU, where the
  interleaved leaves are faster, nor on TPU, whose (8, 128) tiles would pad
  the ``s`` rows of each block (9 to 16 in the paper's setting) where
  stacked leaves pad nothing.
"""

import dataclasses
from typing import Any

import jax
import jax.extend

from pgrad_jax._src import validation

# Elements per interleaved block on CPU: a 4 KiB page of float32, so each
# step's strided write touches one page per block.
CPU_INTERLEAVE_BLOCK = 1 << 10
# Parameters per block of a contiguous trajectory on one GPU. On an H200, a
# ResNet-50-sized Gram matrix took 0.99 ms in blocks of 8192, 1.49 ms in one
# block and 2.11 ms in blocks of 32768 or 131072 (docs/design.md).
GPU_BLOCK = 1 << 13


@dataclasses.dataclass(frozen=True)
class TrajectoryLayout:
  """How a rollout runs its scan and stores its trajectory.

  Attributes:
    unroll: the ``jax.lax.scan`` unroll: a positive int, or ``True`` (full).
    interleave_block: None: every leaf is stored stacked. Else a block size
      ``c``: each float32 or float64 leaf whose size ``c`` divides is stored
      interleaved (``trajectory.py``).
    contiguous: store the whole trajectory as one array, in blocks of
      ``interleave_block`` parameters (None: one block), when every leaf is
      stored in one dtype; else leaf by leaf, as ``interleave_block`` says.
  """

  unroll: int | bool = 1
  interleave_block: int | None = None
  contiguous: bool = False

  def __post_init__(self):
    if self.unroll is not True:
      validation.positive_int("unroll", self.unroll)
    if self.interleave_block is not None:
      validation.positive_int("interleave_block", self.interleave_block)
    if not isinstance(self.contiguous, bool):
      raise ValueError(
          f"contiguous must be True or False; got {self.contiguous!r}.")


def has_convolution(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr holds a convolution, at any nesting depth."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return (any(eqn.primitive.name == "conv_general_dilated"
              for eqn in jaxpr.eqns)
          or any(map(has_convolution, jax.extend.core.subjaxprs(jaxpr))))


def default_layout(loss_jaxpr: Any,
                   unroll: int | bool | None = None) -> TrajectoryLayout:
  """The layout for the current devices and a loss (see the module docstring).

  Args:
    loss_jaxpr: the loss traced on one chunk, e.g.
      ``jax.make_jaxpr(loss_fn)(params, batch)``.
    unroll: the user's unroll, kept if not None.

  Returns:
    A :class:`TrajectoryLayout`.
  """
  on_cpu = jax.default_backend() == "cpu"
  if unroll is None:
    unroll = True if on_cpu and has_convolution(loss_jaxpr) else 1
  if jax.device_count() > 1:
    return TrajectoryLayout(unroll)
  if on_cpu:
    return TrajectoryLayout(unroll, CPU_INTERLEAVE_BLOCK)
  if jax.default_backend() == "gpu":
    return TrajectoryLayout(unroll, GPU_BLOCK, contiguous=True)
  return TrajectoryLayout(unroll)
