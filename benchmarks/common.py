"""Shared pieces of the benchmarks: the project's two benchmark shapes, a FLOP
model of the Transformer, the machine's measured matmul peak, and a timer.

Shapes (float32 everywhere):

  S  shared vocabulary 8192, d_model 256, 4 heads, d_ff 1024, 3 + 3 layers,
     batch 32, source and target length 64.
  B  the paper's base model (d_model 512, 8 heads, d_ff 2048, 6 + 6 layers),
     vocabulary 32000, batch 16, source and target length 64.

  config, batch, src_len, tgt_len = SHAPES["S"](dropout_rate=0.1)
  SHAPES["B"](dtype="bfloat16")   # keyword overrides replace TransformerConfig fields

("tiny", a seconds-long smoke test of the scripts, is in SHAPES too.)
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from transformer.training.flops import (forward_flops, matmul_rate, matmul_weights,  # noqa: F401
                               training_flops_per_step)
from transformer.model.transformer import TransformerConfig

# The real parallel corpus beside the checkout (../shared), and its 1,000 test pairs.
GETTEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                       "shared", "corpora", "gettext-en-fr")
GETTEXT_TEST = os.path.join(GETTEXT, "test.tsv")


# ----------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------


def _shape(vocab_size, d_model, num_heads, d_ff, layers, batch, dropout_rate, overrides,
           length=64):
  fields = dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, d_ff=d_ff,
                num_encoder_layers=layers, num_decoder_layers=layers,
                dropout_rate=dropout_rate, dtype="float32", param_dtype="float32")
  config = TransformerConfig(**{**fields, **overrides})  # (overrides: any field, sizes too)
  return config, batch, length, length


def shape_s(dropout_rate: float = 0.0, **overrides):
  """-> (TransformerConfig, batch, src_len, tgt_len) of the small shape S."""
  return _shape(8192, 256, 4, 1024, 3, 32, dropout_rate, overrides)


def shape_b(dropout_rate: float = 0.0, **overrides):
  """-> (TransformerConfig, batch, src_len, tgt_len) of the base shape B."""
  return _shape(32000, 512, 8, 2048, 6, 16, dropout_rate, overrides)


def shape_tiny(dropout_rate: float = 0.0, **overrides):
  """-> (TransformerConfig, batch, src_len, tgt_len) of "tiny": not a benchmark
  but a smoke test of the scripts, seconds on a laptop CPU (vocabulary 512,
  d_model 64, 4 heads, d_ff 256, 2 + 2 layers, batch 8, lengths 16)."""
  return _shape(512, 64, 4, 256, 2, 8, dropout_rate, overrides, length=16)


SHAPES: dict[str, Callable] = {"S": shape_s, "B": shape_b, "tiny": shape_tiny}


def random_batch(config: TransformerConfig, batch: int, src_len: int, tgt_len: int,
                 seed: int = 0):
  """A fixed random batch of real tokens (ids >= 3, no padding):
  -> (inputs [batch, src_len], targets [batch, tgt_len]) int32."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  inputs = jax.random.randint(k1, (batch, src_len), 3, config.vocab_size, jnp.int32)
  targets = jax.random.randint(k2, (batch, tgt_len), 3, config.vocab_size, jnp.int32)
  return inputs, targets


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def time_fn(fn: Callable, *args, repeats: int = 5, warmup: int = 1):
  """Runs `fn(*args)` `warmup` times, then times `repeats` calls, each waited
  for with `jax.block_until_ready`. -> (median seconds, [seconds of each call])."""
  timing = time_fn_detailed(fn, *args, repeats=repeats, warmup=warmup)
  return timing["median_s"], timing["times_s"]


def time_fn_detailed(fn: Callable, *args, repeats: int = 5, warmup: int = 1) -> dict:
  """`time_fn` that also records the process CPU time of every call.

  On a shared machine the wall time of a call mostly says how many cores the
  other processes left us (here it varied 4x between identical calls), while the
  CPU time, the work done, moves by about 10%. `cpu_s / os.cpu_count()` is thus a
  load-robust estimate of the wall time on an idle machine (an upper bound: it
  also counts threads spinning while they wait for work).

  -> {"median_s", "times_s", "min_s", "median_cpu_s", "cpu_s"}.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times, cpu = [], []
  for _ in range(repeats):
    cpu_start, start = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - cpu_start)
  return {"median_s": statistics.median(times), "times_s": times, "min_s": min(times),
          "median_cpu_s": statistics.median(cpu), "cpu_s": cpu}


def measure_matmul_peak(dtype=jnp.float32, sizes=(1024, 2048, 4096),
                        repeats: int = 5, detailed: bool = False):
  """The machine's matmul peak: the best FLOP/s of a jitted `jnp.dot` of two
  random n x n matrices over `sizes` and `repeats` runs each (2 n^3 FLOPs).
  (n = 1024 is included because on a loaded machine the larger ones, whose
  operands exceed the L3 cache, suffer most from the neighbours.)

  -> (FLOP/s, the n that reached it). Best rather than median: the peak is what
  the hardware can do when nothing else is running. With `detailed`, a dict that
  adds the load-robust peak from CPU time, 2 n^3 / (cpu_s / os.cpu_count()),
  best over sizes and runs (see `time_fn_detailed`).
  """
  dot = jax.jit(jnp.dot)
  best, best_n, best_cpu = 0.0, 0, 0.0
  for n in sizes:
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    timing = time_fn_detailed(dot, a, b, repeats=repeats, warmup=1)
    rate = 2 * n ** 3 / timing["min_s"]
    if rate > best:
      best, best_n = rate, n
    best_cpu = max(best_cpu, 2 * n ** 3 / (min(timing["cpu_s"]) / os.cpu_count()))
  if detailed:
    return {"flops": best, "n": best_n, "flops_cpu": best_cpu}
  return best, best_n


def machine_load() -> str:
  """`uptime`'s load averages (1, 5, 15 min) and the CPU count, as text."""
  one, five, fifteen = os.getloadavg()
  return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


