"""The benchmarks' measuring tools against hand-counted FLOPs."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def test_matmuls_alone_finds_every_matmul_of_forward_backward_and_scans():
  """A two-layer MLP's loss gradient inside a 3-step scan: 3 x (2 forward +
  4 backward matmuls, minus the input gradient of the first layer, which
  nothing needs), counted by hand."""
  n, d, f = 8, 16, 32
  w1, w2, x = jnp.ones((d, f)), jnp.ones((f, d)), jnp.ones((n, d))

  def loss(ws, x):
    return jnp.sum(jnp.tanh(x @ ws[0]) @ ws[1])

  def train(ws, x):
    def body(ws, _):
      grads = jax.grad(loss)(ws, x)
      return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), None
    return jax.lax.scan(body, ws, None, length=3)[0]

  run, operands, flops = common.matmuls_alone(train, (w1, w2), x)
  forward = 2 * n * d * f * 2                       # x W1, h W2
  backward = 2 * n * d * f * 3                      # dW2, dh, dW1 (no dx: x is not differentiated)
  assert flops == 3 * (forward + backward)
  outputs = run(operands)
  assert len(outputs) == 3 * 5
  assert sorted(o.shape for o in outputs) == sorted(
      3 * [(n, f), (n, d), (f, d), (n, f), (d, f)])


def test_training_flop_model_counts_the_step_matmuls():
  """The closed-form FLOP model of `common.training_flops_per_step` equals the
  FLOPs of the dot_generals the real training step performs."""
  from transformer.model import transformer as M
  config = M.TransformerConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=48,
                               num_encoder_layers=2, num_decoder_layers=1,
                               dropout_rate=0.0)
  params = M.init_params(config, jax.random.key(0))
  batch, src_len, tgt_len = 2, 5, 7
  src = jnp.full((batch, src_len), 5)
  tgt = jnp.full((batch, tgt_len), 6)

  def step(params):
    def loss(params):
      return jnp.sum(M.Transformer(config).apply({"params": params}, src, tgt))
    return jax.grad(loss)(params)

  _, _, flops = common.matmuls_alone(step, params)
  assert flops == common.training_flops_per_step(config, batch, src_len, tgt_len)


def test_decoding_flop_model_counts_the_cached_steps_matmuls(monkeypatch):
  """`flops.decoding_flops` against the FLOPs of the dot_generals of a real
  cached decoding (encode, the encoder memory, then one `decode_step` per
  target token): equal, but for the self-attention over the cache's slots
  not filled yet, which the step computes (its cache as long as the target,
  read whole) and the model count leaves out (t (t - 1) / 2 slot-steps per
  layer)."""
  from transformer.model import kv_cache, transformer as M
  from transformer.model.kv_cache import init_cache
  from transformer.training import flops
  # One prefix: a step reads the whole cache (the default's `lax.switch`
  # among 4 prefixes would put every branch's dots in the jaxpr).
  monkeypatch.setattr(kv_cache, "CACHE_PREFIX_PARTS", 1)
  config = M.TransformerConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=48,
                               num_encoder_layers=2, num_decoder_layers=3,
                               dropout_rate=0.0)
  params = M.init_params(config, jax.random.key(0))
  src_len, tgt_len = 5, 7
  src = jnp.full((1, src_len), 5)

  def decode(params):
    model = M.Transformer(config)
    encoded = model.apply({"params": params}, src, method="encode")
    kernel = model.apply({"params": params}, method="logits_kernel")
    memory = model.apply({"params": params}, encoded, src, None, kernel,
                         method="encoder_memory")
    cache, token = init_cache(config, 1, tgt_len), jnp.full((1,), config.bos_id)
    for _ in range(tgt_len):
      logits, cache = model.apply({"params": params}, token, cache, memory,
                                  method="decode_step")
      token = jnp.argmax(logits, axis=-1)
    return logits

  measured = common.dot_flops_of(decode, params)  # (a step's attention: matrix-vector)
  unfilled = 4 * config.d_model * config.num_decoder_layers * tgt_len * (tgt_len - 1) // 2
  assert measured == flops.decoding_flops(config, [src_len], [tgt_len]) + unfilled
  # Hypotheses multiply the target's part only.
  one, three = (flops.decoding_flops(config, [src_len], [tgt_len], h) for h in (1, 3))
  source = flops.decoding_flops(config, [src_len], [0])
  assert three - source == 3 * (one - source) > 0


def test_program_hash_ignores_where_the_code_lives_but_not_what_it_computes():
  """fingerprint.program_hash: the same computation written in two places (other
  lines, other function names) hashes the same; another computation does not."""
  from benchmarks import fingerprint
  x = jnp.ones((4, 8))

  def scaled(v):
    return jnp.tanh(v * 2.0) + 1.0

  def moved_elsewhere(v):
    return jnp.tanh(v * 2.0) + 1.0

  def other(v):
    return jnp.tanh(v * 3.0) + 1.0

  compile_ = lambda f: jax.jit(f).lower(x).compile()
  assert "scaled" in compile_(scaled).as_text()  # the source location is in the text
  assert fingerprint.program_hash(compile_(scaled)) == fingerprint.program_hash(
      compile_(moved_elsewhere))
  assert fingerprint.program_hash(compile_(scaled)) != fingerprint.program_hash(
      compile_(other))


def test_rated_peaks_by_device_kind():
  from transformer.training import flops

  class Device:
    def __init__(self, platform, kind):
      self.platform, self.device_kind = platform, kind
  assert flops.rated_peak(Device("gpu", "NVIDIA H100 80GB HBM3")) == 989e12
  assert flops.rated_peak(Device("gpu", "NVIDIA A100-SXM4-40GB")) == 312e12
  assert flops.rated_peak(Device("tpu", "TPU v5 lite")) == 197e12
  assert flops.rated_peak(Device("gpu", "Some Future GPU")) is None
  assert flops.rated_peak(Device("cpu", "cpu")) is None


def test_a_cpu_peak_is_measured_once_per_process(monkeypatch):
  """MFU's CPU peak is a 2048^3 float32 matmul timed by the first run of a
  process; later runs of the same process divide by it too."""
  from transformer.training import flops
  sizes = []

  def rate(n=2048, repeats=2, dtype=jnp.float32):
    sizes.append(n)
    return 1e11 + len(sizes)  # (a different figure at every measurement)

  monkeypatch.setattr(flops, "matmul_rate", rate)
  flops.peak_flops.cache_clear()
  try:
    first, again = flops.peak_flops(), flops.peak_flops()
  finally:
    flops.peak_flops.cache_clear()  # (the next run measures the real one)
  assert sizes == [2048]
  assert first == again == (1e11 + 1, "float32 matmul peak of this machine, measured (2048^3)")


_HLO = """HloModule m

