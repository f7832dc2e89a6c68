"""The input pipeline against what an accelerator eats: training batches per
second, examples and target tokens per second, and per CPU core, from the text
(tokenized every epoch) and from prepared shards (data/prepared.py), packed;
optionally with grain worker processes (train.py's `config.data.workers`). Then what the paper's base model
(configs/wmt14_base.py: 96 rows x 256 tokens a step) needs on one H100 at 50%
MFU (flops.py's FLOP model, the rated bfloat16 peak flops.RATED_PEAKS) and the
ratio.

    python benchmarks/bench_input_pipeline.py                      # synthetic corpus
    python benchmarks/bench_input_pipeline.py --corpus=../shared/corpora/gettext-en-fr/train.tsv
    python benchmarks/bench_input_pipeline.py --workers=0,1,2,3 --seconds=15
    python benchmarks/bench_input_pipeline.py --memory=200000,1000000   # peak RSS per path

The synthetic corpus (made at run time in a temporary directory, never kept)
has WMT-like lengths: words drawn from a Zipf law over 50,000 made-up words,
sentences of lognormal length (mean ~23 words), targets ~1.1x their source.

Cores: the process's CPU time (its threads and its grain worker processes)
over the wall time of the measurement; "per core" divides by that.
--memory: for each number of pairs, the peak resident memory (VmHWM) of a
fresh process that (a) reads the corpus as text, the raw path's first step,
(b) prepares it (streaming), (c) trains 200 batches from the shards. The
peak counts the pages of the memory-mapped shards that were read (file-backed,
clean: the OS drops them under pressure, they are not the process's heap), so
(c) also says how much of its memory at the end was anonymous and how much was
mapped files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from transformer.data import pipeline as data  # noqa: E402
from transformer.data import prepared  # noqa: E402
from transformer.data import sources as data_sources  # noqa: E402
from transformer.data import tokenizer as tokenizer_lib  # noqa: E402

BATCH, LENGTH = 96, 256  # configs/wmt14_base.py: rows x tokens per step (one accelerator)
MFU, DEVICE = 0.5, "h100"


# ----------------------------------------------------------------------------
# What the accelerator needs
# ----------------------------------------------------------------------------


def needed() -> dict:
  """Steps/s and target token slots/s of transformer-base (wmt14_base, vocabulary
  37,000) on one H100 at 50% MFU."""
  from configs import wmt14_base
  from transformer.training import flops, run_setup
  config = wmt14_base.get_config()
  model = run_setup.model_config_from(config, 37_000)
  peak = dict(flops.RATED_PEAKS)[DEVICE]
  step_flops = flops.training_flops_per_step(model, BATCH, LENGTH, LENGTH)
  steps = MFU * peak / step_flops
  return {"step_tflop": step_flops / 1e12, "peak_tflops": peak / 1e12, "steps_per_s": steps,
          "target_slots_per_s": steps * BATCH * LENGTH}


# ----------------------------------------------------------------------------
# A synthetic corpus
# ----------------------------------------------------------------------------


def synthetic_pairs(n: int, seed: int = 0, words: int = 50_000, chunk: int = 10_000):
  """n (source, target) pairs, generated a chunk at a time (never all in memory)."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  lens = rng.integers(2, 11, size=words)
  vocab_src = ["".join(rng.choice(letters, k)) for k in lens]
  vocab_tgt = ["".join(rng.choice(letters, k)) for k in rng.permutation(lens)]
  probs = 1.0 / np.arange(1, words + 1) ** 1.05
  probs /= probs.sum()
  done = 0
  while done < n:
    m = min(chunk, n - done)
    src_len = np.clip(rng.lognormal(3.0, 0.55, m), 1, 150).astype(int)
    tgt_len = np.clip((src_len * rng.normal(1.1, 0.12, m)).round(), 1, 170).astype(int)
    ids = rng.choice(words, size=int(src_len.sum() + tgt_len.sum()), p=probs)
    pos = 0
    for a, b in zip(src_len, tgt_len):
      src = " ".join(vocab_src[i] for i in ids[pos:pos + a])
      tgt = " ".join(vocab_tgt[i] for i in ids[pos + a:pos + a + b])
      pos += a + b
      yield src, tgt
    done += m