# ----------------------------------------------------------------------------
# Matmuls alone: the floor XLA's matrix multiplications set for a computation
# ----------------------------------------------------------------------------


def _dot_generals(jaxpr, found: list, repeat: int = 1, matrix_vector: bool = False) -> None:
  """Appends (lhs aval, rhs aval, dimension_numbers) of every matrix-matrix
  dot_general in `jaxpr` and its sub-jaxprs (a scan body's dots once per
  iteration). Matrix-vector products (an operand with no free dimension, such
  as the row sums of `layers.layer_norm`'s gradient) are reductions written as
  dots, not model FLOPs: left out, unless `matrix_vector` (a decoding step's
  attention of one query is one)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      numbers = eqn.params["dimension_numbers"]
      if matrix_vector or _free_size(lhs.shape, numbers[0][0], numbers[1][0]) > 1 < _free_size(
          rhs.shape, numbers[0][1], numbers[1][1]):
        found.extend([(lhs, rhs, numbers)] * repeat)
    times = repeat * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          _dot_generals(sub.jaxpr, found, times, matrix_vector)
        elif isinstance(sub, jax_core.Jaxpr):
          _dot_generals(sub, found, times, matrix_vector)


def _free_size(shape, contracting, batch) -> int:
  return math.prod(n for i, n in enumerate(shape) if i not in contracting and i not in batch)


def dot_flops(lhs_shape, rhs_shape, dimension_numbers) -> int:
  """2 x (output elements) x (contracted size) of one dot_general."""
  (_, rhs_contract), (_, rhs_batch) = dimension_numbers
  free = [n for i, n in enumerate(rhs_shape) if i not in rhs_contract and i not in rhs_batch]
  return 2 * math.prod(lhs_shape) * math.prod(free)


def dot_flops_of(fn: Callable, *args) -> int:
  """The FLOPs of every dot_general `fn(*args)` performs, matrix-vector
  products included (a scan body's once per iteration; every branch of a
  `lax.cond` / `lax.switch` counted)."""
  dots = []
  _dot_generals(jax.make_jaxpr(fn)(*args).jaxpr, dots, matrix_vector=True)
  return sum(dot_flops(lhs.shape, rhs.shape, numbers) for lhs, rhs, numbers in dots)


def matmuls_alone(fn: Callable, *args):
  """Every matrix multiplication `fn(*args)` performs (the dot_generals of its
  jaxpr, forward and backward alike), and nothing else: each on operands of
  its own shape, in one jitted function. Its time is the floor XLA's matmuls
  on this machine set for `fn`, whatever `fn` does around them (no
  elementwise work, no softmax, no copies between them).

  -> (run, operands, flops): `run(operands)` does the matmuls; `flops` is
  their total (2 x multiply-adds)."""
  dots = []
  _dot_generals(jax.make_jaxpr(fn)(*args).jaxpr, dots)
  rng = np.random.default_rng(0)  # numpy: no compilation per operand shape
  operands = [tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in (lhs, rhs))
              for lhs, rhs, _ in dots]

  @jax.jit
  def run(operands):
    return [jax.lax.dot_general(a, b, numbers)
            for (a, b), (_, _, numbers) in zip(operands, dots)]
  flops = sum(dot_flops(lhs.shape, rhs.shape, numbers) for lhs, rhs, numbers in dots)
  return run, operands, flops


# ----------------------------------------------------------------------------
# Collectives in compiled HLO
# ----------------------------------------------------------------------------

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8, "pred": 1, "s8": 1, "u8": 1}


def _shape_bytes(shape_text: str) -> tuple[int, set[str]]:
  """(bytes, dtypes) of an HLO result shape such as `(f32[32,64]{1,0}, s32[])`."""
  total, dtypes = 0, set()
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
    if dtype in _DTYPE_BYTES:
      dtypes.add(dtype)
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total, dtypes


def collectives(hlo_text: str, op: str = "all-reduce") -> list[dict]:
  """Every `op` (all-reduce, all-gather, reduce-scatter, ...) of a compiled
  module's text (`jit(f).lower(...).compile().as_text()`): its computation,
  whether that is a while loop's body (or called from one: run once per
  iteration), its result bytes and dtypes."""
  computations, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$", line)
    if header and not line.startswith(" "):
      current = header.group(1).lstrip("%")
      computations[current] = []
    elif current is not None:
      computations[current].append(line)
  calls = {name: set(re.findall(r"(?:body|condition|to_apply|calls|branch_computations)="
                                r"\{?%?([\w.\-]+)", "\n".join(lines)))
           for name, lines in computations.items()}
  in_loop = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
  frontier = list(in_loop)
  while frontier:  # what a loop body calls runs once per iteration too
    for callee in calls.get(frontier.pop(), ()):
      if callee not in in_loop:
        in_loop.add(callee)
        frontier.append(callee)
  found = []
  pattern = re.compile(r"=\s*(.*?)\s" + re.escape(op) + r"(?:-start)?\(")
  for name, lines in computations.items():
    for line in lines:
      match = pattern.search(line)
      if match:
        size, dtypes = _shape_bytes(match.group(1))
        found.append({"computation": name, "in_loop": name in in_loop, "bytes": size,
                      "dtypes": sorted(dtypes)})
  return found
