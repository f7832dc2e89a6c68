"""A rehearsal of configs/wmt14_base.py on CPU, on a synthetic corpus made at run
time (never kept): the vocabulary, the preparation of the token shards, the
first training steps and a resume, each timed, with each stage's peak resident
memory (the process's ru_maxrss, from os.wait4).

    python benchmarks/rehearsal_wmt14.py --pairs=5000000
    python benchmarks/rehearsal_wmt14.py --pairs=500000 --keep=/tmp/rehearsal   # keep the workdir

The stages are the commands a user runs, as subprocesses:

  corpus    the synthetic TSV (bench_input_pipeline.synthetic_pairs: WMT-like lengths)
  prepare   python -m transformer.training.prepare --config=configs/wmt14_base.py ...
            (the vocabulary: 37,000 BPE pieces on vocab_max_sentences = 2M sentences
            evenly spaced, then the shards)
  train     python train.py --config=configs/wmt14_base.py ... --config.num_train_steps=S
  resume    the same command with 2S steps: resumes from step S's checkpoint

The model is the paper's base (float32 on CPU); the batch is --batch_size rows of
256 tokens (the config's 96 take minutes a step on a CPU); evaluation is cut to
a few sentences and no BLEU. Everything else is wmt14_base's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_input_pipeline import write_tsv  # noqa: E402


def run_stage(name: str, cmd: list[str], log_path: str) -> dict:
  """Runs `cmd`, its output to `log_path`; (seconds, peak RSS in MB) of that process."""
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
  seconds = time.perf_counter() - start
  code = os.waitstatus_to_exitcode(status)
  text = open(log_path, errors="replace").read()
  if code != 0:
    raise SystemExit(f"{name} failed (exit {code}); its output:\n{text[-4000:]}")
  row = {"stage": name, "seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024, "log": text}
  print(f"{name:>8}: {seconds:8.1f} s, peak RSS {row['peak_rss_mb']:8.0f} MB", flush=True)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pairs", type=int, default=5_000_000)
  parser.add_argument("--steps", type=int, default=3, help="training steps before the resume")
  parser.add_argument("--batch_size", type=int, default=8, help="rows of 256 tokens a step")
  parser.add_argument("--keep", default="", help="a directory to keep the workdir in")
  args = parser.parse_args()

  with tempfile.TemporaryDirectory() as tmp:
    base = args.keep or tmp
    os.makedirs(base, exist_ok=True)
    workdir = os.path.join(base, "workdir")
    train_tsv, eval_tsv = os.path.join(tmp, "train.tsv"), os.path.join(tmp, "eval.tsv")
    start = time.perf_counter()
    write_tsv(train_tsv, args.pairs, seed=0)
    write_tsv(eval_tsv, 200, seed=1)
    size = os.path.getsize(train_tsv) / 2**20
    print(f"  corpus: {time.perf_counter() - start:8.1f} s, {args.pairs:,} pairs, "
          f"{size:,.0f} MB of text", flush=True)
    config = [
        "--config=configs/wmt14_base.py", f"--workdir={workdir}",
        "--config.data.source=tsv", f"--config.data.train_path={train_tsv}",
        f"--config.data.eval_path={eval_tsv}", "--config.test_report=False",
        "--config.model.dtype=float32", f"--config.batch_size={args.batch_size}",
        "--config.eval_batch_size=8", "--config.num_eval_examples=16",
        "--config.num_bleu_examples=0", "--config.log_every=1", "--config.average_last=1",
    ]
    rows = [run_stage("prepare", [sys.executable, "-m", "transformer.training.prepare", *config],
                      os.path.join(base, "prepare.log"))]
    found = re.search(r"Trained the vocabulary \((\d+) pieces\) on (\d+) sentences in ([\d.]+) s",
                      rows[0]["log"])
    shards = re.search(r"Prepared (\d+) pairs .* in ([\d.]+) s\.", rows[0]["log"])
    if found:
      print(f"          vocabulary: {found.group(1)} pieces on {int(found.group(2)):,} "
            f"sentences in {float(found.group(3)):.1f} s", flush=True)
    if shards:
      print(f"          shards: {int(shards.group(1)):,} pairs in {float(shards.group(2)):.1f} s "
            f"({int(shards.group(1)) / float(shards.group(2)):,.0f} pairs/s)", flush=True)
    for name, steps in (("train", args.steps), ("resume", 2 * args.steps)):
      rows.append(run_stage(name, [sys.executable, "train.py", *config, "--quiet",
                                   f"--config.num_train_steps={steps}",
                                   f"--config.checkpoint_every={args.steps}"],
                            os.path.join(base, f"{name}.log")))
    if f"Resumed from step {args.steps}" not in open(os.path.join(workdir, "train.log")).read():
      raise SystemExit("the second run did not resume from the first run's checkpoint")
    print(f"resumed from step {args.steps}; ran to step {2 * args.steps}")
    print("\n| pairs | stage | seconds | peak RSS (MB) |\n|---|---|---|---|")
    for row in rows:
      print(f"| {args.pairs:,} | {row['stage']} | {row['seconds']:.0f} | "
            f"{row['peak_rss_mb']:,.0f} |")


if __name__ == "__main__":
  main()
