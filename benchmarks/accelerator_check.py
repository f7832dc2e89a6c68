"""One command for a GPU or TPU: every backend-specific path against its
reference on this device, then the speed of training and decoding, in one table.

    python benchmarks/accelerator_check.py                # GPU/TPU: shapes S and B
    python benchmarks/accelerator_check.py --shapes=tiny  # seconds; the default on CPU

Checks (per shape; "error" is max |got - reference| / max |reference| over
every compared array, so one tolerance fits any size):

  attention        scaled_dot_product_attention with each implementation that
                   runs here (einsum, xla, and cudnn on an NVIDIA GPU where
                   it takes the shape, the model's default or not) against
                   a float32 einsum reference of Equation (1) at
                   "highest" matmul precision: output and gradients for q, k, v,
                   two packed segments + padding + causal mask, float32 inputs
                   (run at "highest") and bfloat16 inputs (the default precision).
  dropout          prng.dropout against dropout through jax.random.bernoulli
                   (bit for bit), also under shard_map with prng.rows_sharded_over
                   (each device's slice of the whole batch's masks, as the
                   trainer uses it); and the time of each on a [rows, length,
                   d_ff] activation: the hand-written hash exists because JAX
                   lowers Threefry as a slow loop on CPU.
  LayerNorm        layers.LayerNorm against flax.linen.LayerNorm: output and
                   gradients (x, scale, bias), float32 and bfloat16 inputs.
  cached decoding  decode_step logits, one position at a time through the
                   key/value cache (2 beams sharing the encoder memory), against
                   the full teacher-forced forward on the same tokens, in float32
                   and bfloat16.

Timings (bfloat16 compute, float32 parameters; the row's result says it ran
sanely: a finite loss, every sentence decoded to full length):

  training step    the trainer's step (bench_train.compile_train_step: Adam,
                   label smoothing, dropout 0.1, data parallel over all devices):
                   steps/s, target tokens/s, MFU = model FLOPs per step
                   (common.training_flops_per_step) x steps/s / peak, against
                   the bfloat16 matmul peak measured in this run and, where the
                   device kind is known, its rated peak (flops.rated_peak).
  decoding         greedy and beam 4 (bench_decode.compile_decoder: 16 sentences
                   of 32 source tokens, 64 generated tokens each): sentences/s.

Exit status 1 if any row FAILs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import sys
import traceback
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks import bench_decode, bench_train, common
from transformer.training import flops
from transformer.model import attention_choice, kv_cache
from transformer.model import layers
from transformer.model import transformer as model_lib
from transformer.runtime import parallel
from transformer.model import prng

# Tolerances on the error (max |got - ref| / max |ref|). float32 paths differ
# from their references only in the order of float32 sums (~1e-7 measured on
# CPU); bfloat16 ones round every activation to 8 significant bits (one ulp is
# 2^-7 = 0.8%), and errors grow through softmax, the backward pass and the
# model's layers (on CPU, tiny: attention 4e-3 to 5e-3 with head_dim 16 or 64,
# LayerNorm 5e-3, cached decoding 2e-3); the bfloat16 tolerances leave room for
# other kernels (cuDNN's flash attention computes its backward pass its own
# way). A real bug gives errors of order 1: a missing 1/sqrt(d_k) 3-8, a
# missing causal mask 1.0-1.2, a query not seeing itself 1.0-1.2.
TOLERANCES = {
    ("attention", "float32"): 1e-4, ("attention", "bfloat16"): 5e-2,
    ("LayerNorm", "float32"): 1e-5, ("LayerNorm", "bfloat16"): 2e-2,
    ("cached decoding", "float32"): 1e-4, ("cached decoding", "bfloat16"): 5e-2,
}
DROPOUT_RATE = 0.1


@dataclasses.dataclass
class Row:
  """One line of the table. `error`/`tolerance` are None for timings, whose
  `passed` says that the run was sane (finite loss, full-length output)."""
  shape: str
  check: str
  implementation: str
  dtype: str
  error: float | None
  tolerance: float | None
  passed: bool
  measured: str = ""

  @property
  def result(self) -> str:
    return "PASS" if self.passed else "FAIL"


def relative_error(got, want) -> float:
  """max |got - want| / max |want| over pytrees of arrays of equal structure,
  the worst leaf (in float64; inf for a NaN or a shape mismatch)."""
  worst = 0.0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if g.shape != w.shape or not np.all(np.isfinite(g)):
      return math.inf
    scale = max(float(np.max(np.abs(w))), np.finfo(np.float32).tiny)
    worst = max(worst, float(np.max(np.abs(g - w))) / scale)
  return worst


def compare(shape, check, implementation, dtype, got, want, tolerance, measured="") -> Row:
  error = relative_error(got, want)
  return Row(shape, check, implementation, dtype, error, tolerance, error <= tolerance, measured)


def precision_for(dtype: str):
  """float32 paths are checked at "highest" matmul precision (TPUs default to
  bfloat16 passes, GPUs to TF32); bfloat16 paths at the default, as they run."""
  if dtype == "float32":
    return jax.default_matmul_precision("highest")
  return contextlib.nullcontext()


# ----------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------


def packed_segment_ids(batch: int, length: int) -> np.ndarray:
  """int32 `[batch, length]`: two packed examples and trailing padding per row,
  split at different places in each row (3/8 and 7/8 of the row, shifted)."""
  ids = np.zeros((batch, length), np.int32)
  for row in range(batch):
    first = max(1, (3 * length) // 8 - row % 3)
    second = max(first + 1, (7 * length) // 8 - row % 2)
    ids[row, :first], ids[row, first:second] = 1, 2
  return ids


def reference_attention(query, key, value, mask):
  """softmax(Q K^T / sqrt(d_k)) V in float32, written out: query
  `[batch, q_len, heads, d_k]`, key/value `[batch, kv_len, heads, d_k]`, bool
  mask `[batch, 1, q_len, kv_len]` -> `[batch, q_len, heads, d_k]`."""
  query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
  scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / math.sqrt(query.shape[-1])
  scores = jnp.where(mask, scores, -1e30)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), value)


def attention_inputs(batch: int, length: int, heads: int, head_dim: int, seed: int = 0):
  """Random unit-scale q, k, v `[batch, length, heads, head_dim]` and an output
  cotangent (float32), and `packed_segment_ids`."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (batch, length, heads, head_dim)
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  return q, k, v, cotangent, jnp.asarray(packed_segment_ids(batch, length))


