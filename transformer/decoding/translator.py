"""Batch translation: strings in, strings out, in order, nothing dropped.

`Translator` ties the model (`model/transformer.py`), a decoding strategy
(`search.py`, `sampling.py`) and the vocabulary (`data/tokenizer.py`) together.
It is what `decode.py`, the training loop's BLEU evaluation and the notebook API
use (`loader.py` loads one from a trained workdir).

`translate_hypotheses` reads top to bottom:
  1. Tokenize (`encode`): append EOS; inputs longer than the model's
     `max_len` are truncated (counted in `last_stats["truncated"]`). Empty
     lines are not decoded: they translate to "".
  2. Plan (`batch_plan.py`, pure Python): sort by length and cut into batches
     of consecutive lengths, each padded to a power of two, so that there are
     few shapes to compile; a batch's rows are a multiple of the local device
     count, over which it is sharded; which decoder each batch needs.
  3. Decode (`runner.py` running the plan on `decoders.py`'s compiled
     decoders): encode once per batch, compute every decoder layer's
     cross-attention keys/values once, run the strategy with a
     self-attention cache, first for about as many steps as the translations
     take, then again in full for the inputs left unfinished.
  4. Detokenize (`_detokenize`), each result in its input's place.

The default output budget is the paper's: input length + 50 tokens (the input
length rounded up to its bucket).

`output.py` turns `translate`'s results and `last_stats` into text (decode.py's
output lines and stderr).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

import jax
import numpy as np
import tqdm
from jax.sharding import Mesh

from transformer.data.tokenizer import Tokenizer
from transformer.decoding import batch_plan, batching, executable_cache, runner, scoring
from transformer.decoding import search as decoding
from transformer.decoding.decoders import Decoders
from transformer.decoding.options import PAPER_LENGTH_PENALTY, check_options
from transformer.model.config import MATMUL_DTYPES, TransformerConfig
from transformer.runtime import parallel
from transformer.runtime.errors import OptionError
from transformer.runtime.workdir import Workdir

logger = logging.getLogger(__name__)

# The CPU flags (Linux's names) of instructions that multiply bfloat16 (x86's
# AVX512-BF16 and AMX, Arm's BF16): without one, bfloat16 weights likely gain nothing.
BFLOAT16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


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
      the same BLEU (docs/benchmarks.md); on one without, a warning.
    workdir: the `workdir.Workdir` the model was read from (the loader's),
      or None: its compiled decoders are also kept in, and read from,
      `<workdir>/compiled/`, so that they travel with the model
      (`executable_cache.model_directory`); its decoding.json (the length
      penalty its training run recorded) sets `length_penalty`.
  Batches are sharded over this process's local devices.

  `length_penalty`: beam search's alpha where a call gives none: the
  workdir's decoding.json, else the paper's PAPER_LENGTH_PENALTY.

  `policy` (a `batch_plan.Policy`, its attributes settable): how batches are
  cut, padded and shrunk, by default what was measured to pay on this
  platform (its fields say what each gains). `decoders` (`decoders.Decoders`):
  the compiled decoders, kept for call after call. `overlap` (default True):
  detokenize batch k - 1 while the device decodes batch k.
  """

  def __init__(self, model_config: TransformerConfig, params, tokenizer: Tokenizer, *,
               param_sharding: str = "replicated", weights_dtype: str | None = None,
               workdir: Workdir | None = None):
    if weights_dtype not in MATMUL_DTYPES:
      raise OptionError("weights_dtype", weights_dtype,
                        f"must be one of {', '.join(map(str, MATMUL_DTYPES))}")
    if param_sharding not in parallel.STATE_SHARDINGS:
      raise OptionError("param_sharding", param_sharding,
                        f"must be one of {', '.join(parallel.STATE_SHARDINGS)}")
    self.config = model_config.replace(matmul_dtype=weights_dtype or model_config.matmul_dtype)
    self.tokenizer = tokenizer
    self.mesh = Mesh(np.array(jax.local_devices()), ("data",))
    self.platform = platform = self.mesh.devices.flat[0].platform  # "cpu", "gpu" or "tpu"
    devices = len(self.mesh.devices.flat)
    if (weights_dtype == "bfloat16" and platform == "cpu"
        and not BFLOAT16_CPU_FLAGS & executable_cache.host_cpu_flags()):
      logger.warning("weights_dtype=bfloat16 on a CPU without bfloat16 instructions "
                     "(none of %s): likely no faster than float32.",
                     ", ".join(sorted(BFLOAT16_CPU_FLAGS)))
    self.policy = batch_plan.Policy.for_platform(platform, devices)
    self.decoders = Decoders(self.config, self.mesh, param_sharding,
                             executable_cache.model_directory(workdir))
    self.overlap = True
    self.length_penalty = (workdir.decoding if workdir else {}).get("length_penalty",
                                                                   PAPER_LENGTH_PENALTY)
    self.last_stats: dict[str, float] = {}
    self.set_params(params)

  def set_params(self, params) -> None:
    """Translates with `params` from now on (same shapes: e.g. a later
    checkpoint of the same model, as training's evaluation does). The
    compiled decoders are kept: they take the parameters as an argument."""
    self.decoders.set_params(params)

  @property
  def params(self):
    """The parameters as they serve (on the devices, projections in their
    matmul dtype)."""
    return self.decoders.params

  def default_concurrent_batches(self) -> int:
    """Batches decoded at once when a call does not say (`runner.py`)."""
    return runner.default_concurrent_batches(self.decoders.devices)

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
      length_penalty: float | None = None, beam_stop: str = "exact",
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
      beam_size, length_penalty: beam search (the paper: 4 and 0.6; None: the
        translator's `length_penalty`: the workdir's, if it recorded one).
      beam_stop: when beam search stops an input: "exact" (once no alive
        hypothesis could beat its n-best at any length it can still reach:
        what searching to max_len gives) or "current" (once none could at
        its next step's length: faster, not exact; `beam_search.beam_search`).
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
        go on with fewer rows once most of a batch is done
        (`Policy.shrink_batches`): the same results, less time; False runs
        every step on every row (for benchmarks).
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
    if length_penalty is None:
      length_penalty = self.length_penalty
    check_options(method=method, beam_size=beam_size, length_penalty=length_penalty,
                  beam_stop=beam_stop,
                  max_len=max_len, min_len=min_len, temperature=temperature, top_k=top_k,
                  top_p=top_p, n_best=n_best, batch_size=batch_size,
                  batch_tokens=batch_tokens, concurrent_batches=concurrent_batches)
    start = time.perf_counter()
    self.decoders.loaded = 0
    # 1. Tokenize.
    encoded, truncated = self.encode(sentences)
    # 2. Plan.
    request = batch_plan.Request(
        method=method, beam_size=beam_size, beam_stop=beam_stop, n_best=n_best, top_k=top_k,
        temperature=temperature, top_p=top_p, min_len=min_len, max_len=max_len,
        extra_len=extra_len, batch_size=batch_size, batch_tokens=batch_tokens,
        early_exit=early_exit, scores=scores)
    plan = batch_plan.plan(
        encoded, request, self.policy, max_source_len=self.config.max_len,
        position_limit=self.config.max_len if self.config.positional == "learned" else None,
        share=share)
    # Blank inputs are in no batch: "" (share 0's); the others: filled in by their batch.
    results: list[list[Hypothesis] | None] = [
        [Hypothesis("", 0.0, 0.0, 0)] * n_best if not ids and share[0] == 0 else None
        for ids in encoded]
    decoded = sum(len(members) for _, members in plan.batches)
    bar = tqdm.tqdm(total=decoded, unit="sent", disable=not progress, desc="decode",
                    dynamic_ncols=True)
    # 3. Decode, 4. detokenize (in the lane that decoded each batch).
    # The sampling key, as its raw data: only sampling makes it, since making a
    # key compiles a small program (0.03 s of every decode.py start otherwise).
    key_data = (np.asarray(jax.random.key_data(jax.random.key(seed))) if method == "sample"
                else np.zeros(2, np.uint32))
    args = runner.Arguments(encoded, plan.limits, request.copies, first_line, key_data,
                            (float(length_penalty), float(temperature), float(top_p),
                             int(min_len)))

    def detokenize(members, seqs, scores) -> int:
      tokens = self._detokenize(members, seqs, scores, results, plan.limits, request,
                                length_penalty)
      bar.update(len(members))
      return tokens

    totals = runner.run(self.decoders, plan, args, detokenize,
                        lanes=concurrent_batches or self.default_concurrent_batches(),
                        overlap=self.overlap)
    bar.close()
    self.last_stats = self._stats(len(sentences), decoded, truncated,
                                  time.perf_counter() - start, totals)
    return results

  # -- the steps of `translate_hypotheses` -----------------------------------

  def encode(self, sentences: Sequence[str], *,
             target: bool = False) -> tuple[list[list[int]], int]:
    """(token ids + EOS per sentence, [] for a blank one; how many were
    truncated to the model's max_len). `target`: with the target side's
    vocabulary (an imported Marian model has one per side)."""
    cfg, encoded, truncated = self.config, [], 0
    encode = self.tokenizer.encode_target if target else self.tokenizer.encode
    for text in sentences:
      ids = encode(text) if text.strip() else []
      if len(ids) + 1 > cfg.max_len:
        ids, truncated = ids[:cfg.max_len - 1], truncated + 1
      encoded.append(ids + [cfg.eos_id] if ids else [])
    return encoded, truncated

  def _detokenize(self, members: list[int], seqs: np.ndarray, scores: np.ndarray,
                  results: list, limits: dict[int, int], request: batch_plan.Request,
                  length_penalty: float) -> int:
    """Puts the hypotheses of a decoded batch's `members` (`seqs` [rows, n,
    len], `scores` [rows, n], rows as `batching.pack_batch` packed them) in
    `results`, best first; returns the tokens they generated."""
    if not request.log_probs:  # (the decoder left them out: zeros)
      scores = np.full(scores.shape, np.nan, np.float32)
    rows = batching.unpack_hypotheses(seqs, scores, len(members), request.copies,
                                      request.n_best)
    ids = [[row_ids.tolist()[:limits[i]] for row_ids, _ in hyps]  # (then PAD)
           for i, hyps in zip(members, rows)]
    lengths = np.asarray([[self._length(h) for h in hyps] for hyps in ids])
    # Beam scores are log p / lp(length): log p is the score times lp (in
    # numpy: in jax it compiled 4 small programs at a process's first beam batch).
    lps = (decoding.gnmt_length_penalty(lengths, length_penalty, xp=np)
           if request.method == "beam" else np.ones(lengths.shape))
    tokens = 0
    for k, (i, hyps) in enumerate(zip(members, rows)):
      results[i] = sorted(
          (Hypothesis(self.tokenizer.decode(ids[k][n]), float(score),
                      float(score) * float(lps[k, n]), int(lengths[k, n]))
           for n, (_, score) in enumerate(hyps)), key=lambda h: -h.score)
      tokens += int(lengths[k].sum())
    return tokens

  def _length(self, ids: list[int]) -> int:
    """Generated tokens of a decoded row, to its EOS included (all if none)."""
    return ids.index(self.config.eos_id) + 1 if self.config.eos_id in ids else len(ids)

  def _stats(self, sentences: int, decoded: int, truncated: int, seconds: float,
             totals: runner.Totals) -> dict[str, float]:
    """`last_stats`: counts, times and tokens/s of the decoding itself
    (compilation happens once per shape, so it is left out of the speed), and
    the host's own work (tokens to and from text, packing) outside compiling."""
    return {"sentences": sentences, "decoded": decoded, "truncated": truncated,
            "generated_tokens": totals.generated, "seconds": seconds,
            "compile_seconds": totals.compile_seconds, "host_seconds": totals.host_seconds,
            "decoders_loaded": self.decoders.loaded, "searched_again": totals.searched_again,
            "devices": self.decoders.devices,
            "tokens_per_second": totals.generated / max(seconds - totals.compile_seconds, 1e-9)}

  def score(self, sources: Sequence[str], targets: Sequence[str], *, alignment: bool = False,
            batch_size: int = 32, share: tuple[int, int] = (0, 1)):
    """log p(target | source) of each given pair, a `scoring.Score` each (None
    for pairs of other shares): `scoring.score_pairs`, which says how."""
    return scoring.score_pairs(self, sources, targets, alignment=alignment,
                               batch_size=batch_size, share=share)

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
    weights = self.decoders.cross_attention_fn()(self.params, inputs, decoder_inputs)
    weights = np.asarray(weights)[:, :, :len(tgt_ids), :len(src_ids)]
    return tok.pieces(src_ids), tok.pieces(tgt_ids), weights

