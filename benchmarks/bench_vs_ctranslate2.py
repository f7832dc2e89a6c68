"""decode.py and CTranslate2 side by side on the same weights and cores.

    python benchmarks/bench_vs_ctranslate2.py --workdir=runs/mine \
        --input=../shared/corpora/gettext-en-fr/test.tsv --lines=1000

The workdir's model is exported to CTranslate2 (float32 and int8, through
transformer.interop.ctranslate2_export); the same input lines (the source
column of a TSV, or a text file) are translated by

  * this project's `Translator` in this process: decoding throughput, compile
    time apart (a second pass over the input, so every shape is compiled);
  * `decode.py` as a command (the whole command: start, load, compile or
    compilation cache, decode, write), run twice, the second timed (the
    compilation cache warm, as a user's second command finds it);
  * CTranslate2's `Translator` (`intra_threads` = the cores), as a command of
    its own (no JAX threads beside it): its `translate_batch` time and the
    whole command's, the second of two runs;

greedy and beam 4, at each `--batch_sizes`. Printed: sentences/s of the
decoding, the whole command's seconds, BLEU against the references (a TSV's
target column), the ratio to CTranslate2 float32, and the decoding's model
FLOPs utilisation (float32 rows): the FLOPs any engine must compute for
those translations (`flops.decoding_flops`: the sources encoded once, a
cached decoder step per output token and beam hypothesis; padding and
finished rows count 0) per second, over this machine's float32 matmul peak
(measured before each table block, the best so far: a busy spell only lowers
it). CTranslate2's length
penalty differs from decode.py's GNMT penalty (its beam outputs can differ
where the penalty decides); greedy outputs should be the same in float32.

`--weights_dtypes=float32,bfloat16` adds our rows with the projections'
weights in bfloat16 (`decode.py --weights_dtype=bfloat16`: the reduced
precision to set beside CTranslate2's int8: CTranslate2 4.8.5 offers int8,
int8_float32 and float32 on a CPU, no bfloat16).

`--rounds=N`: each engine decodes the input N times, the engines taking
turns, and the tables give the medians (one engine's run can be 12% slower
than its last for the machine's sake alone; alternating spreads such spells
over both).

`--fixed_steps=N` adds the step alone: every row of every batch decodes
exactly N steps in both engines (EOS forbidden before the last,
`fixed_step_options`), so that neither's stopping rule, batching or early
exit counts, only what a decoding step costs per row (microseconds per
row-step, the encoder included) at each batch size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def add_model_and_input_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags this benchmark shares with bench_batching.py: the model, the
  input lines, the batch sizes and the methods."""
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--input", required=True, help="a TSV (source<TAB>reference) or text")
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--batch_sizes", default="32,128")
  parser.add_argument("--methods", default="greedy,beam")


def read_input(path: Path, lines: int) -> tuple[list[str], list[str] | None]:
  rows = path.read_text(encoding="utf-8").splitlines()[:lines]
  if all("\t" in row for row in rows):
    sources, references = zip(*(row.split("\t", 1) for row in rows))
    return list(sources), list(references)
  return rows, None


def bleu(hypotheses, references) -> float:
  import sacrebleu
  return sacrebleu.corpus_bleu(hypotheses, [references]).score if references else float("nan")


CT2_COMMAND = """
import sys, time, ctranslate2, sentencepiece as spm
model, src, out, batch, beam, threads, spm_in, spm_out, max_len, min_len = sys.argv[1:11]
sp_in = spm.SentencePieceProcessor(model_file=spm_in)
sp_out = spm.SentencePieceProcessor(model_file=spm_out)
translator = ctranslate2.Translator(model, device="cpu", intra_threads=int(threads))
lines = open(src, encoding="utf-8").read().splitlines()
tokens = [sp_in.encode(line, out_type=str) for line in lines]
start = time.perf_counter()
results = translator.translate_batch(tokens, max_batch_size=int(batch), beam_size=int(beam),
                                     max_decoding_length=int(max_len),
                                     min_decoding_length=int(min_len))
seconds = time.perf_counter() - start
with open(out, "w", encoding="utf-8") as f:
  f.writelines(sp_out.decode(r.hypotheses[0]) + "\\n" for r in results)
print(min(len(r.hypotheses[0]) for r in results), max(len(r.hypotheses[0]) for r in results))
print(seconds)
"""


