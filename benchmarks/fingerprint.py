"""What a refactor must not change, printed so that two runs can be compared:
the training step's losses (every bit) and the programs XLA compiles for the
training step and the decoders (a hash of their instructions).

    python benchmarks/fingerprint.py                  # S and B, 3 steps each
    python benchmarks/fingerprint.py --shapes S --steps 5

Losses: `bench_train.compile_train_step` (train.py's step, dropout 0.1, Adam,
the paper's schedule) from the same initial state on the same fixed batch, each
step's summed loss as Python's repr of the float32 value. Programs: the
compiled HLO of that step and of `bench_decode.compile_decoder`'s greedy and
beam-4 decoders, with source locations (file names, lines, function names,
which change whenever code moves) left out, hashed. Run it before and after a
change on the same machine: identical lines mean the change left the
arithmetic, and the compiled programs that time it, as they were.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks import bench_decode, bench_train


def step_losses(compiled, state, batch, steps: int) -> list[float]:
  """The summed (label-smoothed) loss of `steps` consecutive training steps."""
  losses = []
  for _ in range(steps):
    state, metrics = compiled(state, batch)
    losses.append(float(np.asarray(metrics["loss"])))
  return losses


def program_hash(compiled) -> str:
  """A hash of a compiled program's instructions, without source locations:
  the frame tables (file and function names) and each instruction's metadata
  and stack frame id are dropped, the module renamed."""
  lines = []
  for line in compiled.as_text().splitlines():
    if " = " not in line and not line.endswith("{") and line.strip() != "}":
      continue  # the frame tables and blank lines
    line = re.sub(r",? metadata=\{[^}]*\}", "", line)
    line = re.sub(r",? stack_frame_id=\d+", "", line)
    lines.append(re.sub(r"^HloModule \S+", "HloModule m", line))
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="S,B")
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  for shape in args.shapes.split(","):
    compiled, state, batch, _ = bench_train.compile_train_step(shape, dropout=0.1)
    print(f"{shape} train step program: {program_hash(compiled)}")
    losses = step_losses(compiled, state, batch, args.steps)
    print(f"{shape} losses: " + " ".join(repr(x) for x in losses))
    for method, beams in (("greedy", 1), ("beam", 4)):
      compiled = bench_decode.compile_decoder(shape, method, beams)[0]
      print(f"{shape} {method} decoder program: {program_hash(compiled)}")


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory()  # as train.py does, before any computation
  main()
