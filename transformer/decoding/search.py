"""Decoding strategies: greedy search, beam search and sampling.

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
`EARLY_EXIT_CHUNK` scan steps inside a `lax.while_loop` that checks "done"
between chunks: the trip count of each chunk stays static (on accelerators a
data-dependent loop predicate is read back by the host at every iteration, and
on CPU a one-step while loop measured slower per step than a scan) and at most
`EARLY_EXIT_CHUNK - 1` steps are wasted. Results are
identical with and without early exit (see benchmarks/bench_early_exit.py for
the time it saves).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any
TokensToLogits = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]

# Decode steps run between two "is everything finished?" checks.
EARLY_EXIT_CHUNK = 8

NEG_INF = -np.inf


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def gnmt_length_penalty(length, alpha):
  """GNMT length penalty lp(length) = ((5 + length) / 6) ** alpha (Wu et al. 2016).

  A hypothesis' beam-search score is log p(y) / lp(|y|), where |y| counts the
  EOS token. alpha = 0 disables the normalisation (lp = 1).
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


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


def _map_batched(fn, cache: PyTree) -> PyTree:
  """Applies `fn` to cache leaves with a batch axis; scalars pass through."""
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else fn(x), cache)


# Block size of `top_k_large`'s first pass.
TOP_K_BLOCK = 128