%body.1 (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ar = f32[4,8]{1,0} all-reduce(%x), channel_id=1, to_apply=%add
  %f = f32[4,8]{1,0} fusion(%ar), kind=kLoop, calls=%fused.1
}

%fused.1 (a: f32[4,8]) -> f32[4,8] {
  %ar2 = (f32[8]{0}, bf16[2,2]{1,0}) all-reduce-start(%a, %b), channel_id=2, to_apply=%add
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %w = (s32[], f32[4,8]) while(%t), condition=%cond.1, body=%body.1
  %ar3 = s32[] all-reduce(%y), channel_id=3, to_apply=%add
  %ag = f32[16,8]{1,0} all-gather(%x), dimensions={0}
}
"""


def test_collectives_finds_each_with_its_loop_and_bytes():
  found = common.collectives(_HLO)
  assert [(c["computation"], c["in_loop"], c["bytes"], c["dtypes"]) for c in found] == [
      ("body.1", True, 4 * 32, ["f32"]),
      ("fused.1", True, 4 * 8 + 2 * 4, ["bf16", "f32"]),   # called from the loop body
      ("main", False, 4, ["s32"]),
  ]
  assert [c["bytes"] for c in common.collectives(_HLO, "all-gather")] == [4 * 16 * 8]


# The train step on 8 devices (bfloat16 compute, float32 parameters), for 4
# micro-batches (and 1, replicated): per collective (all-reduce, reduce-scatter, all-gather), its
# float32 bytes inside loops and outside; the parameters' float32 bytes; the
# train state's bytes on one device; for each mode: "replicated" and "fsdp" (the
# trainer's step: steps_lib.jit_train_step), and "jit" (train_step under plain
# jit, replicated: what the trainer did before shard_map). One process for all
# three: JAX starts once.
_STEP_COLLECTIVES = """
import json, sys
import jax, numpy as np
sys.path.insert(0, "tests")
import train_worker
from benchmarks import common
from transformer.runtime import parallel
from transformer.training import run_setup, steps as steps_lib
result = {}
for mode, accum in [("replicated", 1), ("replicated", 4), ("fsdp", 4), ("jit", 4)]:
  config = train_worker.tiny_config({"grad_accum_steps": accum, "model.dtype": "bfloat16",
                                     "state_sharding": "fsdp" if mode == "fsdp" else "replicated"})
  model_config = run_setup.model_config_from(config, 128)
  optimizer, schedule = steps_lib.make_optimizer(config, model_config.d_model)
  mesh = parallel.make_mesh()
  state, shardings = steps_lib.init_train_state(config, model_config, optimizer, mesh)
  step, rows = steps_lib.jit_train_step(config, model_config, optimizer, schedule, mesh, shardings)
  if mode == "jit":
    step = jax.jit(lambda s, b: steps_lib.train_step(
        s, b, model_config=model_config, optimizer=optimizer, schedule=schedule,
        label_smoothing=0.1), in_shardings=(shardings, rows), out_shardings=(shardings, None))
  batch = {k: jax.device_put(np.ones((accum, 16, 32), np.int32), rows) for k in (
      "inputs", "targets", "inputs_segment_ids", "targets_segment_ids", "inputs_positions",
      "targets_positions")}
  hlo = step.lower(state, batch).compile().as_text()
  row = {}
  for op in ("all-reduce", "reduce-scatter", "all-gather"):
    found = [c for c in common.collectives(hlo, op) if c["dtypes"] == ["f32"]]
    row[op] = [sum(c["bytes"] for c in found if c["in_loop"]),
               sum(c["bytes"] for c in found if not c["in_loop"])]
  row["params"] = sum(4 * x.size for x in jax.tree_util.tree_leaves(state["params"]))
  row["state_bytes_per_device"] = parallel.bytes_per_device(state)
  result.setdefault(mode, {})[accum] = row
