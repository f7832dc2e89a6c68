"""Decoding strategies: greedy search here, beam search in `beam_search.py`
(sampling: `sampling.py`), and what they share.

Everything here is pure and jittable, batched, and model-agnostic: a strategy
only sees a callable

    tokens_to_logits(token_ids, cache) -> (logits, new_cache)

  token_ids: int32 [flat_batch], the token emitted at the previous step (BOS at
             the first step).
  logits:    float [flat_batch, vocab], the scores of the next token.
  cache:     any pytree (the decoder's self-attention keys/values, the position
             index, ...).

Cache contract. Greedy search and sampling never look inside the cache. Beam
search must make the cache follow the hypotheses it keeps, in one of two ways:

  * generic (default): every cache leaf with ndim >= 1 has the flat batch on
    axis 0 and is gathered along it at every step; scalar leaves (ndim 0, e.g.
    the decode position) are passed through untouched. The cache handed to
    `beam_search` is for `[batch]`; the strategy expands it with
    `jnp.repeat(leaf, beam_size, axis=0)`.
  * `reorder_cache(cache, parents [batch, beams]) -> cache`: the model does it
    itself, from a cache it built for `batch * beams` rows. The Transformer
    uses this to keep its keys/values in place and move only a small table of
    which slot holds which position (`kv_cache.reorder_cache`): gathering the
    whole cache at every step costs more memory traffic than the weights.

Either way the flat batch is batch-major: row `b * beam_size + j` is beam j of
input b, so a model may reshape `[batch * beams, ...] -> [batch, beams, ...]`
to share per-input data (the encoder's cross-attention keys/values) between
the beams of one input.

Conventions shared by all strategies:
  * `sequences` hold generated tokens only (not the BOS): the EOS token when one
    was generated, then 0 (PAD) up to `max_len`.
  * `min_len`: EOS is forbidden (its logit set to -inf, so the other tokens
    renormalise) at steps t < min_len, i.e. at least `min_len` tokens precede
    EOS. Log-probabilities and scores are taken under this constrained
    distribution.
  * All ids, lengths and the length penalty are arguments; nothing is
    hard-coded. Shapes and loop structure must be static Python values
    (batch_size, max_len, beam_size, top_k, early_exit); bos_id, eos_id,
    min_len, length_penalty, temperature and top_p may be traced. E.g.
    `jax.jit(functools.partial(beam_search, fn, batch_size=8, max_len=64, ...))`
    applied to the cache.

Early exit. Decoding runs as a fixed number of `lax.scan` steps. To stop a batch
whose rows (or beams) have all finished, the steps are grouped in chunks of
`options.EARLY_EXIT_CHUNK` scan steps inside a `lax.while_loop` that checks "done"
between chunks: the trip count of each chunk stays static (on accelerators a
data-dependent loop predicate is read back by the host at every iteration, and
on CPU a one-step while loop measured slower per step than a scan) and at most
`EARLY_EXIT_CHUNK - 1` steps are wasted. Results are
identical with and without early exit (beam search: its first `n_best`
hypotheses, with the default exact bound; see benchmarks/bench_early_exit.py
for the time it saves).

Shrinking (`Shrink`, optional). At those same checks, once the unfinished
inputs fit in a fraction of the batch they go on alone in a smaller batch
(a fixed ladder of sizes, each compiled), so a batch does not run all its rows
until its longest output ends. The tokens are the same; the model's matmuls
may round a row's last bits differently in a smaller batch.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer.decoding.loops import (PyTree, Shrink, _decode_loop, _map_batched,
                                        _select_inputs, _shrinking_loop)
from transformer.decoding.top_k import NEG_INF

TokensToLogits = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]




# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def gnmt_length_penalty(length, alpha, xp=jnp):
  """GNMT length penalty lp(length) = ((5 + length) / 6) ** alpha (Wu et al. 2016).

  A hypothesis' beam-search score is log p(y) / lp(|y|), where |y| counts the
  EOS token. alpha = 0 disables the normalisation (lp = 1). `xp`: jax.numpy
  (in a program, float32) or numpy (on the host, float64: no program is
  compiled for it).
  """
  dtype = jnp.float32 if xp is jnp else np.float64
  return ((5.0 + xp.asarray(length, dtype)) / 6.0) ** alpha


def _check_cache(cache: PyTree, batch_size: int) -> None:
  """Fails early, with the leaf's path, on a cache that breaks the contract."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    shape = jnp.shape(leaf)
    if len(shape) >= 1 and shape[0] != batch_size:
      raise ValueError(
          f"cache leaf {jax.tree_util.keystr(path)} has shape {shape}: leaves "
          f"with ndim >= 1 must have the batch ({batch_size}) on axis 0 "
          "(scalar leaves are allowed and passed through)."
      )


