"""transformer.prng: Threefry bits and dropout masks equal JAX's / Flax's own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import layers
from transformer.model import prng


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (4, 33, 17), (2, 1, 3, 1)])
@pytest.mark.parametrize("seed", [0, 1, 123456789])
def test_threefry_bits_equal_jax_random_bits(shape, seed):
  key = jax.random.key(seed)
  ours = jax.jit(prng.threefry_random_bits, static_argnums=1)(key, shape)
  np.testing.assert_array_equal(ours, jax.random.bits(key, shape, jnp.uint32))


def test_threefry_bits_accept_raw_uint32_keys():
  raw = jax.random.PRNGKey(5)
  np.testing.assert_array_equal(prng.threefry_random_bits(raw, (9, 4)),
                                jax.random.bits(raw, (9, 4), jnp.uint32))


def test_threefry_known_answer():
  """The Threefry-2x32 (20 rounds) test vector of Salmon et al.'s Random123,
  also in JAX's own tests: key (0x13198a2e, 0x03707344), counter
  (0x243f6a88, 0x85a308d3) -> (0xc4923a9c, 0x483df7a0)."""
  u32 = lambda v: jnp.asarray(np.uint32(v))
  x0, x1 = prng._threefry_2x32(u32(0x13198A2E), u32(0x03707344),
                                u32(0x243F6A88), u32(0x85A308D3))
  assert (int(x0), int(x1)) == (0xC4923A9C, 0x483DF7A0)


@pytest.mark.parametrize("p", [0.0, 1e-7, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_bernoulli_equals_jax_random_bernoulli(p):
  for seed in range(3):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(prng.bernoulli(key, p, (16, 24, 32)),
                                  jax.random.bernoulli(key, p, (16, 24, 32)))


def test_bernoulli_keep_fraction():
  keep = np.asarray(prng.bernoulli(jax.random.key(0), 0.9, (512, 512)))
  # 262144 draws: the standard deviation of the mean is 0.0006
  assert abs(keep.mean() - 0.9) < 0.003


def test_other_prng_implementations_fall_back_to_jax():
  key = jax.random.key(3, impl="rbg")
  np.testing.assert_array_equal(prng.bernoulli(key, 0.7, (8, 8)),
                                jax.random.bernoulli(key, 0.7, (8, 8)))


def test_dropout_module_equals_flax_dropout():
  """layers.Dropout inside a module draws the same mask as flax.linen.Dropout
  would in its place (same name, same "dropout" RNG stream)."""
  class Ours(nn.Module):
    @nn.compact
    def __call__(self, x):
      return layers.Dropout(0.3, deterministic=False)(x)

  class Flax(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.3, deterministic=False)(x)

  x = jax.random.normal(jax.random.key(1), (6, 10, 32))
  rngs = {"dropout": jax.random.key(2)}
  ours = Ours().apply({}, x, rngs=rngs)
  np.testing.assert_array_equal(ours, Flax().apply({}, x, rngs=rngs))
  kept = np.asarray(ours) != 0
  np.testing.assert_allclose(np.asarray(ours)[kept], np.asarray(x)[kept] / 0.7, rtol=1e-6)
  np.testing.assert_array_equal(layers.Dropout(0.3, deterministic=True).apply({}, x), x)


def test_dropout_gradient_is_the_mask_over_keep_prob():
  key = jax.random.key(4)
  x = jnp.ones((64, 64))
  grad = jax.grad(lambda x: jnp.sum(prng.dropout(x, 0.25, key)))(x)
  keep = np.asarray(jax.random.bernoulli(key, 0.75, (64, 64)))
  np.testing.assert_allclose(grad, np.where(keep, 1 / 0.75, 0.0), rtol=1e-6)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.75, 1 / 3])
def test_uniform_below_at_the_threshold(p):
  """Mantissas on both sides of the cut, against JAX's float formula in numpy:
  u = float32(1 + m / 2^23) - 1, kept when u < float32(p)."""
  centre = int(np.float32(p) * 2 ** 23)
  mantissas = np.arange(centre - 3, centre + 4, dtype=np.uint32)
  bits = (mantissas << 9) | np.uint32(0x1FF)  # the low 9 bits must not matter
  u = (((mantissas | np.uint32(0x3F800000)).view(np.float32)) - np.float32(1.0))
  np.testing.assert_array_equal(prng._uniform_below(jnp.asarray(bits), p), u < np.float32(p))


# A [256, 128, 512] float32 batch sharded on its rows over 8 simulated devices
# (one shard: 32 rows, 2M elements, 8 MiB). Prints, for prng.dropout and for the
# same dropout through jax.random.bernoulli: the compiled temporaries in bytes
# and the largest uint32 array of the partitioned program (in elements); then
# whether the two outputs are equal.
_SHARDED_DROPOUT = """
import re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from transformer.model import prng
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
x = jax.device_put(jnp.arange(256 * 128 * 512, dtype=jnp.float32).reshape(256, 128, 512),
                   sharding)
