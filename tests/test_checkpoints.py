"""Tests for transformer/runtime/checkpoints.py (CPU, one device)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.runtime import averaging
from transformer.runtime import checkpoints, orbax_items
from transformer.runtime import checkpoint_names
from transformer.runtime import checkpoint_space, disk_space

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers import small_disk  # noqa: E402


def _params(seed: int):
  rng = np.random.default_rng(seed)
  return {
      "encoder": {"kernel": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
                  "bias": jnp.asarray(rng.normal(size=(16,)), jnp.float32)},
      "embedding": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32),
  }


_TX = optax.adam(1e-3, b1=0.9, b2=0.98, eps=1e-9)


@jax.jit
def _update(params, opt_state):
  grads = jax.tree.map(lambda p: 0.1 * p + 1.0, params)
  updates, opt_state = _TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _train_state(seed: int = 0, steps: int = 2):
  params = _params(seed)
  opt_state = _TX.init(params)
  for _ in range(steps):  # make the optimizer state non-trivial
    params, opt_state = _update(params, opt_state)
  return {
      "params": params,
      "opt_state": opt_state,
      "step": jnp.asarray(steps, jnp.int32),
      "rng": jax.random.key(seed + 7),                # typed key
      "dropout_rng": jax.random.PRNGKey(seed + 11),   # raw uint32 key
  }


def _leaves(tree):
  def host(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return ("key", str(x.dtype), np.asarray(jax.random.key_data(x)))
    return (str(x.dtype), np.asarray(x))
  return [host(x) for x in jax.tree.leaves(tree)]


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    assert x[:-1] == y[:-1]
    np.testing.assert_array_equal(x[-1], y[-1])


def test_round_trip_is_exact(tmp_path):
  state = _train_state()
  data_state = {"epoch": 3, "next_index": 12345, "shuffle_seed": 42,
                "nested": {"offsets": [1, 2, 3], "name": "wmt"}}
  with checkpoints.Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
      ckpt.restore(jax.eval_shape(lambda: state))
    assert ckpt.save(2, state, data_state, metadata={"config": "demo"})
    other = _train_state(seed=1)
    assert ckpt.save(4, other, {"epoch": 4})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4] and ckpt.latest_step() == 4

  # A fresh Checkpointer (as after a restart) restores exactly.
  with checkpoints.Checkpointer(tmp_path, keep=3) as ckpt:
    abstract = jax.eval_shape(lambda: state)     # no shardings: restored replicated
    restored, restored_data = ckpt.restore(abstract, step=2)
    _assert_trees_equal(restored, state)
    assert restored_data == data_state
    latest, latest_data = ckpt.restore(state)     # concrete target, latest step
    _assert_trees_equal(latest, other)
    assert latest_data == {"epoch": 4}
    _, no_data = ckpt.restore(state, restore_data_state=False)
    assert no_data is None
    meta = ckpt.restore_metadata(2)
    assert meta["step"] == 2 and meta["config"] == "demo" and meta["process_count"] == 1
    assert isinstance(restored["rng"], jax.Array) and jnp.issubdtype(
        restored["rng"].dtype, jax.dtypes.prng_key)
    # The restored state is usable: the same update gives the same result.
    g = jax.tree.map(jnp.ones_like, state["params"])
    update = jax.jit(_TX.update)
    u1, _ = update(g, state["opt_state"], state["params"])
    u2, _ = update(g, restored["opt_state"], restored["params"])
    _assert_trees_equal(u1, u2)
    # Missing step and mismatched target give clear errors.
    with pytest.raises(FileNotFoundError, match="step 3"):
      ckpt.restore(abstract, step=3)
    bad = dict(state, params=dict(state["params"], embedding=jnp.zeros((5, 8))))
    with pytest.raises(ValueError, match="Could not restore") as info:
      ckpt.restore(bad)
    # Found in the metadata, before orbax reads (and advises its API's options):
    assert "params.embedding is (32, 8) there, (5, 8) here" in str(info.value)
    assert "strict" not in str(info.value)
  # Data state is stored per process.
  assert (tmp_path / "checkpoints" / "2" / "data_state" / "process_0-of-1.json").exists()


def test_save_state_can_be_deleted_right_after_async_save(tmp_path):
  # The trainer donates the state to the next step: save() must not need it later.
  state = _train_state()
  expected = _leaves(state)
  with checkpoints.Checkpointer(tmp_path, async_save=True) as ckpt:
    ckpt.save(1, state)
    for x in jax.tree.leaves(state):
      x.delete()
    ckpt.wait()
    restored, _ = ckpt.restore(_train_state())
  for x, y in zip(_leaves(restored), expected):
    np.testing.assert_array_equal(x[-1], y[-1])


def test_keep_n_and_save_every(tmp_path):
  with checkpoints.Checkpointer(tmp_path, keep=2, save_every=3) as ckpt:
    saved = [s for s in range(1, 11)
             if ckpt.save(s, {"x": jnp.full((4,), s, jnp.float32)}, {"s": s})]
    assert saved == [3, 6, 9]
    assert ckpt.save(10, {"x": jnp.full((4,), 10.0)}, force=True)   # final step
    ckpt.wait()
    assert ckpt.all_steps() == [9, 10]
    # A step that exists is never written again.
    assert not ckpt.save(10, {"x": jnp.full((4,), -1.0)}, force=True)
    ckpt.wait()
    state, _ = ckpt.restore({"x": jnp.zeros(4)})
    np.testing.assert_array_equal(state["x"], np.full(4, 10.0))
    with pytest.raises(TypeError, match="data_state must be JSON"):
      ckpt.save(12, {"x": jnp.zeros(4)}, {"pos": np.int64(3)}, force=True)
    assert ckpt.all_steps() == [9, 10]
  on_disk = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert on_disk == ["10", "9"]


def test_average_of_three_checkpoints(tmp_path):
  states = {s: _train_state(seed=s, steps=1) for s in (10, 20, 30, 40)}
  with checkpoints.Checkpointer(tmp_path, keep=None) as ckpt:
    for step, state in states.items():
      ckpt.save(step, state)
  target = jax.eval_shape(lambda: states[10]["params"])

  averaged = averaging.average_checkpoints(tmp_path, target, num=3)
  expected = jax.tree.map(lambda *xs: np.mean(np.stack([np.asarray(x, np.float64) for x in xs]), 0),
                          *(states[s]["params"] for s in (20, 30, 40)))
  assert jax.tree.structure(averaged) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(averaged), jax.tree.leaves(expected)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), e, rtol=1e-6, atol=1e-6)
  explicit = averaging.average_checkpoints(tmp_path, target, steps=[10, 40])
  np.testing.assert_allclose(
      explicit["embedding"],
      (np.asarray(states[10]["params"]["embedding"], np.float64)
       + np.asarray(states[40]["params"]["embedding"], np.float64)) / 2, rtol=1e-6)

  params, steps = averaging.average_and_save(tmp_path, target, num=3)
  assert steps == [20, 30, 40]
  assert averaging.averaged_info(tmp_path)["averaged_steps"] == [20, 30, 40]
  assert checkpoint_names.checkpoint_steps(tmp_path, checkpoints.AVERAGED_DIR) == [40]
  loaded, info = averaging.load_params(tmp_path, target, "averaged", with_info=True)
  assert info["kind"] == "averaged" and info["averaged_steps"] == [20, 30, 40]
  _assert_trees_equal(loaded, params)
  _assert_trees_equal(averaging.load_params(tmp_path, target), params)  # auto -> averaged
  _assert_trees_equal(averaging.load_params(tmp_path, target, "latest"), states[40]["params"])
  _assert_trees_equal(averaging.load_params(tmp_path, target, 20), states[20]["params"])
  # Re-averaging other steps with the same last step replaces the checkpoint.
  averaging.save_averaged(tmp_path, explicit, [10, 40])
  assert averaging.averaged_info(tmp_path)["averaged_steps"] == [10, 40]
  _assert_trees_equal(averaging.load_params(tmp_path, target, "averaged"), explicit)
  with pytest.raises(FileNotFoundError):
    averaging.load_params(tmp_path / "nowhere", target)


@pytest.mark.parametrize("record", ['[1, 2]', '{"averaged_steps": "20"}', '{"averaged_steps": []}',
                                    '{"averaged_steps": [20, -1]}', '{"averaged_steps": [true]}',
                                    '{"averaged_steps": [99999]}', '{"averaged_steps": '])
def test_an_absurd_averaged_record_is_one_sentence(tmp_path, record):
  """The averaged checkpoint's record (meta/metadata) is data: a wrong type, an
  empty or negative list, a step past the checkpoint's own, or a truncated
  file is one ValueError naming the file, as is what `workdir.read` chooses
  from it (never a TypeError or a KeyError from deeper down)."""
  from transformer.runtime import workdir as workdir_lib
  meta = tmp_path / checkpoints.AVERAGED_DIR / "40" / checkpoints.META_ITEM / "metadata"
  meta.parent.mkdir(parents=True)
  (tmp_path / checkpoints.CHECKPOINT_DIR / "40").mkdir(parents=True)
  meta.write_text(record)
  with pytest.raises(ValueError, match="metadata") as error:
    averaging.averaged_info(tmp_path)
  assert str(meta) in str(error.value) and "\n" not in str(error.value)
  # Choosing "auto" still works: the average counts as filed under its step.
  assert workdir_lib.resolve_checkpoint(tmp_path, "auto") == "averaged"


KILL_WRITER = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from transformer.runtime import checkpoints
    workdir = sys.argv[1]
    ckpt = checkpoints.Checkpointer(workdir, keep=2)
    step = ckpt.latest_step() or 0          # resume numbering after a kill
    while True:
        step += 1
        state = {"params": {f"w{i}": jnp.full((4_000_000,), step + i, jnp.float32)
                            for i in range(4)},
                 "step": jnp.asarray(step)}
        ckpt.save(step, state, {"step": step})
        ckpt.wait()
        print(f"SAVED {step}", flush=True)
""")