def write_tsv(path: str, n: int, seed: int = 0) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for src, tgt in synthetic_pairs(n, seed):
      f.write(f"{src}\t{tgt}\n")


# ----------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------


def _cpu_seconds(process: psutil.Process) -> float:
  total = sum(process.cpu_times()[:2])
  for child in process.children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.NoSuchProcess:
      pass
  return total


def measure(source, tokenizer, *, workers: int, seconds: float, warmup: int = 20) -> dict:
  """Throughput of the packed training pipeline of `source` (pairs or a PreparedCorpus)."""
  # train.py's own iterator (config.data.workers = `workers`)
  it = data.train_iterator(source, tokenizer, batch_size=BATCH, max_length=LENGTH, seed=0,
                           pack=True, workers=workers)
  for _ in range(warmup):
    next(it)
  me = psutil.Process()
  cpu0, t0 = _cpu_seconds(me), time.perf_counter()
  batches = examples = tokens = 0
  while time.perf_counter() - t0 < seconds:
    batch = next(it)
    batches += 1
    segments = batch["targets_segment_ids"]
    tokens += int((segments > 0).sum())
    examples += int(segments.max(axis=1).sum())
  wall = time.perf_counter() - t0
  cores = (_cpu_seconds(me) - cpu0) / wall
  it.close()
  return {"batches_per_s": batches / wall, "examples_per_s": examples / wall,
          "target_tokens_per_s": tokens / wall, "fill": tokens / (batches * BATCH * LENGTH),
          "cores": cores}


# ----------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------


_MEMORY_CHILD = r"""
import json, sys
sys.path.insert(0, {repo!r})
from transformer.data import pipeline as data, prepared, sources, tokenizer as tl
def status_kb(field):  # VmHWM: this process's peak RSS (ru_maxrss keeps the forking parent's)
  return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))
hwm_kb = lambda: status_kb("VmHWM")
what, tsv, vocab, out = {what!r}, {tsv!r}, {vocab!r}, {out!r}
tok = tl.load_tokenizer(vocab)
base = hwm_kb()
if what == "text":
  pairs = sources.read_parallel_tsv(tsv)
elif what == "prepare":
  prepared.prepare(sources.stream_split(dict(source="tsv", train_path=tsv), "train"), tok, out)
else:
  it = data.train_iterator(prepared.open_prepared(out, tok), tok, batch_size=96,
                           max_length=256, seed=0)
  for _ in range(200):
    next(it)
  it.close()
print(json.dumps(dict(base_kb=base, peak_kb=hwm_kb(), anon_kb=status_kb("RssAnon"),
                      file_kb=status_kb("RssFile"))))
"""


def memory_rows(sizes, vocab_path: str, tmp: str) -> list[dict]:
  rows = []
  for n in sizes:
    tsv = os.path.join(tmp, f"mem-{n}.tsv")
    write_tsv(tsv, n, seed=1)
    out = os.path.join(tmp, f"mem-{n}-prepared")
    row = {"pairs": n, "tsv_mb": os.path.getsize(tsv) / 2**20}
    for what in ("text", "prepare", "train"):
      code = _MEMORY_CHILD.format(repo=REPO, what=what, tsv=tsv, vocab=vocab_path, out=out)
      start = time.perf_counter()
      proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
      result = json.loads(proc.stdout.strip().splitlines()[-1])
      row[f"{what}_peak_mb"] = result["peak_kb"] / 1024
      row[f"{what}_growth_mb"] = (result["peak_kb"] - result["base_kb"]) / 1024
      row[f"{what}_s"] = time.perf_counter() - start
      row[f"{what}_anon_mb"] = result["anon_kb"] / 1024  # at the end: heap, not file pages
      row[f"{what}_file_mb"] = result["file_kb"] / 1024
    rows.append(row)
    os.remove(tsv)
    print(f"{n:>10,} pairs ({row['tsv_mb']:.0f} MB of text): peak RSS growth "
          f"{row['text_growth_mb']:.0f} MB reading it as text, {row['prepare_growth_mb']:.0f} MB "
          f"preparing it ({row['prepare_s']:.0f} s), {row['train_growth_mb']:.0f} MB training "
          f"200 batches from the shards (peaks {row['text_peak_mb']:.0f} / "
          f"{row['prepare_peak_mb']:.0f} / {row['train_peak_mb']:.0f} MB); at the end of "
          f"training, {row['train_anon_mb']:.0f} MB anonymous + {row['train_file_mb']:.0f} MB "
          "of mapped files (shards and libraries: page cache the OS may drop)", flush=True)
  return rows


