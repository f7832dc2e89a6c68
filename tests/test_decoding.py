"""Tests for transformer/decoding/search.py.

The strategies are checked against references computed independently in
numpy (float64) from toy models:

  * a "hash" model whose next-token distribution depends on the whole history
    (a rolling hash of the emitted tokens, the step and a per-input offset
    selects a row of a fixed random table). Its cache has a scalar position,
    a `[flat_batch]` state, a `[flat_batch, max_len]` history and the
    `[flat_batch]` offset; the logits turn to NaN if the history and the state
    disagree, so a strategy that reorders one leaf but not another fails;
  * a Markov model with hand-written probabilities, for hand-computed scores.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.decoding import sampling, search as decoding

from transformer.decoding import beam_search as beam_lib
from transformer.decoding import loops, options
from transformer.decoding import top_k as top_k_lib

try:
  from scipy import stats
except ImportError:  # pragma: no cover - scipy is optional
  stats = None

N_STATES = 101  # Rows of the hash model's table (prime, for the hash).


# ---------------------------------------------------------------------------
# Toy models and numpy references
# ---------------------------------------------------------------------------


def _hash(state, token, step):
  return (state * 31 + token * 7 + step * 3 + 1) % N_STATES


def make_hash_model(table, max_len: int, calls: list | None = None,
                    eos_id=None, eos_from: int | None = None):
  """tokens_to_logits over a history-dependent table.

  calls: if given, the model appends its step index there at every call.
  eos_id, eos_from: if given, EOS is impossible before step `eos_from` and
    near certain from then on.
  """
  table = jnp.asarray(table, jnp.float32)
  pow31 = jnp.asarray([pow(31, m, N_STATES) for m in range(max_len + 2)], jnp.int32)
  positions = jnp.arange(max_len, dtype=jnp.int32)

  def tokens_to_logits(token_ids, cache):
    if calls is not None:
      jax.debug.callback(lambda i: calls.append(int(i)), cache["index"])
    index = cache["index"]
    history = cache["history"].at[:, index].set(token_ids)
    state = _hash(cache["state"], token_ids, index)
    # The same state recomputed from the offset and the history (closed form of
    # the rolling hash): a consistency check between the cache leaves.
    weights = jnp.where(positions <= index, pow31[jnp.clip(index - positions, 0)], 0)
    terms = ((history * 7 + positions * 3 + 1) % N_STATES) * weights
    from_history = ((cache["offset"] % N_STATES) * pow31[index + 1]
                    + jnp.sum(terms % N_STATES, axis=1)) % N_STATES
    logits = table[state]
    if eos_from is not None:
      logits = logits.at[:, eos_id].set(jnp.where(index >= eos_from, 30.0, -jnp.inf))
    logits = jnp.where((from_history == state)[:, None], logits, jnp.nan)
    new_cache = dict(index=index + 1, history=history, state=state,
                     offset=cache["offset"])
    return logits, new_cache

  return tokens_to_logits


def init_hash_cache(offsets, max_len):
  offsets = jnp.asarray(offsets, jnp.int32)
  return dict(index=jnp.int32(0),
              history=jnp.zeros((len(offsets), max_len), jnp.int32),
              state=offsets % N_STATES, offset=offsets)


def ref_log_probs(table, offset, prefix, *, bos_id, eos_id, min_len=0):
  """float64 log p(next | BOS + prefix) of the hash model, min_len applied."""
  state = offset % N_STATES
  for step, token in enumerate([bos_id] + list(prefix)):
    state = _hash(state, token, step)
  logits = table[state].astype(np.float64)
  if len(prefix) < min_len:
    logits[eos_id] = -np.inf
  m = logits.max()
  return logits - m - np.log(np.sum(np.exp(logits - m)))


def gnmt_lp(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def brute_force_nbest(table, offset, *, max_len, bos_id, eos_id, alpha, min_len,
                      n):
  """Every sequence, scored: finished ones first, then truncated, best first."""
  vocab = table.shape[1]
  finished, truncated = [], []

  def expand(prefix, log_prob):
    log_probs = ref_log_probs(table, offset, prefix, bos_id=bos_id,
                              eos_id=eos_id, min_len=min_len)
    for token in range(vocab):
      if log_probs[token] == -np.inf:
        continue
      seq, lp = prefix + [token], log_prob + log_probs[token]
      if token == eos_id:
        finished.append((lp / gnmt_lp(len(seq), alpha), seq))
      elif len(seq) == max_len:
        truncated.append((lp / gnmt_lp(max_len, alpha), seq))
      else:
        expand(seq, lp)

  expand([], 0.0)
  ranked = (sorted(finished, key=lambda x: -x[0])
            + sorted(truncated, key=lambda x: -x[0]))[:n]
  ranked += [(-np.inf, [])] * (n - len(ranked))  # Empty slots: -inf, all PAD.
  scores = np.array([s for s, _ in ranked])
  seqs = np.array([seq + [0] * (max_len - len(seq)) for _, seq in ranked])
  return seqs, scores


def random_table(seed, vocab, scale=1.5):
  return (np.random.default_rng(seed).normal(size=(N_STATES, vocab)) * scale
          ).astype(np.float32)


# Markov model with hand-written probabilities: PAD, BOS, EOS, A, B.
PAD, BOS, EOS, A, B = range(5)
MARKOV = np.array([
    [0.0, 0.0, 0.2, 0.4, 0.4],  # after PAD (never used)
    [0.0, 0.0, 0.1, 0.5, 0.4],  # after BOS
    [0.0, 0.0, 0.2, 0.4, 0.4],  # after EOS (never used)
    [0.0, 0.0, 0.7, 0.1, 0.2],  # after A
    [0.0, 0.0, 0.3, 0.1, 0.6],  # after B
])


def make_markov_model(log_table):
  """Next-token log-probs depend on the previous token only (log 0 = -inf)."""
  def tokens_to_logits(token_ids, cache):
    return log_table[token_ids], dict(cache, index=cache["index"] + 1)
  return tokens_to_logits


# Arguments that fix shapes or Python control flow; the others (ids, lengths,
# alpha, temperature, top_p, the PRNG key) are passed traced, which checks that
# nothing is hard-coded and lets tests share compilations.
STATIC_ARGS = ("max_len", "beam_size", "top_k", "early_exit", "reorder_cache", "shrink",
               "n_best", "stop", "log_probs", "bound_len", "return_done")
# Compiling dominates the run time of these tests; XLA's -O0 cuts it by about a
# third and does not change what is computed.
jit = functools.partial(jax.jit,
                        compiler_options={"xla_backend_optimization_level": 0})


@functools.cache
def _compiled(strategy, model_kind, max_len, static_items):
  def fn(table, cache, dynamic):
    model = (make_hash_model(table, max_len) if model_kind == "hash"
             else make_markov_model(table))
    return strategy(model, cache, batch_size=cache["offset"].shape[0],
                    max_len=max_len, **dict(static_items), **dynamic)
  return jit(fn)


def _split_args(strategy, kwargs):
  """-> (static items, traced arguments with every default filled in and a
  fixed dtype, so that calls differing only in values share a compilation)."""
  static = tuple(sorted((k, v) for k, v in kwargs.items() if k in STATIC_ARGS))
  dynamic = {}
  for name, param in inspect.signature(strategy).parameters.items():
    if param.kind != param.KEYWORD_ONLY or name in STATIC_ARGS + (
        "batch_size", "max_len"):
      continue
    value = kwargs.get(name, param.default)
    if value is None:  # (an option left out: empty_rows)
      continue
    if name in ("rng", "empty_rows", "row_limits"):
      dynamic[name] = value
    elif name in ("bos_id", "eos_id", "min_len"):
      dynamic[name] = jnp.int32(value)
    else:
      dynamic[name] = jnp.float32(value)
  unknown = set(kwargs) - set(dynamic) - set(STATIC_ARGS)
  assert not unknown, unknown
  return static, dynamic


def run(strategy, table, offsets, *, max_len, **kwargs):
  """Jitted `strategy` on the hash model for len(offsets) inputs -> numpy."""
  static, dynamic = _split_args(strategy, kwargs)
  out = _compiled(strategy, "hash", max_len, static)(
      jnp.asarray(table), init_hash_cache(offsets, max_len), dynamic)
  return jax.tree.map(np.asarray, out)


def run_markov(strategy, *, max_len, **kwargs):
  """`strategy` on the Markov model for one input -> numpy, batch removed."""
  static, dynamic = _split_args(strategy, kwargs)
  with np.errstate(divide="ignore"):
    log_table = jnp.asarray(np.log(MARKOV), jnp.float32)
  cache = dict(index=jnp.int32(0), offset=jnp.zeros((1,), jnp.int32))
  out = _compiled(strategy, "markov", max_len, static)(log_table, cache, dynamic)
  return jax.tree.map(lambda x: np.asarray(x)[0], out)


# The shapes most tests share (so that they share compilations).
VOCAB, MAX_LEN, OFFSETS = 10, 8, list(range(0, 96, 8))


# ---------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,max_len,beam_size,alpha,min_len,holes", [
    (4, 3, 27, 0.6, 0, 0.0),  # 13 finished + 27 truncated sequences.
    (4, 3, 27, 2.0, 1, 0.0),
    (4, 3, 27, 0.6, 0, 0.4),  # Impossible tokens: fewer sequences than beams.
    (3, 4, 16, 0.6, 0, 0.0),  # 15 finished + 16 truncated.
    (3, 4, 16, 0.0, 2, 0.0),
])
def test_beam_search_covering_the_space_equals_brute_force(vocab, max_len,
                                                           beam_size, alpha,
                                                           min_len, holes):
  """With a beam as large as the number of prefixes (and 2 * beam >= the
  number of one-token extensions), nothing is pruned: the n-best list must be
  the exhaustive ranking, order included (empty slots last, score -inf)."""
  bos_id, eos_id = 1, 2
  table = random_table(vocab * 10 + max_len + min_len, vocab)
  # A -inf logit makes a token impossible (token 0 always stays possible).
  rng = np.random.default_rng(0)
  table[:, 1:][rng.random((N_STATES, vocab - 1)) < holes] = -np.inf
  offsets = [3, 58]
  seqs, scores = run(beam_lib.beam_search, table, offsets, max_len=max_len,
                     beam_size=beam_size, length_penalty=alpha, bos_id=bos_id,
                     eos_id=eos_id, min_len=min_len)
  assert seqs.shape == (2, beam_size, max_len) and seqs.dtype == np.int32
  assert scores.shape == (2, beam_size) and scores.dtype == np.float32
  for b, offset in enumerate(offsets):
    ref_seqs, ref_scores = brute_force_nbest(
        table, offset, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
        alpha=alpha, min_len=min_len, n=beam_size)
    np.testing.assert_array_equal(seqs[b], ref_seqs)
    np.testing.assert_allclose(scores[b], ref_scores, rtol=1e-5, atol=1e-5)
    if holes:
      assert ref_scores[-1] == -np.inf  # The empty-slot case is exercised.


def test_beam_search_hand_computed_scores():
  """2 beams, 3 steps on the Markov model; the arithmetic is in the comments."""
  def beam(alpha, min_len=0):
    return run_markov(beam_lib.beam_search, beam_size=2, length_penalty=alpha,
                      max_len=3, bos_id=BOS, eos_id=EOS, min_len=min_len)

  lp2, lp3 = (7 / 6) ** 0.6, (8 / 6) ** 0.6
  # Step 0 from BOS: EOS .1 (finished, score log .1), A .5, B .4 (alive).
  # Step 1: A EOS .35, B B .24, B EOS .12, A B .10, ...: alive {BB, AB};
  #   finished {A EOS: log .35 / lp2 = -0.957, B EOS: log .12 / lp2 = -1.933}
  #   (EOS alone scores log .1 / lp1 = -2.303 and drops out).
  # Step 2: B B EOS .072 -> log .072 / lp3 = -2.214, A B EOS .03 -> -2.951: both
  #   worse than the finished ones.
  seqs, scores = beam(0.6)
  np.testing.assert_array_equal(seqs, [[A, EOS, PAD], [B, EOS, PAD]])
  np.testing.assert_allclose(scores, [math.log(0.35) / lp2, math.log(0.12) / lp2],
                             rtol=1e-6)

  # alpha = 2 favours length: B B EOS scores log .072 / (8/6)^2 = -1.480, which
  # beats B EOS, log .12 / (7/6)^2 = -1.558.
  seqs, scores = beam(2.0)
  np.testing.assert_array_equal(seqs, [[A, EOS, PAD], [B, B, EOS]])
  np.testing.assert_allclose(
      scores, [math.log(0.35) / (7 / 6) ** 2, math.log(0.072) / (8 / 6) ** 2],
      rtol=1e-6)

  # min_len = 1: EOS is impossible at step 0, so step 0 renormalises to
  # A 5/9, B 4/9; the same two hypotheses win with the new probabilities.
  seqs, scores = beam(0.6, min_len=1)
  np.testing.assert_array_equal(seqs, [[A, EOS, PAD], [B, EOS, PAD]])
  np.testing.assert_allclose(
      scores, [math.log(5 / 9 * 0.7) / lp2, math.log(4 / 9 * 0.3) / lp2],
      rtol=1e-6)

  # min_len = max_len: nothing can finish, so the alive beam comes back,
  # scored with lp(max_len). Without EOS: after BOS A 5/9, B 4/9; after A
  # A 1/3, B 2/3; after B A 1/7, B 6/7. Step 1 keeps B B (4/9 * 6/7 = .381)
  # and A B (5/9 * 2/3 = .370) over A A (.185) and B A (.063); step 2 ends with
  # B B B = .381 * 6/7 = .327 and A B B = .370 * 6/7 = .317.
  seqs, scores = beam(0.6, min_len=3)
  np.testing.assert_array_equal(seqs, [[B, B, B], [A, B, B]])
  np.testing.assert_allclose(
      scores, [math.log(4 / 9 * 36 / 49) / lp3,
               math.log(5 / 9 * 2 / 3 * 6 / 7) / lp3],
      rtol=1e-6)


def test_beam_size_one_equals_greedy():
  """Beam 1 follows the greedy path; it returns what greedy returns when EOS,
  wherever it is possible, is the argmax (otherwise beam search may keep an
  earlier, better-scoring EOS that greedy skipped, by design)."""
  eos_id = 4
  table = random_table(1, VOCAB, scale=2.0)
  eos_possible = np.random.default_rng(0).random(N_STATES) < 0.1
  table[:, eos_id] = np.where(eos_possible, 30.0, -np.inf)
  kw = dict(max_len=MAX_LEN, bos_id=0, eos_id=eos_id)
  g_seqs, g_scores = run(decoding.greedy_search, table, OFFSETS, **kw)
  finished = (g_seqs == eos_id).any(axis=1)
  assert finished.any() and not finished.all()  # Both cases are covered.
  lengths = np.where(finished, np.argmax(g_seqs == eos_id, axis=1) + 1, MAX_LEN)
  for alpha in (0.0, 0.6):
    b_seqs, b_scores = run(beam_lib.beam_search, table, OFFSETS, beam_size=1,
                           length_penalty=alpha, **kw)
    np.testing.assert_array_equal(b_seqs[:, 0], g_seqs)
    np.testing.assert_allclose(b_scores[:, 0], g_scores / gnmt_lp(lengths, alpha),
                               rtol=1e-5)


def test_beam_search_scores_and_layout_are_consistent():
  """A beam smaller than the space: every returned hypothesis is well formed and
  its score is log p / lp recomputed from scratch; finished come first."""
  bos_id, eos_id, alpha, min_len = 1, 9, 0.6, 2
  table = random_table(7, VOCAB)
  table[:, eos_id] += 0.5  # Let some, not all, hypotheses finish.
  seqs, scores = run(beam_lib.beam_search, table, OFFSETS, max_len=MAX_LEN,
                     beam_size=3, length_penalty=alpha, bos_id=bos_id,
                     eos_id=eos_id, min_len=min_len)
  assert np.isfinite(scores).all()
  all_finished = []
  for b, offset in enumerate(OFFSETS):
    is_finished = []
    for seq, score in zip(seqs[b], scores[b]):
      eos_at = np.flatnonzero(seq == eos_id)
      length = eos_at[0] + 1 if len(eos_at) else MAX_LEN
      assert length > min_len
      assert (seq[length:] == 0).all()
      log_prob = sum(
          ref_log_probs(table, offset, list(seq[:t]), bos_id=bos_id,
                        eos_id=eos_id, min_len=min_len)[seq[t]]
          for t in range(length))
      np.testing.assert_allclose(score, log_prob / gnmt_lp(length, alpha),
                                 rtol=1e-5)
      is_finished.append(len(eos_at) > 0)
    # Finished first; inside each block, best first.
    assert is_finished == sorted(is_finished, reverse=True)
    for block in (np.array(is_finished), ~np.array(is_finished)):
      assert (np.diff(scores[b][block]) <= 0).all()
    all_finished += is_finished
  assert any(all_finished) and not all(all_finished)  # Both blocks are tested.


def test_beam_search_batch_rows_are_independent():
  """Permuting the inputs permutes the outputs: the beams of one input never
  read another input's cache (see also test_rows_do_not_depend_on_each_other)."""
  table = random_table(11, VOCAB)
  kw = dict(max_len=MAX_LEN, beam_size=3, bos_id=0, eos_id=3, min_len=1)
  seqs, scores = run(beam_lib.beam_search, table, OFFSETS, **kw)
  perm = np.random.default_rng(0).permutation(len(OFFSETS))
  p_seqs, p_scores = run(beam_lib.beam_search, table,
                         [OFFSETS[i] for i in perm], **kw)
  np.testing.assert_array_equal(p_seqs, seqs[perm])
  np.testing.assert_allclose(p_scores, scores[perm], rtol=1e-6)
  assert len({tuple(s.ravel()) for s in seqs}) > 1  # Inputs do differ.