def attention_and_gradients(attention: Callable, dtype: str, inputs):
  """`attention(q, k, v, mask) -> out` (all `[batch, length, heads, d_k]`) on
  `attention_inputs` rounded to `dtype`, with the causal mask of the packed
  segments: -> (float32 output, gradients of sum(out * cotangent) for q, k, v).
  Padding queries (no visible key; no loss reads them) are zeroed in both."""
  q, k, v, cotangent, segment_ids = inputs
  mask = model_lib.attention_mask(segment_ids, segment_ids, causal=True)
  real = (segment_ids > 0)[:, :, None, None]

  def loss(q, k, v):
    out = jnp.where(real, attention(q, k, v, mask).astype(jnp.float32), 0.0)
    return jnp.sum(out * cotangent), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      *(x.astype(dtype) for x in (q, k, v)))
  return out, grads


def reference_attention_and_gradients(dtype: str, inputs):
  """`attention_and_gradients` of `reference_attention` in float32 at
  "highest" precision, on the inputs rounded to `dtype` (what the checked
  implementation sees)."""
  q, k, v, *rest = inputs
  rounded = tuple(x.astype(dtype).astype(jnp.float32) for x in (q, k, v))
  with jax.default_matmul_precision("highest"):
    return jax.jit(functools.partial(attention_and_gradients, reference_attention,
                                     "float32"))((*rounded, *rest))


