"""Decoding speed: sentences/s and generated tokens/s of greedy and beam search.

    python benchmarks/bench_decode.py                       # S and B, greedy and beam 4
    python benchmarks/bench_decode.py --early_exit_workdir=runs/demo

The project's fixed work: random weights (float32), 16 source sentences of 32
tokens, exactly 64 generated tokens each (min_len = max_len = 64 keeps EOS from
ending the search, so every run does the same work). The jitted function is
the one `decode.py` runs (`Translator._decode_fn`): encoder once, cross-
attention keys/values once per input, then the scan-based strategy.

With --early_exit_workdir (a trained demo workdir), it also times beam search
over the demo test set with and without early exit. With
--compare_prefix_parts=1,4 it instead compares decoders that read the whole
self-attention cache at every step (1) with ones that read only the written
prefix (4 static prefixes, the default), in turn in one process.
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

from benchmarks import common
from transformer.model import kv_cache
from transformer.model import transformer as model_lib
from transformer.decoding.batch_plan import DecoderShape
from transformer.decoding.translator import Translator

NUM_SENTENCES, SRC_LEN, GEN_LEN = 16, 32, 64


def compile_decoder(shape: str, method: str, beam_size: int, compiler_options=None,
                    sentences: int = NUM_SENTENCES, **overrides):
  """The benchmark's decoder for `shape` (TransformerConfig fields replaced by
  `overrides`, e.g. dtype="bfloat16"), compiled (with XLA `compiler_options`
  if given): -> (compiled, args, seconds to compile). `compiled(*args)`
  decodes the fixed batch."""
  config, *_ = common.SHAPES[shape](**overrides)
  config = config.replace(max_len=128)
  params = model_lib.init_params(config, jax.random.key(0))
  translator = Translator(config, params, tokenizer=None)
  fn = translator.decoders.program(
      DecoderShape(method, sentences, SRC_LEN, GEN_LEN, beam_size, 0))
  inputs = np.asarray(jax.random.randint(jax.random.key(1), (sentences, SRC_LEN), 3,
                                         config.vocab_size))
  rows = np.zeros(sentences, np.int32)  # (each row's line and copy: sampling's keys)
  limits = np.full(sentences, GEN_LEN, np.int32)  # (each row's most tokens: all of them)
  args = (translator.params, translator.decoders.logits_kernel, inputs, jax.random.key(2), rows, rows,
          limits, 0.6, 1.0, 1.0, GEN_LEN, ())
  start = time.perf_counter()
  compiled = fn.lower(*args).compile(compiler_options=compiler_options)
  return compiled, args, time.perf_counter() - start


def bench(shape: str, method: str, beam_size: int, repeats: int,
          sentences: int = NUM_SENTENCES) -> dict:
  """Times the batch and its matmuls alone (`matmul_floor`) in turn, `repeats`
  rounds after one warm-up: both see the same neighbours, so their ratio is
  steadier than either time on a shared machine (the figures are medians)."""
  compiled, args, compile_s = compile_decoder(shape, method, beam_size, sentences=sentences)
  seqs, *_ = compiled(*args)  # (sequences, scores, done)
  assert int(np.sum(np.asarray(seqs)[:, 0] != 0)) == sentences * GEN_LEN, "EOS ended early"
  floor, floor_args = matmul_floor(shape, sentences * beam_size)
  rounds = []
  for i in range(repeats + 1):
    batch_s = common.time_fn(lambda: compiled(*args), repeats=1, warmup=0)[0]
    floor_s = common.time_fn(floor, *floor_args, repeats=1, warmup=0)[0]
    if i:
      rounds.append((batch_s, floor_s))
  seconds = statistics.median(r[0] for r in rounds)
  return {"shape": shape, "method": f"beam {beam_size}" if method == "beam" else method,
          "sentences": sentences,
          "seconds": seconds, "sentences_per_s": sentences / seconds,
          "tokens_per_s": sentences * GEN_LEN / seconds, "compile_s": compile_s,
          "floor_s": statistics.median(r[1] for r in rounds),
          "over_floor": statistics.median(r[0] / r[1] for r in rounds)}


def matmul_floor(shape: str, rows: int):
  """The decoder's weight matrices alone for the same work, compiled: -> (run, args).
  `rows` (sentences x beams) times every per-step weight matrix (self-attention
  Q, K, V, O; cross-attention Q, O; feed-forward W_1, W_2; the vocabulary
  projection) for GEN_LEN steps, chained in a `lax.scan` as in decoding. No
  attention, softmax, LayerNorm or search: a lower bound for this machine and
  XLA's matmuls, whatever the decoder does around them (time `run(*args)`)."""
  config, *_ = common.SHAPES[shape]()
  d, f, layers = config.d_model, config.d_ff, config.num_decoder_layers
  keys = iter(jax.random.split(jax.random.key(0), 4))
  weights = {"attention": 0.02 * jax.random.normal(next(keys), (layers, 6, d, d)),
             "inner": 0.02 * jax.random.normal(next(keys), (layers, d, f)),
             "outer": 0.02 * jax.random.normal(next(keys), (layers, f, d)),
             # [d_model, vocab], as the decoder reads it (Decoder.logits_kernel)
             "vocab": 0.02 * jax.random.normal(next(keys), (d, config.vocab_size))}

  def step(x, w):
    for layer in range(layers):
      for j in range(6):
        x = x + x @ w["attention"][layer, j]
      x = x + jax.nn.relu(x @ w["inner"][layer]) @ w["outer"][layer]
    logits = x @ w["vocab"]
    return x + 1e-3 * logits[:, :d]

  @jax.jit
  def run(x, w):
    return jax.lax.scan(lambda x, _: (step(x, w), None), x, None, length=GEN_LEN)[0]

  args = (jax.numpy.ones((rows, d)), weights)
  jax.block_until_ready(run(*args))  # compile
  return run, args