# ----------------------------------------------------------------------------


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--corpus", default="", help="a source<TAB>target file; default: synthetic")
  parser.add_argument("--pairs", type=int, default=200_000, help="synthetic corpus size")
  parser.add_argument("--vocab_size", type=int, default=8000)
  parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
  parser.add_argument("--workers", default="0,2", help="grain worker processes to try")
  parser.add_argument("--memory", default="", help="pair counts for the memory table")
  parser.add_argument("--only_memory", action="store_true", help="skip the throughput table")
  args = parser.parse_args()

  need = needed()
  print(f"transformer-base (wmt14_base, {BATCH} x {LENGTH} a step, vocabulary 37,000): "
        f"{need['step_tflop']:.2f} TFLOP a step; one H100 ({need['peak_tflops']:.0f} TFLOP/s "
        f"bfloat16 rated) at {MFU:.0%} MFU runs {need['steps_per_s']:.1f} steps/s = "
        f"{need['target_slots_per_s'] / 1e6:.2f}M target token slots/s; the goal (1.5x) is "
        f"{1.5 * need['steps_per_s']:.1f} batches/s with <= 4 cores.", flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    tsv = args.corpus
    if not tsv:
      tsv = os.path.join(tmp, "train.tsv")
      start = time.perf_counter()
      write_tsv(tsv, args.pairs)
      print(f"Synthetic corpus: {args.pairs:,} pairs in {time.perf_counter() - start:.1f} s",
            flush=True)
    pairs = data_sources.read_parallel_tsv(tsv)
    start = time.perf_counter()
    tok = tokenizer_lib.train_tokenizer(
        data_sources.sample_sentences(pairs, 200_000), os.path.join(tmp, "vocab.model"),
        args.vocab_size, model_type="bpe", num_threads=tokenizer_lib.available_cores())
    print(f"Vocabulary ({tok.vocab_size} BPE pieces) in {time.perf_counter() - start:.1f} s",
          flush=True)
    stream = data_sources.stream_split({"source": "tsv", "train_path": tsv}, "train")
    manifest = prepared.prepare(stream, tok, os.path.join(tmp, "prepared"))
    corpus = prepared.open_prepared(os.path.join(tmp, "prepared"), tok, stream)
    print(f"Prepared {manifest['num_examples']:,} pairs in {manifest['seconds']:.1f} s "
          f"({manifest['num_examples'] / manifest['seconds']:,.0f} pairs/s); mean "
          f"{manifest['source_tokens'] / manifest['num_examples']:.1f} source / "
          f"{manifest['target_tokens'] / manifest['num_examples']:.1f} target tokens "
          "(EOS included)", flush=True)

    if args.only_memory:
      args.workers = ""
    print("\n| path | grain workers | batches/s | examples/s | target tokens/s | fill | "
          "cores used | target tokens/s per core | x one H100 at 50% MFU (batches/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, source in (("text", pairs), ("prepared", corpus)):
      for workers in [int(w) for w in args.workers.split(",") if w]:
        r = measure(source, tok, workers=workers, seconds=args.seconds)
        print(f"| {name} | {workers} | {r['batches_per_s']:.1f} | {r['examples_per_s']:,.0f} | "
              f"{r['target_tokens_per_s']:,.0f} | {r['fill']:.1%} | {r['cores']:.2f} | "
              f"{r['target_tokens_per_s'] / max(r['cores'], 1e-9):,.0f} | "
              f"{r['batches_per_s'] / need['steps_per_s']:.2f} |", flush=True)
    del pairs
    if args.memory:
      print()
      memory_rows([int(n) for n in args.memory.split(",")], tok.model_path, tmp)


if __name__ == "__main__":
  main()
