"""Cold, warm and first-after-training `decode.py` commands: what a user waits
for on a fresh machine (issue 54; docs/decoding.md "How it is fast").

    python train.py ... --workdir=W          # then at once:
    python benchmarks/cold_start.py --workdir=W \
        --input=../shared/corpora/gettext-en-fr/test.tsv --lines=1000 \
        --methods=beam,greedy -- --batch_size=32

For each method, whole `decode.py` commands of the first `--lines` source lines
of `--input` (a TSV's first column, or a text file), each timed from the
shell's side (process start to exit):
  first    the workdir as it is, with the machine's compilation cache
           (`--cache`, default: decode.py's own): right after `train.py`,
           the first decode after training;
  warm     the same again (its decoders loaded, nothing compiled);
  cold     a copy of the workdir without `compiled/`, with an empty cache: a
           fresh machine and a workdir that carries no decoders;
  copied   a copy of the workdir `cold` left (its `compiled/` filled), with
           another empty cache: a workdir copied to another machine of the
           same kind that holds the same signing key (a copy of the key);
  received the same copy on a machine with another key (a workdir received
           from someone else): its compiled decoders are not loaded but
           compiled afresh (issue 59; docs/security.md);
  trusted  the same with `--trust_compiled=<this machine's signing.key>`: a
           copy of one's own workdir on another machine of one's own,
           adopted explicitly by naming the key it was sealed under.
Then the ratios to `warm` (the issue's goals: cold <= 3x, first <= 1.5x) and
whether every run wrote the same lines as `warm`. Flags after `--` go to every
`decode.py` (e.g. `--batch_size=128`). The first method's `first` run is the
one right after training; later methods' `first` runs find the machine's cache
as the earlier ones left it. Timing goes to stdout only: no pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_vs_ctranslate2 import read_input  # noqa: E402
from transformer.runtime import signing  # noqa: E402


def decode(workdir: Path, source: Path, output: Path, method: str, cache: str | None,
           flags: list[str], key: Path | None = None) -> float:
  """Seconds of one `decode.py` command (start to exit); `key`: the signing
  key file of the machine it stands for (default: this user's)."""
  command = [sys.executable, str(REPO / "decode.py"), f"--workdir={workdir}",
             f"--input={source}", f"--output={output}", f"--method={method}", "--quiet",
             *([f"--compilation_cache={cache}"] if cache else []), *flags]
  env = dict(os.environ, **({"TRANSFORMER_SIGNING_KEY": str(key)} if key else {}))
  start = time.perf_counter()
  subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--input", required=True)
  parser.add_argument("--lines", type=int, default=1000)
  parser.add_argument("--methods", default="beam,greedy")  # (beam: what training compiled)
  parser.add_argument("--cache", default=None,
                      help="the machine's compilation cache for `first` and `warm` "
                           "(default: decode.py's)")
  parser.add_argument("flags", nargs="*", help="after --: flags for every decode.py")
  args = parser.parse_args()
  os.environ.pop("TRANSFORMER_WORKDIR_DECODERS", None)  # (the tests' "off")
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    source = tmp / "input.txt"
    sources, _ = read_input(Path(args.input), args.lines)
    source.write_text("".join(line + "\n" for line in sources))
    print(f"{args.lines} lines of {args.input}; decode.py {' '.join(args.flags)}")
    print("| method | first (after training) | warm | cold | copied (same key) "
          "| received (another key) | trusted (--trust_compiled=KEY) | first / warm "
          "| cold / warm | same lines as warm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
      out = {name: tmp / f"{method}.{name}.txt"
             for name in ("first", "warm", "cold", "copied", "received", "trusted")}
      seconds = {}
      workdir = Path(args.workdir)
      seconds["first"] = decode(workdir, source, out["first"], method, args.cache, args.flags)
      seconds["warm"] = decode(workdir, source, out["warm"], method, args.cache, args.flags)
      bare = tmp / f"{method}_bare"
      shutil.copytree(workdir, bare, ignore=shutil.ignore_patterns("compiled"))
      seconds["cold"] = decode(bare, source, out["cold"], method, str(tmp / f"{method}_cache1"),
                               args.flags)
      copied = tmp / f"{method}_copied"
      shutil.copytree(bare, copied)
      shutil.copytree(copied, tmp / f"{method}_received")
      shutil.copytree(copied, tmp / f"{method}_trusted")
      seconds["copied"] = decode(copied, source, out["copied"], method,
                                 str(tmp / f"{method}_cache2"), args.flags)
      other_key = tmp / f"{method}_other_machine" / "signing.key"  # (made by decode.py)
      seconds["received"] = decode(tmp / f"{method}_received", source, out["received"], method,
                                   str(tmp / f"{method}_cache3"), args.flags, key=other_key)
      seconds["trusted"] = decode(tmp / f"{method}_trusted", source, out["trusted"], method,
                                  str(tmp / f"{method}_cache4"),
                                  [*args.flags, f"--trust_compiled={signing.key_path()}"],
                                  key=other_key)
      warm_text = out["warm"].read_text()
      same = all(path.read_text() == warm_text for path in out.values())
      print(f"| {method} | {seconds['first']:.1f} s | {seconds['warm']:.1f} s "
            f"| {seconds['cold']:.1f} s | {seconds['copied']:.1f} s "
            f"| {seconds['received']:.1f} s | {seconds['trusted']:.1f} s "
            f"| {seconds['first'] / seconds['warm']:.2f}x | {seconds['cold'] / seconds['warm']:.2f}x "
            f"| {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
  main()