def argmax(logits: jax.Array) -> jax.Array:
  """`jnp.argmax(logits, axis=-1)` (the first index of the maximum), as a max
  and then a min over the indices that reach it: two vectorised reductions
  instead of XLA's variadic (value, index) reduce, 3x faster on CPU for
  [16, 32000] (1.2 -> 0.4 ms, a greedy step's largest cost after its
  matmuls). NaN counts as +inf, so a row with NaN gives its first NaN, as
  jnp.argmax does (unless a +inf comes first).

  logits: [batch, vocab] float -> [batch] int32.
  """
  logits = jnp.where(jnp.isnan(logits), jnp.inf, logits)
  best = jnp.max(logits, axis=-1, keepdims=True)
  index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(logits == best, index, logits.shape[-1]), axis=-1)


def _forbid_eos(logits: jax.Array, eos_id, forbid) -> jax.Array:
  """Sets the EOS logit of every row to -inf where `forbid` (a scalar bool).

  A select rather than an in-place update of column eos_id: it fuses into
  whatever reads the logits, where an update made XLA copy the whole
  [batch, vocab] logits for each of their readers.
  """
  is_eos = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == eos_id
  return jnp.where(forbid & is_eos, NEG_INF, logits)


def _step_logits(tokens_to_logits, token_ids, cache, step, eos_id, min_len):
  """Calls the model and applies the min_len constraint; logits in float32."""
  logits, cache = tokens_to_logits(token_ids, cache)
  # Scores are accumulated over many steps: do it in float32 even if the model
  # computes in bfloat16.
  logits = logits.astype(jnp.float32)
  if not (isinstance(min_len, int) and min_len <= 0):
    logits = _forbid_eos(logits, eos_id, step < min_len)
  return logits, cache


# ---------------------------------------------------------------------------
# Greedy search and sampling
# ---------------------------------------------------------------------------


class _SamplingState(NamedTuple):
  step: jax.Array  # int32 scalar: tokens generated so far.
  last_tokens: jax.Array  # [batch] int32, fed to the model next.
  sequences: jax.Array  # [batch, max_len] int32.
  scores: jax.Array  # [batch] float32 sum of log-probs.
  finished: jax.Array  # [batch] bool: EOS already emitted.
  rows: jax.Array  # [batch] int32: the input each row decodes (moves when the batch shrinks).
  cache: PyTree


