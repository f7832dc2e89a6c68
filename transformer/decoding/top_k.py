"""Top-k over a large vocabulary, exactly `lax.top_k`'s values and indices, in
two passes: the maximum of every block of TOP_K_BLOCK entries, then the k best
entries of the k best blocks. It replaces `lax.top_k` over the whole row, which
sorts `[rows, vocab]` (beam search: `[batch, beams * vocab]`) at every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG_INF = -np.inf  # a removed candidate's score


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


def beam_candidates_top_k(logits: jax.Array, alive_log_probs: jax.Array,
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
