"""The order in which a rollout visits the training domains and their chunks."""

from typing import Literal

import jax
import jax.numpy as jnp

from pgrad_jax._src import validation

Order = Literal["random", "fixed"]


def domain_schedule(
    key: jax.Array, num_domains: int, num_chunks: int, order: Order
) -> tuple[jax.Array, jax.Array]:
  """Returns the (domain, chunk) visited at every inner step of a rollout.

  Round ``i`` (``0 <= i < num_chunks``) visits every domain once, on chunk
  ``i`` of that domain's batch (the trajectory sampling of eq. 4).

  Args:
    key: a PRNG key; unused for ``order="fixed"``.
    num_domains: ``n``, the number of training domains.
    num_chunks: ``B``, the number of chunks each domain's batch is split into.
    order: ``"fixed"`` (PGrad-F): every round visits domains ``0..n-1``;
      ``"random"`` (PGrad): a fresh random permutation each round.

  Returns:
    ``(domains, chunks)``: two int32 arrays of length ``n * B``; step ``s``
    takes an inner step on chunk ``chunks[s]`` of domain ``domains[s]``.

  Example:
    >>> import jax
    >>> from pgrad_jax import domain_schedule
    >>> domains, chunks = domain_schedule(jax.random.key(0), 3, 2, "fixed")
    >>> domains.tolist(), chunks.tolist()
    ([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
  """
  validation.one_of("order", order, Order)
  if order == "fixed":
    perms = jnp.tile(jnp.arange(num_domains, dtype=jnp.int32), (num_chunks, 1))
  else:
    keys = jax.random.split(key, num_chunks)
    perms = jax.vmap(lambda k: jax.random.permutation(k, num_domains))(keys)
  chunks = jnp.repeat(jnp.arange(num_chunks, dtype=jnp.int32), num_domains)
  return perms.reshape(-1).astype(jnp.int32), chunks
