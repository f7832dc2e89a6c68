"""decode.py on several devices and several processes: parameters split over
8 simulated devices (FSDP) decode as replicated ones do, and two processes on
localhost write the output one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from transformer.data import demo_task

REPO = Path(__file__).resolve().parents[1]
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"
sys.path.insert(0, str(REPO / "tests"))
from helpers import free_port, run_together, subprocess_env  # noqa: E402

FSDP_VS_REPLICATED = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from transformer.decoding import loader
from transformer.runtime import parallel
sentences = json.loads(sys.argv[2])
out = {}
with jax.default_matmul_precision("highest"):
  for sharding in ("replicated", "fsdp"):
    translator = loader.load_translator(sys.argv[1], param_sharding=sharding)
    shards = {str(path): [list(s.data.shape) for s in leaf.addressable_shards]
              for path, leaf in jax.tree_util.tree_leaves_with_path(translator.params)}
    out[sharding] = {
        "devices": len(jax.devices()),
        "bytes_per_device": parallel.bytes_per_device(translator.params),
        "shards": shards,
        "shapes": {str(path): list(leaf.shape)
                   for path, leaf in jax.tree_util.tree_leaves_with_path(translator.params)},
        "greedy": translator.translate_hypotheses(sentences, method="greedy", batch_size=8),
        "beam": translator.translate_hypotheses(sentences, method="beam", n_best=2,
                                                batch_size=8),
        "sample": translator.translate(sentences, method="sample", top_k=5, seed=1,
                                       batch_size=8)}
print(json.dumps(out))
"""


