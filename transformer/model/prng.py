"""Dropout masks from JAX's Threefry-2x32 random bits, computed as one fused
elementwise kernel.

`jax.random.bernoulli` lowers Threefry on CPU as a loop of five iterations
(`fori_loop`, to keep compile times small), and every iteration writes its
state to memory: a dropout mask of a `[32, 64, 256]` activation then costs
about 2 ms, and the 17 masks of a small Transformer's training step were 8-10%
of the step (`benchmarks/profile_ops.py train`). Written out as the 20 rounds
of plain integer ops below, XLA fuses the hash with the comparison and the
`where` of dropout into one loop over the activation: 3-4x faster, no extra
memory traffic.

The bits are JAX's own, bit for bit: `threefry_random_bits(key, shape)` equals
`jax.random.bits(key, shape, jnp.uint32)` and `bernoulli(key, p, shape)`
equals `jax.random.bernoulli(key, p, shape)` (JAX's default partitionable
Threefry: the counter of an element is its flat index), so a model with these
masks trains exactly like one using `flax.linen.Dropout`
(tests/test_prng.py checks both). Keys of other PRNG implementations, and
arrays of 2^32 elements or more, take their bits from `jax.random.bits` itself.

Inside `shard_map` each device sees only its rows, so a counter from the
local flat index would give every shard the same mask. Under
`rows_sharded_over(axis)` (the trainer's gradient step) the counter is the
element's index in the *global* array instead: shard i of a batch split on its
leading axis holds elements [i * size, (i + 1) * size) of it, so the masks are
again those of `jax.random.bits` on the whole batch (tests/test_prng.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Threefry-2x32 (Salmon et al., 2011): 20 rounds in 5 groups of 4, with these
# rotation distances, alternating; a key injection after each group.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
  return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def _threefry_key_words(key: jax.Array) -> tuple[jax.Array, jax.Array] | None:
  """(k1, k2) uint32 scalars of a Threefry key (typed `jax.random.key` or a
  raw `uint32[2]` `PRNGKey`); None for keys of another implementation."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape or "threefry" not in str(jax.random.key_impl(key)):
      return None
    key = jax.random.key_data(key)
  elif key.shape != (2,) or key.dtype != jnp.uint32:
    return None
  return key[0], key[1]


def _threefry_2x32(k1: jax.Array, k2: jax.Array, x0: jax.Array, x1: jax.Array):
  """The Threefry-2x32 block function on counter words `x0`, `x1` (any shape)."""
  keys = (k1, k2, k1 ^ k2 ^ _KEY_PARITY)
  x0, x1 = x0 + keys[0], x1 + keys[1]
  for group in range(5):
    for distance in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = x0 ^ _rotate_left(x1, distance)
    x0 = x0 + keys[(group + 1) % 3]
    x1 = x1 + keys[(group + 2) % 3] + np.uint32(group + 1)
  return x0, x1


# The mesh axis the leading (row) axis is split over, inside shard_map; None
# outside. Read when a function is traced, not when it runs.
_ROWS_SHARDED_OVER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rows_sharded_over", default=None)


@contextlib.contextmanager
def rows_sharded_over(axis_name: str):
  """While tracing a `shard_map` body whose arrays are split on their leading
  axis over the mesh axis `axis_name` (in device order), random bits are
  those of the global array: each shard's counters start at its offset."""
  token = _ROWS_SHARDED_OVER.set(axis_name)
  try:
    yield
  finally:
    _ROWS_SHARDED_OVER.reset(token)


def threefry_random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 random bits of `shape`; equal to `jax.random.bits(key, shape,
  jnp.uint32)` for a Threefry key (to which it falls back for other keys).
  Under `rows_sharded_over`, `shape` is one shard's and the bits are that
  shard's slice of the global array's."""
  shape = tuple(shape)
  size = math.prod(shape)
  axis = _ROWS_SHARDED_OVER.get()
  shards = 1 if axis is None else lax.axis_size(axis)
  words = _threefry_key_words(key)
  if words is None or size * shards >= 2 ** 32:
    if axis is not None:  # still independent bits per shard (not the global array's)
      key = jax.random.fold_in(key, lax.axis_index(axis))
    return jax.random.bits(key, shape, jnp.uint32)
  # Element i hashes the 64-bit counter i: high word 0, low word i.
  counter = lax.iota(jnp.uint32, size).reshape(shape)
  if axis is not None:  # this shard's first element's index in the global array
    counter = counter + lax.axis_index(axis).astype(jnp.uint32) * np.uint32(size)
  x0, x1 = _threefry_2x32(*words, jnp.zeros(shape, jnp.uint32), counter)
  return x0 ^ x1


def bernoulli(key: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
  """bool `shape`, True with probability `p`; equal to
  `jax.random.bernoulli(key, p, shape)` (which is `uniform(bits) < p` for
  every key implementation, so other keys only change where the bits come from)."""
  return _uniform_below(threefry_random_bits(key, shape), p)


def _uniform_below(bits: jax.Array, p: float) -> jax.Array:
  """JAX's `uniform(bits) < p` on the integers: JAX draws u = m / 2^23 from
  the top 23 bits m of each word, and u < p is m < ceil(p * 2^23) (p rounded
  to float32 first, as JAX does)."""
  threshold = math.ceil(float(np.float32(p)) * 2 ** 23)
  return (bits >> np.uint32(9)) < np.uint32(threshold)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """Inverted dropout: each element zeroed with probability `rate`, the rest
  divided by 1 - rate; the same as `flax.linen.Dropout(rate)` with `key`."""
  keep_prob = 1.0 - rate
  keep = bernoulli(key, keep_prob, x.shape)
  return lax.select(keep, x / keep_prob, jnp.zeros_like(x))