def spm_files(model_dir: Path) -> tuple[str, str]:
  if (model_dir / "vocab.model").exists():
    return str(model_dir / "vocab.model"), str(model_dir / "vocab.model")
  return str(model_dir / "source.spm"), str(model_dir / "target.spm")


def ct2_run(model_dir: Path, src_file: Path, out_file: Path, batch: int, beam: int,
            threads: int, fixed_steps: int = 0) -> tuple[float, float, list[str]]:
  """CTranslate2 as its own command (no JAX threads beside it): (seconds of
  translate_batch, seconds of the whole command, hypotheses). `fixed_steps`:
  if > 0, every hypothesis is decoded exactly that many steps (EOS allowed
  at the last only: its best hypotheses hold that many tokens, or one fewer
  where the last was the EOS, which CTranslate2 leaves out; checked)."""
  spm_in, spm_out = spm_files(model_dir)
  lengths = (fixed_steps, fixed_steps) if fixed_steps else (256, 0)
  start = time.perf_counter()
  run = subprocess.run([sys.executable, "-c", CT2_COMMAND, str(model_dir), str(src_file),
                        str(out_file), str(batch), str(beam), str(threads), spm_in, spm_out,
                        *map(str, lengths)],
                       cwd=REPO, check=True, capture_output=True, text=True)
  wall = time.perf_counter() - start
  *_, shortest, longest, seconds = run.stdout.split()
  if fixed_steps and not fixed_steps - 1 <= int(shortest) <= int(longest) <= fixed_steps:
    raise RuntimeError(f"CTranslate2 decoded {shortest}-{longest} tokens, not {fixed_steps}")
  return float(seconds), wall, out_file.read_text(encoding="utf-8").splitlines()


def fixed_step_options(steps: int) -> dict:
  """decode.py / Translator options under which every row decodes exactly
  `steps` steps: at most `steps` tokens, EOS forbidden before the last."""
  return {"max_len": steps, "min_len": steps - 1}


def fixed_step_table(translator, exported_float32: Path, src_file: Path, out: Path,
                     sources: list[str], args) -> None:
  """Prints microseconds per row-step, ours (default lanes) against
  CTranslate2 float32, every row decoding exactly `args.fixed_steps` steps."""
  steps = args.fixed_steps
  print(f"\nEvery row decodes exactly {steps} steps ({len(sources)} sentences; "
        "microseconds per row-step = seconds / (sentences x beams x steps), the encoder "
        "included):\n")
  print("| method | batch | CTranslate2 float32 (us) | decode.py / Translator (us) | "
        "CT2 / ours |")
  print("|---|---|---|---|---|")
  for method in args.methods.split(","):
    beam = 4 if method == "beam" else 1
    row_steps = len(sources) * beam * steps
    for batch in (int(b) for b in args.batch_sizes.split(",")):
      seconds = min(ct2_run(exported_float32, src_file, out / "ct2.out", batch, beam,
                            args.threads, fixed_steps=steps)[0] for _ in range(3))
      options = dict(method=method, beam_size=4, batch_size=batch, **fixed_step_options(steps))
      translator.translate(sources, **options)  # every shape compiled
      ours = []
      for _ in range(3):
        hypotheses = translator.translate_hypotheses(sources, **options)
        if {h[0].length for h in hypotheses} != {steps}:
          raise RuntimeError(f"decode.py decoded other than {steps} steps")
        stats = translator.last_stats
        ours.append(stats["seconds"] - stats["compile_seconds"])
      ct2_us, ours_us = seconds / row_steps * 1e6, min(ours) / row_steps * 1e6
      print(f"| {method} | {batch} | {ct2_us:.1f} | {ours_us:.1f} | {ct2_us / ours_us:.2f} |",
            flush=True)


