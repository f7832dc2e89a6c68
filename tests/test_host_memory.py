"""transformer/host_memory.py: with keep_freed_memory() called first, a jitted
computation's temporary buffer is no longer faulted in afresh on every call."""

import os
import subprocess
import sys

import pytest

from transformer import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A computation with a 64 MB temporary buffer ((x * 2)^T, materialised for the
# matrix product), called 12 times to settle, then 8 times more; prints the
# minor page faults of each of the last 8 calls. 64 MB is above the largest
# size glibc ever serves from its heap by default (32 MB), so without the
# settings every call maps the buffer afresh. (XLA frees the buffer just after
# the result is ready, so a call can still find it not yet freed and take a
# new block; a pause between calls makes that rare, and the test asks for half
# the faults or fewer, not none.)
_PROBE = """
import resource, sys, time
from transformer import host_memory
applied = host_memory.keep_freed_memory() if sys.argv[1] == "on" else False
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: jnp.sum((x * 2.0).T @ w))
x, w = jnp.ones((4096, 4096), jnp.float32), jnp.ones((4096, 64), jnp.float32)
faults = []
for call in range(20):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(f(x, w))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  time.sleep(0.02)  # let XLA free the call's buffer before the next call asks
print(applied, *faults[12:])
"""


def _faults(mode: str) -> tuple[bool, list[int]]:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=True)
  applied, *faults = out.stdout.split("\n")[-2].split()
  return applied == "True", [int(n) for n in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_stops_per_call_page_faults():
  applied, faults_on = _faults("on")
  assert applied
  _, faults_off = _faults("off")
  pages = 64 * 1024 * 1024 // 4096
  # The premise: without the settings every call faults its buffer in.
  assert all(n >= pages * 9 // 10 for n in faults_off), faults_off
  # With them, most calls fault (almost) nothing: at most half as many in all.
  assert sum(faults_on) <= sum(faults_off) // 2, (faults_on, faults_off)


def test_keep_freed_memory_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("TRANSFORMER_KEEP_FREED_MEMORY", "0")
  assert host_memory.keep_freed_memory() is False