@pytest.mark.parametrize("table_seed,alpha,min_len,eos_bias,n_best", [
    (100, 0.6, 0, 1.0, None),
    (101, 0.0, 3, 0.0, None),
    (102, 1.5, 0, 2.5, None),
    (103, 0.6, 2, -np.inf, None),  # Nothing ever finishes.
    (104, -0.5, 0, 2.0, None),     # A negative alpha (favours short outputs).
    # Stopping once the first n_best are final (not the whole beam):
    (200, 0.6, 0, 1.0, 1),
    (200, 2.0, 0, 2.5, 1),  # The bound at the next length alone would stop too soon.
    (201, 0.0, 3, 0.0, 2),
    (203, 0.6, 2, -np.inf, 1),
    (204, 1.5, 0, 2.5, 3),  # Stopping once the best is final would change the 2nd / 3rd.
])
def test_beam_search_early_exit_changes_nothing(table_seed, alpha, min_len, eos_bias, n_best):
  """Early exit keeps the n-best (and scores) of the search run to max_len:
  the whole beam, or with `n_best` its first n_best."""
  eos_id, max_len = 5, 21  # Not a multiple of the chunk.
  table = random_table(table_seed, VOCAB)
  table[:, eos_id] += eos_bias
  kw = dict(max_len=max_len, beam_size=4, length_penalty=alpha, bos_id=0,
            eos_id=eos_id, min_len=min_len)
  kept = 4 if n_best is None else n_best
  fast = run(beam_lib.beam_search, table, OFFSETS, early_exit=True,
             **({} if n_best is None else dict(n_best=n_best)), **kw)
  full = run(beam_lib.beam_search, table, OFFSETS, early_exit=False, **kw)
  np.testing.assert_array_equal(fast[0][:, :kept], full[0][:, :kept])
  np.testing.assert_array_equal(fast[1][:, :kept], full[1][:, :kept])


