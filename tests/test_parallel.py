"""Tests for transformer/runtime/parallel.py.

JAX fixes its device count when the backend starts, so the 8-device and the
two-process checks run in subprocesses with their own environment (the
XLA_FLAGS / jax_num_cpu_devices settings must precede `import jax`). Every
subprocess has a time limit, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "multiprocess_worker.py"
TIMEOUT_S = 120

sys.path.insert(0, str(REPO / "tests"))
import multiprocess_worker  # noqa: E402  (numpy-only helpers; no JAX import)
from helpers import free_port, run_checked, run_together, subprocess_env  # noqa: E402


def _numpy_sgd():
  """float64 reference of the worker's SGD."""
  x, y = multiprocess_worker.global_data()
  x, y = x.astype(np.float64), y.astype(np.float64)
  w, b = np.zeros(x.shape[1]), 0.0
  for _ in range(multiprocess_worker.SGD_STEPS):
    r = x @ w + b - y
    gw, gb = 2 * x.T @ r / len(y), 2 * r.mean()
    w, b = w - multiprocess_worker.LEARNING_RATE * gw, b - multiprocess_worker.LEARNING_RATE * gb
  return w, b


EIGHT_DEVICE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax, jax.numpy as jnp
    from transformer.runtime import parallel
    import multiprocess_worker as mw

    out = {}
    assert not parallel.maybe_initialize_distributed()   # nothing configured: no-op
    assert parallel.process_info() == (0, 1)
    mesh = parallel.make_mesh()
    out["mesh_size"] = int(mesh.devices.size)
    out["axis_names"] = list(mesh.axis_names)

    x, y = mw.global_data()
    batch = parallel.shard_batch({"x": x, "y": y}, mesh)
    shards = {}
    for s in batch["x"].addressable_shards:
        rows = s.index[0]
        shards[s.device.id] = [rows.start, rows.stop,
                               bool(np.array_equal(np.asarray(s.data), x[rows]))]
    out["shards"] = shards
    out["global_shape"] = list(batch["x"].shape)

    repl = parallel.replicated(mesh)
    mean = jax.jit(lambda b: jnp.mean(b["x"]), out_shardings=repl)(batch)
    out["mean"] = float(mean)
    out["np_mean"] = float(np.mean(x.astype(np.float64)))

    p8, _ = mw.run_sgd(mesh, {"x": x, "y": y})
    p1, _ = mw.run_sgd(parallel.make_mesh(jax.devices()[:1]), {"x": x, "y": y})
    out["p8"], out["p1"] = p8, p1

    state = parallel.replicate({"w": np.ones(3, np.float32), "rng": jax.random.key(0)}, mesh)
    out["replicated"] = bool(state["w"].sharding.is_fully_replicated
                             and len(state["w"].addressable_shards) == 8)

    try:
        parallel.shard_batch({"tokens": np.zeros((12, 3))}, mesh)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    print("RESULT" + json.dumps(out))
