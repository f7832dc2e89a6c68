"""Worker for tests/test_parallel.py: one JAX process of a data-parallel run.

    python tests/multiprocess_worker.py --num_processes=2 --process_id=0 \
        --port=12345 --local_devices=2 --out=result_0.json

Every process builds the same deterministic global batch, keeps its own
contiguous share of the rows (process i gets rows [i*n/P, (i+1)*n/P)), and
  * computes a jitted global sum / mean of the sharded batch,
  * runs a few jitted SGD steps of a tiny linear model (replicated params,
    batch sharded over all devices of all processes),
then writes the results as JSON. With --num_processes=1 it is the
single-process reference (no distributed runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GLOBAL_ROWS = 16
FEATURES = 4
SGD_STEPS = 3
LEARNING_RATE = 0.1


def global_data():
  import numpy as np
  rng = np.random.default_rng(0)
  x = rng.normal(size=(GLOBAL_ROWS, FEATURES)).astype(np.float32)
  y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.5
       + 0.1 * rng.normal(size=GLOBAL_ROWS)).astype(np.float32)
  return x, y


def init_params():
  import numpy as np
  return {"w": np.zeros((FEATURES,), np.float32), "b": np.zeros((), np.float32)}


def make_sgd_step(mesh):
  import jax
  import jax.numpy as jnp
  from transformer.runtime import parallel

  def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss

  repl = parallel.replicated(mesh)
  return jax.jit(step, in_shardings=(repl, parallel.data_sharding(mesh)),
                 out_shardings=(repl, repl))


def run_sgd(mesh, local_batch):
  import numpy as np
  from transformer.runtime import parallel
  params = parallel.replicate(init_params(), mesh)
  step = make_sgd_step(mesh)
  losses = []
  for _ in range(SGD_STEPS):
    params, loss = step(params, parallel.shard_batch(local_batch, mesh))
    losses.append(float(loss))
  params = parallel.to_host(params)
  return {k: np.asarray(v).tolist() for k, v in params.items()}, losses


def save_and_restore(workdir, mesh, params, pid):
  """Every process saves the replicated state (+ its own data state) and
  restores it from a fresh Checkpointer."""
  import jax
  import numpy as np
  from transformer.runtime import checkpoints
  from transformer.runtime import parallel
  state = parallel.replicate({"params": {k: np.asarray(v, np.float32) for k, v in params.items()},
                              "step": np.int32(SGD_STEPS)}, mesh)
  with checkpoints.Checkpointer(workdir, keep=2) as ckpt:
    assert ckpt.save(SGD_STEPS, state, {"process": pid, "offset": 100 + pid})
  with checkpoints.Checkpointer(workdir, keep=2) as ckpt:
    target = jax.eval_shape(lambda: state)   # no shardings -> replicated on make_mesh()
    restored, data_state = ckpt.restore(target)
  host = parallel.to_host(restored)
  return {
      "step": int(host["step"]),
      "params": {k: np.asarray(v).tolist() for k, v in host["params"].items()},
      "data_state": data_state,
      "replicated": all(x.sharding.is_fully_replicated for x in jax.tree.leaves(restored)),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--local_devices", type=int, default=1)
  parser.add_argument("--out", required=True)
  parser.add_argument("--workdir", default=None,
                      help="also save + restore a checkpoint of the params here")
  args = parser.parse_args()

  from transformer.runtime import parallel
  if args.num_processes > 1:
    ok = parallel.maybe_initialize_distributed(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        num_cpu_devices=args.local_devices,
        initialization_timeout=60,
    )
    assert ok
  else:
    assert not parallel.maybe_initialize_distributed(num_cpu_devices=args.local_devices)

  import jax
  import numpy as np

  pid, pcount = parallel.process_info()
  assert (pid, pcount) == (args.process_id, args.num_processes), (pid, pcount)
  mesh = parallel.make_mesh()
  x, y = global_data()
  rows = GLOBAL_ROWS // pcount
  local = {"x": x[pid * rows:(pid + 1) * rows], "y": y[pid * rows:(pid + 1) * rows]}

  batch = parallel.shard_batch(local, mesh)
  repl = parallel.replicated(mesh)
  stats = jax.jit(lambda b: {"sum": jnp_sum(b["x"]), "mean": jnp_mean(b["x"]),
                             "ysum": jnp_sum(b["y"])},
                  out_shardings=repl)(batch)
  stats = {k: float(np.asarray(v)) for k, v in stats.items()}

  params, losses = run_sgd(mesh, local)
  checkpoint = None
  if args.workdir:
    checkpoint = save_and_restore(args.workdir, mesh, params, pid)
  result = {
      "process_index": pid,
      "process_count": pcount,
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "mesh_size": int(mesh.devices.size),
      "global_shape": list(batch["x"].shape),
      "local_rows_per_device": sorted({s.data.shape[0] for s in batch["x"].addressable_shards}),
      "stats": stats,
      "params": params,
      "losses": losses,
      "checkpoint": checkpoint,
  }
  with open(args.out, "w") as f:
    json.dump(result, f)
  if pcount > 1:
    parallel.shutdown_distributed()


def jnp_sum(a):
  import jax.numpy as jnp
  return jnp.sum(a.astype(jnp.float32))


def jnp_mean(a):
  import jax.numpy as jnp
  return jnp.mean(a.astype(jnp.float32))


if __name__ == "__main__":
  main()
