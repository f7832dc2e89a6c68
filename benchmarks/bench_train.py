"""Training throughput and model FLOPs utilisation (MFU) on shapes S and B.

    python benchmarks/bench_train.py                 # S and B, dropout 0.1
    python benchmarks/bench_train.py --shapes S --repeats 10
    python benchmarks/bench_train.py --shapes S --batch_size 64 --length 64 \
        --model d_model=128,d_ff=512,dtype=bfloat16   # compute dtype, sizes

One full training step as train.py runs it (Adam, the paper's schedule, label
smoothing 0.1, dropout 0.1, packed-batch masks), on a fixed random batch with
no padding. MFU = model FLOPs per step (benchmarks/common.py:
training_flops_per_step) / step time / the float32 matmul peak (a 2048^3 matmul)
measured in the same round. Also times the step's matmuls alone (the same
dot_generals, nothing around them): the floor XLA's matmuls set on this
machine. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import ml_collections

from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import common
from transformer.runtime import parallel
from transformer.training import steps as steps_lib


def optimizer_config(warmup_steps=4000):
  return ml_collections.ConfigDict(dict(
      warmup_steps=warmup_steps, learning_rate_scale=1.0, adam_b1=0.9, adam_b2=0.98,
      adam_eps=1e-9, grad_clip_norm=0.0))


def make_batch(config, batch, src_len, tgt_len):
  inputs, targets = common.random_batch(config, batch, src_len, tgt_len)
  ones = lambda x: jnp.ones_like(x)
  positions = lambda x: jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
  b = {"inputs": inputs, "targets": targets,
       "inputs_segment_ids": ones(inputs), "targets_segment_ids": ones(targets),
       "inputs_positions": positions(inputs), "targets_positions": positions(targets)}
  return {k: v[None] for k, v in b.items()}  # [accumulation=1, rows, length]


def compile_train_step(name, dropout, compiler_options=None, **overrides):
  """train.py's step for shape `name` (TransformerConfig fields replaced by
  `overrides`, e.g. dtype="bfloat16"), compiled (with XLA `compiler_options` if
  given) as train.py compiles it: data-parallel over every device (the batch
  sharded, the state replicated): -> (compiled, initial state, batch, seconds
  to compile). `compiled(state, batch)` -> (state, metrics); the state is donated."""
  config, batch, src_len, tgt_len = common.SHAPES[name](dropout_rate=dropout, **overrides)
  optimizer, schedule = steps_lib.make_optimizer(optimizer_config(), config.d_model)
  mesh = parallel.make_mesh()
  replicated = parallel.replicated(mesh)
  batch_sharding = NamedSharding(mesh, PartitionSpec(None, parallel.DATA_AXIS))
  state = jax.device_put(steps_lib.create_train_state(config, optimizer, seed=0), replicated)
  step = jax.jit(lambda s, b: steps_lib.train_step(
      s, b, model_config=config, optimizer=optimizer, schedule=schedule,
      label_smoothing=0.1, mesh=mesh), in_shardings=(replicated, batch_sharding),
      out_shardings=(replicated, replicated), donate_argnums=0)
  data = jax.device_put(make_batch(config, batch, src_len, tgt_len), batch_sharding)
  start = time.perf_counter()
  compiled = step.lower(state, data).compile(compiler_options=compiler_options)
  return compiled, state, data, time.perf_counter() - start


def bench_shape(name, dropout, repeats, **overrides):
  """Times the step, its matmuls alone and the matmul peak in turn, `repeats`
  rounds: each round's MFU divides by the peak measured in that round, so a
  neighbour that slows the machine slows both (the figures are medians).
  `overrides` replace TransformerConfig fields (e.g. dtype="bfloat16": the
  compute dtype, float32 parameters and optimizer)."""
  config, batch, src_len, tgt_len = common.SHAPES[name](dropout_rate=dropout, **overrides)
  compiled, state, data, compile_s = compile_train_step(name, dropout, **overrides)
  optimizer, schedule = steps_lib.make_optimizer(optimizer_config(), config.d_model)
  matmuls, operands, matmul_flops = common.matmuls_alone(
      lambda s, b: steps_lib.train_step(s, b, model_config=config, optimizer=optimizer,
                                       schedule=schedule, label_smoothing=0.1), state, data)
  flops = common.training_flops_per_step(config, batch, src_len, tgt_len)
  assert abs(matmul_flops - flops) <= 0.01 * flops, (matmul_flops, flops)  # the FLOP model
  holder = {"state": state}

  def step():
    holder["state"], metrics = compiled(holder["state"], data)
    return metrics
  rounds = []
  for i in range(repeats + 2):  # two warm-up rounds
    step_s = common.time_fn(step, repeats=1, warmup=0)[0]
    matmuls_s = common.time_fn(matmuls, operands, repeats=1, warmup=0)[0]
    peak = common.matmul_rate()
    if i >= 2:
      rounds.append((step_s, matmuls_s, peak))
  median = lambda values: statistics.median(values)
  step_s = median([r[0] for r in rounds])
  matmuls_s = median([r[1] for r in rounds])
  return {"shape": name, "dropout": dropout, "compile_s": compile_s, "step_s": step_s,
          "target_tokens_per_s": batch * tgt_len / step_s, "gflops_per_step": flops / 1e9,
          "achieved_gflops": flops / step_s / 1e9,
          "peak_gflops": median([r[2] for r in rounds]) / 1e9,
          "mfu": median([flops / r[0] / r[2] for r in rounds]),
          "matmuls_s": matmuls_s, "step_over_matmuls": median([r[0] / r[1] for r in rounds]),
          "matmuls_mfu": median([flops / r[1] / r[2] for r in rounds])}


def _resized(shape, batch_size: int, length: int):
  """`shape` (a common.SHAPES entry) with another batch size and/or length."""
  def resized(**kwargs):
    config, batch, src_len, tgt_len = shape(**kwargs)
    return config, batch_size or batch, length or src_len, length or tgt_len
  return resized


def _field(item: str) -> tuple[str, object]:
  """"d_model=128" -> ("d_model", 128); a value that is no number stays a string."""
  name, _, value = item.partition("=")
  for kind in (int, float):
    try:
      return name, kind(value)
    except ValueError:
      pass
  return name, value


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="S,B")
  parser.add_argument("--dropout", type=float, default=0.1)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", default="")
  parser.add_argument("--cpu_devices", type=int, default=0,
                      help="split the CPU into this many devices (train.py "
                           "--cpu_devices): data parallel over them. 0: JAX's default (one)")
  parser.add_argument("--batch_size", type=int, default=0, help="rows per step (0: the shape's)")
  parser.add_argument("--model", default="",
                      help="TransformerConfig fields replaced, e.g. d_model=128,d_ff=512,"
                           "dtype=bfloat16 (MFU stays against the float32 peak)")
  parser.add_argument("--length", type=int, default=0,
                      help="source and target tokens per row (0: the shape's, 64)")
  args = parser.parse_args()
  if args.batch_size or args.length:
    for name, shape in list(common.SHAPES.items()):
      common.SHAPES[name] = _resized(shape, args.batch_size, args.length)
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  overrides = dict(_field(item) for item in args.model.split(",") if item)
  rows = [bench_shape(s, args.dropout, args.repeats, **overrides) for s in args.shapes.split(",")]
  print(f"\n{common.machine_load()}; jax {jax.__version__}, {len(jax.devices())} "
        f"{jax.devices()[0].platform} device(s); "
        f"medians of {args.repeats} rounds{'; ' + args.model if args.model else ''}")
  print("\n| shape | dropout | step (s) | target tokens/s | GFLOP/step | GFLOP/s | peak GFLOP/s "
        "| MFU | matmuls alone (s) | their MFU | step / matmuls | compile (s) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['shape']} | {r['dropout']} | {r['step_s']:.3f} | {r['target_tokens_per_s']:,.0f} "
          f"| {r['gflops_per_step']:.1f} | {r['achieved_gflops']:.1f} | {r['peak_gflops']:.0f} "
          f"| {r['mfu']:.0%} | {r['matmuls_s']:.3f} | {r['matmuls_mfu']:.0%} "
          f"| {r['step_over_matmuls']:.2f} | {r['compile_s']:.1f} |")
  print("\nmatmuls alone: every matrix multiplication of the step (forward and backward, "
        "the same shapes), nothing else (common.matmuls_alone); their MFU is the most "
        "a step made of these matmuls could reach with XLA on this machine. peak: a 2048^3 float32 "
        "matmul, re-measured in every round.")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py / decode.py do, before any computation
  main()