def _tmp_dirs(directory: Path) -> list[str]:
  try:
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]
  except FileNotFoundError:
    return []


def _run_writer_and_kill_mid_save(workdir: Path) -> str:
  """Starts the writer, SIGKILLs it as soon as a save is in progress (its
  temporary directory exists) after at least two finished saves; returns its
  output."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  directory = workdir / "checkpoints"
  first = max(checkpoint_names.checkpoint_steps(workdir), default=0)
  with open(workdir / "writer.log", "w+") as log:
    proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(workdir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    killed = False
    try:
      deadline = time.time() + 60
      while time.time() < deadline and proc.poll() is None:
        if (max(checkpoint_names.checkpoint_steps(workdir), default=0) >= first + 2
            and _tmp_dirs(directory)):
          os.kill(proc.pid, signal.SIGKILL)
          killed = True
          break
        time.sleep(0.001)
    finally:
      if proc.poll() is None and not killed:
        proc.kill()
      proc.wait(timeout=30)
    log.seek(0)
    output = log.read()
  assert killed, f"never caught the writer mid-save:\n{output}"
  assert proc.returncode == -signal.SIGKILL
  return output


def test_sigkill_during_save_leaves_a_restorable_workdir(tmp_path):
  directory = tmp_path / "checkpoints"
  # The kill lands within a millisecond of seeing the temporary directory of a
  # ~0.3 s save; should that save finish in between, resume and kill again.
  for _ in range(3):
    output = _run_writer_and_kill_mid_save(tmp_path)
    if _tmp_dirs(directory):
      break
  left_over = _tmp_dirs(directory)
  assert left_over, "expected the interrupted save's temporary directory"
  saved = [int(l.split()[1]) for l in output.splitlines() if l.startswith("SAVED")]
  in_flight = max(int(n.split(".")[0]) for n in left_over)

  target = {"params": {f"w{i}": jax.ShapeDtypeStruct((4_000_000,), jnp.float32)
                       for i in range(4)},
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
  with checkpoints.Checkpointer(tmp_path, keep=2) as ckpt:
    latest = ckpt.latest_step()
    assert latest == in_flight - 1
    assert latest >= max(saved)
    assert in_flight not in ckpt.all_steps()
    state, data_state = ckpt.restore(target)
    assert int(state["step"]) == latest and data_state == {"step": latest}
    for i in range(4):
      w = np.asarray(state["params"][f"w{i}"])
      assert w[0] == latest + i and (w == w[0]).all()
    assert not _tmp_dirs(directory), "partial directories are removed on restart"
    # Training goes on: the next save (the same step number again) works.
    new = jax.tree.map(lambda x: x + 100, state)
    assert ckpt.save(latest + 1, new, {"step": latest + 1})
    ckpt.wait()
    again, _ = ckpt.restore(target)
    assert int(again["step"]) == latest + 100
    assert ckpt.latest_step() == latest + 1


# --------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------


def _random_state(step: int, size: int = 100_000):
  """~400 kB that do not compress (orbax compresses: constant arrays take nothing)."""
  return {"w": jax.random.normal(jax.random.key(step), (size,)), "step": jnp.asarray(step)}


# After orbax gives up on a failed save, tensorstore's late callbacks may find
# its event loop closed: "unraisable" exceptions, which train.py's run sends to
# train.log (tests/test_train_cli.py) and pytest would report as warnings.
late_tensorstore_callbacks = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


async def _no_space(self, text, directory):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))


def _assert_disk_full_message(error, directory, step, last_step, keep=3):
  message = str(error)
  assert message.startswith(f"The disk is full: the checkpoint of step {step} "), message
  assert (f"needs about {disk_space.format_bytes(error.needed)} in {directory} and "
          f"{disk_space.format_bytes(error.free)} are free; " in message
          or f"did not fit in {directory}, where {disk_space.format_bytes(error.free)} were free"
          in message), message
  assert f"The last complete checkpoint is step {last_step}." in message
  assert f"keep fewer with config.keep_checkpoints, now {keep}" in message
  assert message.endswith(f"training resumes from step {last_step}.")
  assert error.errno == errno.ENOSPC and error.last_step == last_step
  assert error.needed > 0 and error.free >= 0


@late_tensorstore_callbacks
@pytest.mark.parametrize("learnt_by", ["wait", "save", "close"])
def test_a_full_disk_in_a_background_write_is_one_clear_error(learnt_by, tmp_path, monkeypatch):
  """Orbax writes in background threads; the ENOSPC of a write there comes
  back from whichever call learns of it as DiskFullError, the unfinished
  checkpoint removed, the last complete one intact."""
  directory = tmp_path / "checkpoints"
  ckpt = checkpoints.Checkpointer(tmp_path, keep=3)
  assert ckpt.save(1, _random_state(1), {"step": 1})
  ckpt.wait()
  monkeypatch.setattr(orbax_items.ProcessJsonCheckpointHandler, "_save_fn", _no_space)
  assert ckpt.save(2, _random_state(2), {"step": 2})     # started; fails in the background
  with pytest.raises(disk_space.DiskFullError) as info:
    if learnt_by == "wait":
      ckpt.wait()
    elif learnt_by == "save":
      ckpt.save(3, _random_state(3), {"step": 3})
    else:
      ckpt.close()
  ckpt.close()                                           # (said once: quiet now)
  _assert_disk_full_message(info.value, directory, 2, 1)
  assert "its unfinished 2.orbax-checkpoint-tmp was removed" in str(info.value)
  assert not _tmp_dirs(directory)
  monkeypatch.undo()
  with checkpoints.Checkpointer(tmp_path, keep=3) as again:
    assert again.all_steps() == [1]
    state, data_state = again.restore(_random_state(0))
  _assert_trees_equal(state, _random_state(1))
  assert data_state == {"step": 1}


def test_free_space_is_checked_before_each_save(tmp_path, monkeypatch):
  """From the second save on (the first tells a checkpoint's size), a save
  that would not fit is refused before anything is written."""
  disk_usage = shutil.disk_usage
  free = {"bytes": 1000}
  monkeypatch.setattr(checkpoint_space.shutil, "disk_usage",
                      lambda path: disk_usage(path)._replace(free=free["bytes"]))
  with checkpoints.Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.save(1, _random_state(1))               # size unknown: not checked
    ckpt.wait()
    size = disk_space.disk_bytes(tmp_path / "checkpoints" / "1")
    with pytest.raises(disk_space.DiskFullError) as info:
      ckpt.save(2, _random_state(2))
    _assert_disk_full_message(info.value, tmp_path / "checkpoints", 2, 1)
    assert f"({int(size * 1.05):,} bytes)" in str(info.value)
    assert "1.0 kB (1,000 bytes) are free; nothing was written." in str(info.value)
    assert not _tmp_dirs(tmp_path / "checkpoints") and ckpt.all_steps() == [1]
    free["bytes"] = int(size * 1.06)                   # room again: saving goes on
    assert ckpt.save(2, _random_state(2))
  assert checkpoint_names.checkpoint_steps(tmp_path) == [1, 2]


@late_tensorstore_callbacks
def test_a_full_disk_while_averaging_keeps_the_checkpoints(tmp_path, monkeypatch):
  with checkpoints.Checkpointer(tmp_path, keep=3) as ckpt:
    for step in (1, 2):
      ckpt.save(step, {"params": _random_state(step)})
  monkeypatch.setattr(checkpoints.ocp.JsonCheckpointHandler, "_save_fn", _no_space)
  with pytest.raises(disk_space.DiskFullError) as info:
    averaging.average_and_save(tmp_path, _random_state(0), num=2)
  message = str(info.value)
  assert message.startswith("The disk is full: the average of steps [1, 2] ")
  assert str(tmp_path / checkpoints.AVERAGED_DIR) in message
  assert "The last complete checkpoint is step 2." in message
  assert "config.average_last=1" in message
  assert not _tmp_dirs(tmp_path / checkpoints.AVERAGED_DIR)
  assert checkpoint_names.checkpoint_steps(tmp_path) == [1, 2]
  assert checkpoint_names.checkpoint_steps(tmp_path, checkpoints.AVERAGED_DIR) == []


@late_tensorstore_callbacks
@pytest.mark.parametrize("check_space", [True, False],
                         ids=["caught_before_writing", "caught_when_a_write_fails"])
def test_a_real_full_disk(check_space, tmp_path):
  """On a 1 MiB tmpfs two ~400 kB checkpoints fit, the third does not: it is
  refused before writing, or (the check off) tensorstore's RESOURCE_EXHAUSTED
  from orbax's threads becomes the same DiskFullError."""
  with small_disk(tmp_path / "disk", 1024) as disk:
    ckpt = checkpoints.Checkpointer(disk, keep=3, check_space=check_space)
    with pytest.raises(disk_space.DiskFullError) as info:
      for step in range(1, 6):
        ckpt.save(step, _random_state(step), {"step": step})
      ckpt.wait()
    ckpt.close()
    _assert_disk_full_message(info.value, disk / "checkpoints", 3, 2)
    assert ("nothing was written" in str(info.value)) == check_space
    assert not _tmp_dirs(disk / "checkpoints")
    with checkpoints.Checkpointer(disk, keep=3) as again:
      assert again.all_steps() == [1, 2]
      state, data_state = again.restore(_random_state(0))
    _assert_trees_equal(state, _random_state(2))
    assert data_state == {"step": 2}
