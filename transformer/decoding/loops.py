"""The loops decoding strategies run their steps in (`search.py`,
`sampling.py`): early exit in chunks, and batches that shrink as their inputs
finish. Pure and jittable; the strategies' state is theirs (a NamedTuple with
`step` and `cache`), the loops only step it, test it and select its inputs.

Early exit. Decoding runs as a fixed number of `lax.scan` steps. To stop a
batch whose rows (or beams) have all finished, the steps are grouped in
chunks of `EARLY_EXIT_CHUNK` scan steps inside a `lax.while_loop` that checks
"done" between chunks (search.py's docstring says why chunks).

Shrinking (`Shrink`). At those same checks, once the unfinished inputs fit in
a fraction of the batch they go on alone in a smaller batch (a fixed ladder of
sizes, each compiled).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any

from transformer.decoding import options  # (EARLY_EXIT_CHUNK, with its measurements)


def _map_batched(fn, cache: PyTree) -> PyTree:
  """Applies `fn` to cache leaves with a batch axis; scalars pass through."""
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else fn(x), cache)


def _scan_steps(step_fn, state, length: int):
  """`state = step_fn(state)` `length` times (a static count), as one lax.scan."""
  if length == 0:
    return state
  state, _ = lax.scan(lambda s, _: (step_fn(s), None), state, None, length=length)
  return state


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
  if not early_exit:
    return _scan_steps(step_fn, state, num_steps)

  chunk = max(1, min(options.EARLY_EXIT_CHUNK, num_steps))
  num_chunks, remainder = divmod(num_steps, chunk)
  state = _scan_steps(step_fn, state, remainder)

  def cond(carry):
    chunks_done, state = carry
    return (chunks_done < num_chunks) & ~done_fn(state)

  def body(carry):
    chunks_done, state = carry
    return chunks_done + 1, _scan_steps(step_fn, state, chunk)

  _, state = lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


class Shrink(NamedTuple):
  """Drop finished inputs from the batch as decoding goes (`_shrinking_loop`).

  select_cache(cache, indices [n] int32) -> the cache of those inputs only, in
    that order: the model's, where its cache keeps the inputs elsewhere than
    on axis 0 (the Transformer: one entry per input for all its beams, layers
    stacked by scan_layers). None: the cache contract's, every leaf with
    ndim >= 1 gathered along axis 0 (beam search: the rows of the inputs' beams).
  factor: the batch goes on with 1 / factor of its rows once that many hold
    all the unfinished inputs, again and again, ...
  min_rows: ... while that is a whole number of at least `min_rows` rows
  multiple_of: ... and a multiple of this (the devices the batch is split over),
  at most `cuts` times (None: as often as that allows).
  Each size compiles the step once more: fewer, larger cuts trade a little
  of the saving for compile time.
  """
  select_cache: Callable[[PyTree, jax.Array], PyTree] | None = None
  factor: int = 4
  min_rows: int = 8
  multiple_of: int = 1
  cuts: int | None = None

  def sizes(self, batch: int) -> list[int]:
    """The batch sizes a shrinking loop of `batch` inputs goes through."""
    sizes = [batch]
    while ((self.cuts is None or len(sizes) <= self.cuts)
           and sizes[-1] % self.factor == 0 and sizes[-1] // self.factor >= self.min_rows
           and (sizes[-1] // self.factor) % self.multiple_of == 0):
      sizes.append(sizes[-1] // self.factor)
    return sizes


def _shrinking_loop(step_fn, unfinished_fn, results_fn, select_state, state, *,
                    batch: int, num_steps: int, sizes: list[int]):
  """`_decode_loop` with early exit that also drops finished inputs: whenever
  the unfinished inputs fit in a smaller batch of `sizes`, they go on in it
  (finished ones fill it up). The step is compiled once per size; a step's
  cost falls with the rows it runs on, and most of a batch has finished long
  before its longest translation does.

  Args:
    step_fn: state -> state (one decoding step, for any batch size).
    unfinished_fn: state -> [size] bool, inputs that may still change.
    results_fn: state -> pytree of per-input results, input axis first.
    select_state: (state, indices [n]) -> the state of those inputs.
    state: the state of all `batch` inputs.
    sizes: `Shrink.sizes(batch)`.
  Returns:
    results_fn's pytree for all `batch` inputs, in their order: each input's
    as it was when it left the batch (finished: unchanged since), or at the
    end of the budget.
  """
  chunk = max(1, min(options.EARLY_EXIT_CHUNK, num_steps))
  state = _scan_steps(step_fn, state, num_steps % chunk)
  results = jax.tree.map(jnp.zeros_like, results_fn(state))
  rows = jnp.arange(batch)  # rows[i]: the input that row i of `state` decodes
  for size, next_size in zip(sizes, sizes[1:] + [0]):

    def cond(state, next_size=next_size):
      return ((state.step + chunk <= num_steps)
              & (jnp.sum(unfinished_fn(state)) > next_size))

    state = lax.while_loop(cond, lambda s: _scan_steps(step_fn, s, chunk), state)
    results = jax.tree.map(lambda out, new: out.at[rows].set(new), results,
                           results_fn(state))
    if next_size:
      keep = _unfinished_first(unfinished_fn(state))[:next_size]
      state, rows = select_state(state, keep), rows[keep]
  return results


def _select_inputs(state, indices: jax.Array, select_cache):
  """A search state (a NamedTuple with a `cache`) of the inputs `indices` only:
  its arrays gathered on their input axis (0), its cache by `select_cache`."""
  return _map_batched(lambda x: x[indices], state._replace(cache=None)
                      )._replace(cache=select_cache(state.cache, indices))


def _unfinished_first(unfinished: jax.Array) -> jax.Array:
  """[n] bool -> [n] int32, the indices of the unfinished rows (in order), then
  those of the finished ones (in order): a stable partition, by cumulative
  counts rather than a sort."""
  count = jnp.sum(unfinished)
  rank = jnp.where(unfinished, jnp.cumsum(unfinished) - 1, count + jnp.cumsum(~unfinished) - 1)
  return jnp.zeros_like(rank).at[rank].set(jnp.arange(rank.shape[0], dtype=rank.dtype))
