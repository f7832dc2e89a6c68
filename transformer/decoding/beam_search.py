"""Beam search (the Tensor2Tensor / Flax WMT scheme of alive and finished
hypotheses), jittable and model-agnostic: the contract of `tokens_to_logits`,
of the cache and of early exit and shrinking is `search.py`'s docstring.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer.decoding.loops import (PyTree, Shrink, _decode_loop, _map_batched,
                                        _select_inputs, _shrinking_loop)
from transformer.decoding.options import BEAM_STOPS
from transformer.decoding.search import (TokensToLogits, _check_cache, _step_logits,
                                         gnmt_length_penalty)
from transformer.decoding.top_k import NEG_INF, beam_candidates_top_k


class _BeamState(NamedTuple):
  """Alive and finished hypotheses (the Tensor2Tensor / Flax WMT scheme)."""
  step: jax.Array  # int32 scalar: tokens generated so far.
  alive_seqs: jax.Array  # [batch, beams, max_len] int32, no EOS yet.
  alive_log_probs: jax.Array  # [batch, beams] float32, sorted, -inf = empty.
  last_tokens: jax.Array  # [batch, beams] int32, fed to the model next.
  finished_seqs: jax.Array  # [batch, beams, max_len] int32, end in EOS.
  finished_scores: jax.Array  # [batch, beams] float32 log p / lp, sorted, -inf = empty.
  limits: jax.Array  # [batch] int32: the length each input's search runs to.
  cache: PyTree  # Leaves [batch * beams, ...] (batch-major), or scalars.


def _gather_beams(x: jax.Array, indices: jax.Array) -> jax.Array:
  """x [batch, n, ...], indices [batch, m] -> [batch, m, ...]."""
  return jax.vmap(lambda xb, ib: xb[ib])(x, indices)


def beam_search(tokens_to_logits: TokensToLogits, cache: PyTree, *,
                batch_size: int, beam_size: int = 4, length_penalty=0.6,
                max_len: int, bos_id: int, eos_id: int, min_len: int = 0,
                early_exit: bool = True,
                reorder_cache: Callable[[PyTree, jax.Array], PyTree] | None = None,
                shrink: Shrink | None = None,
                empty_rows: jax.Array | None = None,
                n_best: int | None = None, stop: str = "exact",
                bound_len: int | None = None, row_limits: jax.Array | None = None,
                return_done: bool = False) -> tuple[jax.Array, ...]:
  """Beam search with the GNMT length penalty.

  One function on purpose: its step (`step_fn`) and stopping test (`done_fn`)
  are closures over the search's constants, so the whole algorithm reads top
  to bottom in one place, the way the text below describes it.

  Each input keeps `beam_size` alive hypotheses (no EOS yet, ranked by
  log-probability) and `beam_size` finished ones (ended by EOS, ranked by
  score). At every step the 2 * beam_size best one-token extensions of the alive
  hypotheses are taken (at most beam_size of them end in EOS, so at least
  beam_size stay alive); those ending in EOS compete for the finished slots,
  the others for the alive slots.

  Score of a hypothesis y: log p(y) / lp(|y|), lp(n) = ((5 + n) / 6) ** alpha,
  where |y| counts the generated tokens *including* the EOS (the BOS is not
  counted). A hypothesis still alive at max_len is scored with n = max_len.

  Output order. Finished hypotheses come first, best first. If fewer than
  beam_size hypotheses finished by max_len, the remaining slots hold the best
  alive (truncated, no EOS) ones, best first; in particular, if none finished,
  the output is the alive beam. Slots left empty (only possible when the search
  space is smaller than the beam) have score -inf.

  Early exit. An input is done when no alive hypothesis can still beat its
  n_best-th finished one: log-probs only decrease, so an alive hypothesis with
  log-prob s <= 0 ends with a score of at most s / max(lp(n)) over the lengths
  n it can still reach (the T2T bound), and whatever finishes later ranks
  after the first n_best. When every input is done decoding stops (checked
  every EARLY_EXIT_CHUNK steps). The first n_best hypotheses and scores are
  identical to `early_exit=False`'s (all of them with n_best = beam_size: the
  T2T rule; a caller that keeps only the best needs only the first to be
  final, often many steps sooner).

  `stop="current"` bounds an alive hypothesis by its score were it to end at
  the next step instead (HuggingFace's default rule; CTranslate2 and fairseq
  stop sooner still): with alpha > 0 a longer continuation gains length
  normalization, so a hypothesis that would have overtaken the n-best can be
  cut off. Not exact; much faster, since the exact bound, taken at max_len,
  keeps inputs going long after their best hypothesis ended.

  Args:
    tokens_to_logits: (token_ids [batch * beams] int32, cache) ->
      (logits [batch * beams, vocab], cache). Row b * beam_size + j is beam j
      of input b.
    cache: without `reorder_cache`, the model's decoding cache for [batch]
      (leaves with ndim >= 1 have the batch on axis 0, scalars are passed
      through): it is repeated beam_size times along axis 0, then its batched
      leaves are reordered with the surviving beams at every step. With
      `reorder_cache`, the cache for batch * beam_size rows, used as given.
    batch_size: number of inputs.
    beam_size: hypotheses kept per input (the paper: 4).
    length_penalty: alpha (the paper: 0.6).
    max_len: number of decode steps; outputs are [.., max_len].
    bos_id: fed to the model at the first step.
    eos_id: ends a hypothesis; later positions are 0 (PAD).
    min_len: EOS is forbidden at steps t < min_len.
    early_exit: stop once no input can improve (same results, less time).
    reorder_cache: (cache, parents [batch, beam_size] int32) -> the cache of
      the kept hypotheses, where hypothesis j of input b extends beam
      parents[b, j] of the previous step. None: gather every batched leaf.
    shrink: with early exit, drop the inputs that are done from the batch as
      decoding goes (`Shrink`: its `select_cache` gets input indices; None
      gathers the beams' rows of those inputs, axis 0 of every leaf).
    empty_rows: [batch] bool, inputs with nothing to decode (filling up the
      batch): no hypothesis, done from the start (scores -inf, sequences 0).
    n_best: the hypotheses per input early exit keeps exact (above), 1 ...
      beam_size; None: beam_size.
    stop: "exact" or "current": the early-exit bound (above).
    bound_len: the length the search runs to (>= max_len; None: max_len),
      of which only the first max_len steps are decoded here: the exact
      bound looks at every length up to bound_len, so an input done within
      max_len steps has what a search of bound_len steps would give it. (A
      caller decodes a short first part, with a short cache, and searches
      again in full only the inputs that are not done: `Translator`.)
    row_limits: [batch] int32, each input's own bound_len (None: bound_len
      for all): input b's search is one of row_limits[b] steps. Below
      max_len, its hypotheses stop growing there (its state frozen at that
      step, its alive ones scored at that length), as a search of that
      max_len would leave them; above, its bound looks that far. So an
      input's result does not depend on the batch it is decoded in (the
      inputs of a batch padded to a longer bucket keep their own limit).
    return_done: also return `done`.

  Returns:
    sequences: [batch, beam_size, max_len] int32, n-best, best first (with
      early exit, the slots after the first n_best may hold hypotheses that
      a longer search would have replaced).
    scores: [batch, beam_size] float32, log p / lp as above.
    done (with return_done): [batch] bool, the inputs whose first n_best
      hypotheses are final (early exit's test, at bound_len): for the others
      a longer search could still change them.
  """
  alpha = length_penalty
  batch, beams = batch_size, beam_size
  n_best = beams if n_best is None else n_best
  bound_len = max_len if bound_len is None else bound_len
  if bound_len < max_len:
    raise ValueError(f"bound_len={bound_len} must be at least max_len={max_len}")
  limits = (jnp.full((batch,), bound_len, jnp.int32) if row_limits is None
            else jnp.asarray(row_limits, jnp.int32))
  if not 1 <= n_best <= beams:
    raise ValueError(f"n_best={n_best} must be in 1 ... beam_size={beams}")
  if stop not in BEAM_STOPS:
    raise ValueError(f"stop={stop!r} must be one of {BEAM_STOPS}")
  if reorder_cache is None:
    _check_cache(cache, batch_size)
    cache = _map_batched(lambda x: jnp.repeat(x, beams, axis=0), cache)

    def reorder_cache(cache, parents):
      # A gather along the flat batch axis of every batched leaf.
      flat_parents = (jnp.arange(parents.shape[0])[:, None] * beams + parents).reshape(-1)
      return _map_batched(lambda x: jnp.take(x, flat_parents, axis=0), cache)

  def step_fn(state: _BeamState) -> _BeamState:
    step = state.step
    rows = state.last_tokens.shape[0]  # inputs in this batch (fewer once it shrinks)
    logits, cache = _step_logits(tokens_to_logits,
                                 state.last_tokens.reshape(rows * beams),
                                 state.cache, step, eos_id, min_len)
    vocab = logits.shape[-1]

    # The 2 * beams best extensions of the alive hypotheses (log-prob of the
    # hypothesis + log_softmax of the next token), per input. Empty alive
    # slots have log-prob -inf, so their extensions stay -inf.
    topk_log_probs, topk_flat = beam_candidates_top_k(
        logits.reshape(rows, beams, vocab), state.alive_log_probs, 2 * beams)
    topk_parents = topk_flat // vocab  # [batch, 2 * beams] beam index
    topk_tokens = (topk_flat % vocab).astype(jnp.int32)
    topk_seqs = _gather_beams(state.alive_seqs, topk_parents)
    topk_seqs = topk_seqs.at[:, :, step].set(topk_tokens)
    valid = topk_log_probs > NEG_INF
    ends = topk_tokens == eos_id

    # Alive: the best candidates that did not just emit EOS.
    new_alive_log_probs, alive_idx = lax.top_k(
        jnp.where(ends, NEG_INF, topk_log_probs), beams)
    alive_parents = jnp.take_along_axis(topk_parents, alive_idx, axis=1)
    # The cache follows the surviving beams.
    cache = reorder_cache(cache, alive_parents)

    # Finished: the old finished ones and the candidates that just emitted EOS
    # (length step + 1, EOS included) compete for the beam_size slots. Old ones
    # come first, so on a tie the hypothesis found first stays.
    new_scores = jnp.where(ends & valid,
                           topk_log_probs / gnmt_length_penalty(step + 1, alpha),
                           NEG_INF)
    all_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
    all_seqs = jnp.concatenate([state.finished_seqs, topk_seqs], axis=1)
    finished_scores, finished_idx = lax.top_k(all_scores, beams)

    new = state._replace(
        step=step + 1,
        alive_seqs=_gather_beams(topk_seqs, alive_idx),
        alive_log_probs=new_alive_log_probs,
        last_tokens=jnp.take_along_axis(topk_tokens, alive_idx, axis=1),
        finished_seqs=_gather_beams(all_seqs, finished_idx),
        finished_scores=finished_scores,
        cache=cache,
    )
    if row_limits is None:  # (every input runs to max_len <= bound_len)
      return new
    # An input whose search ended at its own limit keeps its hypotheses as
    # they were then (its rows' cache goes on being written, unread).
    ended = step >= state.limits
    keep = lambda old, new: jnp.where(ended.reshape((-1,) + (1,) * (old.ndim - 1)), old, new)
    return new._replace(**{field: keep(getattr(state, field), getattr(new, field))
                           for field in ("alive_seqs", "alive_log_probs", "last_tokens",
                                         "finished_seqs", "finished_scores")})

  def input_done(state: _BeamState) -> jax.Array:
    """[batch] bool: no alive hypothesis of the input can still change its
    first n_best hypotheses."""
    best_alive = state.alive_log_probs[:, 0]  # Sorted: best first.
    worst_finished = state.finished_scores[:, n_best - 1]  # -inf until n_best finish.
    # Largest lp over the lengths an alive hypothesis can still reach (lp is
    # monotone in the length, so it is at one end); s / lp is largest there
    # because s <= 0. "current": only the next step's length.
    max_lp = gnmt_length_penalty(state.step + 1, alpha)
    if stop == "exact":
      max_lp = jnp.maximum(max_lp, gnmt_length_penalty(state.limits, alpha))
    cannot_improve = best_alive / max_lp < worst_finished
    no_alive = best_alive == NEG_INF
    return cannot_improve | no_alive | (state.step >= state.limits)  # (its whole search run)

  def results(state: _BeamState) -> tuple[jax.Array, ...]:
    """The finished hypotheses, then (in the slots finished ones did not fill)
    the alive ones, truncated at max_len. Both blocks are sorted best first,
    so a stable sort that only moves empty slots (-inf) to the end keeps that
    order. (And `done`, with return_done.)"""
    # (the length they were cut at: max_len, or their own limit, if shorter)
    cut = jnp.minimum(state.limits, max_len)[:, None]
    alive_scores = state.alive_log_probs / gnmt_length_penalty(cut, alpha)
    scores = jnp.concatenate([state.finished_scores, alive_scores], axis=1)
    seqs = jnp.concatenate([state.finished_seqs, state.alive_seqs], axis=1)
    empty = (scores == NEG_INF).astype(jnp.int32)
    order = jnp.argsort(empty, axis=1, stable=True)[:, :beams]
    scores = jnp.take_along_axis(scores, order, axis=1)
    seqs = jnp.where((scores > NEG_INF)[:, :, None], _gather_beams(seqs, order), 0)
    if not return_done:
      return seqs, scores
    return seqs, scores, input_done(state)

  # Only beam 0 is alive at the start; the others would be duplicates.
  first = 0.0 if empty_rows is None else jnp.where(empty_rows, NEG_INF, 0.0)
  alive_log_probs = jnp.full((batch, beams), NEG_INF, jnp.float32).at[:, 0].set(first)
  state = _BeamState(
      step=jnp.int32(0),
      alive_seqs=jnp.zeros((batch, beams, max_len), jnp.int32),
      alive_log_probs=alive_log_probs,
      last_tokens=jnp.full((batch, beams), bos_id, jnp.int32),
      finished_seqs=jnp.zeros((batch, beams, max_len), jnp.int32),
      finished_scores=jnp.full((batch, beams), NEG_INF, jnp.float32),
      limits=limits,
      cache=cache,
  )
  if shrink is None or not early_exit:
    state = _decode_loop(step_fn, lambda s: jnp.all(input_done(s)), state, max_len,
                         early_exit)
    return results(state)
  select_cache = shrink.select_cache
  if select_cache is None:  # a cache of batch * beams rows: the beams' rows of each input
    select_cache = lambda cache, indices: _map_batched(
        lambda x: x[(indices[:, None] * beams + jnp.arange(beams)).reshape(-1)], cache)

  return _shrinking_loop(step_fn, lambda s: ~input_done(s), results,
                         functools.partial(_select_inputs, select_cache=select_cache), state,
                         batch=batch, num_steps=max_len,
                         sizes=shrink.sizes(batch))
