"""The training step's losses, printed exactly: a guard for changes that must
not change the numbers (a refactor, a faster kernel said to be bit-exact).

    python benchmarks/step_losses.py                 # S and B, 3 steps each
    python benchmarks/step_losses.py --shapes S --steps 5

Runs `bench_train.compile_train_step` (train.py's step, dropout 0.1, Adam, the
paper's schedule) from the same initial state on the same fixed batch and
prints each step's summed loss as Python's repr of the float32 value (every bit
shown). Run it before and after a change on the same machine: identical lines
mean the change left the training step's arithmetic as it was.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks import bench_train


def step_losses(shape: str, steps: int) -> list[float]:
  """The summed (label-smoothed) loss of `steps` consecutive training steps."""
  compiled, state, batch, _ = bench_train.compile_train_step(shape, dropout=0.1)
  losses = []
  for _ in range(steps):
    state, metrics = compiled(state, batch)
    losses.append(float(np.asarray(metrics["loss"])))
  return losses


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="S,B")
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  for shape in args.shapes.split(","):
    print(f"{shape}: " + " ".join(repr(x) for x in step_losses(shape, args.steps)))


if __name__ == "__main__":
  from transformer import host_memory
  host_memory.keep_freed_memory()  # as train.py does, before any computation
  main()