""")


def test_eight_cpu_devices():
  env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8",
                   PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
  proc = run_checked([sys.executable, "-c", EIGHT_DEVICE_SCRIPT], env, TIMEOUT_S)
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  out = json.loads(line[len("RESULT"):])

  assert out["mesh_size"] == 8
  assert out["axis_names"] == ["data"]
  assert out["global_shape"] == [16, 4]
  # 1/8 of the rows on each device, contiguous, in device order, with the right data.
  spans = sorted((v[0], v[1]) for v in out["shards"].values())
  assert spans == [(2 * i, 2 * i + 2) for i in range(8)]
  assert all(v[2] for v in out["shards"].values())
  np.testing.assert_allclose(out["mean"], out["np_mean"], rtol=1e-6)
  for k in ("w", "b"):
    np.testing.assert_allclose(out["p8"][k], out["p1"][k], atol=1e-6, rtol=0)
  w, b = _numpy_sgd()
  np.testing.assert_allclose(out["p8"]["w"], w, rtol=1e-5)
  np.testing.assert_allclose(out["p8"]["b"], b, rtol=1e-5)
  assert out["replicated"]
  assert out["error"] and "['tokens']" in out["error"] and "12 rows" in out["error"] \
      and "8 local devices" in out["error"]


def test_two_processes_on_localhost(tmp_path):
  port = free_port()
  env = subprocess_env(JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # loopback only
  outs = [tmp_path / f"result_{pid}.json" for pid in range(2)]
  run_together([[sys.executable, str(WORKER), "--num_processes=2", f"--process_id={pid}",
                 f"--port={port}", "--local_devices=2", f"--out={outs[pid]}",
                 f"--workdir={tmp_path / 'workdir'}"] for pid in range(2)], env, TIMEOUT_S)

  single_out = tmp_path / "single.json"
  run_checked([sys.executable, str(WORKER), "--num_processes=1", "--local_devices=1",
               f"--out={single_out}"], subprocess_env(), TIMEOUT_S)

  r = [json.loads(o.read_text()) for o in outs]
  single = json.loads(single_out.read_text())
  x, y = multiprocess_worker.global_data()
  for pid, res in enumerate(r):
    assert res["process_index"] == pid and res["process_count"] == 2
    assert res["device_count"] == 4 and res["local_device_count"] == 2
    assert res["mesh_size"] == 4 and res["global_shape"] == [16, 4]
    assert res["local_rows_per_device"] == [4]
    np.testing.assert_allclose(res["stats"]["sum"], x.astype(np.float64).sum(), rtol=1e-5)
    np.testing.assert_allclose(res["stats"]["mean"], x.astype(np.float64).mean(), rtol=1e-5)
    np.testing.assert_allclose(res["stats"]["ysum"], y.astype(np.float64).sum(), rtol=1e-5)
  # Identical params in both processes, equal to the single-process run.
  assert r[0]["params"] == r[1]["params"]
  for k in ("w", "b"):
    np.testing.assert_allclose(r[0]["params"][k], single["params"][k], atol=1e-6, rtol=0)
  w, b = _numpy_sgd()
  np.testing.assert_allclose(r[0]["params"]["w"], w, rtol=1e-5)
  # Multi-process checkpointing: one shared step, each process its own data state.
  for pid, res in enumerate(r):
    ck = res["checkpoint"]
    assert ck["step"] == multiprocess_worker.SGD_STEPS and ck["replicated"]
    assert ck["params"] == res["params"]
    assert ck["data_state"] == {"process": pid, "offset": 100 + pid}
  data_dir = tmp_path / "workdir" / "checkpoints" / str(multiprocess_worker.SGD_STEPS) / "data_state"
  assert sorted(p.name for p in data_dir.iterdir() if p.suffix == ".json") == [
      "process_0-of-2.json", "process_1-of-2.json"]


def test_initialize_is_a_noop_without_configuration(monkeypatch):
  from transformer.runtime import parallel
  for var in (parallel.ENV_COORDINATOR_ADDRESS, parallel.ENV_NUM_PROCESSES,
              parallel.ENV_PROCESS_ID):
    monkeypatch.delenv(var, raising=False)
  assert parallel.maybe_initialize_distributed() is False
  assert parallel.maybe_initialize_distributed(num_processes=1) is False


def test_initialize_names_missing_settings(monkeypatch):
  from transformer.runtime import parallel
  for var in (parallel.ENV_COORDINATOR_ADDRESS, parallel.ENV_PROCESS_ID):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv(parallel.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match=r"coordinator_address.*process_id"):
    parallel.maybe_initialize_distributed()
  monkeypatch.setenv(parallel.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
    parallel.maybe_initialize_distributed()


def test_fsdp_spec_splits_the_largest_divisible_axis():
  from jax.sharding import PartitionSpec as P
  from transformer.runtime import parallel
  assert parallel.fsdp_spec((512, 2048), 8) == P(None, "data")
  assert parallel.fsdp_spec((2048, 512), 8) == P("data", None)
  assert parallel.fsdp_spec((512, 8, 64), 8) == P("data", None, None)
  assert parallel.fsdp_spec((64, 64), 8) == P("data", None)            # the first on a tie
  assert parallel.fsdp_spec((6, 12), 8) == P()                         # none divisible
  assert parallel.fsdp_spec((4,), 8) == P()                            # smaller than the devices
  assert parallel.fsdp_spec((), 8) == P()
  assert parallel.fsdp_spec((512, 2048), 1) == P()


def test_state_shardings_names_the_option_when_unknown():
  import jax
  from transformer.runtime import parallel
  mesh = parallel.make_mesh(jax.devices()[:1])
  with pytest.raises(ValueError, match="state_sharding='zero'"):
    parallel.state_shardings({"w": np.zeros(4)}, mesh, "zero")
