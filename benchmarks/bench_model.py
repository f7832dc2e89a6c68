"""Training-step speed, MFU and compile time of the Transformer on the benchmark shapes.

For each shape (see `common.py`), with random weights and a fixed random batch:

  step      a jitted forward + backward: the gradient, with respect to the
            parameters, of the mean cross-entropy of the logits against the
            targets (no label smoothing, no optimizer update). Timed with
            dropout 0 (`deterministic=True`, the default) and, with
            `--dropout 0,0.1`, also with dropout 0.1 (`deterministic=False`, a
            fresh dropout key each call) -> step time (median), target
            tokens/s, achieved GFLOP/s and MFU = model FLOPs / step time /
            matmul peak, the peak measured in the same run.
  compile   wall time of `jax.jit(f).lower(...).compile()` of the same training
            forward + backward (dropout 0), a fresh function each time, with
            `scan_layers` False and True, at 6 and 12 layers per side (the rest of
            the shape as S, resp. B); split into lowering (tracing) and XLA compile.

Every figure also records the process CPU time: on a shared machine the wall
time mostly measures the other processes (see `common.time_fn_detailed`), so
MFU(CPU) = FLOPs / (CPU seconds / cores) / (the peak measured the same way) is
printed beside the wall-time MFU as the estimate for an idle machine.

  python benchmarks/bench_model.py
  python benchmarks/bench_model.py --shapes S --repeats 10 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import optax

import common

SIZES = (1024, 2048, 4096)  # matmul peak sizes (common.measure_matmul_peak's default)
from transformer.model.transformer import Transformer, count_params, init_params, shift_right


def make_loss(config):
  """-> loss(params, inputs, targets, dropout_key): mean token cross-entropy."""
  deterministic = config.dropout_rate == 0.0
  model = Transformer(config, deterministic=deterministic)

  def loss(params, inputs, targets, dropout_key):
    decoder_inputs = shift_right(targets, config.bos_id)
    rngs = None if deterministic else {"dropout": dropout_key}
    logits = model.apply({"params": params}, inputs, decoder_inputs, rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


def make_train_grad(config):
  """A fresh, un-jitted fwd+bwd function: -> (loss, grads)."""
  return jax.value_and_grad(make_loss(config))


def bench_step(shape, dropout_rate, repeats, warmup):
  config, batch, src_len, tgt_len = common.SHAPES[shape](dropout_rate)
  params = init_params(config, jax.random.key(0), src_len, tgt_len)
  inputs, targets = common.random_batch(config, batch, src_len, tgt_len)
  step = jax.jit(make_train_grad(config))
  keys = iter(jax.random.split(jax.random.key(1), repeats + warmup))
  fn = lambda: step(params, inputs, targets, next(keys))
  timing = common.time_fn_detailed(fn, repeats=repeats, warmup=warmup)
  median = timing["median_s"]
  flops = common.training_flops_per_step(config, batch, src_len, tgt_len)
  idle_step = timing["median_cpu_s"] / os.cpu_count()  # load-robust estimate
  return {
      "shape": shape, "dropout": dropout_rate, "params": count_params(params),
      "tflop_per_step": flops / 1e12, "step_s": median, "step_s_min": timing["min_s"],
      "step_s_all": timing["times_s"], "tokens_per_s": batch * tgt_len / median,
      "gflops": flops / median / 1e9, "gflops_cpu": flops / idle_step / 1e9,
      "cpu_s": timing["median_cpu_s"], "cpu_s_all": timing["cpu_s"],
  }


def bench_compile(shape, layers, scan, repeats):
  config, batch, src_len, tgt_len = common.SHAPES[shape](
      0.0, scan_layers=scan)
  config = config.replace(num_encoder_layers=layers, num_decoder_layers=layers)
  # Abstract arguments: nothing is allocated, only shapes matter to the compiler.
  params = jax.eval_shape(lambda k: init_params(config, k, src_len, tgt_len),
                          jax.random.key(0))
  inputs = jax.ShapeDtypeStruct((batch, src_len), jnp.int32)
  targets = jax.ShapeDtypeStruct((batch, tgt_len), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  lowers, compiles, cpus = [], [], []
  for _ in range(repeats):
    fn = jax.jit(make_train_grad(config))  # a fresh function: no tracing cache hit
    cpu_start, start = time.process_time(), time.perf_counter()
    lowered = fn.lower(params, inputs, targets, key)
    mid = time.perf_counter()
    lowered.compile()
    end = time.perf_counter()
    cpus.append(time.process_time() - cpu_start)
    lowers.append(mid - start)
    compiles.append(end - mid)
  totals = [a + b for a, b in zip(lowers, compiles)]
  return {"shape": shape, "layers": layers, "scan_layers": scan,
          "total_s": statistics.median(totals), "total_s_all": totals,
          "lower_s": statistics.median(lowers), "compile_s": statistics.median(compiles),
          "cpu_s": statistics.median(cpus), "cpu_s_all": cpus}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="S,B", help="comma-separated: S, B")
  parser.add_argument("--repeats", type=int, default=5, help="timed steps per figure")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps (after compiling)")
  parser.add_argument("--dropout", default="0,0.1",
                      help="comma-separated dropout rates of the timed step")
  parser.add_argument("--compile_repeats", type=int, default=2,
                      help="compilations per compile-time figure (median)")
  parser.add_argument("--compile_layers", default="shape,6,12",
                      help="layers per side of the compile-time figures; 'shape' = the "
                      "shape's own depth; '' to skip")
  parser.add_argument("--json", default=None, help="also write the figures here")
  args = parser.parse_args(argv)
  shapes = [s.strip().upper() for s in args.shapes.split(",") if s.strip()]
  dropouts = [float(x) for x in args.dropout.split(",") if x.strip()]
  compile_layers = [x.strip() for x in args.compile_layers.split(",") if x.strip()]

  started = time.perf_counter()
  load_start = common.machine_load()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {load_start}", flush=True)
  peak = common.measure_matmul_peak(sizes=SIZES, detailed=True)
  print(f"matmul peak (float32, jnp.dot {peak['n']}^2, best of 5): {peak['flops'] / 1e9:.1f} "
        f"GFLOP/s wall, {peak['flops_cpu'] / 1e9:.1f} GFLOP/s from CPU time", flush=True)

  steps, compiles = [], []
  for shape in shapes:
    for dropout in dropouts:
      r = bench_step(shape, dropout, args.repeats, args.warmup)
      steps.append(r)
      print(f"  step {shape} dropout {dropout}: {r['step_s'] * 1e3:.0f} ms "
            f"(all: {', '.join(f'{t * 1e3:.0f}' for t in r['step_s_all'])}), "
            f"CPU {r['cpu_s']:.2f} s  [{common.machine_load()}]", flush=True)
  for shape in shapes:
    own = common.SHAPES[shape]()[0].num_encoder_layers
    for layers in sorted({own if x == "shape" else int(x) for x in compile_layers}):
      for scan in (False, True):
        r = bench_compile(shape, layers, scan, args.compile_repeats)
        compiles.append(r)
        print(f"  compile {shape} {layers}+{layers} scan={scan}: {r['total_s']:.2f} s "
              f"(all: {', '.join(f'{t:.2f}' for t in r['total_s_all'])})  "
              f"[{common.machine_load()}]", flush=True)
  peak2 = common.measure_matmul_peak(sizes=SIZES, detailed=True)
  load_end = common.machine_load()
  wall = time.perf_counter() - started
  # The peak is what the machine can do: the better of the two measurements.
  peak_flops = max(peak["flops"], peak2["flops"])
  peak_cpu = max(peak["flops_cpu"], peak2["flops_cpu"])
  for r in steps:
    r["mfu"] = r["gflops"] * 1e9 / peak_flops
    r["mfu_cpu"] = r["gflops_cpu"] * 1e9 / peak_cpu

  print()
  ncpu = os.cpu_count()
  print(f"Matmul peak (float32 jnp.dot, best of 5 runs at n = {SIZES}, measured at the "
        f"start and the end, the better taken): {peak_flops / 1e9:.1f} GFLOP/s by wall time "
        f"(start {peak['flops'] / 1e9:.1f} at n={peak['n']}, end {peak2['flops'] / 1e9:.1f} "
        f"at n={peak2['n']}); {peak_cpu / 1e9:.1f} GFLOP/s by CPU time / {ncpu} (start "
        f"{peak['flops_cpu'] / 1e9:.1f}, end {peak2['flops_cpu'] / 1e9:.1f}). Machine: {load_start} at "
        f"the start, {load_end} at the end. Wall time {wall:.0f} s.")
  print(f"MFU = model FLOPs / median step wall time / wall peak. MFU(CPU) = model FLOPs / "
        f"(CPU s / {ncpu}) / CPU-time peak: the load-robust estimate for an idle machine.")
  print()
  print("| shape | params | dropout | TFLOP/step | step median (min) | target tok/s "
        "| GFLOP/s | MFU | CPU s/step | MFU(CPU) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in steps:
    print(f"| {r['shape']} | {r['params'] / 1e6:.1f} M | {r['dropout']} | "
          f"{r['tflop_per_step']:.3f} | {r['step_s'] * 1e3:.0f} ({r['step_s_min'] * 1e3:.0f}) ms | "
          f"{r['tokens_per_s']:,.0f} | {r['gflops']:.1f} | {r['mfu']:.1%} | "
          f"{r['cpu_s']:.2f} | {r['mfu_cpu']:.1%} |")
  if compiles:
    print()
    print("| shape | layers/side | scan_layers | lower+compile (median) | lower | XLA compile "
          "| CPU s |")
    print("|---|---|---|---|---|---|---|")
    for r in compiles:
      print(f"| {r['shape']} | {r['layers']} | {r['scan_layers']} | {r['total_s']:.2f} s | "
            f"{r['lower_s']:.2f} s | {r['compile_s']:.2f} s | {r['cpu_s']:.1f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "platform": jax.devices()[0].platform,
                 "matmul_peak": peak, "matmul_peak_end": peak2, "load_start": load_start,
                 "load_end": load_end, "wall_s": wall,
                 "steps": steps, "compiles": compiles}, f, indent=1)


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py / decode.py do, before any computation
  main()