def sampling_loop(tokens_to_logits, cache, choose_fn, *, batch_size, max_len,
                  bos_id, eos_id, min_len, shrink: Shrink | None = None,
                  empty_rows: jax.Array | None = None, log_probs: bool = True,
                  row_limits: jax.Array | None = None):
  """Shared loop of greedy search and sampling.

  choose_fn(logits [rows, vocab] float32, step, rows [rows] int32) -> token ids
  [rows]; the logits already carry the min_len constraint; `rows` says which
  input each row decodes (for per-input random keys).
  shrink: drop finished inputs from the batch as they finish (`Shrink`).
  empty_rows: [batch] bool, rows with nothing to decode (the empty rows that
    fill up a batch): finished from the start (PAD, score 0).
  log_probs: False leaves the scores out (zeros): no log-sum-exp over the
    vocabulary at each step, for callers that keep only the tokens.
  row_limits: [batch] int32, the most tokens each row generates: the row
    ends there, as a search of that length would end it (then PAD); a limit
    of max_len or more changes nothing. None: max_len for every row.
  Returns (sequences [batch, max_len] int32, scores [batch] float32).
  """

  def step_fn(state: _SamplingState) -> _SamplingState:
    logits, cache = _step_logits(tokens_to_logits, state.last_tokens,
                                 state.cache, state.step, eos_id, min_len)
    tokens = choose_fn(logits, state.step, state.rows).astype(jnp.int32)
    # Rows that already emitted EOS emit PAD and add nothing to their score.
    tokens = jnp.where(state.finished, 0, tokens)
    # log p(token) = logit - logsumexp(logits): no [batch, vocab] log-softmax.
    token_log_probs = (jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0]
                       - jax.nn.logsumexp(logits, axis=-1)) if log_probs else 0.0
    scores = state.scores + jnp.where(state.finished, 0.0, token_log_probs)
    finished = state.finished | (tokens == eos_id)
    if row_limits is not None:  # (indexed by input: the rows move when the batch shrinks)
      finished = finished | (state.step + 1 >= row_limits[state.rows])
    return state._replace(
        step=state.step + 1,
        last_tokens=tokens,
        sequences=state.sequences.at[:, state.step].set(tokens),
        scores=scores,
        finished=finished,
        cache=cache,
    )

  state = _SamplingState(
      step=jnp.int32(0),
      last_tokens=jnp.full((batch_size,), bos_id, jnp.int32),
      sequences=jnp.zeros((batch_size, max_len), jnp.int32),
      scores=jnp.zeros((batch_size,), jnp.float32),
      finished=(jnp.zeros((batch_size,), bool) if empty_rows is None
                else jnp.asarray(empty_rows, bool)),
      rows=jnp.arange(batch_size, dtype=jnp.int32),
      cache=cache,
  )
  if shrink is None:
    state = _decode_loop(step_fn, lambda s: jnp.all(s.finished), state, max_len,
                         early_exit=True)
    return state.sequences, state.scores

  select_cache = shrink.select_cache or (
      lambda cache, indices: _map_batched(lambda x: x[indices], cache))
  return _shrinking_loop(
      step_fn, lambda s: ~s.finished, lambda s: (s.sequences, s.scores),
      functools.partial(_select_inputs, select_cache=select_cache), state,
      batch=batch_size, num_steps=max_len,
      sizes=shrink.sizes(batch_size))


def greedy_search(tokens_to_logits: TokensToLogits, cache: PyTree, *,
                  batch_size: int, max_len: int, bos_id: int, eos_id: int,
                  min_len: int = 0, shrink: Shrink | None = None,
                  empty_rows: jax.Array | None = None,
                  log_probs: bool = True,
                  row_limits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Greedy decoding: the most probable next token at every step.

  Args:
    tokens_to_logits: (token_ids [batch] int32, cache) -> (logits [batch,
      vocab], cache).
    cache: the model's decoding cache for [batch] (leaves with ndim >= 1 have
      the batch on axis 0).
    batch_size, max_len: output is [batch_size, max_len].
    bos_id: fed to the model at the first step.
    eos_id: ends a sequence; later positions are 0 (PAD).
    min_len: EOS is forbidden at steps t < min_len.
    shrink: drop finished inputs from the batch as they finish (`Shrink`):
      the same tokens, less work (up to the last bits of rounding: a row's
      matmuls run in batches of other sizes).
    empty_rows: [batch] bool, rows with nothing to decode (filling up the
      batch): finished from the start, they emit PAD and cost no steps.
    log_probs: False: no scores (zeros), and no log-sum-exp over the
      vocabulary at each step (a few % of a step).
    row_limits: [batch] int32, the most tokens each row generates (a limit
      of max_len or more changes nothing); None: max_len (`sampling_loop`).

  Returns:
    sequences: [batch, max_len] int32 generated tokens (EOS included, then 0).
    scores: [batch] float32 log-probability of each sequence (sum over its
      tokens, EOS included).
  """
  return sampling_loop(
      tokens_to_logits, cache, lambda logits, step, rows: argmax(logits),
      batch_size=batch_size, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
      min_len=min_len, shrink=shrink, empty_rows=empty_rows, log_probs=log_probs,
      row_limits=row_limits)