def check_attention(attention: Callable, implementation: str, dtype: str, inputs,
                    shape: str = "", reference=None) -> Row:
  """`attention(q, k, v, mask) -> out` against `reference_attention`: output
  and gradients (`attention_and_gradients`), float32 at "highest" precision,
  bfloat16 at the default. `reference`: `reference_attention_and_gradients`
  of the same dtype and inputs, if already computed."""
  with precision_for(dtype):
    got = jax.jit(functools.partial(attention_and_gradients, attention, dtype))(inputs)
  if reference is None:
    reference = reference_attention_and_gradients(dtype, inputs)
  return compare(shape, "attention: output, d(q, k, v)", implementation, dtype, got,
                 reference, TOLERANCES["attention", dtype])


def attention_implementations(head_dim: int) -> list[str]:
  """What can compute attention on this device: the einsums and XLA always,
  cuDNN on an NVIDIA GPU where it takes bfloat16 at this head size (whether or
  not the model uses it by default: this check is what decides that)."""
  cudnn = (attention_choice.attention_backend() == "gpu"
           and attention_choice.cudnn_problem(jnp.bfloat16, head_dim) is None)
  return ["einsum", "xla"] + (["cudnn"] if cudnn else [])


def attention_rows(shape: str, config, batch: int, length: int) -> list[Row]:
  inputs = attention_inputs(min(batch, 8), length, config.num_heads, config.head_dim)
  references = {dtype: reference_attention_and_gradients(dtype, inputs)
                for dtype in ("float32", "bfloat16")}
  rows = []
  for implementation in attention_implementations(config.head_dim):
    attention = lambda q, k, v, mask, impl=implementation: (
        model_lib.scaled_dot_product_attention(q, k, v, mask, implementation=impl)[0])
    for dtype, reference in references.items():
      if implementation == "cudnn" and dtype == "float32":
        continue  # cuDNN has no float32 kernel
      rows.append(check_attention(attention, implementation, dtype, inputs, shape, reference))
  return rows


# ----------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------


def jax_dropout(x, rate: float, key):
  """Inverted dropout with JAX's own generator: the reference for prng.dropout."""
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def dropout_rows(shape: str, config, batch: int, length: int, repeats: int) -> list[Row]:
  """prng.dropout = jax_dropout bit for bit on a `[batch, length, d_ff]`
  activation (also split over the devices under shard_map) and their times."""
  dtype = config.dtype
  x = jax.random.normal(jax.random.key(0), (batch, length, config.d_ff), dtype)
  key = jax.random.key(1)
  ours = jax.jit(lambda x, key: prng.dropout(x, DROPOUT_RATE, key))
  theirs = jax.jit(lambda x, key: jax_dropout(x, DROPOUT_RATE, key))
  want = theirs(x, key)

  # Time masks, not dispatch: `chain` dropouts in a row (new keys) per call.
  chain = 10

  def chained(dropout, x, key):
    return jax.lax.fori_loop(
        0, chain, lambda i, x: dropout(x, DROPOUT_RATE, jax.random.fold_in(key, i)), x)
  times = {name: common.time_fn(jax.jit(functools.partial(chained, fn)), x, key,
                                repeats=repeats, warmup=1)[0] / chain
           for name, fn in (("prng", prng.dropout), ("jax", jax_dropout))}
  measured = (f"per mask {tuple(x.shape)}: prng {times['prng'] * 1e6:,.0f} us, "
              f"jax.random {times['jax'] * 1e6:,.0f} us: prng "
              f"{times['jax'] / times['prng']:.2f}x as fast")
  rows = [compare(shape, "dropout = jax.random.bernoulli's", "prng.dropout", dtype,
                  ours(x, key), want, 0.0, measured)]

  devices = jax.device_count()
  if batch % devices == 0:  # the trainer's use: each device its rows' slice
    mesh = parallel.make_mesh()

    def sharded(x, key):
      with prng.rows_sharded_over(parallel.DATA_AXIS):
        return prng.dropout(x, DROPOUT_RATE, key)
    split = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P(parallel.DATA_AXIS), P()),
                                  out_specs=P(parallel.DATA_AXIS)))
    rows.append(compare(shape, "dropout = jax.random.bernoulli's",
                        f"prng under shard_map, {devices} device(s)", dtype,
                        split(x, key), want, 0.0))
  return rows


