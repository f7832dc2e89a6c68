"""Where the time goes: per-op times of one compiled training step or decode batch.

    python benchmarks/profile_ops.py train --shape=S
    python benchmarks/profile_ops.py decode --shape=S --method=beam --top=30
    python benchmarks/profile_ops.py decode --shape=S --method=greedy --sentences=128
    python benchmarks/profile_ops.py train --shape=S --exclude=matmul   # the rest

Runs the computation once under `jax.profiler.trace` (a Perfetto trace, read
back here) and prints the op time of each XLA op, labelled with its shape and
the model code it comes from (the `op_name` of the compiled HLO), then totals
per kind of op. Op times can add up to more than the wall time: ops run on both
cores at once. The closing timeline says how much of the wall time had a
matmul running, only other ops, or nothing (dispatch gaps), and which kinds
of op cost time no matmul hides.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks import common


def train_computation(shape: str):
  """-> (compiled, run()) for one training step of `shape` (dropout 0.1)."""
  from benchmarks import bench_train
  compiled, state, data, _ = bench_train.compile_train_step(shape, 0.1)
  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], data)
    return metrics
  return compiled, run


def decode_computation(shape: str, method: str, sentences: int | None = None):
  """-> (compiled, run()) for bench_decode.py's batch of `shape` (of
  `sentences` sentences; None: bench_decode's 16)."""
  from benchmarks import bench_decode
  compiled, args, _ = bench_decode.compile_decoder(
      shape, method, 4 if method == "beam" else 1,
      sentences=sentences or bench_decode.NUM_SENTENCES)
  return compiled, lambda: compiled(*args)


def op_labels(hlo_text: str) -> dict[str, tuple[str, str]]:
  """HLO instruction name -> (result shape, source op_name)."""
  labels = {}
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
    if match:
      op_name = re.search(r'op_name="([^"]*)"', line)
      labels[match.group(1)] = (match.group(2), op_name.group(1) if op_name else "")
  return labels


def kind_of(name: str, op_name: str) -> str:
  """A coarse label for totals: matmuls, copies/transposes, or the jax op's name."""
  if "dot_general" in op_name or name.startswith(("dot", "convolution")):
    return "matmul"
  if name.startswith(("copy", "transpose")) or "transpose" in name:
    return "copy/transpose"
  return op_name.split("/")[-1] or name.split(".")[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("what", choices=("train", "decode"))
  parser.add_argument("--shape", default="S", choices=sorted(common.SHAPES))
  parser.add_argument("--method", default="beam", choices=("greedy", "beam"))
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--sentences", type=int, default=None,
                      help="decode: sentences per batch (default: bench_decode.py's 16)")
  parser.add_argument("--exclude", default="",
                      help="comma-separated kinds left out of the per-op list, e.g. matmul")
  args = parser.parse_args()
  if args.what == "train":
    compiled, run = train_computation(args.shape)
  else:
    compiled, run = decode_computation(args.shape, args.method, args.sentences)
  labels = op_labels(compiled.as_text())
  for _ in range(2):
    jax.block_until_ready(run())
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      start = time.perf_counter()
      jax.block_until_ready(run())
      wall = time.perf_counter() - start
    path = glob.glob(os.path.join(logdir, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  op_time, calls = collections.Counter(), collections.Counter()
  intervals = []  # (start ms, end ms, op name)
  for event in events:
    if event.get("ph") == "X" and event["name"] in labels:
      op_time[event["name"]] += event.get("dur", 0) / 1e3
      calls[event["name"]] += 1
      start = event["ts"] / 1e3
      intervals.append((start, start + event.get("dur", 0) / 1e3, event["name"]))
  total = sum(op_time.values())
  print(f"{args.what} {args.shape}{' ' + args.method if args.what == 'decode' else ''}: "
        f"wall {wall * 1e3:.0f} ms (profiled), op time {total:.0f} ms; {common.machine_load()}")
  print(f"\n{'ms':>8} {'%':>5} {'calls':>5}  op, shape, source")
  excluded = set(filter(None, args.exclude.split(",")))
  listed = [(name, ms) for name, ms in op_time.most_common()
            if kind_of(name, labels[name][1]) not in excluded]
  for name, ms in listed[:args.top]:
    shape, op_name = labels[name]
    print(f"{ms:8.1f} {ms / total:5.1%} {calls[name]:5d}  {name} {shape[:40]} {op_name[-90:]}")
  kinds = collections.Counter()
  for name, ms in op_time.items():
    kinds[kind_of(name, labels[name][1])] += ms
  print("\nby kind:")
  for kind, ms in kinds.most_common(12):
    print(f"{ms:8.1f} {ms / total:5.1%}  {kind}")
  print_timeline(intervals, labels)


def _merged(spans):
  """Sorted, non-overlapping union of (start, end) spans."""
  merged = []
  for start, end in sorted(spans):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def print_timeline(intervals, labels):
  """The wall-clock view: ops run on both cores at once, so op times overstate
  what each kind costs. Splits the step's span into time with a matmul running,
  time with only other ops running, and idle gaps between ops (dispatch), and
  charges each non-matmul kind only for its time not under a matmul."""
  is_matmul = lambda name: kind_of(name, labels[name][1]) == "matmul"
  span = max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals)
  busy = sum(e - s for s, e in _merged([(s, e) for s, e, _ in intervals]))
  matmul = _merged([(s, e) for s, e, n in intervals if is_matmul(n)])
  matmul_ms = sum(e - s for s, e in matmul)
  print(f"\ntimeline: span {span:.0f} ms = a matmul running {matmul_ms:.0f} "
        f"+ only other ops {busy - matmul_ms:.0f} + idle {span - busy:.0f}")
  exposed = collections.Counter()
  for start, end, name in intervals:
    if is_matmul(name):
      continue
    under = sum(max(0.0, min(end, e) - max(start, s)) for s, e in matmul
                if s < end and e > start)
    exposed[kind_of(name, labels[name][1])] += max(0.0, end - start - under)
  print("not under a matmul, by kind (ms):",
        ", ".join(f"{kind} {ms:.1f}" for kind, ms in exposed.most_common(8)))


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py / decode.py do, before any computation
  main()
