"""Fine-tuning measured (configs/finetune.py): a model trained on general text,
then fine-tuned on a domain it saw little of, at several learning rates.

    python benchmarks/bench_finetune.py --corpus=../shared/corpora/gettext-en-fr --out=/tmp/ft
    python benchmarks/bench_finetune.py ... --pretrained=/tmp/ft/pre     # reuse a pretrained run

The domain: command-line option help (a source with `--option` or ` -x,`),
about 5% of the gettext corpus. The pretrained model is configs/small_corpus.py
trained on the other 95% (`--pretrain_minutes`); each fine-tuning run is
configs/finetune.py on the option-help training pairs for `--steps` steps at one
`learning_rate_scale`. Printed: greedy BLEU / chrF (sacreBLEU) on the
option-help test pairs (in-domain) and on the rest of the test split (what the
general model knew: forgetting), for the pretrained model and each run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import sacrebleu

REPO = Path(__file__).resolve().parents[1]
OPTION_HELP = re.compile(r"--| -[a-zA-Z],")


def split(corpus: Path, out: Path) -> dict[str, Path]:
  """general / option-help files of each split, `source<TAB>target`."""
  out.mkdir(parents=True, exist_ok=True)
  files = {}
  for name in ("train", "valid", "test"):
    lines = (corpus / f"{name}.tsv").read_text(encoding="utf-8").splitlines()
    for domain, keep in (("option", True), ("general", False)):
      path = out / f"{domain}_{name}.tsv"
      path.write_text("".join(line + "\n" for line in lines
                              if bool(OPTION_HELP.search(line.split("\t")[0])) == keep),
                      encoding="utf-8")
      files[f"{domain}_{name}"] = path
  return files


def run(args: list[str]) -> float:
  """Runs a command from the repository; returns its minutes."""
  start = time.monotonic()
  subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
  return (time.monotonic() - start) / 60


def score(workdir: Path, pairs: Path, out: Path) -> tuple[float, float]:
  """Greedy BLEU and chrF of `workdir` on `pairs`."""
  sources, references = zip(*(line.split("\t") for line in
                              pairs.read_text(encoding="utf-8").splitlines()))
  src = out.with_suffix(".src")
  src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
  run([sys.executable, "decode.py", f"--workdir={workdir}", f"--input={src}",
       f"--output={out}", "--method=greedy"])
  hypotheses = out.read_text(encoding="utf-8").splitlines()
  return (sacrebleu.corpus_bleu(hypotheses, [list(references)]).score,
          sacrebleu.corpus_chrf(hypotheses, [list(references)]).score)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--corpus", default=str(REPO.parent / "shared/corpora/gettext-en-fr"))
  parser.add_argument("--out", default="/tmp/bench_finetune")
  parser.add_argument("--pretrained", default="", help="a pretrained workdir to reuse")
  parser.add_argument("--pretrain_minutes", type=float, default=15.0)
  parser.add_argument("--scales", default="0.02,0.1,0.5", help="learning_rate_scale values")
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  out = Path(args.out)
  files = split(Path(args.corpus), out)
  print({k: sum(1 for _ in open(v, encoding="utf-8")) for k, v in files.items()})
  pretrained = Path(args.pretrained) if args.pretrained else out / "pretrained"
  if not args.pretrained:
    minutes = run([sys.executable, "train.py", "--config=configs/small_corpus.py",
                   f"--workdir={pretrained}", f"--config.data.train_path={files['general_train']}",
                   f"--config.data.eval_path={files['general_valid']}",
                   f"--config.train_minutes={args.pretrain_minutes}", "--config.test_report=False"])
    print(f"pretrained in {minutes:.1f} min")
  rows = [("pretrained (no fine-tuning)", "", pretrained)]
  for scale in args.scales.split(","):
    workdir = out / f"tuned_{scale}"
    if not (workdir / "checkpoints_averaged").exists():
      minutes = run([sys.executable, "train.py", "--config=configs/finetune.py",
                     f"--workdir={workdir}", f"--config.init_from={pretrained}",
                     f"--config.data.train_path={files['option_train']}",
                     f"--config.data.eval_path={files['option_valid']}",
                     f"--config.num_train_steps={args.steps}",
                     f"--config.learning_rate_scale={scale}", "--config.test_report=False"])
    else:
      minutes = float("nan")
    rows.append((f"fine-tuned, learning_rate_scale={scale}", f"{minutes:.1f}", workdir))
  print(f"\n| model | minutes | option help BLEU / chrF ({len(files['option_test'].read_text().splitlines())} "
        f"test pairs) | general BLEU / chrF ({len(files['general_test'].read_text().splitlines())}) |")
  print("|---|---|---|---|")
  for name, minutes, workdir in rows:
    in_domain = score(workdir, files["option_test"], out / f"{workdir.name}.option.out")
    general = score(workdir, files["general_test"], out / f"{workdir.name}.general.out")
    print(f"| {name} | {minutes} | {in_domain[0]:.1f} / {in_domain[1]:.1f} | "
          f"{general[0]:.1f} / {general[1]:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