@pytest.mark.parametrize("shrink", [None, "shrink"])
@pytest.mark.parametrize("table_seed,alpha,eos_bias,n_best", [
    (201, 0.6, -1.0, 1),  # 4 of 12 inputs done
    (205, 0.6, 0.5, 3),   # 4
    (204, 1.5, 0.0, 1),   # 1
])
def test_beam_search_done_in_a_first_part_is_what_the_whole_search_gives(
    table_seed, alpha, eos_bias, n_best, shrink):
  """`bound_len`: only the first 8 steps of a search to 21 decoded. The inputs
  it says are done have the n-best and scores of the whole search (without
  early exit); some are done, and some that are not would have changed.
  (With `stop="current"`, not exact, an input's n-best can still change after
  it is done, while its batch decodes on: the whole search is no reference.)"""
  eos_id, max_len, first = 5, 21, 8
  table = random_table(table_seed, VOCAB)
  table[:, eos_id] += eos_bias
  kw = dict(beam_size=4, length_penalty=alpha, bos_id=0, eos_id=eos_id)
  whole_seqs, whole_scores = run(beam_lib.beam_search, table, OFFSETS, max_len=max_len,
                                 early_exit=False, **kw)
  kw.update(n_best=n_best)
  seqs, scores, done = run(beam_lib.beam_search, table, OFFSETS, max_len=first,
                           bound_len=max_len, return_done=True,
                           shrink=SHRINK if shrink else None, **kw)
  assert done.dtype == bool and 0 < done.sum() < len(OFFSETS)
  np.testing.assert_array_equal(seqs[done, :n_best], whole_seqs[done, :n_best, :first])
  assert not whole_seqs[done, :n_best, first:].any()
  np.testing.assert_array_equal(scores[done, :n_best], whole_scores[done, :n_best])
  changed = [not (np.array_equal(seqs[i, :n_best], whole_seqs[i, :n_best, :first])
                  and np.array_equal(scores[i, :n_best], whole_scores[i, :n_best]))
             for i in np.flatnonzero(~done)]
  assert any(changed)


