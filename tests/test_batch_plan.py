"""The batch plan (decoding/batch_plan.py) on its own: pure Python, no model,
no JAX; every expected plan worked out by hand from the rules it documents."""

from __future__ import annotations

import ast
from pathlib import Path

from transformer.decoding import batch_plan
from transformer.decoding.batch_plan import DecoderShape, Policy, Request

ROOT = Path(__file__).resolve().parents[1]
CPU = Policy.for_platform("cpu", 1)
GPU = Policy.for_platform("gpu", 1)


def _ids(length: int) -> list[int]:
  """An input of `length` tokens, EOS included (the ids do not matter)."""
  return [5] * length


def test_the_plan_imports_no_jax():
  """batch_plan.py and the modules it imports of the project import neither
  JAX nor flax (their imports read from the source, as test_import_graph)."""
  for name in ("batch_plan", "batching", "options"):
    tree = ast.parse((ROOT / "transformer" / "decoding" / f"{name}.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "flax")}, name
    assert imported <= {"__future__", "dataclasses", "typing", "numpy",
                        "transformer.decoding", "transformer.decoding.options",
                        "transformer.runtime.errors"}, (name, imported)


def test_policies_by_platform():
  """On a CPU every measured policy is on (sources packed only with one
  device); on a GPU all are off: whole batches, one decoder per bucket."""
  assert (CPU.shrink_batches, CPU.pack_sources, CPU.share_buckets, CPU.cut_least_padding,
          CPU.first_search, CPU.small_decoders_for_few_rows) == (True, True, True, True,
                                                                 True, False)
  assert Policy.for_platform("cpu", 2).pack_sources is False
  assert (GPU.shrink_batches, GPU.pack_sources, GPU.share_buckets,
          GPU.cut_least_padding) == (False, False, False, False)


def test_greedy_plan_of_twelve_inputs_on_a_cpu():
  """12 inputs of 3..14 tokens, batch_size 4, greedy, model max_len 64.
  By hand: buckets 8 (lengths 3-8: six inputs) and 16 (9-14: six).
  `shared_buckets` (rows 1 per input): keeping both costs 2 x 2^20; padding
  bucket 8 to 16 costs one decoder plus 6 x (256 - 64) = 1152: shared, so
  every batch is padded to 16. Batches of 4 in length order: inputs 0-3,
  4-7, 8-11 (greedy cuts where padding is least, all pad to 16 alike).
  Output length: 16 + 50 = 66, rounded up to 2 -> 66; each input's limit
  is its own bucket's: 8 + 50 = 58 for inputs 0-5, 66 for 6-11. First
  search: 16 + max(16, 8) = 32 steps (< 66). Longest batches first."""
  encoded = [_ids(n) for n in range(3, 15)]
  plan = batch_plan.plan(encoded, Request(method="greedy", batch_size=4), CPU,
                         max_source_len=64)
  shape = DecoderShape("greedy", 4, 16, 32, 4, 0, True, False, False, 0, "exact", True,
                       True, True, 66, 4, False)
  assert plan.batches == [(shape, [8, 9, 10, 11]), (shape, [4, 5, 6, 7]),
                          (shape, [0, 1, 2, 3])]
  assert plan.limits == {i: 58 if i < 6 else 66 for i in range(12)}
  # A GPU: buckets of their own, whole batches, no first search's packing.
  plan = batch_plan.plan(encoded, Request(method="greedy", batch_size=4), GPU,
                         max_source_len=64)
  assert [(s.src_len, s.max_len, s.search_len, s.shrink, s.packed, members)
          for s, members in plan.batches] == [
      (16, 32, 66, False, False, [8, 9, 10, 11]),
      (16, 32, 66, False, False, [4, 5, 6, 7]),   # (lengths 7-10: the longest is 16's)
      (8, 24, 58, False, False, [0, 1, 2, 3])]


def test_beam_plan_shares_and_shrink_factors():
  """Beam 4 (4 rows per input), batch_size 2 -> 8 rows; n_best 1 goes into
  the decoder. Rows to decode per decoder counted over every share, and
  halves from FINE_SHRINK_MIN_ROWS on; share (1, 2) takes batches 1, 3, ...
  of the plan in length order (then longest first)."""
  encoded = [_ids(5)] * 6  # one bucket (8): 3 batches of 2, 24 beam rows in all
  request = Request(method="beam", beam_size=4, batch_size=2)
  plan = batch_plan.plan(encoded, request, CPU, max_source_len=64)
  assert [members for _, members in plan.batches] == [[4, 5], [2, 3], [0, 1]]
  (shape, _), = set((s, 0) for s, _ in plan.batches)
  assert (shape.batch, shape.src_len, shape.n_best, shape.shrink_factor,
          shape.log_probs) == (2, 8, 1, batch_plan.SHRINK_FACTOR, True)
  fine = Request(method="beam", beam_size=4, batch_size=2)
  old = batch_plan.FINE_SHRINK_MIN_ROWS
  try:
    batch_plan.FINE_SHRINK_MIN_ROWS = 24  # (all 24 rows count, though a share has 8)
    shares = batch_plan.plan(encoded, fine, CPU, max_source_len=64, share=(1, 2))
  finally:
    batch_plan.FINE_SHRINK_MIN_ROWS = old
  assert [members for _, members in shares.batches] == [[2, 3]]
  assert shares.batches[0][0].shrink_factor == batch_plan.FINE_SHRINK_FACTOR


def test_rows_by_tokens_and_devices():
  """batch_tokens 256: 256 // 16 = 16 rows for bucket 16, 4 for 64; at least
  one input's samples; rounded up to a multiple of the devices."""
  assert CPU.batch_rows(32, 1, batch_tokens=256, src_len=16) == 16
  assert CPU.batch_rows(32, 1, batch_tokens=256, src_len=64) == 4
  assert CPU.batch_rows(32, 3, batch_tokens=256, src_len=256) == 3
  assert Policy.for_platform("cpu", 8).batch_rows(12, 1) == 16


def test_small_decoders_and_searching_again():
  """Small only for greedy/sampling first searches of at most
  SMALL_DECODER_MAX_ROWS rows, where the policy allows; the decoder that
  searches again has 8 rows (at least one input's, a multiple of the
  devices, at most the batch's: one such decoder per first search's), for
  the whole search."""
  policy = Policy(small_decoders_for_few_rows=True)
  limit = batch_plan.SMALL_DECODER_MAX_ROWS
  assert policy.small_decoder("greedy", limit, True) is True
  assert policy.small_decoder("greedy", limit + 1, True) is False
  assert policy.small_decoder("beam", 1, True) is False
  assert policy.small_decoder("sample", 1, False) is False
  assert CPU.small_decoder("greedy", 1, True) is False
  shape = DecoderShape("greedy", 128, 16, 32, 1, 0, search_len=66, shrink_factor=4,
                       small=True)
  assert shape.first_search
  again = batch_plan.search_again_shape(shape, copies=1, devices=1)
  assert (again.batch, again.max_len, again.small, again.first_search) == (8, 66, False,
                                                                           False)
  assert batch_plan.search_again_shape(shape, copies=12, devices=1).batch == 12  # (one input)
  assert batch_plan.search_again_shape(shape, copies=1, devices=3).batch == 9
  assert batch_plan.search_again_shape(shape._replace(batch=4), 1, devices=1).batch == 4


def test_shrinking_steps():
  """A quarter at a time down to 8 rows (a multiple of the devices); once
  only for a small decoder; none without early exit or shrinking."""
  shape = DecoderShape("greedy", 128, 16, 32, 1, 0)
  assert batch_plan.shrinking(shape, 1) == (4, 8, 1, None)
  assert batch_plan.shrinking(shape._replace(small=True), 1) == (4, 8, 1, 1)
  assert batch_plan.shrinking(shape._replace(shrink_factor=2), 16) == (2, 16, 16, None)
  assert batch_plan.shrinking(shape._replace(early_exit=False), 1) is None
  assert batch_plan.shrinking(shape._replace(shrink=False), 1) is None


def test_output_lengths():
  """The paper's budget, source + 50, in whole early-exit chunks (2); an
  explicit max_len as given; learned positions stop at the model's max_len."""
  assert batch_plan.output_length(8, None, 50, None) == 58
  assert batch_plan.output_length(8, None, 51, None) == 60
  assert batch_plan.output_length(8, 20, 50, None) == 20
  assert batch_plan.output_length(64, None, 50, 100) == 100