def command_seconds(args: list[str]) -> float:
  start = time.perf_counter()
  subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
  return time.perf_counter() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_model_and_input_arguments(parser)
  parser.add_argument("--quantizations", default="float32,int8")
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  parser.add_argument("--commands", action="store_true",
                      help="also time the whole commands (decode.py and a CTranslate2 script)")
  parser.add_argument("--concurrent_batches", default="0",
                      help="ours: comma-separated values of decode.py --concurrent_batches "
                      "(0 = one per core on a CPU), a row each")
  parser.add_argument("--fixed_steps", type=int, default=0,
                      help="also time the step alone: every row decodes exactly this many "
                      "steps in both engines (0: off)")
  parser.add_argument("--beam_stops", default="exact",
                      help="ours, beam search: comma-separated values of decode.py --beam_stop, "
                      "a row each")
  parser.add_argument("--weights_dtypes", default="float32",
                      help="ours: comma-separated weights dtypes (float32 = the model's own; "
                      "bfloat16 = decode.py --weights_dtype=bfloat16), a row each")
  parser.add_argument("--rounds", type=int, default=1,
                      help="times each engine decodes the input, taking turns; the tables "
                      "give the medians (a shared machine's speed moves between minutes)")
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  import jax
  from transformer.decoding import loader
  from transformer.interop import ctranslate2_export
  from transformer.training import flops

  out = Path(args.out or tempfile.mkdtemp(prefix="bench_ct2_"))
  out.mkdir(parents=True, exist_ok=True)
  sources, references = read_input(Path(args.input), args.lines)
  src_file = out / "input.txt"
  src_file.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
  exported = {}
  for quantization in args.quantizations.split(","):
    exported[quantization] = Path(ctranslate2_export.export_workdir(
        args.workdir, str(out / f"ct2_{quantization}"), quantization=quantization, force=True))
  weights_dtypes = args.weights_dtypes.split(",")
  translators = {dtype: loader.load_translator(
      args.workdir, weights_dtype=None if dtype == "float32" else dtype)
      for dtype in weights_dtypes}
  translator = translators[weights_dtypes[0]]
  # FLOP/s, the best measured so far. At the start, the best of 20 (0.4-0.8 s):
  # the first few matmuls after the export ran up to 1.2x slower (388 against
  # 463 GFLOP/s), and the first block's MFU was reckoned over that.
  best_peak = flops.matmul_rate(repeats=20)
  print(f"{len(sources)} lines of {args.input}; {args.threads} threads; jax {jax.__version__} "
        f"on {jax.devices()[0].device_kind}; workdir {args.workdir}; float32 matmul peak "
        f"{best_peak / 1e9:.1f} GFLOP/s (2048^3; measured again before each block, the "
        "best kept)", flush=True)
  source_lengths = [len(translator.tokenizer.encode(s)) + 1 if s.strip() else 0  # (+ EOS)
                    for s in sources]

  def mfu(hypotheses: list[str], hypotheses_per_input: int, seconds: float,
          peak: float) -> float:
    """Model FLOPs utilisation of decoding `sources` into `hypotheses` (each
    tokenized again: its tokens and EOS) in `seconds`, over `peak` FLOP/s."""
    target_lengths = [len(translator.tokenizer.encode(h)) + 1 if n else 0
                      for h, n in zip(hypotheses, source_lengths)]
    model_flops = flops.decoding_flops(translator.config, source_lengths, target_lengths,
                                       hypotheses_per_input)
    return model_flops / seconds / peak

  print("\n| engine | method | batch | sentences/s (decoding) | vs CT2 float32 | "
        "whole command (s) | BLEU | MFU (decoding) |")
  print("|---|---|---|---|---|---|---|---|")
  notes = []
  for method in args.methods.split(","):
    beam = 4 if method == "beam" else 1
    for batch in (int(b) for b in args.batch_sizes.split(",")):
      # label -> {"seconds": [...], "wall": [...], "hyps": [...], "mfu": bool}, a
      # value per round; the engines take turns in every round, so that a
      # slow spell of the machine falls on both.
      runs: dict[str, dict] = {}

      def record(label, seconds, wall, hyps, with_mfu=True):
        run = runs.setdefault(label, {"seconds": [], "wall": [], "mfu": with_mfu})
        run["seconds"].append(seconds)
        run["wall"].append(wall)
        run["hyps"] = hyps

      stops = args.beam_stops.split(",") if method == "beam" else ["exact"]
      best_peak = max(best_peak, flops.matmul_rate(repeats=3))
      for round_index in range(args.rounds):
        for quantization, model_dir in exported.items():
          if round_index == 0:
            ct2_run(model_dir, src_file, out / "ct2.out", batch, beam, args.threads)  # (warm)
          seconds, wall, hyps = ct2_run(model_dir, src_file, out / "ct2.out", batch, beam,
                                        args.threads)
          record(f"CTranslate2 {quantization}", seconds, wall, hyps,
                 with_mfu=quantization == "float32")
        for lanes, stop, dtype in itertools.product(
            map(int, args.concurrent_batches.split(",")), stops, weights_dtypes):
          options = dict(method=method, beam_size=4, batch_size=batch, beam_stop=stop,
                         concurrent_batches=lanes)
          if round_index == 0:
            translators[dtype].translate(sources, **options)  # every shape compiled
          hyps = translators[dtype].translate(sources, **options)
          stats = translators[dtype].last_stats
          seconds = max(stats["seconds"] - stats["compile_seconds"], 1e-9)
          wall = float("nan")
          if args.commands:
            command = [sys.executable, "decode.py", f"--workdir={args.workdir}",
                       f"--input={src_file}", f"--output={out / 'ours.out'}",
                       f"--method={method}", f"--batch_size={batch}",
                       f"--beam_stop={stop}", f"--concurrent_batches={lanes}"]
            command += [f"--weights_dtype={dtype}"] if dtype != "float32" else []
            if round_index == 0:
              command_seconds(command)  # fills the compilation cache
            (out / "ours.out").unlink()
            wall = command_seconds(command)
          label = "decode.py / Translator" + "".join(
              f", {flag}" for flag, shown in (
                  (f"{lanes} lane{'s' * (lanes > 1)}", lanes != 0),
                  (f"beam_stop={stop}", stop != "exact"),
                  (f"{dtype} weights", dtype != "float32")) if shown)
          # (MFU over the float32 peak: not for bfloat16's products)
          record(label, seconds, wall, hyps, with_mfu=dtype == "float32")
      float32_hyps = runs["CTranslate2 float32"]["hyps"] if "float32" in exported else None
      reference_speed = None
      for label, run in runs.items():
        seconds, wall = statistics.median(run["seconds"]), statistics.median(run["wall"])
        speed = len(sources) / seconds
        reference_speed = reference_speed or speed
        shown = f"{mfu(run['hyps'], beam, seconds, best_peak):.1%}" if run["mfu"] else "–"  # (int8: –)
        print(f"| {label} | {method} | {batch} | {speed:.1f} | {speed / reference_speed:.2f} | "
              f"{wall:.1f} | {bleu(run['hyps'], references):.1f} | {shown} |", flush=True)
        if label.startswith("decode.py") and float32_hyps is not None:
          same = sum(a == b for a, b in zip(run["hyps"], float32_hyps))
          notes.append(f"{method}, batch {batch} ({label}): {same} of {len(run['hyps'])} "
                       "translations identical to CTranslate2 float32's")
  print(f"\nfloat32 matmul peak, the best measured: {best_peak / 1e9:.1f} GFLOP/s")
  print("\n" + "\n".join(notes))
  if args.fixed_steps:
    fixed_step_table(translator, exported["float32"], src_file, out, sources, args)
  (out / "done.json").write_text(json.dumps({"lines": len(sources)}))
  return 0


if __name__ == "__main__":
  # Freed memory kept per thread, as decode.py has it (`host_memory`): the
  # Translator rows then decode as `decode.py` does. Under glibc's defaults
  # (this benchmark until 2026-11-27) they read slower than the command
  # decodes: 5,000 gettext lines greedy at 128, 1,000-1,020 against
  # 1,070-1,120 sentences/s (processes taking turns, 2-core CPU).
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory(one_heap=False)
  sys.exit(main())