print(json.dumps(result))
"""


@functools.lru_cache(maxsize=None)
def _all_step_collectives() -> dict[str, dict[int, dict]]:
  import json
  import subprocess
  from helpers import REPO, subprocess_env
  env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", _STEP_COLLECTIVES], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  return {mode: {int(k): v for k, v in rows.items()} for mode, rows in result.items()}


def _step_collectives(mode: str) -> dict[int, dict]:
  return _all_step_collectives()[mode]


@pytest.mark.slow  # (15-25 s on 2 cores: `python -m pytest -m slow`)
def test_gradient_accumulation_reduces_the_gradients_once_per_update():
  rows = _step_collectives("replicated")
  params = rows[1]["params"]
  inside_1, outside_1 = rows[1]["all-reduce"]
  assert inside_1 == 0 and params <= outside_1 < params + 64, rows  # the gradients, once
  inside_4, outside_4 = rows[4]["all-reduce"]
  assert inside_4 == 0, rows                     # none per micro-batch
  assert outside_4 == outside_1, rows            # the same bytes as without accumulation


@pytest.mark.slow  # (~22 s on 2 cores: `python -m pytest -m slow`)
def test_plain_jit_would_reduce_the_gradients_at_every_micro_batch():
  # The premise of the shard_map above (measured on main before it: 134,672
  # float32 bytes all-reduced inside the accumulation loop).
  row = _step_collectives("jit")[4]
  assert row["all-reduce"][0] >= row["params"], row


@pytest.mark.slow  # (~20 s on 2 cores: `python -m pytest -m slow`)
def test_fsdp_splits_the_state_and_gathers_and_scatters_once_per_update():
  """state_sharding="fsdp" on 8 devices: one device holds ~1/8 of the train
  state; the parameters are all-gathered and the gradients reduce-scattered
  outside the accumulation loop (once per update), each the parameters' bytes."""
  row, replicated = _step_collectives("fsdp")[4], _step_collectives("replicated")[4]
  assert row["state_bytes_per_device"] <= replicated["state_bytes_per_device"] / 8 + 64
  params = row["params"]
  assert row["all-gather"][0] == 0 and row["reduce-scatter"][0] == 0, row
  # gathered: the whole parameters (a few small ones may stay replicated)
  assert 0.95 * params <= row["all-gather"][1] <= params, row
  assert row["reduce-scatter"][1] >= 0.95 * params / 8, row   # results: 1/8 each
  assert row["all-reduce"][0] == 0, row