def test_beam_search_rejects_a_bound_shorter_than_its_steps():
  with pytest.raises(ValueError, match="bound_len=4 must be at least max_len=8"):
    beam_lib.beam_search(lambda ids, cache: None, {}, batch_size=1, max_len=8, bound_len=4,
                         bos_id=0, eos_id=1)


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_beam_stop_current_is_exact_when_longer_outputs_gain_nothing(alpha):
  """With alpha <= 0 the length penalty never grows with the length, so the
  bound at the next step's length is the bound over every length."""
  eos_id, max_len = 5, 21
  table = random_table(300, VOCAB)
  table[:, eos_id] += 1.5
  kw = dict(max_len=max_len, beam_size=4, length_penalty=alpha, bos_id=0, eos_id=eos_id)
  fast = run(beam_lib.beam_search, table, OFFSETS, stop="current", n_best=1, **kw)
  full = run(beam_lib.beam_search, table, OFFSETS, early_exit=False, **kw)
  np.testing.assert_array_equal(fast[0][:, 0], full[0][:, 0])
  np.testing.assert_array_equal(fast[1][:, 0], full[1][:, 0])


def test_beam_stop_current_gives_up_a_longer_better_hypothesis():
  """Hand-computed (beam 1, alpha 2, lp(n) = ((5 + n) / 6)^2): after BOS,
  EOS 0.45, A 0.3, B 0.25; after A, C 0.999; after C, EOS 0.999.
  Step 1 keeps EOS (finished, score log 0.45 / lp(1) = -0.799) and A (alive,
  log 0.3 = -1.204). "current" bounds A by -1.204 / lp(2) = -0.885 < -0.799
  and stops at the first check (after step 1 of 9); "exact" bounds it by
  -1.204 / lp(9) = -0.221 and goes on to A C EOS, whose score
  (log 0.3 + 2 log 0.999) / lp(3) = -0.678 beats EOS."""
  pad, bos, eos, a, b, c = range(6)
  probs = np.full((6, 6), 1e-12)
  probs[bos, [eos, a, b]] = [0.45, 0.3, 0.25]
  probs[a, [c, eos]] = [0.999, 0.001]
  probs[c, [eos, a]] = [0.999, 0.001]
  probs[b, [b, eos]] = [0.5, 0.5]
  probs[pad, eos] = probs[eos, eos] = 1.0
  log_table = jnp.asarray(np.log(probs / probs.sum(1, keepdims=True)), jnp.float32)
  max_len = options.EARLY_EXIT_CHUNK + 1  # The first check comes after step 1.
  alpha = 2.0

  def search(stop, early_exit=True):
    fn = lambda cache: beam_lib.beam_search(
        make_markov_model(log_table), cache, batch_size=1, beam_size=1, max_len=max_len,
        length_penalty=alpha, bos_id=bos, eos_id=eos, early_exit=early_exit, stop=stop)
    cache = dict(index=jnp.int32(0), offset=jnp.zeros((1,), jnp.int32))
    seqs, scores = jax.jit(fn)(cache)
    return np.asarray(seqs)[0, 0], float(scores[0, 0])

  lp = lambda n: ((5 + n) / 6) ** alpha
  seqs, score = search("current")
  assert list(seqs) == [eos] + [0] * (max_len - 1)
  assert score == pytest.approx(math.log(0.45) / lp(1), rel=1e-5)
  for stop, early_exit in (("exact", True), ("exact", False), ("current", False)):
    seqs, score = search(stop, early_exit)
    assert list(seqs) == [a, c, eos] + [0] * (max_len - 3), (stop, early_exit)
    assert score == pytest.approx(math.log(0.3 * 0.999 * 0.999) / lp(3), rel=1e-4)


