"""A/B of whole `decode.py` commands between checkouts: what a user waits for.

    python benchmarks/ab_decode_commands.py --trees=<checkout before>,. \
        --workdir=<model> --input=../shared/corpora/gettext-en-fr/train.tsv \
        --lines=20000 --rounds=4 -- --batch_size=128 --method=beam

Each tree's `decode.py` (its own `transformer/` package: Python puts the
script's directory first on the path) translates the first `--lines` source
lines of `--input` (a TSV's first column, or a text file: the side-by-side
benchmark's `read_input`) with the flags after
`--`. One untimed run per tree first (a first run compiles its decoders), then
`--rounds` rounds in which the trees take turns, so that each sees the same
neighbours on a shared machine (separate processes of the same code differ by
5-15% on a 2-core machine: only alternating runs compare). Prints each tree's
median and all its seconds, its speed against the first tree's, and how many
output lines equal the first tree's.

`--env` (repeated) compares environments instead of, or as well as, trees:
each tree runs under each `--env`'s variables ("NAME=VALUE NAME=VALUE", ""
for none), e.g. `--trees=. --env= --env=MALLOC_ARENA_MAX=1`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_vs_ctranslate2 import read_input  # noqa: E402


def decode_command(tree: str, workdir: str, flags: list[str]) -> list[str]:
  """`decode.py` of `tree` on standard input, quiet (no progress bar)."""
  return [sys.executable, str(Path(tree) / "decode.py"), f"--workdir={workdir}", "--quiet",
          *flags]


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
  """(this script's arguments, decode.py's: those after `--`)."""
  if "--" not in argv:
    return argv, []
  return argv[:argv.index("--")], argv[argv.index("--") + 1:]


@contextlib.contextmanager
def lines_in_a_file(lines: list[str]):
  """The path of a temporary file holding `lines`, one per line (its
  directory is the caller's to use too), removed afterwards."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "input.txt")
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    yield path


def environment(assignments: str) -> dict[str, str]:
  """This process's environment with `assignments` ("NAME=VALUE NAME=VALUE") added."""
  added = {}
  for assignment in assignments.split():
    name, equals, value = assignment.partition("=")
    if not (name and equals):
      raise SystemExit(f"--env: {assignment!r} is not NAME=VALUE")
    added[name] = value
  return dict(os.environ, **added)


def run(command: list[str], input_path: str,
        env: dict[str, str] | None = None) -> tuple[float, list[str]]:
  """(wall seconds, output lines) of one command reading `input_path`."""
  with open(input_path, "rb") as stdin:
    start = time.perf_counter()
    done = subprocess.run(command, stdin=stdin, capture_output=True, check=False, env=env)
    seconds = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n"
                     f"{done.stderr.decode(errors='replace')[-2000:]}")
  return seconds, done.stdout.decode("utf-8").splitlines()


def summary(trees: list[str], seconds: dict[str, list[float]],
            outputs: dict[str, list[str]]) -> list[str]:
  """The table's rows: per tree (or tree and environment), its median
  seconds, the first one's median over its own (> 1: faster), every round's
  seconds, and its output lines equal to the first one's."""
  first = trees[0]
  rows = ["| tree | median (s) | speed vs the first | seconds per round | lines as the first's |",
          "|---|---|---|---|---|"]
  for tree in trees:
    median = statistics.median(seconds[tree])
    same = sum(a == b for a, b in zip(outputs[tree], outputs[first]))
    if len(outputs[tree]) != len(outputs[first]):
      same = f"{same} ({len(outputs[tree])} lines against {len(outputs[first])})"
    rows.append(f"| {tree} | {median:.2f} | {statistics.median(seconds[first]) / median:.3f}x "
                f"| {' '.join(f'{s:.2f}' for s in seconds[tree])} | {same} |")
  return rows


def main(argv=None) -> int:
  own, flags = split_at_dashes(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--trees", required=True,
                      help="comma-separated checkouts (roots holding decode.py); the first "
                           "is the reference")
  parser.add_argument("--workdir", required=True, help="the model, as decode.py's --workdir")
  parser.add_argument("--input", required=True, help="a TSV (source<TAB>reference) or text")
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--env", action="append",
                      help="environment variables to run every tree under, "
                           "\"NAME=VALUE NAME=VALUE\" (\"\": none); repeat to compare")
  args = parser.parse_args(own)
  trees = args.trees.split(",")
  for tree in trees:
    if not (Path(tree) / "decode.py").is_file():
      parser.error(f"--trees: {tree} has no decode.py")
  envs = args.env or [""]
  # Each (tree, environment) is a variant, named by its tree (and its variables).
  variants = {(f"{tree} {env or '(no variables)'}" if len(envs) > 1 else tree):
              (decode_command(tree, args.workdir, flags), environment(env))
              for tree in trees for env in envs}
  lines, _ = read_input(Path(args.input), args.lines)
  with lines_in_a_file(lines) as input_path:
    outputs = {name: run(command, input_path, env)[1]
               for name, (command, env) in variants.items()}  # (compiles)
    seconds = {name: [] for name in variants}
    for _ in range(args.rounds):
      for name, (command, env) in variants.items():
        seconds[name].append(run(command, input_path, env)[0])
  print(f"{len(lines)} lines of {args.input}, decode.py {' '.join(flags)}; "
        f"{args.rounds} rounds, taking turns\n")
  print("\n".join(summary(list(variants), seconds, outputs)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