@pytest.mark.slow  # (20-40 s on 2 cores: `python -m pytest -m slow`)
def test_accelerator_check_runs_on_cpu_and_every_row_passes():
  """benchmarks/accelerator_check.py --shapes=tiny, as a person would run it
  (a subprocess on CPU; fast XLA compiles, as the other subprocess tests use):
  exit status 0, every row of its table PASS, and every check present."""
  import subprocess
  from helpers import REPO, subprocess_env
  env = subprocess_env()  # (XLA at -O0: helpers.FAST_COMPILE_FLAGS)
  proc = subprocess.run([sys.executable, "benchmarks/accelerator_check.py", "--shapes=tiny",
                         "--repeats=2"], env=env, cwd=REPO, capture_output=True, text=True,
                        timeout=240)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
  rows = [[cell.strip() for cell in line.strip("|").split("|")]
          for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
  assert rows and all(row[6] == "PASS" for row in rows), proc.stdout
  present = {(row[1].split(":")[0], row[2], row[3]) for row in rows}
  for dtype in ("float32", "bfloat16"):
    for implementation in ("einsum", "xla"):
      assert ("attention", implementation, dtype) in present, present
    assert ("LayerNorm", "layers.LayerNorm vs flax", dtype) in present, present
    assert any(c == "cached decoding" and d == dtype for c, _, d in present), present
  assert ("dropout = jax.random.bernoulli's", "prng.dropout", "bfloat16") in present, present
  measured = {(row[1], row[2]): row[7] for row in rows}
  assert "as fast" in measured["dropout = jax.random.bernoulli's", "prng.dropout"]
  assert "MFU" in measured["training step", "einsum attention"]
  assert "sentences/s" in measured["decoding", "greedy"]
  assert "sentences/s" in measured["decoding", "beam 4"]
  assert "FAIL" not in proc.stdout, proc.stdout


def test_accelerator_check_fails_a_wrong_attention():
  """The attention check is not vacuous: attention without the 1/sqrt(d_k)
  scale, or without the causal mask, FAILs in float32 and under the looser
  bfloat16 tolerance alike, where the einsums on the same inputs PASS."""
  import math
  from benchmarks import accelerator_check as check
  from transformer.model import transformer as M
  inputs = check.attention_inputs(batch=4, length=16, heads=2, head_dim=16)
  unscaled = lambda q, k, v, mask: check.reference_attention(
      q * math.sqrt(q.shape[-1]), k, v, mask)
  not_causal = lambda q, k, v, mask: check.reference_attention(
      q, k, v, mask | jnp.swapaxes(mask, -1, -2))
  einsum = lambda q, k, v, mask: M.scaled_dot_product_attention(
      q, k, v, mask, implementation="einsum")[0]
  for dtype in ("float32", "bfloat16"):
    assert check.check_attention(einsum, "einsum", dtype, inputs).result == "PASS"
    for name, wrong in (("unscaled", unscaled), ("not causal", not_causal)):
      row = check.check_attention(wrong, name, dtype, inputs)
      assert row.result == "FAIL" and row.error > 10 * row.tolerance, row


def test_input_pipeline_benchmark_needs_and_measures():
  """bench_input_pipeline: what transformer-base needs on one H100 (the FLOP count
  by hand: 6 x weights x tokens + 3 x the attention matmuls), and a measurement
  of a tiny synthetic corpus (made twice alike from one seed) that adds up."""
  from benchmarks import bench_input_pipeline as bench
  from transformer.data import sources, tokenizer as tokenizer_lib
  d, d_ff, vocab, layers, rows, length = 512, 2048, 37000, 6, 96, 256
  tokens = rows * length
  weights = layers * ((4 * d * d + 2 * d * d_ff) + (6 * d * d + 2 * d * d_ff) + 2 * d * d)
  step = 6 * (weights + d * vocab) * tokens + 3 * rows * 4 * d * layers * 3 * length ** 2
  need = bench.needed()
  assert need["step_tflop"] * 1e12 == pytest.approx(step, rel=1e-9)
  assert need["steps_per_s"] == pytest.approx(0.5 * 989e12 / step, rel=1e-9)
  assert need["target_slots_per_s"] == pytest.approx(need["steps_per_s"] * tokens, rel=1e-9)

  pairs = list(bench.synthetic_pairs(400, seed=3))
  assert pairs == list(bench.synthetic_pairs(400, seed=3)) and len(pairs) == 400
  assert not any("\t" in s or "\n" in s or "\t" in t or "\n" in t for s, t in pairs)
  tok = tokenizer_lib.train_tokenizer(sources.sample_sentences(pairs), None, 300,
                                      model_type="bpe")
  result = bench.measure(pairs, tok, workers=0, seconds=0.3, warmup=1)
  assert result["batches_per_s"] > 0 and 0.5 < result["fill"] <= 1
  assert result["target_tokens_per_s"] == pytest.approx(
      result["batches_per_s"] * rows * length * result["fill"], rel=1e-9)


@pytest.mark.parametrize("chunk,factor", [(4, 2), (8, 2), (4, 4), (2, 2)])
def test_batching_benchmark_counts_the_row_steps_the_shrinking_loop_runs(monkeypatch, chunk,
                                                                         factor):
  """bench_batching.row_steps (arithmetic) against `loops._shrinking_loop`
  itself running a toy step that adds up the rows it runs on: the same
  rows x steps for inputs needing 3, 9, 1, 14, 2 steps in a batch of 8 (3
  empty rows), checks every `chunk` steps, shrinking by `factor`."""
  from typing import NamedTuple
  from benchmarks import bench_batching
  from transformer.decoding import loops, options
  monkeypatch.setattr(options, "EARLY_EXIT_CHUNK", chunk)
  needed, batch = [3, 9, 1, 14, 2], 8
  sizes = loops.Shrink(factor=factor, min_rows=2).sizes(batch)

  class Toy(NamedTuple):
    step: jax.Array
    need: jax.Array   # [rows] steps each input needs
    work: jax.Array   # rows x steps run so far

  start = Toy(jnp.int32(0), jnp.asarray(needed + [0] * (batch - len(needed)), jnp.int32),
              jnp.int32(0))
  run = jax.jit(lambda state: loops._shrinking_loop(
      lambda s: s._replace(step=s.step + 1, work=s.work + s.need.shape[0]),
      lambda s: s.need > s.step,
      lambda s: jnp.broadcast_to(s.work, s.need.shape),
      lambda s, indices: s._replace(need=s.need[indices]),
      state, batch=batch, num_steps=32, sizes=sizes))
  work = int(jnp.max(run(start)))
  assert work == bench_batching.row_steps(needed, batch, chunk, sizes)
  assert work >= sum(needed)


def test_the_continuous_batching_ceiling_rounds_each_sentence_up_to_a_check():
  """bench_batching's ceiling for refilling freed rows: each sentence holds a
  row until the first check after its end (by hand: 3, 9, 1, 14, 2 steps
  -> 4 + 10 + 2 + 14 + 2 = 32 with checks every 2, 4 + 12 + 4 + 16 + 4 = 40
  every 4), never more than the shrinking batch of 8 runs."""
  from benchmarks import bench_batching
  needed = [3, 9, 1, 14, 2]
  assert bench_batching.continuous_row_steps(needed, 2) == 32
  assert bench_batching.continuous_row_steps(needed, 4) == 40
  for chunk in (2, 4):
    assert bench_batching.continuous_row_steps(needed, chunk) <= bench_batching.row_steps(
        needed, 8, chunk, [8, 4, 2])


def test_the_built_continuous_batching_drains_its_pool_like_a_shrinking_batch():
  """bench_batching.pool_row_steps, by hand: 3, 9, 1, 14, 2 steps on a pool
  of 2 rows, checks every 2 steps. Rows 3 and 9 start; at step 4 the 3 is
  done and 1 takes its row, at 6 the 1 is done and 14 takes it, at 10 the 9
  is done and 2 takes it (the queue is empty: 20 row-steps so far); at 12
  the 2 is done (24), one row left: the pool goes on with 1 row, the 14 ends
  at step 20 (8 more): 32. Fewer than the one batch of 8 shrinking to 2."""
  from benchmarks import bench_batching
  needed = [3, 9, 1, 14, 2]
  assert bench_batching.pool_row_steps(needed, 2, 2, [2, 1]) == 32
  # A pool as large as the queue is the shrinking batch itself.
  assert bench_batching.pool_row_steps(needed, 8, 2, [8, 4, 2]) == bench_batching.row_steps(
      needed, 8, 2, [8, 4, 2])
  # Without shrinking, 2 rows until the 14 (started at step 6) ends at step 20.
  assert bench_batching.pool_row_steps(needed, 2, 2, [2]) == 40


def test_batching_benchmark_counts_the_packed_source_read_in_whole_chunks():
  """bench_batching.packed_read, by hand: lengths 2, 5, 3, 1, 3, 2 pack into
  2 rows of 8 (test_source_packing), read as one chunk of 8 rows: 64 tokens;
  nine sentences of 8 tokens fill 9 rows: two chunks, 128."""
  from benchmarks import bench_batching
  from transformer.decoding import source_packing
  assert source_packing.CHUNK == 8
  members = [[5] * n for n in (2, 5, 3, 1, 3, 2)]
  assert bench_batching.packed_read(members, rows=16, length=8) == 64
  assert bench_batching.packed_read([[5] * 8] * 9, rows=16, length=8) == 128


def test_batching_benchmark_shrink_sizes_follow_the_translators_ladder_by_any_factor():
  """bench_batching.shrink_sizes: the translator's own shrink rule (at least
  SHRINK_MIN_ROWS = 8 rows, a multiple of its devices) with the factor
  replaced; the ladders by hand. No shrinking (shrink_batches off): the
  batch alone."""
  import types
  from benchmarks import bench_batching
  from transformer.decoding import batch_plan
  fake = types.SimpleNamespace(policy=batch_plan.Policy(devices=1, shrink_batches=True))
  assert bench_batching.shrink_sizes(fake, 128, 4) == [128, 32, 8]
  assert bench_batching.shrink_sizes(fake, 128, 2) == [128, 64, 32, 16, 8]
  assert bench_batching.shrink_sizes(fake, 32, 2) == [32, 16, 8]
  assert bench_batching.shrink_sizes(fake, 32, 4) == [32, 8]
  assert bench_batching.shrink_sizes(fake, 24, 2) == [24, 12]
  fake.policy.shrink_batches = False
  assert bench_batching.shrink_sizes(fake, 128, 2) == [128]


def test_batching_benchmark_counts_the_steps_decoders_run_as_its_arithmetic_does():
  """bench_batching.counted_input_steps (the real decoders, each step
  reporting its batch's inputs, lanes side by side) against row_steps (the
  arithmetic of part 1, from the translations' lengths): the same total for
  greedy search on the tiny fixture model, 18 lines in batches of 16 that
  shrink to 8 (halves), and the tokens counted are the translations' own."""
  from pathlib import Path
  from benchmarks import bench_batching
  from transformer.decoding import loader
  translator = loader.load_translator(
      Path(__file__).resolve().parent / "fixtures" / "workdir_d26a6fb")
  lines = ["one old apple", "six hundred thirty-seven old apples and one big child",
           "two big children", "three red cars and one small dog", "nine",
           "twelve new houses"] * 3
  lengths = [h[0].length for h in translator.translate_hypotheses(lines, method="greedy",
                                                                   batch_size=8)]
  encoded, _ = translator.encode(lines)
  sizes = bench_batching.shrink_sizes(translator, 16, 2)
  assert sizes == [16, 8]
  batches = bench_batching.make_batches("consecutive", encoded, translator.config.max_len, 16,
                                        bench_batching.greedy_shared(translator, encoded))
  expected = bench_batching.batches_row_steps(lengths, batches, 16, 2, sizes)
  steps, tokens = bench_batching.counted_input_steps(translator, lines, "greedy", 16,
                                                     shrink_factor=2)
  assert (steps, tokens) == (expected, sum(lengths))
  assert steps > tokens  # (a batch runs rows past their sentences' ends)


def test_decode_benchmark_runs_the_translators_decoder_for_every_step():
  """`bench_decode.bench` calls a Translator decoder as `translate_hypotheses`
  does (its arguments, its three outputs): a change of the decoder's
  signature fails here, not at the next measurement. Every row decodes all
  GEN_LEN steps (random weights: no EOS), which `bench` asserts. The "tiny"
  shape: the call is the same for every shape, and S's 3 + 3 layers of
  d_model 256 took twice as long (23.5 s against 11.7, 2 cores, 2026-11-29)."""
  from benchmarks import bench_decode
  for method, beams in (("greedy", 1), ("beam", 2)):
    row = bench_decode.bench("tiny", method, beams, repeats=1, sentences=2)
    assert row["sentences"] == 2 and row["seconds"] > 0 and row["floor_s"] > 0


def test_ab_decode_commands_reads_sources_and_summarizes_by_hand(tmp_path):
  """ab_decode_commands.py: a TSV's first column or a text file's lines, cut
  to --lines; the table's medians, speeds against the first tree and equal
  output lines, computed by hand."""
  from benchmarks import ab_decode_commands as ab
  tsv, text = tmp_path / "a.tsv", tmp_path / "a.txt"
  tsv.write_text("one\tun\ntwo\tdeux\nthree\ttrois\n", encoding="utf-8")
  text.write_text("one two\nthree\n", encoding="utf-8")
  assert ab.read_input(tsv, 2)[0] == ["one", "two"]
  assert ab.read_input(text, 5)[0] == ["one two", "three"]
  rows = ab.summary(["old", "new"], {"old": [3.0, 5.0, 4.0], "new": [2.0, 2.5, 9.0]},
                    {"old": ["a", "b", "c"], "new": ["a", "x", "c"]})
  assert rows[2] == "| old | 4.00 | 1.000x | 3.00 5.00 4.00 | 3 |"
  assert rows[3] == "| new | 2.50 | 1.600x | 2.00 2.50 9.00 | 2 |"
  short = ab.summary(["old", "new"], {"old": [1.0], "new": [1.0]},
                     {"old": ["a", "b"], "new": ["a"]})
  assert short[3].endswith("| 1 (1 lines against 2) |")
  with pytest.raises(SystemExit):
    ab.main([f"--trees={tmp_path}", "--workdir=w", f"--input={text}"])  # (no decode.py)
  env = ab.environment("A_B=1 GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
  assert env["A_B"] == "1" and env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  assert env["PATH"] == os.environ["PATH"]  # (added to this process's environment)
  assert ab.environment("") == dict(os.environ)
  with pytest.raises(SystemExit, match="not NAME=VALUE"):
    ab.environment("A=1 B")
  assert ab.split_at_dashes(["--rounds=1", "--", "--beam_size=4", "--"]) == (
      ["--rounds=1"], ["--beam_size=4", "--"])
  assert ab.split_at_dashes(["--rounds=1"]) == (["--rounds=1"], [])
  with ab.lines_in_a_file(["one", "two three"]) as path:
    assert open(path, encoding="utf-8").read() == "one\ntwo three\n"
  assert not os.path.exists(path)


@pytest.mark.slow  # (~10 s: four decode.py processes of the fixture model)
def test_ab_decode_commands_runs_decode_py_of_each_tree(tmp_path, capsys):
  """The whole A/B on the fixture model: this checkout against itself, one
  round: the same output lines, and a row per tree; then with and without
  an environment variable, a row for each."""
  from benchmarks import ab_decode_commands as ab
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  text = tmp_path / "in.txt"
  text.write_text("a cat\nthe red car\n", encoding="utf-8")
  args = [f"--trees={repo}", f"--workdir={repo}/tests/fixtures/workdir_d26a6fb",
          f"--input={text}", "--rounds=1"]
  assert ab.main(args + ["--", "--method=greedy"]) == 0
  out = capsys.readouterr().out
  assert f"| {repo} | " in out and out.rstrip().endswith("| 2 |")
  assert ab.main(args + ["--env=", "--env=TRANSFORMER_KEEP_FREED_MEMORY=0",
                         "--", "--method=greedy"]) == 0
  rows = capsys.readouterr().out.rstrip().splitlines()[-2:]
  assert rows[0].startswith(f"| {repo} (no variables) | ") and rows[0].endswith("| 2 |")
  assert rows[1].startswith(f"| {repo} TRANSFORMER_KEEP_FREED_MEMORY=0 | ")
  assert rows[1].endswith("| 2 |")


def test_decode_phases_splits_a_command_by_hand():
  """decode_phases.py: the phases from a child's stamps (seconds since its
  start) and the command's wall time, worked out by hand; the table's
  medians."""
  from benchmarks import decode_phases
  stamps = {"jax imported": 0.4, "first load": 0.55, "decoders loaded": 0.2, "decoded": 1.0}
  phases = decode_phases.phase_seconds(stamps, total=1.9)
  assert list(phases) == list(decode_phases.PHASES)
  assert phases == pytest.approx({"start, import jax": 0.4, "decode.py ready": 0.15,
                                  "loading decoders": 0.2, "decoding": 1.0,
                                  "the rest": 0.15})
  rows = decode_phases.summary([phases, dict(phases, decoding=2.0), dict(phases, decoding=1.5)],
                               [1.9, 2.9, 2.4])
  assert rows[5] == "| decoding | 1.50 | 1.00 2.00 1.50 |"
  assert rows[-1] == "| whole command | 2.40 | 1.90 2.90 2.40 |"


@pytest.mark.slow  # (~10 s: two decode.py processes of the fixture model)
def test_decode_phases_times_decode_py_of_this_checkout(tmp_path, capsys):
  """decode_phases.py on the fixture model, one round: every phase but the
  rest took some time, and the phases add up to the whole command."""
  from benchmarks import decode_phases
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  text = tmp_path / "in.txt"
  text.write_text("a cat\nthe red car\n", encoding="utf-8")
  assert decode_phases.main([f"--workdir={repo}/tests/fixtures/workdir_d26a6fb",
                             f"--input={text}", "--rounds=1", "--", "--method=greedy"]) == 0
  rows = capsys.readouterr().out.rstrip().splitlines()[-6:]
  seconds = [float(row.split("|")[2]) for row in rows]
  assert [row.split("|")[1].strip() for row in rows[:-1]] == list(decode_phases.PHASES)
  assert all(s > 0 for s in seconds[:4]) and seconds[4] >= 0  # (the rest: nothing counted twice)
  assert sum(seconds[:-1]) == pytest.approx(seconds[-1], abs=0.03)  # (rounding to 0.01 s)
