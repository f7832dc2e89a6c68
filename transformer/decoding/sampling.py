"""Sampling: ancestral sampling with temperature, top-k and top-p (nucleus)
filtering, on the same loop as greedy search (`search.sampling_loop`) and the
same model-agnostic contract (`search.py`'s docstring). Pure and jittable.
A filter that is off costs nothing: top_k=0 and a static top_p=1.0 are not traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer.decoding.search import (NEG_INF, PyTree, Shrink, TokensToLogits, argmax,
                                         sampling_loop)


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
           min_len: int = 0, shrink: Shrink | None = None,
           empty_rows: jax.Array | None = None,
           log_probs: bool = True,
           row_limits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Ancestral sampling with temperature, top-k and top-p (nucleus) filtering.

  At every step the logits are divided by `temperature`, then restricted to
  the `top_k` best tokens, then to the top-p nucleus of what is left, and a
  token is drawn from the renormalised distribution.

  Args:
    tokens_to_logits: (token_ids [batch] int32, cache) -> (logits [batch,
      vocab], cache).
    cache: the model's decoding cache for [batch].
    rng: a PRNG key, or one per row (`[batch]` keys: each row's draws then
      depend on its key alone, not on the other rows). Step t uses
      `fold_in(key, t)`, so results do not depend on how the loop is chunked.
    batch_size, max_len: output is [batch_size, max_len].
    bos_id, eos_id: as in `greedy_search`.
    temperature: > 0; 0 means greedy (argmax). May be a traced scalar.
    top_k: static int, 0 disables.
    top_p: in (0, 1]; 1.0 disables. May be a traced scalar.
    min_len: EOS is forbidden at steps t < min_len.
    shrink: drop finished rows as they finish (`search.Shrink`; needs a key per
      row, so that a row's draws do not depend on the batch it is in).
    empty_rows: [batch] bool, rows with nothing to decode: finished from the start.
    log_probs: False: no scores (zeros), no log-sum-exp per step.
    row_limits: [batch] int32, the most tokens each row generates (a limit
      of max_len or more changes nothing); None: max_len (`search.sampling_loop`).

  Returns:
    sequences: [batch, max_len] int32 (EOS included, then 0).
    scores: [batch] float32 log-probability of each sequence under the model
      (temperature 1, no top-k / top-p truncation; with the min_len
      constraint), so samples drawn with different settings are comparable.
  """
  if shrink is not None and jnp.ndim(rng) == 0:
    raise ValueError("sample(shrink=...) needs a key per row (rng [batch]): with one key "
                     "for the batch, a row's draws depend on the rows beside it.")
  if _is_static(temperature) and temperature == 0:
    choose = lambda logits, step, rows: argmax(logits)
  else:
    def choose(logits, step, rows):
      greedy = jnp.asarray(temperature) <= 0
      safe_temperature = jnp.where(greedy, 1.0, temperature)
      filtered = filter_logits(logits / safe_temperature, top_k=top_k,
                               top_p=top_p)
      drawn = _draw(rng if jnp.ndim(rng) == 0 else rng[rows], step, filtered)
      return jnp.where(greedy, argmax(logits), drawn)

  return sampling_loop(tokens_to_logits, cache, choose, batch_size=batch_size,
                       max_len=max_len, bos_id=bos_id, eos_id=eos_id,
                       min_len=min_len, shrink=shrink, empty_rows=empty_rows,
                       log_probs=log_probs, row_limits=row_limits)


def _draw(rng: jax.Array, step, logits: jax.Array) -> jax.Array:
  """A token per row from `logits` [batch, vocab]: with one key, drawn
  together from `fold_in(rng, step)`; with a key per row, each row from
  `fold_in(its key, step)`."""
  if jnp.ndim(rng) == 0:
    return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, step)
  return jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, logits)