key = jax.random.key(7)
def with_jax(x, key):
  keep = jax.random.bernoulli(key, 0.9, x.shape)
  return jax.lax.select(keep, x / 0.9, jnp.zeros_like(x))
outputs = []
for fn in (lambda x, key: prng.dropout(x, 0.1, key), with_jax):
  jitted = jax.jit(fn, in_shardings=(sharding, None), out_shardings=sharding)
  compiled = jitted.lower(x, key).compile()
  u32 = [int(np.prod([int(d) for d in dims.split(",") if d]))
         for dims in re.findall(r"u32\\[([\\d,]*)\\]", compiled.as_text())]
  print(compiled.memory_analysis().temp_size_in_bytes, max(u32 or [0]))
  outputs.append(jitted(x, key))
print(bool((outputs[0] == outputs[1]).all()))
"""


def test_dropout_of_a_sharded_batch_stays_per_shard():
  """On 8 devices, prng.dropout's masks are made where they are used: no
  temporary buffer, no uint32 array larger than one device's shard, and the
  same output as jax.random.bernoulli's dropout (which needs 24 MiB of
  temporaries for this batch: the premise that makes the test discriminate)."""
  import subprocess
  import sys
  from helpers import subprocess_env
  env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", _SHARDED_DROPOUT], env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout.split("\n")
  (ours_temp, ours_u32), (jax_temp, jax_u32) = (map(int, line.split()) for line in out[:2])
  shard = 256 * 128 * 512 // 8
  assert ours_temp <= 1024, ours_temp           # (a scalar or two)
  assert ours_u32 <= shard, (ours_u32, shard)
  assert jax_temp >= 16 * 2**20, jax_temp       # the premise
  assert out[2] == "True"


# prng.dropout inside shard_map over 8 devices, a [64, 8, 16] batch split on
# its rows: prints whether it equals jax.random.bernoulli's dropout of the
# whole batch, under prng.rows_sharded_over and without it.
_SHARD_MAP_DROPOUT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from transformer.runtime import parallel
from transformer.model import prng
mesh = parallel.make_mesh()
x = jnp.arange(1, 64 * 8 * 16 + 1, dtype=jnp.float32).reshape(64, 8, 16)
key = jax.random.key(3)
expected = jnp.where(jax.random.bernoulli(key, 0.75, x.shape), x / 0.75, 0)
def per_shard(x, key, sharded_counters):
  if sharded_counters:
    with prng.rows_sharded_over("data"):
      return prng.dropout(x, 0.25, key)
  return prng.dropout(x, 0.25, key)
for sharded_counters in (True, False):
  out = jax.jit(jax.shard_map(lambda x, k: per_shard(x, k, sharded_counters), mesh=mesh,
                              in_specs=(P("data"), P()), out_specs=P("data")))(x, key)
  print(bool((out == expected).all()))
"""


def test_dropout_inside_shard_map_equals_the_whole_batch_dropout():
  """The trainer computes gradients in shard_map (one device's rows each):
  under rows_sharded_over its masks are still those of the whole batch, as
  under plain jit or on one device; without it every shard would repeat
  the first shard's mask (the premise, checked too)."""
  import subprocess
  import sys
  from helpers import subprocess_env
  env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", _SHARD_MAP_DROPOUT], env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout.split()
  assert out == ["True", "False"]