def top_k_large(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, k)` for rows much longer than k, e.g. beam search's
  beams x vocabulary candidates: the same values and indices (ties: the lower
  index first), in two cheap passes instead of one expensive one.

  On CPU `lax.top_k` costs about as much per element as a sort (1.5 ms for
  16 x 32768, as much as the decoder's largest matmul). Instead: split each
  row into blocks of TOP_K_BLOCK, take the maximum of every block, keep the k
  blocks with the largest maxima (they hold the k largest entries: a block
  outside them has k blocks above it, hence k larger entries), and run
  `lax.top_k` on those k blocks only, in index order so ties resolve as in
  `lax.top_k`.

  x: [batch, n] float; k: static. Returns ([batch, k] values, [batch, k] int32).
  """
  batch, n = x.shape
  block = TOP_K_BLOCK
  if n < 8 * k * block:  # Too small to gain anything.
    return lax.top_k(x, k)
  num_blocks = -(-n // block)
  padded = jnp.pad(x, ((0, 0), (0, num_blocks * block - n)), constant_values=NEG_INF)
  blocks = padded.reshape(batch, num_blocks, block)
  return _top_k_in_best_blocks(blocks, jnp.max(blocks, axis=-1), k)


def _top_k_in_best_blocks(blocks: jax.Array, block_maxima: jax.Array, k: int,
                          transform=None) -> tuple[jax.Array, jax.Array]:
  """The second pass of `top_k_large`: the k best entries of the k blocks with
  the largest maxima, read in index order so ties resolve as in `lax.top_k`.

  blocks: [batch, num_blocks, block]; block_maxima: [batch, num_blocks], the
  maximum of each block after `transform`; transform(chosen [batch, k, block],
  best_blocks [batch, k]) -> the values to rank (a map that never decreases,
  applied to the chosen blocks only), or None. Returns ([batch, k] values,
  [batch, k] int32 indices into num_blocks * block).
  """
  batch, _, block = blocks.shape
  _, best_blocks = lax.top_k(block_maxima, k)
  best_blocks = jnp.sort(best_blocks, axis=-1)  # index order: ties as lax.top_k
  chosen = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1)  # [batch, k, block]
  if transform is not None:
    chosen = transform(chosen, best_blocks)
  values, flat = lax.top_k(chosen.reshape(batch, k * block), k)
  indices = jnp.take_along_axis(best_blocks, flat // block, axis=1) * block + flat % block
  return values, indices.astype(jnp.int32)


def _beam_candidates_top_k(logits: jax.Array, alive_log_probs: jax.Array,
                           k: int) -> tuple[jax.Array, jax.Array]:
  """The k best one-token extensions of the alive hypotheses: `top_k_large`
  of `alive_log_probs[:, :, None] + log_softmax(logits)` over beams x vocab,
  without writing that [batch, beams * vocab] array.

  Every candidate is f(logit) for a per-row map f(x) = alive + ((x - max) -
  log sum exp(x - max)) that never decreases in x, so the maximum of f over a
  block of TOP_K_BLOCK logits is f(the block's maximum logit), in floating point
  too. One pass over the logits takes the block maxima (whose maximum is the
  row's, for the log-softmax), a second the sum of exponentials; the k best
  blocks are then picked from f(block maxima) and only their k * block
  candidates are formed. Same values and indices as `top_k_large` on the
  candidates (ties: the lower index first).

  logits: [batch, beams, vocab] float32; alive_log_probs: [batch, beams];
  returns ([batch, k] values, [batch, k] int32 indices into beams * vocab).
  """
  batch, beams, vocab = logits.shape
  block = TOP_K_BLOCK
  if vocab % block or beams * vocab < 8 * k * block:
    log_probs = jax.nn.log_softmax(logits)
    return top_k_large((alive_log_probs[:, :, None] + log_probs).reshape(batch, -1), k)
  blocks = logits.reshape(batch, beams, vocab // block, block)
  block_max = jnp.max(blocks, axis=-1)                          # [batch, beams, blocks]
  row_max = jnp.max(block_max, axis=-1, keepdims=True)
  # log_softmax(x) = (x - max) - log(sum(exp(x - max))), as jax.nn.log_softmax.
  log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))

  def candidate(x, row_max, log_sum, alive):
    return alive + ((x - row_max) - log_sum)

  best_of_block = candidate(block_max, row_max, log_sum, alive_log_probs[:, :, None])
  per_beam = vocab // block

  def candidates_of(chosen, best_blocks):
    parent = best_blocks // per_beam                               # [batch, k]
    take = lambda x: jnp.take_along_axis(x, parent, axis=1)[:, :, None]
    return candidate(chosen, take(row_max[..., 0]), take(log_sum[..., 0]),
                     take(alive_log_probs))

  return _top_k_in_best_blocks(blocks.reshape(batch, beams * per_beam, block),
                               best_of_block.reshape(batch, -1), k, candidates_of)


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


def _decode_loop(step_fn, done_fn, state, num_steps: int, early_exit: bool):
  """Runs `state = step_fn(state)` num_steps times, stopping early if done.

  Without early exit this is a plain `lax.scan`. With it, whole chunks of
  EARLY_EXIT_CHUNK scan steps run in a `lax.while_loop` until `done_fn(state)`
  or the budget is spent. The `num_steps % EARLY_EXIT_CHUNK` steps left over
  run first, unconditionally: work is rarely done that early, and it keeps the
  loop body a single fixed-length scan (the price: `step_fn` is compiled twice
  when num_steps is not a multiple of the chunk). `step_fn` must leave finished
  work unchanged, so where the loop stops does not change results.
  """

  def scan_steps(state, length):
    if length == 0:
      return state
    state, _ = lax.scan(lambda s, _: (step_fn(s), None), state, None, length=length)
    return state

  if not early_exit:
    return scan_steps(state, num_steps)

  chunk = max(1, min(EARLY_EXIT_CHUNK, num_steps))
  num_chunks, remainder = divmod(num_steps, chunk)
  state = scan_steps(state, remainder)

  def cond(carry):
    chunks_done, state = carry
    return (chunks_done < num_chunks) & ~done_fn(state)

  def body(carry):
    chunks_done, state = carry
    return chunks_done + 1, scan_steps(state, chunk)

  _, state = lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


# ---------------------------------------------------------------------------
# Greedy search and sampling
# ---------------------------------------------------------------------------


class _SamplingState(NamedTuple):
  step: jax.Array  # int32 scalar: tokens generated so far.
  last_tokens: jax.Array  # [batch] int32, fed to the model next.
  sequences: jax.Array  # [batch, max_len] int32.
  scores: jax.Array  # [batch] float32 sum of log-probs.
  finished: jax.Array  # [batch] bool: EOS already emitted.
  cache: PyTree


def _sampling_loop(tokens_to_logits, cache, choose_fn, *, batch_size, max_len,
                   bos_id, eos_id, min_len):
  """Shared loop of greedy search and sampling.

  choose_fn(logits [batch, vocab] float32, step) -> token ids [batch]; the
  logits already carry the min_len constraint.
  Returns (sequences [batch, max_len] int32, scores [batch] float32).
  """

  def step_fn(state: _SamplingState) -> _SamplingState:
    logits, cache = _step_logits(tokens_to_logits, state.last_tokens,
                                 state.cache, state.step, eos_id, min_len)
    tokens = choose_fn(logits, state.step).astype(jnp.int32)
    # Rows that already emitted EOS emit PAD and add nothing to their score.
    tokens = jnp.where(state.finished, 0, tokens)
    # log p(token) = logit - logsumexp(logits): no [batch, vocab] log-softmax.
    token_log_probs = (jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0]
                       - jax.nn.logsumexp(logits, axis=-1))
    scores = state.scores + jnp.where(state.finished, 0.0, token_log_probs)
    return _SamplingState(
        step=state.step + 1,
        last_tokens=tokens,
        sequences=state.sequences.at[:, state.step].set(tokens),
        scores=scores,
        finished=state.finished | (tokens == eos_id),
        cache=cache,
    )

  state = _SamplingState(
      step=jnp.int32(0),
      last_tokens=jnp.full((batch_size,), bos_id, jnp.int32),
      sequences=jnp.zeros((batch_size, max_len), jnp.int32),
      scores=jnp.zeros((batch_size,), jnp.float32),
      finished=jnp.zeros((batch_size,), bool),
      cache=cache,
  )
  state = _decode_loop(step_fn, lambda s: jnp.all(s.finished), state, max_len,
                       early_exit=True)
  return state.sequences, state.scores


def greedy_search(tokens_to_logits: TokensToLogits, cache: PyTree, *,
                  batch_size: int, max_len: int, bos_id: int, eos_id: int,
                  min_len: int = 0) -> tuple[jax.Array, jax.Array]:
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

  Returns:
    sequences: [batch, max_len] int32 generated tokens (EOS included, then 0).
    scores: [batch] float32 log-probability of each sequence (sum over its
      tokens, EOS included).
  """
  return _sampling_loop(
      tokens_to_logits, cache, lambda logits, step: argmax(logits),
      batch_size=batch_size, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
      min_len=min_len)


def _is_static(x) -> bool:
  return isinstance(x, (int, float, np.number))


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p=1.0) -> jax.Array:
  """Masks (-inf) the logits outside the top-k and then the top-p nucleus.

  Args:
    logits: [batch, vocab] float (already divided by the temperature).
    top_k: keep the k largest logits (0: no top-k). Ties with the k-th value
      are kept too.
    top_p: keep the smallest set of most probable tokens whose probability
      (renormalised after top-k) reaches top_p; always at least one token.
      1.0: no top-p.

  Returns:
    [batch, vocab] logits with the removed tokens at -inf.
  """
  vocab = logits.shape[-1]
  sorted_logits = None  # Descending, for the nucleus.
  if top_k > 0 and top_k < vocab:
    sorted_logits, _ = lax.top_k(logits, top_k)
    kth_largest = sorted_logits[:, -1:]
    logits = jnp.where(logits < kth_largest, NEG_INF, logits)
  if not (_is_static(top_p) and top_p >= 1.0):
    if sorted_logits is None:
      sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token iff the mass of the tokens ranked before it is below top_p:
    # that is the smallest prefix whose mass reaches top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p).at[:, 0].set(True)
    # The smallest kept logit is the threshold; compare logits rather than
    # scattering the mask back to vocabulary order.
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1,
                        keepdims=True)
    keep_all = jnp.asarray(top_p) >= 1.0
    logits = jnp.where((logits < threshold) & ~keep_all, NEG_INF, logits)
  return logits


def sample(tokens_to_logits: TokensToLogits, cache: PyTree, *, rng: jax.Array,
           batch_size: int, max_len: int, bos_id: int, eos_id: int,
           temperature=1.0, top_k: int = 0, top_p=1.0,
           min_len: int = 0) -> tuple[jax.Array, jax.Array]:
  """Ancestral sampling with temperature, top-k and top-p (nucleus) filtering.

  At every step the logits are divided by `temperature`, then restricted to
  the `top_k` best tokens, then to the top-p nucleus of what is left, and a
  token is drawn from the renormalised distribution.

  Args:
    tokens_to_logits: (token_ids [batch] int32, cache) -> (logits [batch,
      vocab], cache).
    cache: the model's decoding cache for [batch].
    rng: PRNG key. Step t uses `fold_in(rng, t)`, so results do not depend on
      how the loop is chunked.
    batch_size, max_len: output is [batch_size, max_len].
    bos_id, eos_id: as in `greedy_search`.
    temperature: > 0; 0 means greedy (argmax). May be a traced scalar.
    top_k: static int, 0 disables.
    top_p: in (0, 1]; 1.0 disables. May be a traced scalar.
    min_len: EOS is forbidden at steps t < min_len.

  Returns:
    sequences: [batch, max_len] int32 (EOS included, then 0).
    scores: [batch] float32 log-probability of each sequence under the model
      (temperature 1, no top-k / top-p truncation; with the min_len
      constraint), so samples drawn with different settings are comparable.
  """
  if _is_static(temperature) and temperature == 0:
    choose = lambda logits, step: argmax(logits)
  else:
    def choose(logits, step):
      greedy = jnp.asarray(temperature) <= 0
      safe_temperature = jnp.where(greedy, 1.0, temperature)
      filtered = filter_logits(logits / safe_temperature, top_k=top_k,
                               top_p=top_p)
      drawn = jax.random.categorical(jax.random.fold_in(rng, step), filtered,
                                     axis=-1)
      return jnp.where(greedy, argmax(logits), drawn)

  return _sampling_loop(tokens_to_logits, cache, choose, batch_size=batch_size,
                        max_len=max_len, bos_id=bos_id, eos_id=eos_id,
                        min_len=min_len)


# ---------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------


class _BeamState(NamedTuple):
  """Alive and finished hypotheses (the Tensor2Tensor / Flax WMT scheme)."""
  step: jax.Array  # int32 scalar: tokens generated so far.
  alive_seqs: jax.Array  # [batch, beams, max_len] int32, no EOS yet.
  alive_log_probs: jax.Array  # [batch, beams] float32, sorted, -inf = empty.
  last_tokens: jax.Array  # [batch, beams] int32, fed to the model next.
  finished_seqs: jax.Array  # [batch, beams, max_len] int32, end in EOS.
  finished_scores: jax.Array  # [batch, beams] float32 log p / lp, sorted, -inf = empty.
  cache: PyTree  # Leaves [batch * beams, ...] (batch-major), or scalars.


def _gather_beams(x: jax.Array, indices: jax.Array) -> jax.Array:
  """x [batch, n, ...], indices [batch, m] -> [batch, m, ...]."""
  return jax.vmap(lambda xb, ib: xb[ib])(x, indices)


def beam_search(tokens_to_logits: TokensToLogits, cache: PyTree, *,
                batch_size: int, beam_size: int = 4, length_penalty=0.6,
                max_len: int, bos_id: int, eos_id: int, min_len: int = 0,
                early_exit: bool = True,
                reorder_cache: Callable[[PyTree, jax.Array], PyTree] | None = None,
                ) -> tuple[jax.Array, jax.Array]:
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
  worst finished one: log-probs only decrease, so an alive hypothesis with
  log-prob s <= 0 ends with a score of at most s / max(lp(n)) over the lengths
  n it can still reach (the T2T bound). When every input is done decoding
  stops (checked every EARLY_EXIT_CHUNK steps). The result is identical to
  `early_exit=False`.

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

  Returns:
    sequences: [batch, beam_size, max_len] int32, n-best, best first.
    scores: [batch, beam_size] float32, log p / lp as above.
  """
  alpha = length_penalty
  batch, beams = batch_size, beam_size
  if reorder_cache is None:
    _check_cache(cache, batch_size)
    cache = _map_batched(lambda x: jnp.repeat(x, beams, axis=0), cache)

    def reorder_cache(cache, parents):
      # A gather along the flat batch axis of every batched leaf.
      flat_parents = (jnp.arange(batch)[:, None] * beams + parents).reshape(-1)
      return _map_batched(lambda x: jnp.take(x, flat_parents, axis=0), cache)

  def step_fn(state: _BeamState) -> _BeamState:
    step = state.step
    logits, cache = _step_logits(tokens_to_logits,
                                 state.last_tokens.reshape(batch * beams),
                                 state.cache, step, eos_id, min_len)
    vocab = logits.shape[-1]

    # The 2 * beams best extensions of the alive hypotheses (log-prob of the
    # hypothesis + log_softmax of the next token), per input. Empty alive
    # slots have log-prob -inf, so their extensions stay -inf.
    topk_log_probs, topk_flat = _beam_candidates_top_k(
        logits.reshape(batch, beams, vocab), state.alive_log_probs, 2 * beams)
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

    return _BeamState(
        step=step + 1,
        alive_seqs=_gather_beams(topk_seqs, alive_idx),
        alive_log_probs=new_alive_log_probs,
        last_tokens=jnp.take_along_axis(topk_tokens, alive_idx, axis=1),
        finished_seqs=_gather_beams(all_seqs, finished_idx),
        finished_scores=finished_scores,
        cache=cache,
    )

  def done_fn(state: _BeamState) -> jax.Array:
    best_alive = state.alive_log_probs[:, 0]  # Sorted: best first.
    worst_finished = state.finished_scores[:, -1]  # -inf until all slots fill.
    # Largest lp over the lengths an alive hypothesis can still reach (lp is
    # monotone in the length, so it is at one end); s / lp is largest there
    # because s <= 0.
    max_lp = jnp.maximum(gnmt_length_penalty(state.step + 1, alpha),
                         gnmt_length_penalty(max_len, alpha))
    cannot_improve = best_alive / max_lp < worst_finished
    no_alive = best_alive == NEG_INF
    return jnp.all(cannot_improve | no_alive)

  # Only beam 0 is alive at the start; the others would be duplicates.
  alive_log_probs = jnp.full((batch, beams), NEG_INF, jnp.float32).at[:, 0].set(0.0)
  state = _BeamState(
      step=jnp.int32(0),
      alive_seqs=jnp.zeros((batch, beams, max_len), jnp.int32),
      alive_log_probs=alive_log_probs,
      last_tokens=jnp.full((batch, beams), bos_id, jnp.int32),
      finished_seqs=jnp.zeros((batch, beams, max_len), jnp.int32),
      finished_scores=jnp.full((batch, beams), NEG_INF, jnp.float32),
      cache=cache,
  )
  state = _decode_loop(step_fn, done_fn, state, max_len, early_exit)

  # n-best: the finished hypotheses, then (in the slots finished ones did not
  # fill) the alive ones, truncated at max_len. Both blocks are sorted best
  # first, so a stable sort that only moves empty slots (-inf) to the end keeps
  # that order.
  alive_scores = state.alive_log_probs / gnmt_length_penalty(max_len, alpha)
  scores = jnp.concatenate([state.finished_scores, alive_scores], axis=1)
  seqs = jnp.concatenate([state.finished_seqs, state.alive_seqs], axis=1)
  empty = (scores == NEG_INF).astype(jnp.int32)
  order = jnp.argsort(empty, axis=1, stable=True)[:, :beams]
  scores = jnp.take_along_axis(scores, order, axis=1)
  seqs = jnp.where((scores > NEG_INF)[:, :, None], _gather_beams(seqs, order), 0)
  return seqs, scores
