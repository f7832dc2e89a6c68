"""train.py on a real corpus against bench_train.py on the same shape, back to
back: does a user's run get the benchmark's speed?

    python benchmarks/real_run.py --train=../shared/corpora/gettext-en-fr/train.tsv \
        --eval=../shared/corpora/gettext-en-fr/valid.tsv --minutes=3
    python benchmarks/real_run.py ... --max_length=128     # 32 x 128-token rows

Runs `python train.py` (configs/small_corpus.py at shape S: d_model 256, 4
heads, d_ff 1024, 3 + 3 layers, an 8192-piece vocabulary, `--batch_size` rows
of `--max_length` tokens, dropout 0.1) for `--minutes` with evaluation and
checkpoints out of the way, sampling its process in /proc once the first
steps are logged: minor page faults and system CPU time per step. Its MFU is
train.py's own (metrics.jsonl, the median of the logged windows after the
first). Then `benchmarks/bench_train.py` times the same shape on a random
batch; the table gives both and their ratio. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_counters(pid: int) -> tuple[int, float, float]:
  """(minor faults, user seconds, system seconds) of process `pid` so far."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  # After the command name: state is field 3, minflt 10, utime 14, stime 15 (1-based).
  return int(fields[7]), int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def _train_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip().endswith("}")
            and '"split": "train"' in line]


def run_train(args, workdir: str) -> dict:
  """train.py for args.minutes; its speed, MFU, page faults and system time."""
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/small_corpus.py",
         f"--workdir={workdir}", "--quiet", "--compilation_cache=off",
         f"--config.data.train_path={args.train}", f"--config.data.eval_path={args.eval}",
         "--config.vocab_size=8192", f"--config.batch_size={args.batch_size}",
         f"--config.max_length={args.max_length}", f"--config.train_minutes={args.minutes}",
         "--config.log_every=20", "--config.eval_every=1000000", "--config.num_bleu_examples=0",
         "--config.checkpoint_every=1000000", "--config.test_report=false",
         "--config.average_last=1"]
  process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  samples = []  # (time, steps logged, faults, user s, system s) once training runs
  while process.poll() is None:
    time.sleep(1.0)
    records = _train_records(workdir)
    if records:  # compiled and stepping: sample from here on
      try:
        samples.append((time.perf_counter(), records[-1]["step"], *_proc_counters(process.pid)))
      except FileNotFoundError:
        break
  _, stderr = process.communicate()
  if process.returncode:
    raise SystemExit(f"train.py failed:\n{stderr.decode()[-3000:]}")
  records = _train_records(workdir)
  windows = records[1:] or records  # the first window holds the compilation
  first, last = samples[0], samples[-1]
  steps_per_second = statistics.median(r["steps_per_second"] for r in windows)
  seconds = last[0] - first[0]
  steps = steps_per_second * seconds
  return {"steps_per_second": steps_per_second,
          "mfu": statistics.median(r["mfu"] for r in windows),
          "faults_per_step": (last[2] - first[2]) / max(steps, 1e-9),
          "user_s_per_step": (last[3] - first[3]) / max(steps, 1e-9),
          "system_s_per_step": (last[4] - first[4]) / max(steps, 1e-9),
          "system_share": (last[4] - first[4]) / max(last[3] - first[3] + last[4] - first[4], 1e-9),
          "steps": records[-1]["step"]}


def run_bench(args) -> dict:
  """bench_train.py's shape S with this batch, as its own process."""
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"),
                    "--shapes=S", f"--repeats={args.repeats}", f"--json={out.name}",
                    f"--batch_size={args.batch_size}", f"--length={args.max_length}"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out.name))["rows"][0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--train", required=True, help="a TSV training file")
  parser.add_argument("--eval", required=True, help="a TSV validation file")
  parser.add_argument("--minutes", type=float, default=3.0)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--max_length", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as workdir:
    train = run_train(args, os.path.join(workdir, "run"))
  bench = run_bench(args)
  print(f"\nshape S at {args.batch_size} x {args.max_length} tokens; load "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
  print("\n| | steps/s | MFU | page faults / step | system s / step | system share |")
  print("|---|---|---|---|---|---|")
  print(f"| train.py ({args.minutes:g} min, {train['steps']} steps) | "
        f"{train['steps_per_second']:.2f} | {train['mfu']:.0%} | {train['faults_per_step']:,.0f} "
        f"| {train['system_s_per_step']:.3f} | {train['system_share']:.0%} |")
  print(f"| bench_train.py | {1 / bench['step_s']:.2f} | {bench['mfu']:.0%} | | | |")
  print(f"\ntrain.py / bench_train.py MFU: {train['mfu'] / bench['mfu']:.0%}")


if __name__ == "__main__":
  main()
