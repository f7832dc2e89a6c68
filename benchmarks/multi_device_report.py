"""What the training step does on 8 devices, per config: read from the programs
XLA compiles, on 8 simulated CPU devices (the same partitioning a GPU or TPU
host with 8 devices gets).

    python benchmarks/multi_device_report.py                    # every config
    python benchmarks/multi_device_report.py --configs default,small_corpus

Prints one markdown table (docs/benchmarks.md carries it), a row
per config and state layout (`state_sharding` "replicated" / "fsdp"):

  * collectives per update: count and bytes of the all-reduces, reduce-scatters
    and all-gathers of the compiled train step (bfloat16 compute, 2 micro-batches
    of 16 rows x 64 tokens), and how many of them sit inside the accumulation
    loop (run once per micro-batch; 0 is right);
  * per-device bytes of parameters + Adam state (from the arrays' shapes and
    `parallel.state_shardings`, as `parallel.bytes_per_device` reads them from
    a real state);
  * the largest uint32 array of the step (dropout's random bits) against one
    device's share of a `[rows, length, d_model]` activation, what dropout
    masks: no larger means each device makes only its own shard's masks;
  * the attention implementation of the training step on CPU, GPU (cuDNN-capable)
    and TPU, bfloat16 (`model.choose_attention_implementation`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
import time

DEVICES = 8
if __name__ == "__main__":  # before JAX starts: 8 simulated CPU devices
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={DEVICES}")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from transformer.model import attention_choice, transformer as model_lib
from transformer.runtime import parallel
from transformer.training import run_setup, steps as steps_lib  # noqa: E402

CONFIGS = ("default", "small_corpus", "wmt14_base", "wmt14_big")
ROWS, LENGTH, MICRO_BATCHES = 16, 64, 2
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


def load_config(name: str, state_sharding: str):
  config = importlib.import_module(f"configs.{name}").get_config()
  config.model.dtype = "bfloat16"
  config.update(dict(batch_size=ROWS, max_length=LENGTH, grad_accum_steps=MICRO_BATCHES,
                     state_sharding=state_sharding))
  return config


def state_bytes_per_device(config, model_config, mesh) -> int:
  """Bytes of one device's share of the train state, from shapes alone."""
  optimizer, _ = steps_lib.make_optimizer(config, model_config.d_model)
  abstract = jax.eval_shape(lambda: steps_lib.create_train_state(model_config, optimizer, 0))
  shardings = parallel.state_shardings(abstract, mesh, config.state_sharding)
  total = 0
  for x, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      continue
    shard = sharding.shard_shape(x.shape)
    total += math.prod(shard) * x.dtype.itemsize
  return total


def step_program(config, model_config, mesh) -> str:
  """The compiled train step's HLO text (the trainer's `jit_train_step`)."""
  optimizer, schedule = steps_lib.make_optimizer(config, model_config.d_model)
  abstract = jax.eval_shape(lambda: steps_lib.create_train_state(model_config, optimizer, 0))
  shardings = parallel.state_shardings(abstract, mesh, config.state_sharding)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       abstract, shardings)
  step, rows = steps_lib.jit_train_step(config, model_config, optimizer, schedule, mesh, shardings)
  batch = {k: jax.ShapeDtypeStruct((MICRO_BATCHES, ROWS, LENGTH), np.int32, sharding=rows)
           for k in ("inputs", "targets", "inputs_segment_ids", "targets_segment_ids",
                     "inputs_positions", "targets_positions")}
  return step.lower(state, batch).compile().as_text()


def largest_u32(hlo: str) -> int:
  sizes = [math.prod(int(d) for d in dims.split(",") if d)
           for dims in re.findall(r"u32\[([\d,]*)\]", hlo)]
  return max(sizes, default=0)


def report_row(name: str, state_sharding: str, mesh) -> dict:
  config = load_config(name, state_sharding)
  model_config = run_setup.model_config_from(config, config.vocab_size)
  start = time.perf_counter()
  hlo = step_program(config, model_config, mesh)
  row = {"config": name, "state": state_sharding, "compile_s": time.perf_counter() - start}
  for op in COLLECTIVES:
    found = common.collectives(hlo, op)
    row[op] = (len(found), sum(c["bytes"] for c in found), sum(c["in_loop"] for c in found))
  row["params"] = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(jax.eval_shape(
      lambda: model_lib.init_params(model_config, jax.random.key(0)))))
  row["state_bytes"] = state_bytes_per_device(config, model_config, mesh)
  row["largest_u32"] = largest_u32(hlo)
  # dropout masks the embeddings and every sub-layer's output, [rows, length,
  # d_model]: one device's share of one of them
  row["activation_shard"] = ROWS // DEVICES * LENGTH * model_config.d_model
  row["attention"] = {backend: attention_choice.choose_attention_implementation(
      model_config.attention_implementation, backend=backend, dtype=model_config.dtype,
      head_dim=model_config.head_dim, dropout=model_config.attention_dropout_rate > 0)
      for backend in ("cpu", "gpu", "tpu")}
  return row


def mib(n: float) -> str:
  return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_table(rows: list[dict]) -> str:
  lines = [
      f"8 devices, bfloat16 compute, {MICRO_BATCHES} micro-batches of {ROWS} rows x "
      f"{LENGTH} tokens per update. Collectives: count / bytes / inside the accumulation loop.",
      "",
      "| config | state | all-reduce | reduce-scatter | all-gather | params + Adam per device"
      " | largest RNG array / one device's activation (elements) | attention CPU / GPU / TPU |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    cells = [f"{n} / {mib(b)} / {inside}" for n, b, inside in (r[op] for op in COLLECTIVES)]
    lines.append(
        f"| {r['config']} | {r['state']} | " + " | ".join(cells)
        + f" | {mib(r['state_bytes'])} | {r['largest_u32']:,} / {r['activation_shard']:,} | "
        + " / ".join(r["attention"][b] for b in ("cpu", "gpu", "tpu")) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--configs", default=",".join(CONFIGS),
                      help="comma-separated names of configs/*.py")
  args = parser.parse_args(argv)
  if jax.device_count() != DEVICES:
    raise SystemExit(f"needs {DEVICES} devices, found {jax.device_count()}: run it as a "
                     "script (it sets XLA_FLAGS before JAX starts)")
  mesh = parallel.make_mesh()
  rows = []
  for name in args.configs.split(","):
    for state_sharding in parallel.STATE_SHARDINGS:
      rows.append(report_row(name, state_sharding, mesh))
      print(f"# {name} {state_sharding}: compiled in {rows[-1]['compile_s']:.0f} s",
            file=sys.stderr, flush=True)
  print(format_table(rows))


if __name__ == "__main__":
  main()
