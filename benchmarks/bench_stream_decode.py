"""Batch decoding at scale: decode.py on files of growing size (peak memory,
sentences/s), killed half way and resumed (time, identical bytes), and how
much of the decoding time the device waits for the host.

    python benchmarks/bench_stream_decode.py                          # the tiny fixture model
    python benchmarks/bench_stream_decode.py --workdir=runs/demo --lines=10000,100000
    python benchmarks/bench_stream_decode.py --baseline=/path/to/old/checkout

Inputs are the demo task's English phrases (made here, never committed),
repeated to the line count. Every decode.py run is a fresh process: peak
resident memory is its maximum RSS (`os.wait4`), time is the whole command.

--baseline: a checkout of an earlier commit whose decode.py reads the whole
input and writes the output at the end; its sentences/s on the first line
count is the "in-memory" column.

Idle share (in one process, the same lines): the device's time alone (the
recorded batches replayed back to back, nothing else between them) over the
decoding time, with the host's work (packing, detokenizing) overlapped with
the device's and without.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FIXTURE = os.path.join(REPO, "tests", "fixtures", "workdir_d26a6fb")


def make_input(path: str, lines: int) -> None:
  from transformer.data import demo_task
  phrases = [s for s, _ in demo_task.demo_splits(0, num_train=5000, num_eval=1,
                                                  num_test=1)["train"]]
  with open(path, "w", encoding="utf-8") as f:
    for i in range(lines):
      f.write(phrases[i % len(phrases)] + "\n")


def run_decode(decode_py: str, flags: list[str], kill_at_line: int | None = None,
               record: str | None = None) -> dict:
  """Runs decode.py; {"seconds", "peak_mib", "killed"}. With `kill_at_line`,
  SIGKILLs it once `record` shows that many lines done."""
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(decode_py)))
  env.setdefault("TRANSFORMER_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(),
                                                               "bench_stream_cache"))
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, decode_py, *flags], env=env,
                          cwd=os.path.dirname(decode_py), stderr=subprocess.PIPE)
  killed = False
  if kill_at_line is not None:
    while proc.poll() is None:
      try:
        with open(record) as f:
          if json.load(f)["lines_done"] >= kill_at_line:
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
      except (OSError, ValueError):
        pass
      time.sleep(0.02)
  _, status, usage = os.wait4(proc.pid, 0)
  seconds = time.perf_counter() - start
  stderr = proc.stderr.read().decode()
  if not killed and status != 0:
    raise RuntimeError(f"decode.py failed:\n{stderr[-3000:]}")
  return {"seconds": seconds, "peak_mib": usage.ru_maxrss / 1024, "killed": killed}


def idle_shares(workdir: str, lines: int, method: str) -> dict:
  """In one process: decoding seconds with and without the overlap, and the
  device's own seconds for the same batches (replayed back to back)."""
  import jax
  import transformer
  from transformer.data import demo_task
  phrases = [s for s, _ in demo_task.demo_splits(0, num_train=5000, num_eval=1,
                                                  num_test=1)["train"]]
  sentences = [phrases[i % len(phrases)] for i in range(lines)]
  translator = transformer.load_translator(workdir)
  recorded = []
  dispatch = translator.decoders.dispatch

  def recording(shape, inputs):
    recorded.append((shape, inputs))
    return dispatch(shape, inputs)
  translator.decoders.dispatch = recording
  options = dict(method=method, concurrent_batches=1)  # (the overlap of one lane)
  translator.translate_hypotheses(sentences, **options)  # compile every shape
  out = {}
  for overlap in (False, True, False, True):
    recorded.clear()
    translator.overlap = overlap
    translator.translate_hypotheses(sentences, **options)
    stats = translator.last_stats
    out[f"decode_s_overlap_{overlap}"] = min(out.get(f"decode_s_overlap_{overlap}", 1e9),
                                             stats["seconds"] - stats["compile_seconds"])
  replay = []
  for _ in range(2):
    start = time.perf_counter()
    results = [dispatch(shape, inputs) for shape, inputs in recorded]
    jax.block_until_ready(results)
    replay.append(time.perf_counter() - start)
  device = min(replay)
  out["device_s"] = device
  for overlap in (False, True):
    out[f"idle_share_overlap_{overlap}"] = max(
        0.0, 1 - device / out[f"decode_s_overlap_{overlap}"])
  out["sentences_per_s_overlap_True"] = lines / out["decode_s_overlap_True"]
  out["sentences_per_s_overlap_False"] = lines / out["decode_s_overlap_False"]
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=FIXTURE)
  parser.add_argument("--lines", default="10000,100000,1000000")
  parser.add_argument("--methods", default="greedy,beam")
  parser.add_argument("--baseline", default="", help="an older checkout's root")
  parser.add_argument("--kill_lines", type=int, default=0,
                      help="lines of the kill-and-resume run (default: the largest)")
  parser.add_argument("--idle_lines", type=int, default=10000)
  args = parser.parse_args()
  workdir = os.path.abspath(args.workdir)
  counts = [int(n) for n in args.lines.split(",")]
  decode_py = os.path.join(REPO, "decode.py")
  tmp = tempfile.mkdtemp(prefix="bench_stream_")
  print(f"model: {workdir}")
  print("| method | lines | seconds | sentences/s | peak RSS MiB | vs in-memory |")
  print("|---|---|---|---|---|---|")
  for method in args.methods.split(","):
    baseline = None
    for n in counts:
      src = os.path.join(tmp, f"in_{n}.txt")
      if not os.path.exists(src):
        make_input(src, n)
      flags = [f"--workdir={workdir}", f"--input={src}", f"--method={method}", "--quiet"]
      if args.baseline and baseline is None:
        old = run_decode(os.path.join(os.path.abspath(args.baseline), "decode.py"),
                         flags + [f"--output={os.path.join(tmp, 'old.txt')}"])
        baseline = n / old["seconds"]
        print(f"| {method} (in-memory, {args.baseline}) | {n:,} | {old['seconds']:.1f} | "
              f"{baseline:.0f} | {old['peak_mib']:.0f} | 1.00x |")
      new = run_decode(decode_py, flags + [f"--output={os.path.join(tmp, 'new.txt')}"])
      speed = n / new["seconds"]
      ratio = f"{speed / baseline:.2f}x" if baseline else "-"
      print(f"| {method} | {n:,} | {new['seconds']:.1f} | {speed:.0f} | "
            f"{new['peak_mib']:.0f} | {ratio} |", flush=True)
  n = args.kill_lines or max(counts)
  src = os.path.join(tmp, f"in_{n}.txt")
  if not os.path.exists(src):
    make_input(src, n)
  method = args.methods.split(",")[0]
  flags = [f"--workdir={workdir}", f"--input={src}", f"--method={method}", "--quiet"]
  whole_out, part_out = os.path.join(tmp, "whole.txt"), os.path.join(tmp, "part.txt")
  whole = run_decode(decode_py, flags + [f"--output={whole_out}"])
  killed = run_decode(decode_py, flags + [f"--output={part_out}"], kill_at_line=n // 2,
                      record=part_out + ".progress.json")
  resumed = run_decode(decode_py, flags + [f"--output={part_out}"])
  with open(whole_out, "rb") as a, open(part_out, "rb") as b:
    same = a.read() == b.read()
  print(f"\nkilled at half of {n:,} lines ({method}) and resumed: "
        f"{killed['seconds']:.1f} s + {resumed['seconds']:.1f} s = "
        f"{(killed['seconds'] + resumed['seconds']) / whole['seconds']:.2f}x the "
        f"uninterrupted {whole['seconds']:.1f} s; output identical: {same}")
  print("\n| method | device alone s | decode s, no overlap | idle share | decode s, overlap "
        "| idle share |")
  print("|---|---|---|---|---|---|")
  for method in args.methods.split(","):
    r = idle_shares(workdir, args.idle_lines, method)
    print(f"| {method} | {r['device_s']:.2f} | {r['decode_s_overlap_False']:.2f} | "
          f"{r['idle_share_overlap_False']:.0%} | {r['decode_s_overlap_True']:.2f} | "
          f"{r['idle_share_overlap_True']:.0%} |", flush=True)


if __name__ == "__main__":
  main()