def test_beam_search_rejects_n_best_and_stop_out_of_range():
  for bad in (dict(n_best=0), dict(n_best=5), dict(stop="soon")):
    with pytest.raises(ValueError, match=next(iter(bad))):
      beam_lib.beam_search(make_markov_model(jnp.zeros((5, 5))),
                           dict(index=jnp.int32(0), offset=jnp.zeros((1,), jnp.int32)),
                           batch_size=1, beam_size=4, max_len=4, bos_id=1, eos_id=2, **bad)


def test_early_exit_stops_decoding():
  """Every hypothesis ends at step 2: decoding stops at the first check after
  that (checks come after the max_len % chunk leftover steps, then every
  chunk)."""
  eos_id, max_len = 3, 42
  chunk = options.EARLY_EXIT_CHUNK
  leftover = max_len % chunk
  expected_calls = leftover + chunk * math.ceil(max(0, 3 - leftover) / chunk)
  assert expected_calls < max_len
  table = random_table(5, VOCAB)
  cache = init_hash_cache([4, 9], max_len)
  kw = dict(batch_size=2, max_len=max_len, bos_id=0, eos_id=eos_id)

  def count_calls(strategy, **extra):
    calls = []
    model = make_hash_model(table, max_len, calls, eos_id=eos_id, eos_from=2)
    seqs, _ = jit(lambda c: strategy(model, c, **kw, **extra))(cache)
    jax.effects_barrier()
    return np.asarray(seqs), len(calls)

  seqs, calls = count_calls(beam_lib.beam_search, beam_size=4)
  assert (seqs[:, :, 2] == eos_id).all()
  assert calls == expected_calls
  _, calls = count_calls(beam_lib.beam_search, beam_size=4, early_exit=False)
  assert calls == max_len
  seqs, calls = count_calls(decoding.greedy_search)  # Sampling shares its loop.
  assert (seqs[:, 2] == eos_id).all() and calls == expected_calls



def test_beam_search_rejects_a_cache_without_the_batch_on_axis_0():
  cache = dict(index=jnp.int32(0), history=jnp.zeros((5, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"\['history'\].*axis 0"):
    beam_lib.beam_search(make_markov_model(None), cache, batch_size=2,
                         max_len=3, bos_id=BOS, eos_id=EOS)


# ---------------------------------------------------------------------------
# Greedy search
# ---------------------------------------------------------------------------


def test_greedy_hand_computed():
  seqs, scores = run_markov(decoding.greedy_search, max_len=3, bos_id=BOS,
                            eos_id=EOS)
  np.testing.assert_array_equal(seqs, [A, EOS, PAD])
  np.testing.assert_allclose(scores, math.log(0.5 * 0.7), rtol=1e-6)
  # min_len = 2: after A, EOS is masked and B (2/3 of the rest) wins; after B,
  # EOS is allowed but B (.6) is still the argmax.
  seqs, scores = run_markov(decoding.greedy_search, max_len=3, bos_id=BOS,
                            eos_id=EOS, min_len=2)
  np.testing.assert_array_equal(seqs, [A, B, B])
  np.testing.assert_allclose(scores, math.log(5 / 9 * 2 / 3 * 0.6), rtol=1e-6)


def test_greedy_matches_numpy_reference():
  bos_id, eos_id = 2, 6
  table = random_table(21, VOCAB)
  seqs, scores = run(decoding.greedy_search, table, OFFSETS, max_len=MAX_LEN,
                     bos_id=bos_id, eos_id=eos_id)
  for b, offset in enumerate(OFFSETS):
    prefix, log_prob = [], 0.0
    while len(prefix) < MAX_LEN and eos_id not in prefix:
      log_probs = ref_log_probs(table, offset, prefix, bos_id=bos_id,
                                eos_id=eos_id)
      prefix.append(int(np.argmax(log_probs)))
      log_prob += log_probs[prefix[-1]]
    np.testing.assert_array_equal(seqs[b], prefix + [0] * (MAX_LEN - len(prefix)))
    np.testing.assert_allclose(scores[b], log_prob, rtol=1e-5)
  finished = (seqs == eos_id).any(axis=1)
  assert finished.any() and not finished.all()
  # Without log-probabilities: the same numpy argmax path, zero scores.
  tokens_only, zeros = run(decoding.greedy_search, table, OFFSETS, max_len=MAX_LEN,
                           bos_id=bos_id, eos_id=eos_id, log_probs=False)
  np.testing.assert_array_equal(tokens_only, seqs)
  np.testing.assert_array_equal(zeros, np.zeros(len(OFFSETS)))


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def ref_filtered_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0):
  """float64 sampling distribution: temperature, then top-k, then top-p."""
  logits = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-logits, kind="stable")
  keep = np.zeros(len(logits), bool)
  keep[order[:top_k] if top_k else order] = True
  probs = np.where(keep, np.exp(logits - logits.max()), 0.0)
  probs /= probs.sum()
  if top_p < 1.0:
    ranked = order[keep[order]]
    mass = np.cumsum(probs[ranked])
    n_keep = int(np.searchsorted(mass, top_p)) + 1  # First prefix reaching p.
    keep[:] = False
    keep[ranked[:n_keep]] = True
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
  return probs


def chi_square_pvalue(counts, probs):
  """Goodness of fit over the support of `probs`; scipy when present."""
  support = probs > 0
  observed, expected = counts[support], probs[support] * counts.sum()
  statistic = np.sum((observed - expected) ** 2 / expected)
  dof = support.sum() - 1
  if stats is not None:
    return stats.chi2.sf(statistic, dof)
  # Wilson-Hilferty normal approximation of the chi-square tail.
  z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
  return 0.5 * math.erfc(z / math.sqrt(2))


def test_filter_logits_keeps_the_top_k_then_the_nucleus():
  logits = np.random.default_rng(0).normal(size=(6, VOCAB)).astype(np.float32)
  # Static settings here (Python numbers take other code paths than traced).
  for top_k, top_p in [(3, 1.0), (4, 0.6), (0, 0.0), (VOCAB, 0.9)]:
    kept = np.isfinite(jit(functools.partial(
        sampling.filter_logits, top_k=top_k, top_p=top_p))(logits))
    for row, kept_row in zip(logits, kept):
      expected = ref_filtered_probs(row, top_k=top_k, top_p=top_p) > 0
      np.testing.assert_array_equal(kept_row, expected, err_msg=f"{top_k, top_p}")


