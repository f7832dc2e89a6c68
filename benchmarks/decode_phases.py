"""Where a whole `decode.py` command's time goes, phase by phase.

    python benchmarks/decode_phases.py --workdir=<model> \
        --input=../shared/corpora/gettext-en-fr/test.tsv --lines=1000 --rounds=3 \
        -- --batch_size=128 --method=beam

Runs `decode.py` (this checkout's) on the first `--lines` source lines of
`--input` (a TSV's first column, or a text file) with the flags after `--`:
one untimed run first (a first run compiles its decoders), then `--rounds`
timed ones. Each run is a fresh process started through this script
(`--phases_child`), which stamps the time since the parent started it at
the end of each phase, then runs decode.py as `python decode.py` would:

  start, import jax    the interpreter's start and JAX's import
  decode.py ready      decode.py's own imports, flags, parameters and vocabulary
  loading decoders     `Translator._prepare_all` (compiled decoders read from
                       disk, or compiled on a first run), summed
  decoding             `Translator._decode_in_lanes` (the batches, first calls
                       of each decoder included), summed
  the rest             reading and writing the text, the exit

Prints each phase's median seconds and every round's, and the whole command's.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import ab_decode_commands  # noqa: E402
from benchmarks.bench_vs_ctranslate2 import read_input  # noqa: E402

PHASES = ("start, import jax", "decode.py ready", "loading decoders", "decoding", "the rest")
_STARTED = "DECODE_PHASES_STARTED"  # (environment: time.time() when the parent started the child)
_STAMPS = "DECODE_PHASES_STAMPS"    # (environment: the file the child writes its stamps to)


def phase_seconds(stamps: dict[str, float], total: float) -> dict[str, float]:
  """The phases' seconds from a child's stamps (seconds since its start:
  "jax imported", "first load", "decoders loaded" and "decoded" for the
  sums of `_prepare_all`'s and `_decode_in_lanes`' time) and the command's
  wall `total`."""
  ready = stamps["first load"] - stamps["jax imported"]
  loading, decoding = stamps["decoders loaded"], stamps["decoded"]
  return dict(zip(PHASES, (stamps["jax imported"], ready, loading, decoding,
                           total - stamps["first load"] - loading - decoding)))


def summary(rounds: list[dict[str, float]], totals: list[float]) -> list[str]:
  """The table's rows: each phase's median and every round's seconds, then the whole command's."""
  rows = ["| phase | median (s) | seconds per round |", "|---|---|---|"]
  for phase in PHASES:
    seconds = [r[phase] for r in rounds]
    rows.append(f"| {phase} | {statistics.median(seconds):.2f} | "
                f"{' '.join(f'{s:.2f}' for s in seconds)} |")
  rows.append(f"| whole command | {statistics.median(totals):.2f} | "
              f"{' '.join(f'{s:.2f}' for s in totals)} |")
  return rows


def _child(flags: list[str]) -> None:
  """decode.py with `flags`, as `python decode.py` runs it, its phases stamped."""
  started = float(os.environ[_STARTED])
  stamps = {}
  import jax  # noqa: F401  (the first import of it, timed)
  stamps["jax imported"] = time.time() - started
  from transformer.decoding import decoders, runner

  def timed(owner, name: str, total: str, first: str | None = None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
      begin = time.time() - started
      if first is not None:
        stamps.setdefault(first, begin)
      try:
        return original(*args, **kwargs)
      finally:
        stamps[total] = stamps.get(total, 0.0) + time.time() - started - begin
    setattr(owner, name, wrapper)

  timed(decoders.Decoders, "prepare_all", "decoders loaded", first="first load")
  timed(runner, "_decode_in_lanes", "decoded")
  exit_now = os._exit

  def write_stamps_then_exit(code):  # (decode.py ends its process with os._exit)
    Path(os.environ[_STAMPS]).write_text(json.dumps(stamps))
    exit_now(code)
  os._exit = write_stamps_then_exit
  sys.argv = [str(REPO / "decode.py"), *flags]
  runpy.run_path(str(REPO / "decode.py"), run_name="__main__")


def run(flags: list[str], input_path: str) -> tuple[dict[str, float], float]:
  """One decode.py command's phases and whole wall time (seconds), reading
  `input_path` (its stamps written beside it)."""
  stamps_path = os.path.join(os.path.dirname(input_path), "stamps.json")
  env = dict(os.environ, **{_STARTED: repr(time.time()), _STAMPS: stamps_path})
  total, _ = ab_decode_commands.run([sys.executable, __file__, "--phases_child", "--", *flags],
                                    input_path, env)
  stamps = json.loads(Path(stamps_path).read_text())
  if "first load" not in stamps:
    raise SystemExit(f"decode.py {' '.join(flags)} decoded nothing: no phases to time")
  return phase_seconds(stamps, total), total


def main(argv=None) -> int:
  own, flags = ab_decode_commands.split_at_dashes(sys.argv[1:] if argv is None else argv)
  if own == ["--phases_child"]:
    _child(flags)
    return 0
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the model, as decode.py's --workdir")
  parser.add_argument("--input", required=True, help="a TSV (source<TAB>reference) or text")
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args(own)
  lines, _ = read_input(Path(args.input), args.lines)
  flags = [f"--workdir={args.workdir}", "--quiet", *flags]
  with ab_decode_commands.lines_in_a_file(lines) as input_path:
    run(flags, input_path)  # (may compile)
    rounds, totals = zip(*(run(flags, input_path) for _ in range(args.rounds)))
  print(f"{len(lines)} lines of {args.input}, decode.py {' '.join(flags)}; {args.rounds} rounds\n")
  print("\n".join(summary(list(rounds), list(totals))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
