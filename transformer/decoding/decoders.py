"""The decoders of one model on this process's devices: the parameters as they
serve (on the devices, projections in their matmul dtype), one compiled program
per `batch_plan.DecoderShape`, kept for call after call and on disk
(`executable_cache.py`), the cross-attention function for plots and the
teacher-forced scoring of given translations (`score_program`, `scorer`).

A decoder, for one batch of shape `shape`:
  (params, logits_kernel, inputs [batch, src_len], key_data, row_lines [batch],
   row_copies [batch], row_limits [batch], length_penalty, temperature, top_p,
   min_len, packing) -> (sequences [batch, n, max_len], scores [batch, n], done [batch])
It encodes the batch once (packed several sentences to a row with
`shape.packed`: `source_packing.py`), computes every decoder layer's
cross-attention keys/values once (`Transformer.encoder_memory`), and runs the
strategy (`search.py`, `sampling.py`) over `Transformer.decode_step` with a
self-attention cache.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer.data.tokenizer import available_cores
from transformer.decoding import batch_plan, executable_cache, sampling, source_packing
from transformer.decoding import beam_search as beam_lib
from transformer.decoding import search as decoding
from transformer.decoding.batch_plan import DecoderShape
from transformer.model import kv_cache
from transformer.model.config import TransformerConfig
from transformer.model.kv_cache import init_cache, reorder_cache
from transformer.runtime import parallel

logger = logging.getLogger(__name__)


def projection_weights_as(params, dtype):
  """`params` with every projection's weights (a `Dense` "kernel") in `dtype`:
  numpy arrays cast on the host (no program compiled), jax arrays where they are."""
  def cast(path, x):
    if getattr(path[-1], "key", None) != "kernel":
      return x
    return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(jnp.dtype(dtype))
  return jax.tree_util.tree_map_with_path(cast, params)


class Decoders:
  """The compiled decoders of `config` over `mesh` (this process's devices),
  with the parameters they run with (`set_params`); `param_sharding`:
  "replicated" or "fsdp" (`Translator`); `model_dir`: the workdir's
  `compiled/` that keeps them too (`executable_cache.model_directory`)."""

  def __init__(self, config: TransformerConfig, mesh: Mesh, param_sharding: str,
               model_dir: Path | None = None):
    self.config, self.mesh, self.param_sharding = config, mesh, param_sharding
    self.model_dir = model_dir
    self.devices = len(mesh.devices.flat)
    self.executables: dict[DecoderShape, jax.stages.Compiled] = {}
    self.loaded = 0  # of them, how many `executable_cache` loaded (per call: the caller resets)
    self._cross_attention = None  # (`cross_attention_fn`)
    self._scorers: dict[tuple, jax.stages.Compiled] = {}  # (`scorer`, by shape)
    self._scorers_lock = threading.Lock()
    self._logits_kernel_fn = None  # (`_logits_kernel`)

  @functools.cached_property
  def model(self):
    """The flax module, made on first use: only tracing a program needs it,
    and decoders that are all on disk (`executable_cache`) never do, so
    decode.py then never imports flax (0.15-0.25 s of its start)."""
    from transformer.model.transformer import Transformer
    return Transformer(self.config)

  # -- the parameters as they serve ------------------------------------------

  def set_params(self, params) -> None:
    """Decodes with `params` from now on (same shapes: the compiled decoders
    are kept, they take the parameters as an argument)."""
    if jax.process_count() > 1 and self.param_sharding == "replicated":
      params = parallel.to_host(params)  # global arrays -> this process's devices
    if self.config.matmul_dtype is not None:  # (stored as they multiply: no cast per step)
      params = projection_weights_as(params, self.config.matmul_dtype)
    self.param_shardings = parallel.state_shardings(params, self.mesh, self.param_sharding)
    self.params = jax.device_put(params, self.param_shardings)
    self.logits_kernel = self._logits_kernel(self.params)
    self._logits_kernel_sharding = jax.tree.map(lambda x: x.sharding, self.logits_kernel)

  def keep_in(self, model_dir: Path | None) -> None:
    """Keeps the compiled decoders in `model_dir` (a workdir's `compiled/`,
    or None: the machine's cache alone) from now on, and the logits kernel
    there now (training's test translation: `report.test_report`)."""
    self.model_dir = model_dir
    if model_dir is not None and self.config.logits_via_embedding:
      self._logits_kernel_fn = None  # (loaded again, and so kept there too)
      self.logits_kernel = self._logits_kernel(self.params)

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
          suffix=".logits_kernel", what="compiled logits kernel", model_dir=self.model_dir)
    return self._logits_kernel_fn(params)

  def _logits_kernel_program(self):
    """params -> `Transformer.logits_kernel` (split like the embedding it
    comes from, under fsdp)."""
    mesh, devices = self.mesh, self.devices

    def logits_kernel(params):
      kernel = self.model.apply({"params": params}, method="logits_kernel")
      if self.param_sharding == "replicated":
        return kernel
      return jax.lax.with_sharding_constraint(
          kernel, NamedSharding(mesh, parallel.fsdp_spec(kernel.shape, devices)))
    return logits_kernel

  # -- one decoder -----------------------------------------------------------

  def program(self, shape: DecoderShape):
    """The jitted decoder of `shape` (module docstring for its arguments).
    Row r's search is one of row_limits[r] tokens (its own bucket's length,
    where it shares a longer bucket's decoder or is batched with longer
    inputs: `batching.shared_buckets`); greedy search and sampling end it
    there, beam search stops its hypotheses there and bounds them at that
    length (`beam_search.beam_search`). Sampling draws row r's tokens from
    `fold_in(fold_in(rng, row_lines[r]), row_copies[r])`, `rng` the PRNG key
    whose `jax.random.key_data` is `key_data`: a line's sample depends on the
    seed and its line number only. `done` says which rows are finished (an
    EOS or their limit; beam: `beam_search.beam_search`'s done); the others would
    go on in a longer search (`batching.first_search_length`). The fields
    of `shape` that switch a part off leave it out of the program (class
    `DecoderShape`)."""
    cfg, model = self.config, self.model
    method, batch, max_len = shape.method, shape.batch, shape.max_len
    shrink = self.shrink(shape)

    def run(params, logits_kernel, inputs, key_data, row_lines, row_copies, row_limits,
            length_penalty, temperature, top_p, min_len, packing):
      if shape.packed:  # the encoder on the sentences packed several to a row
        encoded = source_packing.encode_packed(
            lambda tokens, segments, positions: model.apply(
                {"params": params}, tokens, segments, positions, method="encode"), *packing)
      else:
        encoded = model.apply({"params": params}, inputs, method="encode")
      memory = model.apply({"params": params}, encoded, inputs, None, logits_kernel,
                           method="encoder_memory")

      def tokens_to_logits(token_ids, state):
        with kv_cache.prefix_parts(1 if shape.small else None):  # (read as the step is traced)
          logits, cache = model.apply({"params": params}, token_ids, state["cache"],
                                      state["memory"], method="decode_step")
        return logits, dict(state, cache=cache)

      def state(beams=1):  # what the search carries: the cache and the encoder memory
        return {"cache": init_cache(cfg, batch, max_len, beams), "memory": memory}

      common = dict(batch_size=batch, max_len=max_len, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                    min_len=min_len, shrink=shrink,
                    empty_rows=jnp.all(inputs == cfg.pad_id, axis=1))  # (filling the batch)
      if method == "beam":
        return beam_lib.beam_search(
            tokens_to_logits, state(shape.beam_size), beam_size=shape.beam_size,
            length_penalty=length_penalty, early_exit=shape.early_exit,
            n_best=shape.n_best or None,
            stop=shape.beam_stop, row_limits=row_limits, return_done=True,
            reorder_cache=lambda s, parents: dict(s, cache=reorder_cache(s["cache"], parents)),
            **common)
      if method == "greedy":
        seqs, scores = decoding.greedy_search(tokens_to_logits, state(), log_probs=shape.log_probs,
                                              row_limits=row_limits, **common)
      else:
        fold_in = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
        rng = jax.random.wrap_key_data(key_data)
        row_keys = jax.vmap(jax.random.fold_in)(fold_in(rng, row_lines), row_copies)
        seqs, scores = sampling.sample(
            tokens_to_logits, state(), rng=row_keys,
            temperature=temperature if shape.temperature_on else 1.0, top_k=shape.top_k,
            top_p=top_p if shape.top_p_on else 1.0, log_probs=shape.log_probs,
            row_limits=row_limits,
            **common)
      # Done: an EOS, nothing to decode, or its own length reached within these steps.
      done = (jnp.any(seqs == cfg.eos_id, axis=1) | common["empty_rows"]
              | (row_limits <= max_len))
      return seqs[:, None], scores[:, None], done

    data = NamedSharding(self.mesh, P("data"))
    replicated = NamedSharding(self.mesh, P())
    return jax.jit(run, in_shardings=(self.param_shardings, self._logits_kernel_sharding,
                                      data, replicated, data, data, data, replicated,
                                      replicated, replicated, replicated, data),
                   out_shardings=(data, data, data))

  def shrink(self, shape: DecoderShape) -> decoding.Shrink | None:
    """How the decoder of `shape` drops its finished inputs
    (`batch_plan.shrinking`), as the search takes it (`loops.Shrink`, with
    the model's way of selecting the cache of some inputs); None: it does not."""
    steps = batch_plan.shrinking(shape, self.devices)
    if steps is None:
      return None
    return decoding.Shrink(
        lambda state, indices: kv_cache.select_inputs(state, indices, self.config.scan_layers),
        *steps)

  # -- making them ready, and calling them -------------------------------------

  def prepare_all(self, needed: Sequence[tuple[DecoderShape, tuple]]) -> float:
    """`prepare`s the decoders of `needed` [(shape, inputs)], side by side
    in threads (one per CPU core at most). Loading them from disk (a second
    run) takes 0.4-0.5 s instead of 0.7 s for the 4 decoders of 1,000 lines
    on 2 cores; compiling them (a first run) measured no faster, 13-14 s
    either way (tracing holds Python's lock). Returns the seconds it took."""
    start = time.perf_counter()
    todo = [(shape, inputs) for shape, inputs in needed if shape not in self.executables]
    workers = min(len(todo), available_cores())
    if workers > 1:
      with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        loaded = list(pool.map(lambda item: self.prepare(*item), todo))
    else:
      loaded = [self.prepare(shape, inputs) for shape, inputs in todo]
    self.loaded += sum(loaded)
    return time.perf_counter() - start

  def prepare(self, shape: DecoderShape, inputs: tuple) -> bool:
    """Makes the decoder of `shape` ready, compiled the first time this shape
    is seen (or loaded, compiled by an earlier process: executable_cache.py);
    `inputs`: a batch's arguments after the parameters. Returns whether it
    was loaded."""
    if shape in self.executables:
      return False
    args = (self.params, self.logits_kernel, *inputs)
    parts = {"model": self.config.to_dict(), "decoder": shape,
             "arguments": executable_cache.describe(args)}
    self.executables[shape], loaded = executable_cache.load_or_compile(
        parts, lambda: self.program(shape).lower(*args).compile(), model_dir=self.model_dir)
    return loaded

  def dispatch(self, shape: DecoderShape, inputs: tuple):
    """Starts decoding one batch with the decoder of `shape` (`prepare`d);
    `inputs`: its arguments after the parameters. Returns (sequences [rows,
    n, max_len], scores [rows, n], done [rows]) as device arrays, still being
    computed."""
    return self.executables[shape](self.params, self.logits_kernel, *inputs)

  def score_program(self, alignment: bool = False):
    """Teacher forcing, one forward pass per batch (as training's loss), a new
    jitted function at each call (`executable_cache.load_or_compile` wants
    one per compile): (params, inputs [rows, src], decoder_inputs [rows, tgt],
    targets [rows, tgt]) -> log p of each target token given the source and
    the tokens before it [rows, tgt] float32; with `alignment`, also the source
    position each target token attends to most [rows, tgt] int32 (the last
    decoder layer's encoder-decoder attention, averaged over its heads)."""
    cfg, model = self.config, self.model

    def run(params, inputs, decoder_inputs, targets):
      if alignment:
        logits, state = model.apply({"params": params}, inputs, decoder_inputs,
                                    mutable=["intermediates"])
      else:
        logits = model.apply({"params": params}, inputs, decoder_inputs)
      # log p(target) = its logit - logsumexp(logits): the [rows, tgt, vocab]
      # log-softmax itself is never written out.
      logits = logits.astype(jnp.float32)
      picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
      token_log_probs = picked - jax.nn.logsumexp(logits, axis=-1)
      if not alignment:
        return token_log_probs
      decoder = state["intermediates"]["decoder"]
      if cfg.scan_layers:  # [layers, rows, heads, tgt, src]: the last layer
        weights = decoder["layers"]["cross_attention"]["attention_weights"][0][-1]
      else:
        last = f"layers_{cfg.num_decoder_layers - 1}"
        weights = decoder[last]["cross_attention"]["attention_weights"][0]
      return token_log_probs, jnp.argmax(weights.mean(axis=1), axis=-1).astype(jnp.int32)

    replicated = NamedSharding(self.mesh, P())
    return jax.jit(run, in_shardings=(self.param_shardings, replicated, replicated, replicated),
                   out_shardings=replicated)

  def scorer(self, alignment: bool, args: tuple):
    """The compiled `score_program` for arguments like `args` (params, inputs,
    decoder_inputs, targets), kept for call after call: (compiled, None) when
    kept from an earlier call, else (compiled, whether it was loaded, compiled
    by an earlier process: `executable_cache`, as the decoders). One scorer
    per shape is made at a time, whichever lane asks first."""
    shape = (alignment, *(np.shape(a) for a in args[1:]))
    with self._scorers_lock:
      if shape in self._scorers:
        return self._scorers[shape], None
      parts = {"of": "score", "model": self.config.to_dict(), "alignment": alignment,
               "arguments": executable_cache.describe(args)}
      self._scorers[shape], loaded = executable_cache.load_or_compile(
          parts, lambda: self.score_program(alignment).lower(*args).compile(),
          what="compiled scorer", model_dir=self.model_dir)
      return self._scorers[shape], loaded

  def cross_attention_fn(self):
    """Jitted (params, inputs [1, src], decoder_inputs [1, tgt]) -> the
    encoder-decoder attention weights `[layers, heads, tgt, src]`."""
    if self._cross_attention is not None:
      return self._cross_attention
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
    self._cross_attention = jax.jit(
        run, in_shardings=(self.param_shardings, replicated, replicated),
        out_shardings=replicated)
    return self._cross_attention