DRAWS = 20000  # Rows of one-step sampling runs: i.i.d. draws of one input.


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 4, 1.0),
    (1.0, 0, 0.8),
    (1.3, 4, 0.7),   # Top-k, then top-p on what is left.
    (1.0, 0, 0.0),   # The nucleus always keeps one token.
])
def test_sampling_frequencies_match_the_filtered_distribution(temperature, top_k,
                                                              top_p):
  table = random_table(31, VOCAB, scale=1.0)
  seqs, _ = run(sampling.sample, table, [7] * DRAWS, max_len=1, bos_id=0,
                eos_id=1, rng=jax.random.key(1234), temperature=temperature,
                top_k=top_k, top_p=top_p)
  logits = table[_hash(7 % N_STATES, 0, 0)]
  probs = ref_filtered_probs(logits, temperature=temperature, top_k=top_k,
                             top_p=top_p)
  counts = np.bincount(seqs[:, 0], minlength=VOCAB)
  assert counts[probs == 0].sum() == 0  # Never outside the kept set.
  if (probs > 0).sum() > 1:
    assert chi_square_pvalue(counts, probs) > 1e-3
  # The statistic has power: the unfiltered (or untempered) distribution is
  # rejected whenever it differs.
  plain = ref_filtered_probs(logits)
  if np.abs(plain - probs).max() > 0.02:
    assert chi_square_pvalue(counts, np.maximum(plain, 1e-12)) < 1e-6


def independence_statistic(x, y, vocab):
  """Chi-square statistic of independence of paired draws x and y."""
  contingency = np.zeros((vocab, vocab))
  np.add.at(contingency, (x, y), 1)
  expected = np.outer(contingency.sum(1), contingency.sum(0)) / contingency.sum()
  mask = expected > 0
  assert expected[mask].min() > 5  # The chi-square approximation holds.
  return np.sum((contingency[mask] - expected[mask]) ** 2 / expected[mask])


def test_sampled_draws_are_independent_across_rows_and_steps():
  """With a model whose distribution ignores the history, the draws of two
  rows, and of two steps of one row, are independent (chi-square tests of
  independence on their contingency tables)."""
  eos_id = VOCAB - 1
  row = np.random.default_rng(91).normal(size=VOCAB) * 0.5
  row[eos_id] = -np.inf  # No EOS, so that step 1 is always drawn.
  table = np.tile(row, (N_STATES, 1)).astype(np.float32)
  seqs, _ = run(sampling.sample, table, [0] * DRAWS, max_len=2, bos_id=0,
                eos_id=eos_id, rng=jax.random.key(99))
  dof = (VOCAB - 2) ** 2
  # p = 1e-3 for a chi-square with 64 dof is at a statistic of 104.7.
  threshold = stats.chi2.isf(1e-3, dof) if stats is not None else 104.7
  step0, step1 = seqs[:, 0], seqs[:, 1]
  assert independence_statistic(step0[0::2], step0[1::2], VOCAB) < threshold
  assert independence_statistic(step0, step1, VOCAB) < threshold
  # With the same draw twice, the test rejects (it has power).
  assert independence_statistic(step0, step0, VOCAB) > threshold


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.6), (4, 0.5)])
def test_sampling_stays_inside_top_k_and_nucleus_at_every_step(top_k, top_p):
  bos_id, eos_id, min_len = 0, 9, 2
  table = random_table(41, VOCAB, scale=1.0)
  offsets = list(range(300))
  seqs, scores = run(sampling.sample, table, offsets, max_len=MAX_LEN,
                     bos_id=bos_id, eos_id=eos_id, min_len=min_len,
                     rng=jax.random.key(7), top_k=top_k, top_p=top_p)
  for b, offset in enumerate(offsets):
    seq, log_prob = list(seqs[b]), 0.0
    length = seq.index(eos_id) + 1 if eos_id in seq else MAX_LEN
    assert all(t == 0 for t in seq[length:])  # Padding after EOS.
    for t in range(length):
      log_probs = ref_log_probs(table, offset, seq[:t], bos_id=bos_id,
                                eos_id=eos_id, min_len=min_len)
      allowed = ref_filtered_probs(log_probs, top_k=top_k, top_p=top_p) > 0
      assert allowed[seq[t]], (b, t, seq)
      log_prob += log_probs[seq[t]]
    # Scores are model log-probs (no truncation), min_len applied.
    np.testing.assert_allclose(scores[b], log_prob, rtol=1e-5)


def test_sampling_at_temperature_zero_is_greedy():
  table = random_table(51, VOCAB)
  kw = dict(max_len=MAX_LEN, bos_id=0, eos_id=4)
  greedy = run(decoding.greedy_search, table, OFFSETS, **kw)
  # A traced temperature: 0 exactly, and tending to 0.
  for temperature in (0.0, 1e-6):
    cold = run(sampling.sample, table, OFFSETS, rng=jax.random.key(3),
               temperature=temperature, **kw)
    np.testing.assert_array_equal(cold[0], greedy[0])
    np.testing.assert_allclose(cold[1], greedy[1], rtol=1e-6)
  # A static (Python) 0 takes the argmax path without drawing.
  model = make_hash_model(table, MAX_LEN)
  cold = jit(lambda c: sampling.sample(
      model, c, rng=jax.random.key(3), batch_size=len(OFFSETS), temperature=0,
      **kw))(init_hash_cache(OFFSETS, MAX_LEN))
  np.testing.assert_array_equal(cold[0], greedy[0])
  # ... and at temperature 1 it is not greedy (so the comparison can fail).
  hot = run(sampling.sample, table, OFFSETS, rng=jax.random.key(3), **kw)
  assert not np.array_equal(hot[0], greedy[0])


# ---------------------------------------------------------------------------
# min_len and batching, across strategies
# ---------------------------------------------------------------------------