# ----------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------


def layer_norm_rows(shape: str, config, batch: int, length: int) -> list[Row]:
  """layers.LayerNorm against flax.linen.LayerNorm (same parameters): output
  and gradients of sum(out * cotangent) for x, scale and bias."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
  x = 3 * jax.random.normal(k1, (batch, length, config.d_model)) + 1
  params = {"scale": 1 + 0.1 * jax.random.normal(k2, (config.d_model,)),
            "bias": 0.1 * jax.random.normal(k3, (config.d_model,))}
  cotangent = jax.random.normal(k4, x.shape)
  eps = config.layer_norm_epsilon

  def run(module, x, params):
    def loss(x, params):
      out = module.apply({"params": params}, x).astype(jnp.float32)
      return jnp.sum(out * cotangent), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return out, grads

  rows = []
  for dtype in ("float32", "bfloat16"):
    with precision_for(dtype):
      got = jax.jit(functools.partial(run, layers.LayerNorm(epsilon=eps)))(
          x.astype(dtype), params)
      want = jax.jit(functools.partial(run, nn.LayerNorm(epsilon=eps)))(
          x.astype(dtype), params)
    rows.append(compare(shape, "LayerNorm: output, d(x, scale, bias)",
                        "layers.LayerNorm vs flax", dtype, got, want,
                        TOLERANCES["LayerNorm", dtype]))
  return rows


# ----------------------------------------------------------------------------
# Cached decoding
# ----------------------------------------------------------------------------


def incremental_logits(config, params, inputs, decoder_inputs, beams: int):
  """decode_step one position at a time, each input's memory shared by
  `beams` rows: -> float32 logits `[batch * beams, tgt_len, vocab]`."""
  model = model_lib.Transformer(config)

  @jax.jit
  def memory_of(params, inputs):
    encoded = model.apply({"params": params}, inputs, method=model_lib.Transformer.encode)
    return model.apply({"params": params}, encoded, inputs,
                       method=model_lib.Transformer.encoder_memory)

  @jax.jit
  def step(params, token_ids, cache, memory):
    return model.apply({"params": params}, token_ids, cache, memory,
                       method=model_lib.Transformer.decode_step)
  memory = memory_of(params, inputs)
  batch, length = decoder_inputs.shape
  cache = kv_cache.init_cache(config, batch, length, beams)
  tokens = jnp.repeat(decoder_inputs, beams, axis=0)
  steps = []
  for t in range(length):
    logits, cache = step(params, tokens[:, t], cache, memory)
    steps.append(logits)
  return jnp.stack(steps, axis=1)


def cached_decoding_rows(shape: str, config, batch: int, src_len: int, tgt_len: int,
                         beams: int = 2) -> list[Row]:
  """Logits of incremental decoding with the cache against the full forward
  (teacher forcing, the model's own attention implementation) on the same
  tokens, random weights, in float32 and bfloat16."""
  config = config.replace(dropout_rate=0.0, max_len=max(config.max_len, src_len, tgt_len))
  params = jax.jit(functools.partial(model_lib.init_params, config))(jax.random.key(3))
  inputs, targets = common.random_batch(config, min(batch, 4), src_len, tgt_len, seed=4)
  decoder_inputs = model_lib.shift_right(targets, config.bos_id)
  rows = []
  for dtype in ("float32", "bfloat16"):
    cfg = config.replace(dtype=dtype)
    with precision_for(dtype):
      full = jax.jit(lambda p, s, d: model_lib.Transformer(cfg).apply({"params": p}, s, d))(
          params, inputs, decoder_inputs)
      cached = incremental_logits(cfg, params, inputs, decoder_inputs, beams)
    implementation = (f"{beams} beams vs full forward ("
                      f"{_chosen_attention(cfg)} attention)")
    rows.append(compare(shape, "cached decoding: logits", implementation, dtype, cached,
                        jnp.repeat(full, beams, axis=0), TOLERANCES["cached decoding", dtype]))
  return rows


def _chosen_attention(config) -> str:
  """The implementation the model uses for `config` on this device."""
  return attention_choice.choose_attention_implementation(
      config.attention_implementation, backend=attention_choice.attention_backend(),
      dtype=config.dtype, head_dim=config.head_dim,
      dropout=config.attention_dropout_rate > 0)


# ----------------------------------------------------------------------------
# Timings
# ----------------------------------------------------------------------------


def peak_flops_per_device() -> tuple[float, str]:
  """The best bfloat16 matmul rate of one device, measured now, and the size
  it reached it at (small sizes on CPU, where bfloat16 matmuls are slow)."""
  sizes = (256, 512) if jax.default_backend() == "cpu" else (2048, 4096, 8192)
  flops, n = common.measure_matmul_peak(dtype=jnp.bfloat16, sizes=sizes, repeats=5)
  return flops, f"{n}^3"


def training_row(shape: str, repeats: int, peak: float) -> Row:
  """The trainer's step in bfloat16, timed: steps/s, target tokens/s, MFU."""
  config, batch, src_len, tgt_len = common.SHAPES[shape](
      dropout_rate=DROPOUT_RATE, dtype="bfloat16")
  compiled, state, data, compile_s = bench_train.compile_train_step(
      shape, DROPOUT_RATE, dtype="bfloat16")
  holder = {"state": state}

  def step():
    holder["state"], metrics = compiled(holder["state"], data)
    return metrics
  step_s = common.time_fn(step, repeats=repeats, warmup=2)[0]
  loss = float(step()["loss"])
  devices = jax.device_count()
  achieved = common.training_flops_per_step(config, batch, src_len, tgt_len) / step_s
  measured = (f"{1 / step_s:,.1f} steps/s, {batch * tgt_len / step_s:,.0f} target tokens/s, "
              f"{achieved / 1e12:,.2f} TFLOP/s: MFU {achieved / (peak * devices):.0%} "
              f"of the measured peak")
  rated = flops.rated_peak()
  if rated is not None:
    measured += f", {achieved / (rated * devices):.0%} of the rated {rated / 1e12:,.0f} TFLOP/s"
  measured += f" (compile {compile_s:.1f} s)"
  return Row(shape, "training step", f"{_chosen_attention(config)} attention", "bfloat16",
             None, None, math.isfinite(loss), measured)


def decoding_row(shape: str, method: str, beam_size: int, repeats: int) -> Row:
  """bench_decode's fixed batch in bfloat16: sentences/s and tokens/s."""
  compiled, args, compile_s = bench_decode.compile_decoder(shape, method, beam_size,
                                                           dtype="bfloat16")
  seconds = common.time_fn(lambda: compiled(*args), repeats=repeats, warmup=1)[0]
  sequences = np.asarray(compiled(*args)[0])[:, 0]
  full_length = bool(np.all(sequences != 0))  # min_len = max_len: no early EOS
  sentences, tokens = bench_decode.NUM_SENTENCES, bench_decode.GEN_LEN
  measured = (f"{sentences / seconds:,.1f} sentences/s, {sentences * tokens / seconds:,.0f} "
              f"tokens/s ({sentences} x {bench_decode.SRC_LEN} source tokens -> {tokens}; "
              f"compile {compile_s:.1f} s)")
  name = method if method == "greedy" else f"beam {beam_size}"
  return Row(shape, "decoding", name, "bfloat16", None, None, full_length, measured)


# ----------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------


def guarded(shape: str, check: str, fn: Callable, *args) -> list[Row]:
  """`fn(*args)`'s row(s); a path that raises on this device is a FAIL row
  (the traceback on stderr), and the other checks still run."""
  try:
    rows = fn(*args)
  except Exception as error:  # noqa: BLE001 -- reported in the table, not swallowed
    traceback.print_exc()
    message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return [Row(shape, check, "-", "-", None, None, False,
                f"raised {type(error).__name__}: {message}".replace("|", "/"))]
  return rows if isinstance(rows, list) else [rows]


def check_shape(shape: str, repeats: int, peak: float):
  """Every check and timing of the table for one common.SHAPES entry, each
  check's rows yielded as soon as they are known (a run cut short by a time
  limit still shows what it got)."""
  config, batch, src_len, tgt_len = common.SHAPES[shape](dtype="bfloat16")
  yield from guarded(shape, "attention", attention_rows, shape, config, batch, tgt_len)
  yield from guarded(shape, "dropout", dropout_rows, shape, config, batch, tgt_len, repeats)
  yield from guarded(shape, "LayerNorm", layer_norm_rows, shape, config, batch, tgt_len)
  yield from guarded(shape, "cached decoding", cached_decoding_rows, shape, config, batch,
                     src_len, tgt_len)
  yield from guarded(shape, "training step", training_row, shape, repeats, peak)
  yield from guarded(shape, "decoding", decoding_row, shape, "greedy", 1, repeats)
  yield from guarded(shape, "decoding", decoding_row, shape, "beam", 4, repeats)


TABLE_HEADER = ("| shape | check | implementation | dtype | error | tolerance | result | measured |\n"
                "|---|---|---|---|---|---|---|---|")


def format_row(r: Row) -> str:
  number = lambda x: "-" if x is None else ("0" if x == 0 else f"{x:.1e}")
  return (f"| {r.shape} | {r.check} | {r.implementation} | {r.dtype} | {number(r.error)} "
          f"| {number(r.tolerance)} | {r.result} | {r.measured} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="",
                      help="comma-separated common.SHAPES names (default: S,B on a GPU or "
                           "TPU, tiny on CPU)")
  parser.add_argument("--repeats", type=int, default=0,
                      help="timed calls per measurement (default: 20, 3 on CPU)")
  args = parser.parse_args(argv)
  cpu = jax.default_backend() == "cpu"
  shapes = (args.shapes or ("tiny" if cpu else "S,B")).split(",")
  repeats = args.repeats or (3 if cpu else 20)
  device = jax.devices()[0]
  peak, peak_at = peak_flops_per_device()
  rated = flops.rated_peak()
  print(f"\n{jax.device_count()} x {device.device_kind} ({device.platform}, attention "
        f"backend {attention_choice.attention_backend()!r}); jax {jax.__version__}; "
        f"{common.machine_load()}")
  print(f"bfloat16 matmul peak of one device, measured: {peak / 1e12:,.3f} TFLOP/s ({peak_at})"
        + (f"; rated: {rated / 1e12:,.0f} TFLOP/s" if rated else ""))
  for shape in shapes:
    config = common.SHAPES[shape](dtype="bfloat16")[0]
    print(f"{shape}: {attention_choice.attention_implementation_name(config)}")
  print("error: max |got - reference| / max |reference| over the compared arrays; "
        "float32 checks at matmul precision 'highest'\n")
  print(TABLE_HEADER, flush=True)
  rows = []
  for shape in shapes:
    for row in check_shape(shape, repeats, peak):
      rows.append(row)
      print(format_row(row), flush=True)
  failed = [r for r in rows if not r.passed]
  print(f"\n{len(rows) - len(failed)} of {len(rows)} rows PASS"
        + (f"; FAIL: {', '.join(f'{r.shape} {r.check} {r.implementation} {r.dtype}' for r in failed)}"
           if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py / decode.py do, before any computation
  sys.exit(main())
