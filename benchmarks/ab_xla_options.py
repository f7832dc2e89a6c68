"""A/B of XLA CPU compiler options on a decode batch or a train step, in one process.

    python benchmarks/ab_xla_options.py decode --shape=S --method=beam
    python benchmarks/ab_xla_options.py train --shape=S --rounds=8
    python benchmarks/ab_xla_options.py decode --shape=B --method=greedy --variants=default,eigen_dots

Compiles the benchmark's computation (bench_decode.py's batch or
bench_train.py's step) once per variant of `VARIANTS`, then runs the variants
in turn for `--rounds` rounds, so that each sees the same neighbours on a
shared machine, and prints the median and best seconds and whether the result
equals the default's. The variants choose which library XLA hands the matrix
multiplications (and elementwise ops / reductions) to; every option is an XLA
DebugOptions field, also settable through XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks import bench_decode, bench_train, common

_DOT = "LIBRARY_FUSION_TYPE_DOT"
VARIANTS = {
    "default": {},                                            # YNNPACK dots, reductions, ...
    "eigen_dots": {"xla_cpu_experimental_ynn_fusion_type": ""},  # no YNNPACK at all
    "xnnpack_dots": {"xla_cpu_experimental_ynn_fusion_type": "",
                     "xla_cpu_experimental_xnn_fusion_type": _DOT},
    "onednn_dots": {"xla_cpu_experimental_ynn_fusion_type": "",
                    "xla_cpu_experimental_onednn_fusion_type": _DOT},
    "ynnpack_dots_only": {"xla_cpu_experimental_ynn_fusion_type": _DOT},
    "vector_width_512": {"xla_cpu_prefer_vector_width": 512},
}


def compile_variant(what: str, shape: str, method: str, options: dict):
  """-> (prepare(), run() -> a result to compare, compile seconds); prepare()
  runs untimed before every run()."""
  if what == "decode":
    compiled, args, seconds = bench_decode.compile_decoder(
        shape, method, 4 if method == "beam" else 1, compiler_options=options)
    return (lambda: None), (lambda: compiled(*args)[0]), seconds
  compiled, state, data, seconds = bench_train.compile_train_step(
      shape, 0.1, compiler_options=options)
  # The step donates its state: every run starts from a fresh copy of the
  # initial one, so every variant computes the same first step.
  holder = {}

  def prepare():
    holder["state"] = jax.tree_util.tree_map(lambda x: x.copy(), state)
    return holder["state"]

  def run():
    _, metrics = compiled(holder.pop("state"), data)
    return metrics["loss"]
  return prepare, run, seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("what", choices=("train", "decode"))
  parser.add_argument("--shape", default="S", choices=sorted(common.SHAPES))
  parser.add_argument("--method", default="beam", choices=("greedy", "beam"))
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated, from {', '.join(VARIANTS)}")
  args = parser.parse_args()
  names = args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
  variants = {}
  for name in names:
    try:
      variants[name] = compile_variant(args.what, args.shape, args.method, VARIANTS[name])
    except Exception as error:  # an option this jaxlib does not know
      print(f"{name}: not compiled ({str(error).splitlines()[0][:120]})")
  times = {name: [] for name in variants}
  results = {}
  for _ in range(args.rounds + 1):  # the first round warms up
    for name, (prepare, run, _) in variants.items():
      jax.block_until_ready(prepare())
      start = time.perf_counter()
      results[name] = np.asarray(jax.block_until_ready(run()))
      times[name].append(time.perf_counter() - start)
  label = f"{args.what} {args.shape}" + (f" {args.method}" if args.what == "decode" else "")
  print(f"\n{label}; {common.machine_load()}; medians of {args.rounds} rounds\n")
  print("| variant | median (s) | best (s) | compile (s) | same result as default |")
  print("|---|---|---|---|---|")
  reference = results.get("default")
  for name, (_, _, seconds) in variants.items():
    same = "" if reference is None else str(np.array_equal(results[name], reference))
    print(f"| {name} | {statistics.median(times[name][1:]):.3f} | {min(times[name][1:]):.3f} "
          f"| {seconds:.1f} | {same} |")


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py / decode.py do, before any computation
  main()