STRATEGIES = {
    "greedy": (decoding.greedy_search, {}),
    "sample": (sampling.sample, dict(rng=jax.random.key(5))),
    "beam": (beam_lib.beam_search, dict(beam_size=3)),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_min_len_is_respected(name):
  strategy, extra = STRATEGIES[name]
  eos_id = 2
  table = random_table(71, VOCAB)
  table[:, eos_id] += 4.0  # EOS is the likely first token.
  for min_len in (0, 3):
    seqs, _ = run(strategy, table, OFFSETS, max_len=MAX_LEN, bos_id=1,
                  eos_id=eos_id, min_len=min_len, **extra)
    if seqs.ndim == 3:
      seqs = seqs[:, 0]  # The best hypothesis of beam search.
    assert not (seqs[:, :min_len] == eos_id).any()
    # EOS does come as soon as it is allowed, mostly (so the test can fail).
    assert (seqs[:, min_len] == eos_id).mean() > 0.5


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_rows_do_not_depend_on_each_other(name):
  """Changing the other inputs of the batch changes nothing for row 0 (with
  the same PRNG key, for sampling)."""
  strategy, extra = STRATEGIES[name]
  table = random_table(81, VOCAB)
  kw = dict(max_len=MAX_LEN, bos_id=0, eos_id=3, **extra)
  others = [o + 50 for o in OFFSETS[1:]]
  a = run(strategy, table, OFFSETS, **kw)
  b = run(strategy, table, OFFSETS[:1] + others, **kw)
  np.testing.assert_array_equal(a[0][0], b[0][0])
  np.testing.assert_allclose(a[1][0], b[1][0], rtol=1e-6)
  assert not np.array_equal(a[0][1:], b[0][1:])


# Shrinking: the 12 inputs of OFFSETS go on in 6, then 3 rows as they finish.
SHRINK = decoding.Shrink(factor=2, min_rows=2)


def test_unfinished_first_is_a_stable_partition():
  rng = np.random.default_rng(0)
  for n in (1, 5, 32):
    for _ in range(20):
      unfinished = rng.random(n) < rng.random()
      np.testing.assert_array_equal(loops._unfinished_first(jnp.asarray(unfinished)),
                                    np.argsort(~unfinished, kind="stable"))


def test_shrink_sizes():
  assert SHRINK.sizes(12) == [12, 6, 3]
  assert decoding.Shrink().sizes(32) == [32, 8] and decoding.Shrink().sizes(128) == [128, 32, 8]
  assert decoding.Shrink().sizes(16) == [16] and decoding.Shrink().sizes(24) == [24]
  assert decoding.Shrink(factor=2, min_rows=2, multiple_of=4).sizes(24) == [24, 12]


def _shrink_case(name, seed):
  strategy, extra = STRATEGIES[name]
  eos_id = 3
  table = random_table(200 + seed, VOCAB)
  # EOS likely in some states, unlikely in others: rows end far apart (beam
  # search stops an input later, once no alive hypothesis can win: more EOS).
  shift = -1.0 if name == "beam" else -3.5
  table[:, eos_id] += np.random.default_rng(seed).normal(size=N_STATES) * 2 + shift
  kw = dict(max_len=40, bos_id=0, eos_id=eos_id, **extra)
  if name == "sample":  # a key per row: a row's draws then do not depend on its batch
    kw["rng"] = jax.random.split(jax.random.key(5 + seed), len(OFFSETS))
  return strategy, table, kw


# Cases whose batch does shrink (test_a_shrinking_batch_runs_its_steps_on_fewer_rows).
SHRINKING = [("greedy", 0), ("greedy", 4), ("sample", 0), ("beam", 0), ("beam", 2)]


@pytest.mark.parametrize("name,seed", SHRINKING)
def test_shrinking_the_batch_changes_nothing(name, seed):
  """Inputs that are done leave the batch (`Shrink`): every input's tokens and
  scores are exactly those of the batch decoded whole."""
  strategy, table, kw = _shrink_case(name, seed)
  full = run(strategy, table, OFFSETS, **kw)
  shrunk = run(strategy, table, OFFSETS, shrink=SHRINK, **kw)
  np.testing.assert_array_equal(shrunk[0], full[0])
  np.testing.assert_array_equal(shrunk[1], full[1])


@pytest.mark.parametrize("name,seed", SHRINKING)
def test_a_shrinking_batch_runs_its_steps_on_fewer_rows(name, seed):
  """The model is called on the rows of 12 inputs, then of 6 or 3 (a size is
  skipped when the unfinished fit the next at once), never more again."""
  strategy, table, kw = _shrink_case(name, seed)
  beams = kw.get("beam_size", 1)
  rows = []
  model = make_hash_model(table, kw["max_len"])

  def counting_model(token_ids, cache):
    jax.debug.callback(lambda n: rows.append(int(n)), jnp.int32(token_ids.shape[0]))
    return model(token_ids, cache)

  jit(lambda c: strategy(counting_model, c, batch_size=len(OFFSETS), shrink=SHRINK, **kw))(
      init_hash_cache(OFFSETS, kw["max_len"]))
  jax.effects_barrier()
  sizes = sorted(set(rows), reverse=True)
  assert len(sizes) >= 2 and set(sizes) <= {12 * beams, 6 * beams, 3 * beams}, sizes
  assert rows[0] == 12 * beams and rows == sorted(rows, reverse=True)


def test_shrinking_sampling_needs_a_key_per_row():
  with pytest.raises(ValueError, match="a key per row"):
    sampling.sample(make_hash_model(random_table(0, VOCAB), 8), init_hash_cache(OFFSETS, 8),
                    rng=jax.random.key(0), batch_size=len(OFFSETS), max_len=8, bos_id=0,
                    eos_id=3, shrink=SHRINK)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_empty_rows_are_done_from_the_start_and_change_no_other_row(name):
  strategy, table, kw = _shrink_case(name, 0)
  empty = np.zeros(len(OFFSETS), bool)
  empty[[0, 5]] = True
  full = run(strategy, table, OFFSETS, **kw)
  skipped = run(strategy, table, OFFSETS, empty_rows=jnp.asarray(empty), **kw)
  np.testing.assert_array_equal(skipped[0][~empty], full[0][~empty])
  np.testing.assert_array_equal(skipped[1][~empty], full[1][~empty])
  assert (skipped[0][empty] == 0).all() and (full[0][empty] != 0).any()
  assert (skipped[1][empty] == (-np.inf if name == "beam" else 0.0)).all()

@pytest.mark.parametrize("name", ["greedy", "sample", "beam"])
@pytest.mark.parametrize("shrink", [False, True])
def test_row_limits_search_each_input_to_its_own_length(name, shrink):
  """`row_limits`: input r's tokens and scores are those of the search with
  max_len = row_limits[r] (then PAD): what an input padded to a longer
  bucket's decoder (`batching.shared_buckets`), or batched with longer
  inputs, needs to translate as in its own. (Beam search: its hypotheses
  stop growing at its limit and its alive ones are scored at that length.)"""
  strategy, table, kw = _shrink_case(name, 0)
  if name == "beam":
    table[:, kw["eos_id"]] -= 2.0  # (EOS rarer: more searches that the limit ends)
  limits = np.array([2, 40, 5, 12, 2, 40, 5, 12, 40, 2, 12, 5], np.int32)  # (12 inputs)
  limited = run(strategy, table, OFFSETS, row_limits=jnp.asarray(limits),
                **(dict(shrink=SHRINK) if shrink else {}), **kw)
  cut = 0
  for limit in sorted(set(limits.tolist())):
    alone = run(strategy, table, OFFSETS, **{**kw, "max_len": limit})
    for r in np.flatnonzero(limits == limit):
      want = np.zeros(limited[0][r].shape, np.int32)  # ([max_len], beam: [beams, max_len])
      want[..., :limit] = alone[0][r]
      np.testing.assert_array_equal(limited[0][r], want)
      np.testing.assert_allclose(limited[1][r], alone[1][r], rtol=1e-6)
      best = np.atleast_2d(alone[0][r])[0]
      cut += limit < kw["max_len"] and kw["eos_id"] not in best
  assert cut >= 3  # (the premise: inputs whose best the limit, not an EOS, ended)


@pytest.mark.parametrize("table_seed,alpha,eos_bias,n_best", [
    (201, 0.6, -1.0, 1), (205, 0.6, 0.5, 3), (204, 1.5, 0.0, 1),
    (201, 2.0, 1.0, 1)])  # (bounded at the shorter limit, 3 inputs would be done too soon)
def test_beam_search_row_limits_bound_a_first_part_at_each_input_s_length(
    table_seed, alpha, eos_bias, n_best):
  """`row_limits` above max_len (a first part of each input's search): the
  inputs it says are done have the n-best and scores of their own whole
  search (to their own limit, without early exit), and the others include
  some that it would have changed."""
  eos_id, first = 5, 8
  table = random_table(table_seed, VOCAB)
  table[:, eos_id] += eos_bias
  kw = dict(beam_size=4, length_penalty=alpha, bos_id=0, eos_id=eos_id)
  limits = np.array([10, 30] * 6, np.int32)
  seqs, scores, done = run(beam_lib.beam_search, table, OFFSETS, max_len=first,
                           row_limits=jnp.asarray(limits), return_done=True, n_best=n_best,
                           **kw)
  assert 0 < done.sum() < len(OFFSETS)
  changed = 0
  for limit in (10, 30):
    whole_seqs, whole_scores = run(beam_lib.beam_search, table, OFFSETS, max_len=limit,
                                   early_exit=False, **kw)
    for b in np.flatnonzero(limits == limit):
      same = (np.array_equal(seqs[b, :n_best], whole_seqs[b, :n_best, :first])
              and not whole_seqs[b, :n_best, first:].any()
              and np.array_equal(scores[b, :n_best], whole_scores[b, :n_best]))
      assert same or not done[b], b
      changed += not same
  assert changed  # (the premise: a first part alone is no answer)


@pytest.mark.parametrize("n, k, ties", [(9000, 8, False), (9000, 8, True), (40000, 8, True),
                                        (131072, 16, False)])
def test_top_k_large_equals_lax_top_k(n, k, ties):
  """The two-pass top-k of beam search: same values and indices as lax.top_k,
  ties (lower index first) and -inf entries included."""
  rng = np.random.default_rng(n + k)
  x = rng.integers(0, 6, (4, n)).astype(np.float32) if ties else rng.normal(size=(4, n))
  x = np.where(rng.random((4, n)) < 0.3, -np.inf, x).astype(np.float32)
  x[3, :] = -np.inf  # a row with nothing finite (an input whose beams are all empty)
  x[3, n - 5] = 1.0
  values, indices = jax.jit(top_k_lib.top_k_large, static_argnums=1)(jnp.asarray(x), k)
  want_values, want_indices = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(indices, want_indices)
  # And against numpy: a stable sort, descending by value.
  order = np.argsort(-x, axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(indices, order)


def test_argmax_equals_numpy_argmax():
  """Greedy's argmax: the first index of the maximum, as numpy's, with heavy
  ties, -inf rows, +inf and NaN entries."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 5, (8, 32000)).astype(np.float32)  # many ties of the max
  x[1] = rng.normal(size=32000)
  x[2] = -np.inf                     # nothing finite: index 0
  x[3, [7, 100, 31999]] = np.inf     # the first +inf
  x[4, [20, 9000]] = np.nan          # the first NaN wins, as in numpy
  x[5, 31999] = 10.0                 # the maximum at the last index
  got = jax.jit(decoding.argmax)(jnp.asarray(x))
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
  assert got.dtype == jnp.int32


@pytest.mark.parametrize("ties", [False, True])
def test_beam_candidates_top_k_equals_top_k_of_the_candidates(ties):
  """Beam search's top-k over beams x vocabulary, computed from block maxima
  of the raw logits, equals lax.top_k of the materialised candidates alive +
  log_softmax(logits) (values bit for bit, indices with ties lower first),
  with empty (-inf) alive slots and forbidden (-inf) tokens."""
  batch, beams, vocab, k = 3, 4, 2048, 8
  rng = np.random.default_rng(7)
  if ties:  # few distinct values: many equal candidates across blocks and beams
    logits = rng.integers(0, 4, (batch, beams, vocab)).astype(np.float32)
    # A later block with the largest entry: the blocks must still be read in
    # index order for the ties of 3 to resolve as lax.top_k does.
    logits[0, 0, 5 * top_k_lib.TOP_K_BLOCK + 3] = 9.0
  else:
    logits = rng.normal(size=(batch, beams, vocab)).astype(np.float32) * 3
  logits[:, :, 1] = -np.inf  # e.g. EOS forbidden by min_len
  alive = np.array([[0.0, -1.5, -2.0, -7.0],
                    [0.0, -np.inf, -np.inf, -np.inf],  # the first step: one live beam
                    [-0.5, -0.5, -0.5, -0.5]], np.float32)  # equal beams
  want = jnp.asarray(alive)[:, :, None] + jax.nn.log_softmax(jnp.asarray(logits))
  want_values, want_indices = jax.lax.top_k(want.reshape(batch, -1), k)
  values, indices = jax.jit(top_k_lib.beam_candidates_top_k, static_argnums=2)(
      jnp.asarray(logits), jnp.asarray(alive), k)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(indices, want_indices)
  order = np.argsort(-np.asarray(want).reshape(batch, -1), axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(indices, order)
