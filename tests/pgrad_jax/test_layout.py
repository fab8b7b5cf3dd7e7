"""The device policy: unroll and trajectory layout, decided in one place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pgrad_jax
from pgrad_jax._src import layout as layout_lib


def dense_loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2)


def conv_loss(params, batch):
  y = jax.lax.conv_general_dilated(batch["x"], params["w"], (1, 1), "SAME")
  return jnp.mean(y ** 2)


CONV_ARGS = ({"w": jnp.ones((2, 1, 3, 3))}, {"x": jnp.ones((4, 1, 8, 8))})
DENSE_ARGS = ({"w": jnp.ones((3, 2))}, {"x": jnp.ones((4, 3))})


def test_has_convolution_sees_nested_convolutions():
  nested = jax.checkpoint(lambda p, b: jax.jit(conv_loss)(p, b) + 1.0)
  branch = lambda p, b: jax.lax.cond(b["x"].sum() > 0, conv_loss,
                                     lambda p, b: 0.0, p, b)
  for fn in (conv_loss, nested, branch):
    assert layout_lib.has_convolution(jax.make_jaxpr(fn)(*CONV_ARGS))
  assert not layout_lib.has_convolution(
      jax.make_jaxpr(dense_loss)(*DENSE_ARGS))


def test_default_layout_on_one_cpu_device():
  # The test process sees the default single CPU device: convolutions fully
  # unrolled, everything else rolled; float leaves interleaved.
  assert jax.default_backend() == "cpu" and jax.device_count() == 1
  conv = layout_lib.default_layout(jax.make_jaxpr(conv_loss)(*CONV_ARGS))
  dense = layout_lib.default_layout(jax.make_jaxpr(dense_loss)(*DENSE_ARGS))
  block = layout_lib.CPU_INTERLEAVE_BLOCK
  assert conv == pgrad_jax.TrajectoryLayout(unroll=True,
                                            interleave_block=block)
  assert not conv.contiguous  # Only on one GPU.
  assert dense == pgrad_jax.TrajectoryLayout(unroll=1, interleave_block=block)


def test_default_layout_keeps_a_given_unroll():
  jaxpr = jax.make_jaxpr(conv_loss)(*CONV_ARGS)
  assert layout_lib.default_layout(jaxpr, unroll=3).unroll == 3


def test_layout_is_a_hashable_value():
  layouts = {pgrad_jax.TrajectoryLayout(1, None),
             pgrad_jax.TrajectoryLayout(1, None),
             pgrad_jax.TrajectoryLayout(True, 1024)}
  assert len(layouts) == 2


@pytest.mark.parametrize("kw, match", [
    (dict(unroll=0), "unroll must be a positive integer"),
    (dict(unroll=1.5), "unroll must be a positive integer"),
    (dict(interleave_block=0), "interleave_block must be a positive integer"),
    (dict(interleave_block=True), "interleave_block must be a positive"),
    (dict(contiguous=1), "contiguous must be True or False"),
])
def test_layout_rejects_bad_values(kw, match):
  with pytest.raises(ValueError, match=match):
    pgrad_jax.TrajectoryLayout(**kw)


def test_layout_accepts_numpy_integers():
  layout = pgrad_jax.TrajectoryLayout(np.int64(2), np.int32(8))
  assert layout.unroll == 2 and layout.interleave_block == 8