@pytest.mark.slow  # (20-40 s on 2 cores: `python -m pytest -m slow`)
def test_fsdp_parameters_on_eight_devices_decode_as_replicated_ones():
  sentences = [s for s, _ in demo_task.demo_splits(1, num_train=40, num_eval=1,
                                                   num_test=1)["train"]] + [""]
  result = subprocess.run([sys.executable, "-c", FSDP_VS_REPLICATED, str(FIXTURE_WORKDIR),
                           json.dumps(sentences)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  rep, fsdp = out["replicated"], out["fsdp"]
  assert rep["devices"] == fsdp["devices"] == 8
  # Split, never whole on one device: every array whose largest axis 8 divides
  # holds an eighth of it per device (restored that way, not gathered first).
  split = 0
  for name, shape in fsdp["shapes"].items():
    shard_shapes = fsdp["shards"][name]
    assert len(shard_shapes) == 8
    if any(n % 8 == 0 for n in shape):
      assert all(np.prod(s) * 8 == np.prod(shape) for s in shard_shapes), name
      split += 1
  assert split >= len(fsdp["shapes"]) // 2
  assert fsdp["bytes_per_device"] * 4 < rep["bytes_per_device"]
  for method in ("greedy", "beam"):
    texts = lambda r: [[h[0] for h in hyps] for hyps in r[method]]
    assert texts(fsdp) == texts(rep), method
    np.testing.assert_allclose([[h[1] for h in hyps] for hyps in fsdp[method]],
                               [[h[1] for h in hyps] for hyps in rep[method]], atol=1e-5)
  assert fsdp["sample"] == rep["sample"]



@pytest.mark.slow  # (~32 s on 2 cores: `python -m pytest -m slow`)
def test_two_processes_on_localhost_write_what_one_process_writes(tmp_path):
  pairs = demo_task.demo_splits(2, num_train=700, num_eval=1, num_test=1)["train"]
  src = tmp_path / "in.txt"
  src.write_text("".join(s + "\n" for s, _ in pairs[:300]) + "\n"
                 + "".join(s + "\n" for s, _ in pairs[300:]))
  env = subprocess_env(tmp_path / "cache")
  common = [sys.executable, "decode.py", f"--workdir={FIXTURE_WORKDIR}", f"--input={src}",
            "--window_lines=250", "--quiet", "--n_best=2", "--output_format=jsonl"]
  one = tmp_path / "one.jsonl"
  run_together([common + [f"--output={one}"]], env, timeout=300)
  port = free_port()
  two = tmp_path / "two.jsonl"
  run_together([common + [f"--output={two}", f"--coordinator_address=127.0.0.1:{port}",
                          "--num_processes=2", f"--process_id={i}"] for i in range(2)],
               env, timeout=300)
  lines = two.read_text().splitlines()
  assert len(lines) == 701 and json.loads(lines[300]) == {"line": 301, "source": "",
                                                          "hypotheses": []}
  assert two.read_bytes() == one.read_bytes()


@pytest.mark.slow  # (~12 s on 2 cores: `python -m pytest -m slow`)
def test_two_processes_score_what_one_process_scores(tmp_path):
  """decode.py --score over two processes on localhost: each scores every
  other batch of a window, process 0 writes; the bytes of one process's run."""
  pairs = demo_task.demo_splits(3, num_train=600, num_eval=1, num_test=1)["train"]
  src = tmp_path / "pairs.tsv"
  src.write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
  env = subprocess_env(tmp_path / "cache")
  common = [sys.executable, "decode.py", f"--workdir={FIXTURE_WORKDIR}", f"--input={src}",
            "--window_lines=250", "--quiet", "--score", "--alignment", "--output_format=jsonl"]
  one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
  run_together([common + [f"--output={one}"]], env, timeout=300)
  port = free_port()
  run_together([common + [f"--output={two}", f"--coordinator_address=127.0.0.1:{port}",
                          "--num_processes=2", f"--process_id={i}"] for i in range(2)],
               env, timeout=300)
  lines = two.read_text().splitlines()
  assert len(lines) == 600 and json.loads(lines[599])["line"] == 600
  assert two.read_bytes() == one.read_bytes()


@pytest.fixture(scope="module")
def fixture_translator():
  from transformer.decoding import loader
  return loader.load_translator(str(FIXTURE_WORKDIR))


def test_batches_decoded_side_by_side_translate_as_one_at_a_time(fixture_translator,
                                                                monkeypatch):
  """`concurrent_batches`: threads take the batches in turn and decode them
  side by side. Every method gives what one batch at a time gives (texts,
  scores, order, blank lines), and the batches really went through several
  threads, the calling thread one of them (`runner._decode_in_lanes`:
  decode.py's main thread then keeps its batches' temporaries)."""
  import jax
  translator = fixture_translator
  pairs = demo_task.demo_splits(3, num_train=200, num_eval=1, num_test=1)["train"]
  sentences = [s for s, _ in pairs[:45]] + ["", pairs[45][0] + " " + pairs[46][0]]
  threads = []
  dispatch = translator.decoders.dispatch

  def recording(shape, inputs):
    threads.append(threading.current_thread().name)
    return dispatch(shape, inputs)
  monkeypatch.setattr(translator.decoders, "dispatch", recording)
  runs = [dict(method="greedy"), dict(method="beam", n_best=2),
          dict(method="sample", n_best=2, top_k=5, seed=3)]
  with jax.default_matmul_precision("highest"):
    for options in runs:
      threads.clear()
      one = translator.translate_hypotheses(sentences, batch_size=8, concurrent_batches=1,
                                            **options)
      batches, threads[:] = len(threads), []
      three = translator.translate_hypotheses(sentences, batch_size=8, concurrent_batches=3,
                                              **options)
      assert batches >= 6 and len(threads) == batches and len(set(threads)) > 1, options
      assert threading.current_thread().name in threads, (threads, options)
      assert len(three) == len(sentences) and three[45] == one[45]
      assert [[h.text for h in hyps] for hyps in three] == [[h.text for h in hyps]
                                                            for hyps in one], options
      np.testing.assert_array_equal([[h.score for h in hyps] for hyps in three],
                                    [[h.score for h in hyps] for hyps in one])


def test_an_error_in_one_of_the_side_by_side_batches_reaches_the_caller(fixture_translator,
                                                                       monkeypatch):
  translator = fixture_translator
  sentences = [s for s, _ in demo_task.demo_splits(3, num_train=60, num_eval=1,
                                                   num_test=1)["train"][:40]]
  calls = []
  dispatch = translator.decoders.dispatch

  def failing(shape, inputs):
    calls.append(shape)
    if len(calls) == 2:
      raise RuntimeError("out of memory (a test)")
    return dispatch(shape, inputs)
  monkeypatch.setattr(translator.decoders, "dispatch", failing)
  with pytest.raises(RuntimeError, match="a test"):
    translator.translate(sentences, method="greedy", batch_size=4, concurrent_batches=2)
  assert len(calls) < 10  # (the other lane stopped: 10 batches in all)


def test_concurrent_batches_by_default_one_per_cpu_core(fixture_translator, monkeypatch):
  import jax
  from transformer.decoding import runner
  translator = fixture_translator
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
  assert translator.default_concurrent_batches() == 6
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
  assert translator.default_concurrent_batches() == runner.MAX_CONCURRENT_BATCHES == 8
  monkeypatch.setattr(translator.decoders, "devices", 16)
  assert translator.default_concurrent_batches() == 4  # (64 cores over 16 devices)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert translator.default_concurrent_batches() == 1
