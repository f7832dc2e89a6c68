"""Batch translation: strings in, strings out, in order, nothing dropped.

`Translator` ties the model (`model/transformer.py`), a decoding strategy
(`search.py`, `sampling.py`) and the vocabulary (`data/tokenizer.py`) together.
It is what `decode.py`, the training loop's BLEU evaluation and the notebook API
use (`loader.py` loads one from a trained workdir).

How a list of sentences is decoded:
  1. Tokenize; append EOS; inputs longer than the model's `max_len` are
     truncated (counted in `last_stats["truncated"]`). Empty lines are not
     decoded: they translate to "".
  2. Sort by length and cut into batches of consecutive lengths, each padded
     to a power of two (`batching.py`), so that there are few shapes to
     compile; a batch's rows are a multiple of the local device count, over
     which it is sharded.
  3. Encode once per batch (on a CPU, the sentences packed several to a row:
     `source_packing.py`); compute every decoder layer's cross-attention
     keys/values once (`Transformer.encoder_memory`); run the strategy over
     `Transformer.decode_step` with a self-attention cache, first for about
     as many steps as the translations take (`batching.first_search_length`),
     then again in full for the inputs left unfinished.
  4. Put the results back in input order.

The default output budget is the paper's: input length + 50 tokens (the input
length rounded up to its bucket).

`output.py` turns `translate`'s results and `last_stats` into text (decode.py's
output lines and stderr).
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import threading
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer.data.tokenizer import Tokenizer, available_cores
from transformer.decoding import batching, executable_cache, loops, sampling, source_packing
from transformer.decoding import search as decoding
from transformer.model.config import MATMUL_DTYPES, TransformerConfig
from transformer.model import kv_cache
from transformer.model.kv_cache import init_cache, reorder_cache
from transformer.runtime import parallel
from transformer.decoding.options import check_options, rows_per_input
from transformer.runtime.errors import OptionError

# A decoding batch goes on with a quarter of its rows once they hold all its
# unfinished inputs, down to 8 rows (`Translator._shrink`; measured in
# docs/benchmarks.md: halving to 4 rows saved a little more for twice the compiling).
SHRINK_FACTOR, SHRINK_MIN_ROWS = 4, 8
# ... by halves instead (128 -> 64 -> 32 -> 16 -> 8) for a beam search decoder
# with at least FINE_SHRINK_MIN_ROWS rows to decode in one call (its inputs
# times their beams): 1.6x the program to load at each start (and to
# compile), which that many rows pay back (`Translator._shrink_factor`;
# docs/benchmarks.md "Wasted rows": 20,000 lines, beam 4, whole commands
# 1.03-1.05x faster; greedy search's gain does not pay for its load even there).
FINE_SHRINK_FACTOR, FINE_SHRINK_MIN_ROWS = 2, 8192
# In decode.py (`Translator.small_decoders_for_few_rows`), a greedy or
# sampling decoder's first search with at most this many rows to decode in
# one call is built small (`Translator._small_decoder`): its steps read the
# whole self-attention cache (`kv_cache.prefix_parts(1)`: one copy of the
# attention per layer instead of four) and its batch shrinks once (128 ->
# 32): less to load and set up, which so few rows do not decode long enough
# to win back. Whole greedy commands 1.04-1.05x on 1,000 gettext lines,
# 1.035x on 5,000; break-even near 900 rows at batch 128 (docs/decoding.md).
SMALL_DECODER_MAX_ROWS = 1023
MAX_CONCURRENT_BATCHES = 8  # (`Translator.default_concurrent_batches`)
LONGEST_FIRST = True  # decode the longest batches first (`translate_hypotheses`; False: for
                     # measuring, benchmarks/bench_batching.py)


logger = logging.getLogger(__name__)

# The CPU flags (Linux's names) of instructions that multiply bfloat16 (x86's
# AVX512-BF16 and AMX, Arm's BF16): without one, bfloat16 weights likely gain nothing.
BFLOAT16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def projection_weights_as(params, dtype):
  """`params` with every projection's weights (a `Dense` "kernel") in `dtype`:
  numpy arrays cast on the host (no program compiled), jax arrays where they are."""
  def cast(path, x):
    if getattr(path[-1], "key", None) != "kernel":
      return x
    return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(jnp.dtype(dtype))
  return jax.tree_util.tree_map_with_path(cast, params)


class Hypothesis(NamedTuple):
  """One translation of an input: `score` ranks the n-best (beam: log p / lp,
  the GNMT length penalty; otherwise log p), `log_prob` is log p of its tokens
  under the model, `length` the generated tokens counting the EOS."""
  text: str
  score: float
  log_prob: float
  length: int


class Translator:
  """Translates lists of sentences with a trained model.

  Args:
    model_config: the model's TransformerConfig.
    params: its parameters.
    tokenizer: the shared SentencePiece vocabulary.
    param_sharding: "replicated" (a copy on every local device) or "fsdp"
      (each array split over the local devices on its largest divisible axis,
      `parallel.fsdp_spec`, as training's `state_sharding="fsdp"`: a model
      larger than one device's memory decodes; XLA gathers each layer's
      weights where it is used, never the whole model on one device).
    weights_dtype: None (the model's `dtype`) or "bfloat16": every
      projection's weights (W^Q, W^K, W^V, W^O, the feed-forward's, the
      output projection) kept in bfloat16 and multiplied with their inputs
      in bfloat16, the products summed in the model's dtype; the rest
      (embeddings, attention over the cache, LayerNorm, softmax, search) as
      the model says. On a CPU with AVX512-BF16 or AMX 1.2-1.4x faster with
      the same BLEU (docs/decoding.md); on one without, a warning.
  Batches are sharded over this process's local devices.

  `pack_sources` (an attribute, default: on a CPU with one device): the
  encoder reads a batch's sentences packed several to a row
  (`source_packing`), not each padded to the batch's length.

  `first_search` (an attribute, default True): each batch first decodes the
  first `batching.first_search_length` steps of its search (its cache that long), and
  searches again in full only the inputs those leave unfinished; False: the
  whole search at once (training's evaluation: an undertrained model's
  translations run to the end, and each would be searched twice).

  `share_buckets` (an attribute, default: True on CPU only): the inputs of a
  length bucket too few to pay for a decoder of their own are padded to the
  next longer bucket (`batching.shared_buckets`), each still searched to
  its own bucket's length (`row_limits`): 1,000 gettext lines, greedy, 2
  decoders instead of 4 (a warm decode.py 0.3 s faster, a first one
  compiling half as long); its costs were measured on CPUs only
  (docs/decoding.md).

  `cut_least_padding` (an attribute, default: True on CPU only): greedy
  search's and sampling's batches are cut where they pad the least
  (`batching.length_batches`' `least_padding`): measured on CPUs only.

  `shrink_batches` (an attribute, default: True on CPU only): a batch goes on
  with fewer rows once most of its inputs are done (`_shrink`). Measured on
  CPU 1.6-3x greedy and 1.2-2x beam throughput; on an H200 no gain for greedy
  and 1.1x for beam 4, for twice the compiling (one step per shrunk size:
  43.5 against 27.6 s greedy, 53.9 against 26.7 s beam for 1,000 lines at
  batch 128; docs/decoding.md), so accelerators decode whole batches. A
  quarter of the rows at a time; by halves for a beam search decoder with
  thousands of inputs to decode (`_shrink_factor`).

  `small_decoders_for_few_rows` (an attribute, default: False; decode.py
  sets it on a CPU): a greedy or sampling decoder with at most
  SMALL_DECODER_MAX_ROWS rows to decode in its first search is built small,
  to load faster and decode a little slower (`_small_decoder`): right for a
  command that loads its decoders for one file, not for a Translator that
  keeps them for call after call. Measured on CPUs only.
  """

  def __init__(self, model_config: TransformerConfig, params, tokenizer: Tokenizer, *,
               param_sharding: str = "replicated", weights_dtype: str | None = None):
    if weights_dtype not in MATMUL_DTYPES:
      raise OptionError("weights_dtype", weights_dtype,
                        f"must be one of {', '.join(map(str, MATMUL_DTYPES))}")
    self.config = model_config.replace(matmul_dtype=weights_dtype or model_config.matmul_dtype)
    self.tokenizer = tokenizer
    self.mesh = Mesh(np.array(jax.local_devices()), ("data",))
    on_cpu = self.mesh.devices.flat[0].platform == "cpu"
    if (weights_dtype == "bfloat16" and on_cpu
        and not BFLOAT16_CPU_FLAGS & executable_cache.host_cpu_flags()):
      logger.warning("weights_dtype=bfloat16 on a CPU without bfloat16 instructions "
                     "(none of %s): likely no faster than float32.",
                     ", ".join(sorted(BFLOAT16_CPU_FLAGS)))
    if param_sharding not in parallel.STATE_SHARDINGS:
      raise OptionError("param_sharding", param_sharding,
                        f"must be one of {', '.join(parallel.STATE_SHARDINGS)}")
    self.param_sharding = param_sharding
    self.last_stats: dict[str, float] = {}
    self.overlap = True  # detokenize batch k - 1 while the device decodes batch k
    self.shrink_batches = on_cpu
    self.pack_sources = self.shrink_batches and len(self.mesh.devices.flat) == 1
    self.first_search = True
    self.share_buckets = on_cpu
    self.cut_least_padding = on_cpu
    self.small_decoders_for_few_rows = False  # (decode.py: True on a CPU)
    self._compiled = {}  # the cross-attention function, jitted once
    self._executables = {}  # decoders compiled for one batch shape
    self._decoders_loaded = 0  # of them, how many executable_cache loaded
    self._logits_kernel_fn = None  # (`_logits_kernel`)
    self.set_params(params)

  @functools.cached_property
  def model(self):
    """The flax module, made on first use: only tracing a program needs it,
    and a Translator whose decoders are all on disk (`executable_cache`) never
    does, so decode.py then never imports flax (0.15-0.25 s of its start)."""
    from transformer.model.transformer import Transformer
    return Transformer(self.config)

  def set_params(self, params) -> None:
    """Translates with `params` from now on (same shapes: e.g. a later
    checkpoint of the same model, as training's evaluation does). The
    compiled decoders are kept: they take the parameters as an argument."""
    if jax.process_count() > 1 and self.param_sharding == "replicated":
      params = parallel.to_host(params)  # global arrays -> this process's devices
    if self.config.matmul_dtype is not None:  # (stored as they multiply: no cast per step)
      params = projection_weights_as(params, self.config.matmul_dtype)
    self._param_shardings = parallel.state_shardings(params, self.mesh, self.param_sharding)
    self.params = jax.device_put(params, self._param_shardings)
    self.logits_kernel = self._logits_kernel(self.params)
    self._logits_kernel_sharding = jax.tree.map(lambda x: x.sharding, self.logits_kernel)

  def _logits_kernel(self, params):
    """The tied output projection laid out for decoding steps
    (`Transformer.logits_kernel`), once for all batches (a transpose of the
    embedding: 40 ms for the base model on CPU); None when untied. Compiled
    once and kept with the decoders (`executable_cache`), so that a start
    traces nothing; under fsdp split like the embedding it comes from."""
    if not self.config.logits_via_embedding:
      return None
    if self._logits_kernel_fn is None:
      parts = {"of": "logits_kernel", "model": self.config.to_dict(),
               "params": executable_cache.describe(params)}
      self._logits_kernel_fn, _ = executable_cache.load_or_compile(
          parts, lambda: jax.jit(self._logits_kernel_program()).lower(params).compile(),
          suffix=".logits_kernel", what="compiled logits kernel")
    return self._logits_kernel_fn(params)

  def _logits_kernel_program(self):
    """params -> `Transformer.logits_kernel` (split like the embedding it
    comes from, under fsdp)."""
    mesh, devices = self.mesh, len(self.mesh.devices.flat)

    def logits_kernel(params):
      kernel = self.model.apply({"params": params}, method="logits_kernel")
      if self.param_sharding == "replicated":
        return kernel
      return jax.lax.with_sharding_constraint(
          kernel, NamedSharding(mesh, parallel.fsdp_spec(kernel.shape, devices)))
    return logits_kernel

  # -- the jitted decoder ----------------------------------------------------

  def _decode_fn(self, method: str, batch: int, src_len: int, max_len: int,
                 beam_size: int, top_k: int, early_exit: bool = True,
                 temperature_on: bool = True, top_p_on: bool = True, n_best: int = 0,
                 beam_stop: str = "exact", shrink: bool = True, log_probs: bool = True,
                 packed: bool = False, search_len: int = 0, shrink_factor: int | None = None,
                 small: bool = False):
    """The jitted decoder of one batch shape:
    (params, logits_kernel, inputs [batch, src_len], key_data, row_lines [batch],
    row_copies [batch], row_limits [batch], length_penalty, temperature, top_p,
    min_len, packing) -> (sequences [batch, n, max_len], scores [batch, n],
    done [batch]). Row r's search is one of row_limits[r] tokens (its own
    bucket's length, where it shares a longer bucket's decoder or is batched
    with longer inputs: `batching.shared_buckets`); greedy search and
    sampling end it there, beam search stops its hypotheses there and bounds
    them at that length (`search.beam_search`). `translate_hypotheses`
    compiles it once per shape (`self._executables`). Sampling draws row r's
    tokens from `fold_in(fold_in(rng, row_lines[r]), row_copies[r])`, `rng`
    the PRNG key whose `jax.random.key_data` is `key_data`: a line's
    sample depends on the seed and its line number only. A temperature of 1 or
    a top_p of 1 (`temperature_on`, `top_p_on` False) is left out of the
    program (no division, no sort of the vocabulary). Beam search stops an
    input once its first `n_best` hypotheses are final (0: all beam_size), by
    the bound `beam_stop` names (`search.beam_search`'s `stop`). With early
    exit and `shrink` (`shrink_batches`), the batch drops finished inputs
    (`_shrink`), going on with 1 / `shrink_factor` of its rows at a time
    (None: SHRINK_FACTOR; `_shrink_factor`). A `small` decoder
    (`_small_decoder`) shrinks once only and its steps read the whole
    self-attention cache. Without `log_probs`, greedy
    search and sampling return zero scores (no log-sum-exp over the
    vocabulary per step). With `packed`, the
    encoder reads the inputs packed as `packing` (`source_packing.pack`'s
    tokens, segments, positions, where) says; otherwise `packing` is ().
    `search_len` (0: max_len): the search these max_len steps begin (read on
    the host: the rows' limits are at most that, and what fills a batch gets
    it); `done` says which rows are finished (an EOS or their limit; beam:
    `search.beam_search`'s done), the others would go on in a longer search
    (`batching.first_search_length`)."""
    cfg, model = self.config, self.model

    def run(params, logits_kernel, inputs, key_data, row_lines, row_copies, row_limits,
            length_penalty, temperature, top_p, min_len, packing):
      if packed:  # the encoder on the sentences packed several to a row
        encoded = source_packing.encode_packed(
            lambda tokens, segments, positions: model.apply(
                {"params": params}, tokens, segments, positions, method="encode"), *packing)
      else:
        encoded = model.apply({"params": params}, inputs, method="encode")
      memory = model.apply({"params": params}, encoded, inputs, None, logits_kernel,
                           method="encoder_memory")

      def tokens_to_logits(token_ids, state):
        with kv_cache.prefix_parts(1 if small else None):  # (read as the step is traced)
          logits, cache = model.apply({"params": params}, token_ids, state["cache"],
                                      state["memory"], method="decode_step")
        return logits, dict(state, cache=cache)

      def state(beams=1):  # what the search carries: the cache and the encoder memory
        return {"cache": init_cache(cfg, batch, max_len, beams), "memory": memory}

      common = dict(batch_size=batch, max_len=max_len, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                    min_len=min_len, shrink=self._shrink(early_exit and shrink, shrink_factor,
                                              cuts=1 if small else None),
                    empty_rows=jnp.all(inputs == cfg.pad_id, axis=1))  # (filling the batch)
      if method == "beam":
        return decoding.beam_search(
            tokens_to_logits, state(beam_size), beam_size=beam_size,
            length_penalty=length_penalty, early_exit=early_exit, n_best=n_best or None,
            stop=beam_stop, row_limits=row_limits, return_done=True,
            reorder_cache=lambda s, parents: dict(s, cache=reorder_cache(s["cache"], parents)),
            **common)
      if method == "greedy":
        seqs, scores = decoding.greedy_search(tokens_to_logits, state(), log_probs=log_probs,
                                              row_limits=row_limits, **common)
      else:
        fold_in = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
        rng = jax.random.wrap_key_data(key_data)
        row_keys = jax.vmap(jax.random.fold_in)(fold_in(rng, row_lines), row_copies)
        seqs, scores = sampling.sample(
            tokens_to_logits, state(), rng=row_keys,
            temperature=temperature if temperature_on else 1.0, top_k=top_k,
            top_p=top_p if top_p_on else 1.0, log_probs=log_probs, row_limits=row_limits,
            **common)
      # Done: an EOS, nothing to decode, or its own length reached within these steps.
      done = (jnp.any(seqs == cfg.eos_id, axis=1) | common["empty_rows"]
              | (row_limits <= max_len))
      return seqs[:, None], scores[:, None], done

    data = NamedSharding(self.mesh, P("data"))
    replicated = NamedSharding(self.mesh, P())
    return jax.jit(run, in_shardings=(self._param_shardings, self._logits_kernel_sharding,
                                      data, replicated, data, data, data, replicated,
                                      replicated, replicated, replicated, data),
                   out_shardings=(data, data, data))

  def _shrink(self, shrink: bool, factor: int | None = None,
              cuts: int | None = None) -> decoding.Shrink | None:
    """How a batch drops its finished inputs (`decoding.Shrink`): to 1 /
    `factor` (None: SHRINK_FACTOR, a quarter) of its rows once they hold the
    unfinished, down to SHRINK_MIN_ROWS (a multiple of the devices), at most
    `cuts` times (None: no limit). None when
    not `shrink`: without early exit (every step on every row, for
    benchmarks) or `shrink_batches` (off on accelerators: class docstring)."""
    if not shrink:
      return None
    devices = len(self.mesh.devices.flat)
    return decoding.Shrink(
        lambda state, indices: kv_cache.select_inputs(state, indices, self.config.scan_layers),
        factor=factor or SHRINK_FACTOR, min_rows=max(SHRINK_MIN_ROWS, devices),
        multiple_of=devices, cuts=cuts)

  def _shrink_factor(self, method: str, rows: int, early_exit: bool) -> int:
    """The shrink factor of a decoder of `method` with `rows` rows to decode
    in this call (its inputs times their beams or samples): for beam search
    that shrinks, FINE_SHRINK_FACTOR from FINE_SHRINK_MIN_ROWS on (more
    compiled sizes, fewer wasted row-steps); otherwise SHRINK_FACTOR (a
    smaller program to load; and for a batch that never shrinks, one decoder
    whatever its rows)."""
    fine = (method == "beam" and early_exit and self.shrink_batches
            and rows >= FINE_SHRINK_MIN_ROWS)
    return FINE_SHRINK_FACTOR if fine else SHRINK_FACTOR

  def _small_decoder(self, method: str, rows: int, first_search: bool) -> bool:
    """Whether a decoder of `method` with `rows` rows to decode in this call,
    in a first search (its cache sized to the translations:
    `batching.first_search_length`) or not, is built small (`_decode_fn`'s
    `small`: the whole cache read at every step, one shrink): greedy search
    and sampling with at most SMALL_DECODER_MAX_ROWS rows, whose load and
    first call that makes cheaper than their decoding slower. Beam search
    already reads its whole cache, and its few rows decode long enough to
    pay for every shrink (one only: 4.5% slower on 1,000 lines at 128)."""
    return bool(self.small_decoders_for_few_rows and first_search and method != "beam"
                and rows <= SMALL_DECODER_MAX_ROWS)

  def default_concurrent_batches(self) -> int:
    """Batches decoded at once when the caller does not say: on a CPU, one
    per core its devices leave (at most MAX_CONCURRENT_BATCHES: each holds
    its own cache); elsewhere 1 (one batch at a time already fills a GPU or
    TPU, and JAX overlaps the host's work with it).

    Why on a CPU: a decoding step is many small ops, which XLA splits across
    the cores poorly; two batches side by side on 2 cores decode 1.2-1.6x
    faster than one batch at a time (docs/benchmarks.md)."""
    if jax.default_backend() != "cpu":
      return 1
    return max(1, min(MAX_CONCURRENT_BATCHES, available_cores() // len(self.mesh.devices.flat)))

  # -- the public API --------------------------------------------------------

  def translate(self, sentences: Sequence[str], *, n_best: int = 1, **options):
    """Translates `sentences` (the options: `translate_hypotheses`).

    Returns:
      n_best == 1: a list of strings, one per input, in input order.
      n_best > 1: a list (per input) of n_best (translation, score) pairs,
      best first.
      (None for the inputs of other shares, with `share`.)
    """
    # Texts only (n_best > 1 pairs them with scores, which it computes anyway).
    options.setdefault("scores", False)
    results = self.translate_hypotheses(sentences, n_best=n_best, **options)
    if n_best == 1:
      return [None if hyps is None else hyps[0].text for hyps in results]
    return [None if hyps is None else [(h.text, h.score) for h in hyps] for hyps in results]

  def translate_hypotheses(
      self, sentences: Sequence[str], *, method: str = "beam", beam_size: int = 4,
      length_penalty: float = 0.6, beam_stop: str = "exact",
      max_len: int | None = None, extra_len: int = 50,
      min_len: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
      seed: int = 0, n_best: int = 1, batch_size: int = 32, batch_tokens: int = 0,
      first_line: int = 0, progress: bool = False,
      early_exit: bool = True, share: tuple[int, int] = (0, 1), concurrent_batches: int = 0,
      scores: bool = True) -> list[list[Hypothesis] | None]:
    """Translates `sentences` into `n_best` hypotheses each, best first.

    Args:
      sentences: source sentences (one per item; "" translates to "").
      method: "greedy", "beam" or "sample".
      beam_size, length_penalty: beam search (the paper: 4 and 0.6).
      beam_stop: when beam search stops an input: "exact" (once no alive
        hypothesis could beat its n-best at any length it can still reach:
        what searching to max_len gives) or "current" (once none could at
        its next step's length: faster, not exact; `search.beam_search`).
      max_len: most tokens generated (EOS included); None: input length + extra_len.
      min_len: fewest tokens before EOS may be generated.
      temperature, top_k, top_p, seed: sampling (top_k 0, top_p 1 and
        temperature 1 disable them and cost nothing). Sentence i's samples
        depend only on `seed` and its line number `first_line + i`.
      n_best: hypotheses per sentence (beam: the best n_best of the beam,
        n_best <= beam_size; sample: n_best samples, sorted by score).
      batch_size: sentences per decoding batch (of this process, sharded over
        its local devices), or with `batch_tokens` > 0 ...
      batch_tokens: ... source tokens (padded length x rows) per batch: short
        inputs go in larger batches.
      first_line: the line number of sentences[0] (for the sampling keys).
      progress: show a tqdm bar on stderr.
      early_exit: stop decoding an input once its result cannot change, and
        go on with fewer rows once most of a batch is done (`_shrink`): the
        same results, less time; False runs every step on every row (for
        benchmarks).
      share: (index, count): decode only batches index, index + count, index
        + 2 * count, ... of the batches all the sentences make (the blank ones
        go with share 0): several processes each decode a share of the same
        batches, so that every sentence is decoded in the batch, with the
        rows, it would be decoded in by one process (a sentence's last bits
        depend on its batch: `multihost.split_across_processes`).
      concurrent_batches: batches decoded at once, side by side, the calling
        thread decoding one lane of them and each other lane a thread of its
        own (the same results, in less time where one batch's small steps
        leave cores idle); 0: `default_concurrent_batches()`.
      scores: False when only the texts are wanted: greedy search and
        sampling with n_best 1 then skip the log-probabilities (a log-sum-exp
        over the vocabulary per step) and give NaN scores; beam search and
        ranked samples (n_best > 1) need them and compute them anyway.
    Returns:
      Per input, `n_best` Hypothesis(text, score, log_prob, length): `score`
      is what ranks them (beam: log p / lp(length); otherwise log p),
      `log_prob` the model's log-probability of the tokens, `length` the
      generated tokens counting the EOS. None for the inputs of other shares.
    """
    check_options(method=method, beam_size=beam_size, length_penalty=length_penalty,
                  beam_stop=beam_stop,
                  max_len=max_len, min_len=min_len, temperature=temperature, top_k=top_k,
                  top_p=top_p, n_best=n_best, batch_size=batch_size,
                  batch_tokens=batch_tokens, concurrent_batches=concurrent_batches)
    start = time.perf_counter()
    self._decoders_loaded = 0
    encoded, truncated = self._encode(sentences)
    copies = n_best if method == "sample" else 1  # one row per sample of an input
    empty = Hypothesis("", 0.0, 0.0, 0)
    share_index, share_count = share
    # Blank inputs are in no batch: "" (share 0's); the others: filled in by their batch.
    results: list[list[Hypothesis] | None] = [
        [empty] * n_best if not ids and share_index == 0 else None for ids in encoded]
    options = (float(length_penalty), float(temperature), float(top_p), int(min_len))
    switches = (temperature != 1.0, top_p < 1.0) if method == "sample" else (False, False)
    log_probs = scores or method == "beam" or n_best > 1
    # The sampling key, as its raw data: only sampling makes it, since making a
    # key compiles a small program (0.03 s of every decode.py start otherwise).
    key_data = (np.asarray(jax.random.key_data(jax.random.key(seed))) if method == "sample"
                else np.zeros(2, np.uint32))
    batches = []  # (shape, member indices)
    inputs_per_batch = lambda src_len: max(
        1, self._batch_rows(batch_size, copies, batch_tokens, src_len) // copies)
    # Buckets too small to pay for a decoder of their own go to a longer one
    # (each input still searched to its own bucket's length: `limits`).
    decoder_rows = rows_per_input(method, beam_size, n_best)
    shared = (batching.shared_buckets(encoded, self.config.max_len, decoder_rows)
              if self.share_buckets else {})
    limits = {}  # input -> most tokens it generates: its own bucket's
    for src_len, members in batching.length_batches(encoded, self.config.max_len,
                                                    inputs_per_batch, shared,
                                                    least_padding=(self.cut_least_padding
                                                                   and method != "beam")):
      rows = self._batch_rows(batch_size, copies, batch_tokens, src_len)
      out_len = self._output_length(src_len, max_len, extra_len)
      for i in members:
        limits[i] = self._output_length(
            batching.bucket_length(len(encoded[i]), self.config.max_len), max_len, extra_len)
      first_len = (batching.first_search_length(src_len, out_len, min_len)
                   if early_exit and self.first_search else out_len)
      shape = (method, rows, src_len, first_len,
               beam_size, top_k, early_exit, *switches,
               *((n_best, beam_stop) if method == "beam" else (0, "exact")),
               self.shrink_batches, log_probs, self.pack_sources, out_len)
      batches.append((shape, members))
    # Per decoder, what its rows to decode pay for (counted over every share,
    # so that all processes make the same decoders): beam decoders with many
    # shrink by finer steps; greedy and sampling ones with few are built small.
    rows_per_decoder = {}
    for shape, members in batches:
      rows_per_decoder[shape] = rows_per_decoder.get(shape, 0) + len(members) * decoder_rows
    built = {shape: (self._shrink_factor(method, rows, early_exit),
                     self._small_decoder(method, rows, _is_first_search(shape)))
             for shape, rows in rows_per_decoder.items()}
    batches = [(shape + built[shape], members)
               for shape, members in batches][share_index::share_count]
    decoded = sum(len(members) for _, members in batches)
    bar = tqdm.tqdm(total=decoded, unit="sent", disable=not progress, desc="decode",
                    dynamic_ncols=True)

    def batch_inputs(shape, members) -> tuple:
      """The decoder's arguments after the parameters for one batch."""
      rows = shape[1]
      sources = [encoded[i] for i in members]
      inputs = batching.pack_batch(sources, rows, shape[2], copies)
      row_lines = np.zeros(rows, np.int32)
      row_lines[:len(members) * copies] = np.repeat(np.asarray(members) + first_line, copies)
      row_copies = np.tile(np.arange(copies, dtype=np.int32), rows // copies + 1)[:rows]
      row_limits = np.full(rows, _decoder_option(shape, "search_len"), np.int32)
      row_limits[:len(members) * copies] = np.repeat([limits[i] for i in members], copies)
      packing = (tuple(source_packing.pack([ids for ids in sources for _ in range(copies)],
                                           rows, shape[2]))
                 if _decoder_option(shape, "packed") else ())
      return inputs, key_data, row_lines, row_copies, row_limits, *options, packing

    searched_again = []  # (shape, members): inputs a first search left unfinished

    def finish(pending) -> int:  # (-> tokens generated)
      """The hypotheses of a dispatched batch, read back (waiting for the
      device only if it is not done) and detokenized; its inputs that the
      batch's first search left unfinished go to `searched_again` instead."""
      (shape, members), seqs, scores, done = pending
      seqs, scores, done = np.asarray(seqs), np.asarray(scores), np.asarray(done)
      if not log_probs:  # (the decoder left them out: zeros)
        scores = np.full(scores.shape, np.nan, np.float32)
      if _is_first_search(shape):
        done = done[:len(members) * copies].reshape(len(members), copies).all(axis=1)
        if not done.all():
          searched_again.append(
              (self._search_again_shape(shape, int((~done).sum()) * copies),
               [i for i, d in zip(members, done) if not d]))
          kept = np.flatnonzero(done)
          members = [members[k] for k in kept]
          picked = (kept[:, None] * copies + np.arange(copies)).reshape(-1)  # their rows
          seqs, scores = seqs[picked], scores[picked]
      rows = batching.unpack_hypotheses(seqs, scores, len(members), copies, n_best)
      ids = [[row_ids.tolist()[:limits[i]] for row_ids, _ in hyps]  # (then PAD)
             for i, hyps in zip(members, rows)]
      lengths = np.asarray([[self._length(h) for h in hyps] for hyps in ids])
      # Beam scores are log p / lp(length): log p is the score times lp (in
      # numpy: in jax it compiled 4 small programs at a process's first beam batch).
      lps = (decoding.gnmt_length_penalty(lengths, length_penalty, xp=np)
             if method == "beam" else np.ones(lengths.shape))
      tokens = 0
      for k, (i, hyps) in enumerate(zip(members, rows)):
        results[i] = sorted(
            (Hypothesis(self.tokenizer.decode(ids[k][n]), float(score),
                        float(score) * float(lps[k, n]), int(lengths[k, n]))
             for n, (_, score) in enumerate(hyps)), key=lambda h: -h.score)
        tokens += int(lengths[k].sum())
      bar.update(len(members))
      return tokens

    # Longest batches first: lanes that take the next batch as they free up
    # then end together, instead of one lane decoding the longest batch alone
    # at the end (measured in docs/benchmarks.md "Wasted rows").
    lanes = concurrent_batches or self.default_concurrent_batches()
    compile_seconds = self._prepare_batches(batches, batch_inputs)
    totals = self._decode_in_lanes(batches[::-1] if LONGEST_FIRST else batches,
                                   batch_inputs, finish, lanes)
    if searched_again:  # (rare: `batching.first_search_length`)
      again = sorted(searched_again, key=lambda batch: batch[1][0])
      compile_seconds += self._prepare_batches(again, batch_inputs)
      totals += self._decode_in_lanes(again, batch_inputs, finish, lanes)
    generated = sum(tokens for tokens, _ in totals)
    host_seconds = sum(seconds for _, seconds in totals)
    bar.close()
    self.last_stats = self._stats(
        len(sentences), decoded, truncated, generated, time.perf_counter() - start,
        compile_seconds, host_seconds, sum(len(members) for _, members in searched_again))
    return results

  # -- the steps of `translate_hypotheses` -----------------------------------

  def _encode(self, sentences: Sequence[str]) -> tuple[list[list[int]], int]:
    """(token ids + EOS per sentence, [] for a blank one; how many were
    truncated to the model's max_len)."""
    cfg, encoded, truncated = self.config, [], 0
    for text in sentences:
      ids = self.tokenizer.encode(text) if text.strip() else []
      if len(ids) + 1 > cfg.max_len:
        ids, truncated = ids[:cfg.max_len - 1], truncated + 1
      encoded.append(ids + [cfg.eos_id] if ids else [])
    return encoded, truncated

  def _length(self, ids: list[int]) -> int:
    """Generated tokens of a decoded row, to its EOS included (all if none)."""
    return ids.index(self.config.eos_id) + 1 if self.config.eos_id in ids else len(ids)

  def _batch_rows(self, batch_size: int, copies: int, batch_tokens: int = 0,
                  src_len: int = 0) -> int:
    """Rows of every decoding batch of inputs padded to `src_len`:
    `batch_size`, or `batch_tokens // src_len` (at least one input's `copies`
    sample rows), rounded up to a multiple of the devices."""
    devices = len(self.mesh.devices.flat)
    wanted = max(1, batch_tokens // src_len) if batch_tokens else batch_size
    return batching.round_up(max(wanted, copies), devices)

  def _output_length(self, src_len: int, max_len: int | None, extra_len: int) -> int:
    """Most tokens generated for a bucket of inputs padded to `src_len`."""
    out_len = max_len
    if out_len is None:  # rounded up to whole early-exit chunks: one compilation, not two
      out_len = batching.round_up(src_len + extra_len, loops.EARLY_EXIT_CHUNK)
    if self.config.positional == "learned":  # no position embedding past max_len (NaN)
      out_len = min(out_len, self.config.max_len)
    return out_len

  def _search_again_shape(self, shape: tuple, rows: int) -> tuple:
    """The decoder that searches again in full (max_len = search_len) the
    inputs of a batch of `shape` that its first search left unfinished,
    `rows` of them: as few rows as hold them (SHRINK_MIN_ROWS times a power
    of two, a multiple of the devices, at most the batch's)."""
    devices = len(self.mesh.devices.flat)
    needed = batching.power_of_two_at_least(rows, SHRINK_MIN_ROWS)
    fields = dict(zip(_DECODER_ARGUMENTS, shape))
    fields.update(batch=min(fields["batch"], batching.round_up(needed, devices)),
                  max_len=fields["search_len"], shrink_factor=SHRINK_FACTOR, small=False)
    return tuple(fields.values())

  def _prepare_batches(self, batches, batch_inputs) -> float:
    """`_prepare_all` for every decoder `batches` [(shape, members)] need,
    with `batch_inputs(shape, members)` as a batch's arguments; the seconds
    it took."""
    first_batches: dict[tuple, list[int]] = {}
    for shape, members in batches:
      first_batches.setdefault(shape, members)
    return self._prepare_all(
        [(shape, batch_inputs(shape, members)) for shape, members in first_batches.items()])

  def _decode_in_lanes(self, batches, batch_inputs, finish, lanes: int
                       ) -> list[tuple[int, float]]:
    """Decodes `batches` [(shape, members)] in order, in up to `lanes`
    lanes side by side: the calling thread is one, each other lane a thread
    of its own; `finish((shape, members), *outputs)` reads a batch back and
    returns its tokens generated. Per lane: (tokens generated, host seconds).

    Why the calling thread decodes too: where JAX runs a computation on the
    thread that calls it (decode.py's large batches on a CPU:
    `host_memory.run_computations_on_calling_threads`), the batch's
    temporaries come from that thread's heap, and the main thread's (glibc's
    main heap) keeps freed blocks of any size for the next batch, where a
    thread's own keeps none over 64 MB (beam 4 at batch 128: 397k -> 184k
    page faults per later call on 1,000 gettext lines; docs/decoding.md)."""
    queue = iter(batches)
    take = threading.Lock()  # (lanes take the next batch in turn)
    failed = threading.Event()  # (one lane's error stops the others)

    def lane() -> tuple[int, float]:
      """Decodes batches from `queue` until it is empty. The device works on
      batch k while the host packs batch k + 1 and detokenizes batch k - 1
      (where JAX dispatches asynchronously; where it does not, the other
      lanes keep the cores busy meanwhile)."""
      generated, host_seconds, pending = 0, 0.0, None
      while not failed.is_set():
        with take:
          shape, members = next(queue, (None, None))
        if shape is None:
          break
        host_start = time.perf_counter()
        inputs = batch_inputs(shape, members)
        host_seconds += time.perf_counter() - host_start
        outputs = self._dispatch(shape, inputs)
        if pending is not None:
          host_start = time.perf_counter()
          generated += finish(pending)
          host_seconds += time.perf_counter() - host_start
        pending = ((shape, members), *outputs)
        if not self.overlap:  # (for measuring what the overlap gains)
          generated += finish(pending)
          pending = None
      if pending is not None:
        generated += finish(pending)
      return generated, host_seconds

    lanes = min(lanes, max(len(batches), 1))
    if lanes == 1:
      return [lane()]

    def guarded_lane():  # (the lanes' batches run side by side)
      try:
        return lane()
      except BaseException:
        failed.set()
        raise
    with concurrent.futures.ThreadPoolExecutor(lanes - 1, thread_name_prefix="decode") as pool:
      futures = [pool.submit(guarded_lane) for _ in range(lanes - 1)]
      mine = guarded_lane()
      return [mine] + [future.result() for future in futures]

  def _prepare_all(self, needed: Sequence[tuple[tuple, tuple]]) -> float:
    """`_prepare`s the decoders of `needed` [(shape, inputs)], side by side
    in threads (one per CPU core at most). Loading them from disk (a second
    run) takes 0.4-0.5 s instead of 0.7 s for the 4 decoders of 1,000 lines
    on 2 cores; compiling them (a first run) measured no faster, 13-14 s
    either way (tracing holds Python's lock). Returns the seconds it took."""
    start = time.perf_counter()
    todo = [(shape, inputs) for shape, inputs in needed if shape not in self._executables]
    workers = min(len(todo), available_cores())
    if workers > 1:
      with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        loaded = list(pool.map(lambda item: self._prepare(*item), todo))
    else:
      loaded = [self._prepare(shape, inputs) for shape, inputs in todo]
    self._decoders_loaded += sum(loaded)
    return time.perf_counter() - start

  def _prepare(self, shape: tuple, inputs: tuple) -> bool:
    """Makes the decoder of `shape` (`_decode_fn`'s arguments) ready, compiled
    the first time this shape is seen (or loaded, compiled by an earlier
    process: executable_cache.py); `inputs`: a batch's arguments after the
    parameters. Returns whether it was loaded."""
    if shape in self._executables:
      return False
    args = (self.params, self.logits_kernel, *inputs)
    parts = {"model": self.config.to_dict(), "decoder": shape,
             "arguments": executable_cache.describe(args)}
    self._executables[shape], loaded = executable_cache.load_or_compile(
        parts, lambda: self._decode_fn(*shape).lower(*args).compile())
    return loaded

  def _dispatch(self, shape: tuple, inputs: tuple):
    """Starts decoding one batch with the decoder of `shape` (`_prepare`d);
    `inputs`: its arguments after the parameters. Returns (sequences [rows,
    n, max_len], scores [rows, n], done [rows]) as device arrays, still being
    computed."""
    return self._executables[shape](self.params, self.logits_kernel, *inputs)

  def _stats(self, sentences: int, decoded: int, truncated: int, generated: int,
             seconds: float, compile_seconds: float, host_seconds: float,
             searched_again: int) -> dict[str, float]:
    """`last_stats`: counts, times and tokens/s of the decoding itself
    (compilation happens once per shape, so it is left out of the speed), and
    the host's own work (tokens to and from text, packing) outside compiling."""
    return {"sentences": sentences, "decoded": decoded, "truncated": truncated,
            "generated_tokens": generated, "seconds": seconds,
            "compile_seconds": compile_seconds, "host_seconds": host_seconds,
            "decoders_loaded": self._decoders_loaded, "searched_again": searched_again,
            "devices": len(self.mesh.devices.flat),
            "tokens_per_second": generated / max(seconds - compile_seconds, 1e-9)}

  def cross_attention(self, source: str, target: str | None = None):
    """Encoder-decoder attention weights of one sentence pair.

    If `target` is None, the sentence is first translated greedily.
    Returns (source pieces, target pieces, weights `[layers, heads, tgt, src]`),
    pieces including the EOS of the source and of the target. An over-long
    source is truncated as `translate` does (its start is kept).
    """
    if target is None:
      target = self.translate([source], method="greedy")[0]
    tok, cfg = self.tokenizer, self.config
    src_ids = tok.encode(source)[:cfg.max_len - 1] + [cfg.eos_id]
    tgt_ids = (tok.encode_target(target) + [cfg.eos_id])[:cfg.max_len]
    # Padded to bucket lengths, so that few shapes are compiled; padded source
    # keys get zero weight and padded target queries come after the real ones
    # (causal), so the sliced weights are those of the unpadded pair.
    src_len = batching.bucket_length(len(src_ids), cfg.max_len)
    tgt_len = batching.bucket_length(len(tgt_ids), cfg.max_len)
    inputs = np.full((1, src_len), cfg.pad_id, np.int32)
    inputs[0, :len(src_ids)] = src_ids
    decoder_inputs = np.full((1, tgt_len), cfg.pad_id, np.int32)
    decoder_inputs[0, :len(tgt_ids)] = [cfg.bos_id] + tgt_ids[:-1]
    weights = self._cross_attention_fn()(self.params, inputs, decoder_inputs)
    weights = np.asarray(weights)[:, :, :len(tgt_ids), :len(src_ids)]
    return tok.pieces(src_ids), tok.pieces(tgt_ids), weights

  def _cross_attention_fn(self):
    """Jitted (params, inputs [1, src], decoder_inputs [1, tgt]) -> `[layers, heads, tgt, src]`."""
    if "cross_attention" in self._compiled:
      return self._compiled["cross_attention"]
    cfg, model = self.config, self.model

    def run(params, inputs, decoder_inputs):
      _, state = model.apply({"params": params}, inputs, decoder_inputs,
                             mutable=["intermediates"])
      decoder = state["intermediates"]["decoder"]
      if cfg.scan_layers:
        return decoder["layers"]["cross_attention"]["attention_weights"][0][:, 0]
      return jnp.stack([decoder[f"layers_{i}"]["cross_attention"]["attention_weights"][0][0]
                        for i in range(cfg.num_decoder_layers)])

    replicated = NamedSharding(self.mesh, P())
    fn = jax.jit(run, in_shardings=(self._param_shardings, replicated, replicated),
                 out_shardings=replicated)
    self._compiled["cross_attention"] = fn
    return fn


# `Translator._decode_fn`'s arguments in order: the fields of a decoder's shape
# (the keys of `Translator._executables`).
_DECODER_ARGUMENTS = tuple(inspect.signature(Translator._decode_fn).parameters)[1:]


def _decoder_option(shape: tuple, name: str):
  """The value of `Translator._decode_fn`'s argument `name` in `shape`."""
  return shape[_DECODER_ARGUMENTS.index(name)]


def _is_first_search(shape: tuple) -> bool:
  """Whether the decoder of `shape` runs a first search: its cache sized to
  the translations (`batching.first_search_length`), shorter than the search."""
  return _decoder_option(shape, "max_len") < _decoder_option(shape, "search_len")