def early_exit_saving(workdir: str, beam_size: int = 4) -> str:
  from transformer.data import demo_task
  from transformer.decoding.loader import load_translator
  translator = load_translator(workdir)
  sources = [s for s, _ in demo_task.demo_splits()["test"]]
  times = {}
  outputs = {}
  for early_exit in (True, False):
    translator.translate(sources[:64], method="beam", beam_size=beam_size,
                         early_exit=early_exit)  # compile
    start = time.perf_counter()
    outputs[early_exit] = translator.translate(sources, method="beam", beam_size=beam_size,
                                               early_exit=early_exit)
    times[early_exit] = time.perf_counter() - start
  assert outputs[True] == outputs[False]
  return (f"early exit on {len(sources)} demo test sentences (beam {beam_size}, max length "
          f"= input bucket + 50): {times[False]:.2f} s without, {times[True]:.2f} s with "
          f"({times[False] / times[True]:.1f}x faster, identical output)")


def compare_cache_prefix_parts(shapes, parts_list, repeats: int) -> None:
  """A/B of `kv_cache.CACHE_PREFIX_PARTS` (how many static cache prefixes a
  decoding step chooses from; 1 = always the whole cache): every variant is
  compiled, then they run in turn for `repeats` rounds, so each sees the same
  neighbours. Prints median and best seconds per batch and compile times."""
  print("\n| shape | method | prefixes | median (s) | best (s) | compile (s) | same output |")
  print("|---|---|---|---|---|---|---|")
  default = kv_cache.CACHE_PREFIX_PARTS
  for shape in shapes:
    for method, beams in (("greedy", 1), ("beam", 4)):
      variants = {}
      for parts in parts_list:
        kv_cache.CACHE_PREFIX_PARTS = parts  # read when the decoder is traced
        try:
          variants[parts] = compile_decoder(shape, method, beams)
        finally:
          kv_cache.CACHE_PREFIX_PARTS = default
      outputs = {p: np.asarray(c(*a)[0]) for p, (c, a, _) in variants.items()}
      times = {p: [] for p in variants}
      for _ in range(repeats):
        for p, (compiled, args, _) in variants.items():
          times[p].append(common.time_fn(lambda: compiled(*args), repeats=1, warmup=0)[0])
      first = outputs[parts_list[0]]
      for p, (_, _, compile_s) in variants.items():
        print(f"| {shape} | {method if beams == 1 else f'beam {beams}'} | {p} | "
              f"{statistics.median(times[p]):.3f} | {min(times[p]):.3f} | {compile_s:.1f} | "
              f"{np.array_equal(outputs[p], first)} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="S,B")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--early_exit_workdir", default="")
  parser.add_argument("--sentences", default=str(NUM_SENTENCES),
                      help="batch sizes (sentences per batch), e.g. 8,32,128: how a step "
                           "scales with the batch")
  parser.add_argument("--compare_prefix_parts", default="",
                      help="e.g. 1,4: A/B of kv_cache.CACHE_PREFIX_PARTS instead of the table")
  parser.add_argument("--cpu_devices", type=int, default=0,
                      help="split the CPU into this many devices (decode.py --cpu_devices); "
                           "each batch is sharded over them. 0: JAX's default (one)")
  args = parser.parse_args()
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.compare_prefix_parts:
    compare_cache_prefix_parts(args.shapes.split(","),
                               [int(p) for p in args.compare_prefix_parts.split(",")],
                               args.repeats)
    return
  rows = []
  for shape in args.shapes.split(","):
    for method, beams in (("greedy", 1), ("beam", 4)):
      for sentences in (int(n) for n in args.sentences.split(",")):
        rows.append(bench(shape, method, beams, args.repeats, sentences))
  print(f"\n{common.machine_load()}; jax {jax.__version__}, {len(jax.devices())} "
        f"{jax.devices()[0].platform} device(s); "
        f"sentences of {SRC_LEN} source tokens -> {GEN_LEN} tokens")
  print("\n| shape | method | batch | sentences/s | generated tokens/s | batch time (s) | "
        "matmuls alone (s) | batch / matmuls | compile (s) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['shape']} | {r['method']} | {r['sentences']} | {r['sentences_per_s']:.1f} | "
          f"{r['tokens_per_s']:,.0f} | {r['seconds']:.3f} | {r['floor_s']:.3f} | "
          f"{r['over_floor']:.2f} | {r['compile_s']:.1f} |")
  print("\nmatmuls alone: the decoder's per-step weight matrices times the same rows "
        "for the same steps, nothing else (see matmul_floor): what the machine's "
        "matmuls need for this work.")
  if args.early_exit_workdir:
    print("\n" + early_exit_saving(args.early_exit_workdir))


if __name__ == "__main__":
  # (glibc's defaults, as the tables against the Flax example were measured;
  # decode.py keeps freed memory per thread, `host_memory`)
  main()
