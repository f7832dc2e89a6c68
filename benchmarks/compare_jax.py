"""One machine, two Python environments (two JAX versions): the training
step, a small-corpus run and decode.py cold and warm, side by side.

    python benchmarks/compare_jax.py --python_a=venv310/bin/python \
        --python_b=venv312/bin/python                  # ~20 minutes on 2 cores
    python benchmarks/compare_jax.py ... --minutes=4 --repeats=3 --lines=1000

Each environment has the project installed (`pip install -e .`); the two run
one after the other, never at once. Measured in each:

  * the training step of shape S (benchmarks/bench_train.py: seconds per
    step, MFU against the matmul peak measured in the same run);
  * a small-corpus run: configs/small_corpus.py on ../shared/corpora/
    gettext-en-fr at d_model 128 (`--d_model`: the width fixed, not timed,
    so that both train the same model), `--minutes` of budget: the steps it
    took and its test BLEU;
  * decode.py of `--lines` test sentences (beam 4, the recipe's) with the
    workdir that environment A trained: cold (an empty compilation cache, so
    everything is traced and compiled) and warm (the same command again,
    `--repeats` times, the median).

Prints a markdown table with the ratio B / A of each figure (for times,
above 1 means B is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, "..", "shared", "corpora", "gettext-en-fr")


def run(python: str, args: list[str], *, env=None, timeout=3600) -> tuple[float, str]:
  """Seconds and stdout of `python args` in the repository; raises with the
  output on a failure."""
  start = time.perf_counter()
  proc = subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    raise SystemExit(f"{python} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")
  return seconds, proc.stdout


def version(python: str) -> str:
  return run(python, ["-c", "import sys, jax, jaxlib, flax; print(sys.version.split()[0], "
                            "jax.__version__, jaxlib.__version__, flax.__version__)"])[1].strip()


def train_step(python: str, repeats: int, scratch: str) -> dict:
  out = os.path.join(scratch, "bench_train.json")
  run(python, ["benchmarks/bench_train.py", "--shapes=S", f"--repeats={repeats}",
               f"--json={out}"])
  with open(out) as f:
    row = json.load(f)["rows"][0]
  return {"step_s": row["step_s"], "mfu": row.get("mfu")}


def small_corpus_run(python: str, minutes: float, d_model: int, workdir: str,
                     cache: str) -> dict:
  env = dict(os.environ, TRANSFORMER_COMPILATION_CACHE=cache)
  _, out = run(python, [
      "train.py", "--config=configs/small_corpus.py", f"--workdir={workdir}",
      f"--config.data.train_path={CORPUS}/train.tsv",
      f"--config.data.eval_path={CORPUS}/valid.tsv",
      f"--config.data.test_path={CORPUS}/test.tsv",
      f"--config.train_minutes={minutes}", "--config.model_for_budget=fixed",
      f"--config.model.d_model={d_model}", f"--config.model.d_ff={4 * d_model}"], env=env)
  steps = re.search(r"Trained (\d+) steps", out)
  bleu = re.search(r"BLEU\D{0,12}(\d+(?:\.\d+)?)", out)
  return {"steps": int(steps.group(1)) if steps else None,
          "bleu": float(bleu.group(1)) if bleu else None}


def decode(python: str, workdir: str, source: str, repeats: int, scratch: str) -> dict:
  cache = tempfile.mkdtemp(prefix="decode_cache_", dir=scratch)
  env = dict(os.environ, TRANSFORMER_COMPILATION_CACHE=cache)
  args = ["decode.py", f"--workdir={workdir}", f"--input={source}", "--quiet"]
  cold, _ = run(python, [*args, f"--output={os.path.join(scratch, 'cold.txt')}"], env=env)
  warm = []
  for i in range(repeats):
    seconds, _ = run(python, [*args, f"--output={os.path.join(scratch, f'warm{i}.txt')}"],
                     env=env)
    warm.append(seconds)
  with open(os.path.join(scratch, "cold.txt"), "rb") as f:
    output = f.read()
  return {"cold_s": cold, "warm_s": statistics.median(warm), "output": output}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--python_a", required=True, help="the first environment's python")
  parser.add_argument("--python_b", required=True, help="the second environment's python")
  parser.add_argument("--minutes", type=float, default=5.0, help="the small-corpus run's budget")
  parser.add_argument("--d_model", type=int, default=128, help="the small-corpus run's width")
  parser.add_argument("--only", choices=("all", "run"), default="all",
                      help="run: the small-corpus runs alone")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--scratch", default="", help="where the runs go (default: a temporary folder)")
  args = parser.parse_args()
  scratch = args.scratch or tempfile.mkdtemp(prefix="compare_jax_")
  source = os.path.join(scratch, "test.src")
  with open(os.path.join(CORPUS, "test.tsv"), encoding="utf-8") as f, \
       open(source, "w", encoding="utf-8") as out:
    for _, line in zip(range(args.lines), f):
      out.write(line.split("\t")[0] + "\n")

  results = {}
  for name, python in (("A", args.python_a), ("B", args.python_b)):
    where = os.path.join(scratch, name)
    os.makedirs(where, exist_ok=True)
    results[name] = {"version": version(python)}
    print(f"{name}: {results[name]['version']}", flush=True)
    results[name]["train"] = (train_step(python, args.repeats, where) if args.only == "all"
                              else {"step_s": None, "mfu": None})
    results[name]["run"] = small_corpus_run(python, args.minutes, args.d_model,
                                            os.path.join(where, "run"), os.path.join(where, "cache"))
    print(f"{name}: {results[name]['train']} {results[name]['run']}", flush=True)
  for name, python in (("A", args.python_a), ("B", args.python_b)):
    if args.only == "run":
      results[name]["decode"] = {"cold_s": None, "warm_s": None, "output": b""}
      continue
    results[name]["decode"] = decode(python, os.path.join(scratch, "A", "run"), source,
                                     args.repeats, os.path.join(scratch, name))

  a, b = results["A"], results["B"]
  same = a["decode"].pop("output") == b["decode"].pop("output")
  print(f"\nA: python, jax, jaxlib, flax = {a['version']}\nB: {b['version']}\n")
  print("| figure | A | B | B / A |\n|---|---|---|---|")
  rows = [("training step, shape S (s)", a["train"]["step_s"], b["train"]["step_s"]),
          ("training step MFU", a["train"]["mfu"], b["train"]["mfu"]),
          (f"small-corpus run, d_model {args.d_model}, {args.minutes:g} min: steps", a["run"]["steps"], b["run"]["steps"]),
          ("  its test BLEU", a["run"]["bleu"], b["run"]["bleu"]),
          (f"decode.py, {args.lines} lines, beam 4, cold (s)", a["decode"]["cold_s"],
           b["decode"]["cold_s"]),
          (f"  warm (s, median of {args.repeats})", a["decode"]["warm_s"], b["decode"]["warm_s"])]
  for label, x, y in rows:
    ratio = f"{y / x:.2f}" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else ""
    fmt = (lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
    print(f"| {label} | {fmt(x)} | {fmt(y)} | {ratio} |")
  print(f"\nthe same model's translations byte-identical in A and B: {same}")


if __name__ == "__main__":
  main()
