"""Does early exit pay? Beam search with and without it, on a toy decoder.

The toy `tokens_to_logits` costs about what a small decoder step costs: an
embedding, one attention read over a `[batch * beams, max_len, d_model]`
key/value cache that beam search reorders every step, and a projection to the
vocabulary. Two regimes:

  early: EOS becomes near certain from step `--finish_at` on, so every beam of
         every input finishes early and the rest of the budget is waste;
  never: EOS is impossible, so all `--max_len` steps are needed and the
         numbers show what the chunked while-loop costs over a plain scan.

Greedy search (which always exits early) is timed in both regimes too, and
`--chunks` sweeps options.EARLY_EXIT_CHUNK.

  python benchmarks/bench_early_exit.py
  python benchmarks/bench_early_exit.py --batch 64 --vocab 32000 --max_len 256
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from transformer.decoding import options
from transformer.decoding import search as decoding
from transformer.decoding import beam_search as beam_lib


def make_toy_decoder(*, vocab, d_model, max_len, eos_id, finish_at, seed=0,
                     calls=None):
  """-> (tokens_to_logits, init_cache(batch)); `calls` collects the steps."""
  k_emb, k_w = jax.random.split(jax.random.key(seed))
  embedding = jax.random.normal(k_emb, (vocab, d_model)) / d_model ** 0.5
  w = jax.random.normal(k_w, (d_model, d_model)) / d_model ** 0.5

  def tokens_to_logits(token_ids, cache):
    index = cache["index"]
    if calls is not None:
      jax.debug.callback(lambda i: calls.append(int(i)), index)
    h = jnp.tanh(embedding[token_ids] + cache["state"] @ w)  # [flat, d]
    kv = cache["kv"].at[:, index].set(h)  # [flat, max_len, d]
    attn = jnp.einsum("bd,btd->bt", h, kv) / d_model ** 0.5
    attn = jnp.where(jnp.arange(max_len) <= index, attn, -jnp.inf)
    h = h + jnp.einsum("bt,btd->bd", jax.nn.softmax(attn, axis=-1), kv)
    logits = h @ embedding.T  # [flat, vocab]
    # finish_at < 0: EOS never; otherwise near certain from step finish_at on.
    eos = jnp.where((finish_at >= 0) & (index >= finish_at), 30.0, -jnp.inf)
    logits = logits.at[:, eos_id].set(eos)
    return logits, dict(index=index + 1, kv=kv, state=h)

  def init_cache(batch):
    return dict(index=jnp.int32(0),
                kv=jnp.zeros((batch, max_len, d_model)),
                state=jnp.zeros((batch, d_model)))

  return tokens_to_logits, init_cache


def time_all(fns, *, repeats):
  """Median seconds of each `fn()`; rounds interleave them so that drift in
  the machine's load hits all alike."""
  for fn in fns.values():
    jax.block_until_ready(fn())  # Compile and warm up.
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--max_len", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=8000)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--finish_at", type=int, default=10)
  parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 16])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, "
        f"beams {args.beam_size}, max_len {args.max_len}, vocab {args.vocab}, "
        f"d_model {args.d_model}")

  eos_id, bos_id = 2, 1
  toy = functools.partial(make_toy_decoder, vocab=args.vocab,
                          d_model=args.d_model, max_len=args.max_len,
                          eos_id=eos_id)
  cache = toy(finish_at=-1)[1](args.batch)
  common = dict(batch_size=args.batch, max_len=args.max_len, bos_id=bos_id,
                eos_id=eos_id)

  # finish_at is traced, so each function compiles once per chunk size.
  def beam(early_exit, calls=None):
    def fn(cache, finish_at):
      model = toy(finish_at=finish_at, calls=calls)[0]
      return beam_lib.beam_search(model, cache, beam_size=args.beam_size,
                                  early_exit=early_exit, **common)
    return jax.jit(fn)

  def greedy():
    def fn(cache, finish_at):
      model = toy(finish_at=finish_at)[0]
      return decoding.greedy_search(model, cache, **common)
    return jax.jit(fn)

  regimes = {"early": args.finish_at, "never": -1}
  fns = {("beam", "scan", r): functools.partial(beam(early_exit=False), cache, f)
         for r, f in regimes.items()}
  steps = {}
  for chunk in args.chunks:
    options.EARLY_EXIT_CHUNK = chunk  # Read when tracing.
    b, g = beam(early_exit=True), greedy()
    for r, f in regimes.items():
      fns[("beam", chunk, r)] = functools.partial(b, cache, f)
      fns[("greedy", chunk, r)] = functools.partial(g, cache, f)
    calls = []  # How many steps early exit ran (untimed, with a callback).
    jax.block_until_ready(beam(True, calls)(cache, args.finish_at))
    jax.effects_barrier()
    steps[chunk] = len(calls)
  times = time_all(fns, repeats=args.repeats)

  print(f"\nbeam search; speed-up = time of lax.scan over all {args.max_len} "
        "steps (early_exit=False) / time")
  for r in regimes:
    print(f"  {r:5s}  scan        {times[('beam', 'scan', r)] * 1e3:9.2f} ms")
    for chunk in args.chunks:
      t = times[("beam", chunk, r)]
      ran = steps[chunk] if r == "early" else args.max_len
      print(f"  {r:5s}  chunk {chunk:4d}  {t * 1e3:9.2f} ms   "
            f"speed-up x{times[('beam', 'scan', r)] / t:5.2f}   "
            f"({ran} of {args.max_len} steps run)")
  print("\ngreedy search (always exits early; 'never' runs every step)")
  for r in regimes:
    for chunk in args.chunks:
      print(f"  {r:5s}  chunk {chunk:4d}  {times[('greedy', chunk, r)] * 1e3:9.2f} ms")


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # train.py's one heap, before any computation
  main()
