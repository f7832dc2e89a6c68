"""Training: the loss, the schedule, the optimizer, the jitted steps and the loop.

`train_and_evaluate(config, workdir)` is what `python train.py` runs:

  data (config.data)  ->  SentencePiece vocabulary (<workdir>/vocab.model)
  ->  packed token batches (grain, one shard per process)
  ->  jitted train step over a device mesh (batch sharded on "data", state replicated)
  ->  metrics (console, TensorBoard, metrics.jsonl; MFU: flops.py), periodic
      eval loss + BLEU + chrF, a warning if the model is not learning (stall.py)
  ->  orbax checkpoints (exact resume), average of the last N at the end
  ->  the report: test BLEU / chrF and translations, curves.png (report.py).

The loop ends at config.num_train_steps or, with config.train_minutes, in time
to save, average and evaluate within the budget (time_budget.py).

The paper's recipe (Section 5): Adam(0.9, 0.98, 1e-9), the learning rate
d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), label smoothing 0.1,
batches of about 25k source + 25k target tokens (gradient accumulation reaches
that on small hardware), checkpoint averaging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from transformer.model import attention_choice
from transformer.runtime import averaging
from transformer.runtime import checkpoints
from transformer.data import pipeline as data
from transformer.runtime import multihost
from transformer.runtime import parallel
from transformer.model import prng
from transformer.training import report
from transformer.training import run_monitor
from transformer.training import time_budget as time_budget_lib
from transformer.data import tokenizer as tokenizer_lib
from transformer.training import metrics as metrics_lib
from transformer.decoding import translator as translation
from transformer.runtime import workdir as workdir_lib
from transformer.model.transformer import Transformer, TransformerConfig, init_params, shift_right
from transformer.runtime import run_lock, run_log

logger = logging.getLogger(__name__)


class TrainingDiverged(FloatingPointError):
  """The loss became NaN or infinite; the run stopped, checkpoints are untouched."""


# ----------------------------------------------------------------------------
# Schedule, loss, optimizer
# ----------------------------------------------------------------------------


def learning_rate_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
  """Section 5.3: lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

  `step` counts updates from 1 (optax passes 0 for the first update).
  """
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                       label_smoothing: float) -> dict[str, jax.Array]:
  """Label-smoothed cross entropy (Section 5.4), without a one-hot matrix.

  The smoothed target puts 1 - eps on the reference token and eps / (V - 1) on
  every other token. Its cross entropy with softmax(logits) is
      -(conf - low) * log p[target] - low * sum_v log p[v],
  and sum_v log p[v] = sum_v logits[v] - V * logsumexp(logits), so only the
  log-sum-exp, the row sum and one gathered logit per token are needed. The
  entropy of the smoothed target is subtracted, so a perfect model scores 0.

  Args:
    logits: float32 `[batch, length, vocab]`.
    targets: int `[batch, length]`.
    weights: `[batch, length]`, 1 on real tokens, 0 on padding.
    label_smoothing: eps.
  Returns:
    Sums over real tokens: "loss" (smoothed), "nll" (plain negative
    log-likelihood), "correct" (argmax hits), "weight" (number of tokens).
  """
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  entropy = -(confidence * math.log(confidence)
              + (vocab - 1) * low * math.log(low + 1e-20))
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  log_p_target = target_logit - log_z
  sum_log_p = jnp.sum(logits, axis=-1) - vocab * log_z
  loss = -(confidence - low) * log_p_target - low * sum_log_p - entropy
  weights = weights.astype(jnp.float32)
  # argmax == target, written as "no logit beats the target's" (ties count as hits)
  correct = target_logit >= jnp.max(logits, axis=-1)
  return {"loss": jnp.sum(loss * weights), "nll": jnp.sum(-log_p_target * weights),
          "correct": jnp.sum(correct * weights), "weight": jnp.sum(weights)}


def make_optimizer(config: ml_collections.ConfigDict, d_model: int):
  """Adam with the paper's betas/epsilon and warm-up schedule (+ optional clipping)."""
  schedule = learning_rate_schedule(d_model, config.warmup_steps, config.learning_rate_scale)
  adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.get("grad_clip_norm", 0.0):
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam), schedule
  return adam, schedule


# ----------------------------------------------------------------------------
# Train state and the jitted steps
# ----------------------------------------------------------------------------


def create_train_state(model_config: TransformerConfig, optimizer, seed: int) -> dict:
  """{"step", "params", "opt_state", "rng"}: everything a resumed run needs."""
  init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
  params = init_params(model_config, init_rng)
  return {"step": jnp.array(0, jnp.int32), "params": params,
          "opt_state": optimizer.init(params), "rng": dropout_rng}


def init_train_state(config: ml_collections.ConfigDict, model_config: TransformerConfig,
                     optimizer, mesh) -> tuple[dict, dict]:
  """(the initial train state on the mesh, its shardings): replicated, or with
  `config.state_sharding="fsdp"` every large array split over the devices
  (`parallel.state_shardings`); created in place, never whole on one device."""
  create = lambda: create_train_state(model_config, optimizer, config.seed)
  shardings = parallel.state_shardings(
      jax.eval_shape(create), mesh, config.get("state_sharding", "replicated"))
  return jax.jit(create, out_shardings=shardings)(), shardings


def _forward_sums(params, batch, model_config, label_smoothing, dropout_rng):
  """Loss sums of one (micro)batch; dropout on when `dropout_rng` is given."""
  decoder_inputs = shift_right(batch["targets"], model_config.bos_id,
                               batch["targets_segment_ids"])
  model = Transformer(model_config, deterministic=dropout_rng is None)
  logits = model.apply(
      {"params": params}, batch["inputs"], decoder_inputs,
      inputs_segment_ids=batch["inputs_segment_ids"],
      decoder_segment_ids=batch["targets_segment_ids"],
      inputs_positions=batch["inputs_positions"],
      decoder_positions=batch["targets_positions"],
      rngs=None if dropout_rng is None else {"dropout": dropout_rng})
  weights = batch["targets_segment_ids"] > 0
  return cross_entropy_sums(logits, batch["targets"], weights, label_smoothing)


def train_step(state: dict, batch: dict, *, model_config: TransformerConfig,
               optimizer, schedule, label_smoothing: float, mesh=None,
               param_specs=None) -> tuple[dict, dict]:
  """One update from `batch` (arrays `[accumulation, rows, length]`).

  Gradients of the micro-batches are summed (a `lax.scan`) and divided by the
  number of target tokens of the whole batch, so accumulating k micro-batches
  is the same update as one batch k times larger.

  With a `mesh`, the rows are split over its "data" axis and the gradients
  are computed per device (`shard_map`): each device sums its rows' gradients
  over the micro-batches and the devices add theirs up once per update, one
  float32 all-reduce. (Under plain `jit` XLA reduces them inside the
  accumulation loop, once per micro-batch: tests/test_benchmarks.py counts them.)
  Dropout masks are the same either way: those of the whole batch.

  `param_specs` (PartitionSpecs like the params; default: replicated) is the
  parameters' layout on the mesh: with FSDP (`parallel.state_shardings`) each
  device gathers the whole parameters once per update and the gradients are
  reduce-scattered back to the same layout, once per update too.
  """
  step_rng = jax.random.fold_in(state["rng"], state["step"])
  gradients = functools.partial(_gradient_sums, model_config=model_config,
                                label_smoothing=label_smoothing)
  if mesh is None:
    grads, sums = gradients(state["params"], batch, step_rng)
  else:
    if param_specs is None:
      param_specs = jax.tree.map(lambda _: P(), state["params"])
    grads, sums = jax.shard_map(
        functools.partial(gradients, axis_name=parallel.DATA_AXIS, param_specs=param_specs),
        mesh=mesh, in_specs=(param_specs, P(None, parallel.DATA_AXIS), P()),
        out_specs=(param_specs, P()),
    )(state["params"], batch, step_rng)

  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  metrics = dict(sums, grad_norm=optax.global_norm(grads),
                 learning_rate=schedule(state["step"]))
  new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def _gradient_sums(params, batch: dict, step_rng, *, model_config: TransformerConfig,
                   label_smoothing: float, axis_name: str | None = None,
                   param_specs=None):
  """(gradients of the loss per target token, loss sums) of `batch`
  `[accumulation, rows, length]`, one micro-batch at a time. With `axis_name`
  this runs in `shard_map` on one device's rows and its slice of the params
  (`param_specs`), and the result is reduced over the axis once, at the end."""
  weight = jnp.sum(batch["targets_segment_ids"] > 0)
  if axis_name is not None:
    weight = jax.lax.psum(weight, axis_name)
    # Differentiate this device's copy of the whole parameters, so that the
    # gradient stays local until the end (differentiating the replicated /
    # sharded input itself would all-reduce / reduce-scatter it at every
    # micro-batch: the transposes of JAX's implicit broadcast and of all_gather).
    params = jax.tree.map(functools.partial(_whole, axis_name=axis_name), params, param_specs)
  total_weight = jnp.maximum(weight, 1).astype(jnp.float32)

  def micro_step(grads, micro):
    index, micro_batch = micro
    def loss_fn(params):
      sums = _forward_sums(params, micro_batch, model_config, label_smoothing,
                           jax.random.fold_in(step_rng, index))
      return sums["loss"] / total_weight, sums
    micro_grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    return jax.tree_util.tree_map(jnp.add, grads, micro_grads), sums

  num_micro = batch["targets"].shape[0]
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  with (prng.rows_sharded_over(axis_name) if axis_name else contextlib.nullcontext()):
    if num_micro == 1:
      grads, sums = micro_step(zeros, (0, jax.tree_util.tree_map(lambda x: x[0], batch)))
    else:
      grads, sums = jax.lax.scan(micro_step, zeros, (jnp.arange(num_micro), batch))
      sums = jax.tree_util.tree_map(jnp.sum, sums)
  if axis_name is not None:
    grads = jax.tree.map(functools.partial(_reduce, axis_name=axis_name), grads, param_specs)
    sums = jax.lax.psum(sums, axis_name)
  return grads, sums


def _sharded_axis(spec: P, axis_name: str) -> int | None:
  return next((i for i, name in enumerate(spec) if name == axis_name), None)


def _whole(param, spec: P, *, axis_name: str):
  """This device's copy of a whole parameter, from its slice (`spec`)."""
  axis = _sharded_axis(spec, axis_name)
  if axis is None:
    return jax.lax.pcast(param, axis_name, to="varying")
  return jax.lax.all_gather(param, axis_name, axis=axis, tiled=True)


def _reduce(grad, spec: P, *, axis_name: str):
  """The sum over devices of a local gradient, laid out as `spec`."""
  axis = _sharded_axis(spec, axis_name)
  if axis is None:
    return jax.lax.psum(grad, axis_name)
  return jax.lax.psum_scatter(grad, axis_name, scatter_dimension=axis, tiled=True)


def eval_step(params, batch, *, model_config: TransformerConfig,
              label_smoothing: float) -> dict:
  """Loss sums of an evaluation batch (`[rows, length]`), dropout off."""
  return _forward_sums(params, batch, model_config, label_smoothing, None)


def summarize_sums(sums: dict) -> dict[str, float]:
  """Per-token averages from summed metrics."""
  weight = max(float(sums["weight"]), 1.0)
  out = {"loss": float(sums["loss"]) / weight, "nll": float(sums["nll"]) / weight,
         "accuracy": float(sums["correct"]) / weight}
  out["perplexity"] = float(np.exp(min(out["nll"], 50.0)))
  return out


# ----------------------------------------------------------------------------
# Workdir set-up: vocabulary, model config
# ----------------------------------------------------------------------------


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The TransformerConfig of `config.model`, with the vocabulary's size and ids."""
  fields = dict(config.model)
  fields.update(vocab_size=vocab_size, pad_id=tokenizer_lib.PAD_ID,
                eos_id=tokenizer_lib.EOS_ID, bos_id=tokenizer_lib.BOS_ID)
  try:
    return TransformerConfig.from_dict(fields)
  except ValueError as e:
    raise ValueError(f"{e} (set it with --config.model.<field>=...)") from e


def _unknown_model_fields(config) -> list[str]:
  names = {f.name for f in dataclasses.fields(TransformerConfig)}
  return sorted(set(config.model.keys()) - names)


def get_tokenizer(config, workdir: str, train_pairs, *,
                  shared: bool = True) -> tokenizer_lib.Tokenizer:
  """The vocabulary: config.vocab_path if set, else <workdir>/vocab.model,
  trained on the training data the first time.

  Process 0 reads or trains it and sends it to the other processes (as
  bytes: only process 0 reads config.vocab_path or the workdir's copy). It
  is written to <workdir>/vocab.model when that is missing, so that the
  workdir alone is enough to decode: by process 0, and with workdirs of their
  own (`shared=False`) by every process into its own (replacing a copy that
  differs from process 0's)."""
  path = os.path.join(workdir, workdir_lib.VOCAB_FILE)
  is_main = jax.process_index() == 0
  model, error = None, None
  if is_main:
    try:
      if config.get("vocab_path"):
        model = tokenizer_lib.load_tokenizer(config.vocab_path).serialized_model()
      elif epath.Path(path).exists():
        model = tokenizer_lib.load_tokenizer(path).serialized_model()
      else:
        logger.info("Training a SentencePiece vocabulary of %d pieces -> %s",
                    config.vocab_size, path)
        model = tokenizer_lib.train_tokenizer(
            data.sample_sentences(train_pairs, config.get("vocab_max_sentences", 1_000_000)),
            path if multihost.is_local(path) else None, config.vocab_size,
            model_type=config.get("vocab_model_type", "unigram")).serialized_model()
    except Exception as e:  # (the others wait for the vocabulary: send them nothing)
      if jax.process_count() == 1:
        raise
      model, error = b"", e
  model = multihost.broadcast_bytes(model)
  if error is not None:
    raise error
  if not model:
    raise RuntimeError("Process 0 could not make the vocabulary; see its error.")
  if is_main or not shared:
    stored = epath.Path(path).read_bytes() if epath.Path(path).exists() else None
    if stored is None or (stored != model and not is_main):
      if stored is not None:
        logger.warning("%s differs from process 0's vocabulary: replaced by it.", path)
      multihost.write_file(path, model)
  return tokenizer_lib.Tokenizer(model, model_path=config.get("vocab_path") or path)


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------


def _stack_micro_batches(it: Iterator[dict], num: int) -> dict[str, np.ndarray]:
  micro = [next(it) for _ in range(num)]
  return {key: np.stack([m[key] for m in micro]) for key in micro[0]}


def _shard(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


@dataclasses.dataclass
class TrainResult:
  """What `train_and_evaluate` returns."""

  step: int
  train: dict[str, float]
  eval: dict[str, float]
  samples: list[tuple[str, str, str]]  # (source, reference, translation)
  workdir: str
  test: dict[str, float] = dataclasses.field(default_factory=dict)  # report.test_report
  minutes: float = 0.0          # training minutes, earlier runs of the workdir included
  stopped_by_time: bool = False  # the loop ended at config.train_minutes
  warnings: list[str] = dataclasses.field(default_factory=list)  # stall / warm-up


def _check_config(config) -> None:
  unknown = _unknown_model_fields(config)
  if unknown:
    raise ValueError(f"config.model has unknown field(s) {unknown}; valid fields are "
                     f"{sorted(f.name for f in dataclasses.fields(TransformerConfig))}.")
  for name in ("num_train_steps", "batch_size", "max_length", "grad_accum_steps",
               "log_every", "eval_every", "checkpoint_every"):
    if int(config[name]) < 1:
      raise ValueError(f"config.{name}={config[name]} must be >= 1.")
  if config.get("state_sharding", "replicated") not in parallel.STATE_SHARDINGS:
    raise ValueError(f"config.state_sharding={config.state_sharding!r} must be one of "
                     f"{parallel.STATE_SHARDINGS}.")
  if float(config.get("train_minutes", 0)) < 0:
    raise ValueError(f"config.train_minutes={config.train_minutes} must be >= 0 "
                     "(0: no time budget).")
  if config.eval_batch_size % jax.local_device_count():
    raise ValueError(f"config.eval_batch_size={config.eval_batch_size} must be a multiple "
                     f"of the {jax.local_device_count()} local devices.")
  if config.batch_size % jax.process_count():
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the "
                     f"number of processes ({jax.process_count()}).")
  local_rows = config.batch_size // jax.process_count()
  if local_rows % jax.local_device_count():
    raise ValueError(
        f"config.batch_size={config.batch_size} gives {local_rows} rows per process, not "
        f"divisible by the {jax.local_device_count()} local devices; use a multiple of "
        f"{jax.device_count()}.")


# ----------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------


class Evaluator:
  """Validation of the parameters during and after training.

  `evaluator(params, step)` computes the eval loss, token accuracy and
  perplexity over the eval pairs (the first `config.num_eval_examples`, or
  all), and when `config.num_bleu_examples` > 0 the BLEU and exact match of the
  translations of the first ones (`config.eval_decode_method`, beam
  `config.eval_beam_size`); writes them to the metrics and returns them.
  `samples` keeps (source, reference, translation) of the last evaluation.
  One Translator serves every evaluation (the new parameters swapped in), so
  its decoders compile once.
  """

  def __init__(self, config: ml_collections.ConfigDict, model_config: TransformerConfig,
               tokenizer: tokenizer_lib.Tokenizer, eval_pairs, mesh,
               writer: metrics_lib.MetricsWriter, minutes=None):
    self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
    self.writer = writer
    self.loss_pairs = (eval_pairs[:config.num_eval_examples] if config.num_eval_examples
                       else eval_pairs)
    self.bleu_pairs = list(eval_pairs[:config.num_bleu_examples])
    self.samples: list[tuple[str, str, str]] = []
    self._sharding = NamedSharding(mesh, P("data"))
    replicated = parallel.replicated(mesh)
    self._eval_fn = jax.jit(
        lambda p, b: eval_step(p, b, model_config=model_config,
                               label_smoothing=config.label_smoothing),
        # (params as they are: replicated, or split with state_sharding="fsdp")
        in_shardings=(None, self._sharding), out_shardings=replicated)
    self._translator: translation.Translator | None = None
    self.seconds = 0.0                    # of the last evaluation
    self.seconds_per_sentence = 0.0       # of its translation
    self.minutes = minutes                # a callable -> training minutes, for the records

  def translator(self, params) -> translation.Translator:
    """The Translator, holding `params` (its decoders compile once)."""
    if self._translator is None:
      self._translator = translation.Translator(self.model_config, params, self.tokenizer)
    else:
      self._translator.set_params(params)
    return self._translator

  def __call__(self, params, step: int, *, averaged: bool = False) -> dict[str, float]:
    """Evaluates `params` at `step`; the metrics go under "eval", or
    "eval_averaged" for averaged checkpoints."""
    start = time.perf_counter()
    result = self.loss(params)
    if self.bleu_pairs:
      result.update(self.translation_scores(params))
    self.seconds = time.perf_counter() - start
    record = dict(result, minutes=self.minutes()) if self.minutes is not None else result
    self.writer.write(step, record, prefix="eval_averaged" if averaged else "eval")
    return result

  def loss(self, params) -> dict[str, float]:
    """Per-token eval loss, NLL, accuracy and perplexity (`summarize_sums`)."""
    sums = None
    for batch in data.eval_batches(self.loss_pairs, self.tokenizer,
                                   batch_size=self.config.eval_batch_size,
                                   max_length=self.config.max_length):
      batch.pop("weights")
      out = self._eval_fn(params, _shard(batch, self._sharding))
      sums = out if sums is None else jax.tree_util.tree_map(jnp.add, sums, out)
    return summarize_sums(sums)

  def translation_scores(self, params) -> dict[str, float]:
    """BLEU, chrF, exact match ... (`metrics.translation_scores`) of the
    translations of `bleu_pairs`. With several processes each translates its
    share (`multihost.split_across_processes`) and every process scores them all."""
    translator = self.translator(params)
    sources = [source for source, _ in self.bleu_pairs]
    references = [target for _, target in self.bleu_pairs]
    start = time.perf_counter()
    hypotheses = multihost.split_across_processes(
        lambda share: translator.translate(share, method=self.config.eval_decode_method,
                                           beam_size=self.config.eval_beam_size),
        sources, what="validation sentences")
    self.seconds_per_sentence = (time.perf_counter() - start) / len(sources)
    self.samples = list(zip(sources, references, hypotheses))
    return metrics_lib.translation_scores(hypotheses, references)


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       *, quiet: bool = False, train_pairs=None,
                       eval_pairs=None) -> TrainResult:
  """Trains `config` in `workdir`, resuming from its last checkpoint if any.

  `train_pairs` / `eval_pairs` (sequences of (source, target) strings) replace
  the data source of `config.data`, e.g. for sentence pairs held in memory.

  Before anything is written the workdir is held for this run
  (`run_lock.hold`) and, before anything is loaded or compiled, the config is
  compared with the one it was trained with (`workdir.check_config`); the
  run's log and a fatal error's traceback go to <workdir>/train.log.
  Raises (besides ValueError for a bad config): run_lock.WorkdirLocked,
  workdir.ConfigMismatch, disk_space.DiskFullError, TrainingDiverged.
  """
  started = time.monotonic()
  _check_config(config)
  path = multihost.resolve(workdir)  # a local path made absolute, or gs://... as it is
  path.mkdir(parents=True, exist_ok=True)
  shared = multihost.workdirs_shared(path)
  if not shared and config.get("state_sharding", "replicated") == "fsdp":
    raise ValueError(
        f"config.state_sharding='fsdp' needs one workdir that every process sees (a shared"
        f" disk, gs://...): {workdir} is this process's own, and each checkpoint there would"
        f" hold only this process's slices. Give all processes a shared --workdir, or use"
        f" --config.state_sharding=replicated.")
  workdir = str(path)
  with contextlib.ExitStack() as stack:
    stack.enter_context(run_lock.hold(workdir, shared=shared))
    stack.enter_context(run_log.run_log(workdir))
    return _run(config, workdir, stack, quiet=quiet, train_pairs=train_pairs,
                eval_pairs=eval_pairs, started=started, shared=shared)


def _run(config, workdir: str, stack: contextlib.ExitStack, *, quiet: bool, train_pairs,
         eval_pairs, started: float, shared: bool = True) -> TrainResult:
  """`train_and_evaluate` in a held workdir: what it opens is closed by `stack`,
  on every way out (a checkpointer left open on an error would keep writing
  from its threads). `shared`: whether the processes share the workdir
  (`multihost.workdirs_shared`); if not, each keeps its own vocabulary,
  configs and checkpoints."""
  is_main = jax.process_index() == 0
  for name, stored, requested in workdir_lib.check_config(workdir, config.to_dict()):
    logger.info("config.%s: %s -> %s (allowed on resume)", name, stored, requested)

  if train_pairs is None:
    train_pairs = data.load_split(config.data, "train")
  if eval_pairs is None:
    eval_pairs = data.load_split(config.data, "eval")
  tokenizer = get_tokenizer(config, workdir, train_pairs, shared=shared)
  model_config = model_config_from(config, tokenizer.vocab_size)
  logger.info("%s", attention_choice.attention_implementation_name(model_config))
  if is_main or not shared:
    workdir_lib.save_configs(workdir, config.to_dict(), model_config)

  mesh = parallel.make_mesh()
  optimizer, schedule = make_optimizer(config, model_config.d_model)
  state, state_shardings = init_train_state(config, model_config, optimizer, mesh)
  train_iter = _train_iterator(config, train_pairs, tokenizer)
  stack.callback(train_iter.close)
  ckpt = stack.enter_context(checkpoints.Checkpointer(
      workdir, keep=config.keep_checkpoints, save_every=config.checkpoint_every,
      per_process=not shared))
  state, start_step = _resume(ckpt, state, train_iter, workdir)

  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  stack.callback(writer.close)
  test_pairs = (data.load_split(config.data, "test")
                if config.get("test_report", True) and data.has_split(config.data, "test")
                else [])
  budget = _time_budget(config, ckpt, len(test_pairs), started)
  evaluate = Evaluator(config, model_config, tokenizer, eval_pairs, mesh, writer,
                       minutes=lambda: budget.spent() / 60)
  monitor = run_monitor.RunMonitor(config, model_config, tokenizer, train_pairs, budget)
  state, step, train_summary = _train_steps(
      state, start_step, config=config, workdir=workdir,
      step_fn=_jit_train_step(config, model_config, optimizer, schedule, mesh, state_shardings),
      train_iter=train_iter, ckpt=ckpt, evaluate=evaluate, writer=writer, monitor=monitor,
      progress=metrics_lib.progress_bar(start_step, config.num_train_steps,
                                        enabled=is_main and not quiet))

  final_params, averaged = _average_last_checkpoints(config, workdir, ckpt, state, mesh)
  eval_summary = evaluate(final_params, step, averaged=averaged)
  test_summary = {}
  if test_pairs:
    method = config.get("test_decode_method", "beam")
    test_summary = report.test_report(evaluate.translator(final_params), test_pairs, workdir,
                                      method=method, beam_size=config.eval_beam_size)
    writer.write(step, dict(test_summary, minutes=budget.spent() / 60), prefix="test")
    logger.info(report.format_test(test_summary, method))
  if is_main:
    report.save_curves(workdir)
  if budget.enabled:
    logger.info("The run took %.1f of its %g minutes.", budget.spent() / 60, budget.seconds / 60)
  return TrainResult(step=step, train=train_summary, eval=eval_summary,
                     samples=evaluate.samples, workdir=workdir, test=test_summary,
                     minutes=budget.spent() / 60, stopped_by_time=monitor.stopped_by_time,
                     warnings=monitor.warnings)


def _time_budget(config, ckpt: checkpoints.Checkpointer, num_test: int,
                 started: float) -> time_budget_lib.TimeBudget:
  """config.train_minutes as a TimeBudget, counting from `started` (this run's
  start, time.monotonic) plus the seconds the latest checkpoint records."""
  spent = 0.0
  if ckpt.latest_step():
    spent = float(ckpt.restore_metadata().get(time_budget_lib.SPENT_KEY, 0.0))
  cost = time_budget_lib.decode_cost
  return time_budget_lib.TimeBudget(
      config.get("train_minutes", 0.0), spent + (time.monotonic() - started),
      num_test_sentences=num_test,
      test_cost=cost(config.get("test_decode_method", "beam")) / cost(config.eval_decode_method))


def _train_iterator(config, train_pairs, tokenizer):
  """This process's shard of the training data, packed into token batches."""
  process_index, process_count = parallel.process_info()
  return data.train_iterator(
      train_pairs, tokenizer, batch_size=config.batch_size // process_count,
      max_length=config.max_length, seed=config.seed, shard_index=process_index,
      shard_count=process_count, pack=config.pack)


def _resume(ckpt: checkpoints.Checkpointer, state: dict, train_iter, workdir: str):
  """(state, step) of the last checkpoint, the data position restored with
  it; (state, 0) as given when there is none."""
  start_step = ckpt.latest_step() or 0
  if start_step:
    state, data_state = ckpt.restore(state)
    if data_state is not None:
      train_iter.set_state(data_state)
    logger.info("Resumed from step %d in %s", start_step, workdir)
  return state, start_step


def jit_train_step(config, model_config, optimizer, schedule, mesh, state_shardings):
  """(the jitted step: (state, global batch `[accumulation, rows, length]`) ->
  (state, metrics), the batch's sharding): `train_step` over the mesh, the
  batch sharded on rows, the state laid out as `state_shardings` and donated."""
  batch_sharding = NamedSharding(mesh, P(None, "data"))
  param_specs = jax.tree.map(lambda s: s.spec, state_shardings["params"])
  step_fn = jax.jit(
      lambda s, b: train_step(s, b, model_config=model_config, optimizer=optimizer,
                              schedule=schedule, label_smoothing=config.label_smoothing,
                              mesh=mesh, param_specs=param_specs),
      in_shardings=(state_shardings, batch_sharding),
      out_shardings=(state_shardings, parallel.replicated(mesh)), donate_argnums=0)
  return step_fn, batch_sharding


def _jit_train_step(config, model_config, optimizer, schedule, mesh, state_shardings):
  """`jit_train_step` taking this process's batch of numpy arrays."""
  step_fn, batch_sharding = jit_train_step(config, model_config, optimizer, schedule, mesh,
                                           state_shardings)
  return lambda state, batch: step_fn(state, _shard(batch, batch_sharding))


def _train_steps(state: dict, step: int, *, config, workdir: str, step_fn, train_iter,
                 ckpt: checkpoints.Checkpointer, evaluate: Evaluator,
                 writer: metrics_lib.MetricsWriter, monitor: run_monitor.RunMonitor,
                 progress) -> tuple[dict, int, dict]:
  """Trains from `step` to `config.num_train_steps`, or until the time budget
  (`monitor.budget`) leaves only what the end of the run needs: metrics every
  `log_every` steps (with MFU; the monitor's warnings printed), evaluation
  every `eval_every`, a checkpoint every `checkpoint_every` and at the end.
  Returns (state, step, the last train metrics) once the last checkpoint is
  complete.

  Never loses work: interrupted (KeyboardInterrupt), it saves what was trained
  so far (if it is sane) before stopping; on any other error the caller's
  `ckpt.close()` lets a save in flight finish. A NaN/inf loss raises
  TrainingDiverged without saving.
  """
  train_summary: dict[str, float] = {}
  window, window_start, last_log_step = None, time.perf_counter(), step
  metrics = None
  budget = monitor.budget
  step_seconds = 0.0  # of the last logging window, per step

  def save(force=False):
    _check_finite(float(metrics["loss"]), step, ckpt, workdir)
    start = time.perf_counter()
    # A run stopped by its budget has spent it all (what it kept for its end
    # included): run again with the same budget, it trains no further.
    spent = budget.seconds if monitor.stopped_by_time else budget.spent()
    ckpt.save(step, state, data_state=train_iter.get_state(), force=force,
              metadata={time_budget_lib.SPENT_KEY: spent})
    budget.measured(save_seconds=time.perf_counter() - start)

  try:
    if budget.should_stop(0.0):
      monitor.stopped_by_time = True
      logger.info("The time budget (config.train_minutes=%g) is spent: no more steps.",
                  budget.seconds / 60)
    while step < config.num_train_steps and not monitor.stopped_by_time:
      state, metrics = step_fn(state, _stack_micro_batches(train_iter, config.grad_accum_steps))
      step += 1
      if budget.should_stop(step_seconds):
        monitor.stopped_by_time = True
        progress.write(f"step {step}: stopping for the time budget "
                       f"(config.train_minutes={budget.seconds / 60:g}); "
                       f"{budget.reserve_seconds():.0f} s kept to save, average and evaluate.")
      last = step == config.num_train_steps or monitor.stopped_by_time
      window = metrics if window is None else jax.tree_util.tree_map(jnp.add, window, metrics)
      progress.update(1)
      if step % config.log_every == 0 or last:
        window = jax.device_get(window)
        _check_finite(float(window["loss"]), step, ckpt, workdir)
        train_summary = _train_summary(window, metrics, time.perf_counter() - window_start,
                                       step - last_log_step)
        step_seconds = 1.0 / train_summary["steps_per_second"]
        train_summary.update(mfu=monitor.mfu(train_summary["steps_per_second"]),
                             minutes=budget.spent() / 60)
        writer.write(step, train_summary, prefix="train")
        progress.set_postfix(loss=f"{train_summary['loss']:.3f}",
                             acc=f"{train_summary['accuracy']:.3f}",
                             mfu=f"{train_summary['mfu']:.0%}")
        for warning in monitor.after_log(step, train_summary):
          logger.warning("%s", warning)  # (the console and train.log)
        window, window_start, last_log_step = None, time.perf_counter(), step
      if step % config.eval_every == 0 and not last:
        progress.write(metrics_lib.format_eval(step, evaluate(state["params"], step)))
        budget.measured(eval_seconds=evaluate.seconds,
                        seconds_per_sentence=evaluate.seconds_per_sentence)
        window_start = time.perf_counter()
      if ckpt.should_save(step) or last:
        save(force=last)
  except KeyboardInterrupt:
    if metrics is not None and step > (ckpt.latest_step() or 0):
      progress.write(f"Interrupted: saving a checkpoint at step {step} ...")
      save(force=True)
    raise
  finally:
    progress.close()
  ckpt.wait()
  return state, step, train_summary


def _train_summary(window: dict, metrics: dict, seconds: float, steps: int) -> dict[str, float]:
  """The train metrics of a logging window: per-token averages of its summed
  metrics, the last step's learning rate and gradient norm, and speeds."""
  summary = summarize_sums(window)
  summary.update(learning_rate=float(metrics["learning_rate"]),
                 grad_norm=float(metrics["grad_norm"]),
                 tokens_per_second=float(window["weight"]) / max(seconds, 1e-9),
                 steps_per_second=steps / max(seconds, 1e-9))
  return summary


def _check_finite(loss: float, step: int, ckpt: checkpoints.Checkpointer, workdir: str) -> None:
  """Raises TrainingDiverged, naming the last good checkpoint, if `loss` is NaN or inf."""
  if math.isfinite(loss):
    return
  # An async save of an earlier (finite) step may still be in flight: let it
  # commit, so that the checkpoint named below exists when we stop.
  ckpt.wait()
  last = ckpt.latest_step()
  raise TrainingDiverged(
      f"The training loss became {loss} at step {step}. Stopped without saving; the "
      f"last good checkpoint is {'step %d' % last if last else 'none'} in "
      f"{os.path.join(workdir, checkpoints.CHECKPOINT_DIR)}. Lower the learning rate "
      "(--config.learning_rate_scale), lengthen warm-up (--config.warmup_steps) or "
      "set --config.grad_clip_norm, then run again: training resumes from there.")


def _average_last_checkpoints(config, workdir: str, ckpt: checkpoints.Checkpointer,
                              state: dict, mesh) -> tuple[dict, bool]:
  """(params to evaluate last, whether they are averaged): as the paper did,
  the average of the last `config.average_last` checkpoints (5 base, 20 big),
  saved in the workdir; the final state's params when there is nothing to
  average."""
  if config.average_last <= 1 or len(ckpt.all_steps()) <= 1:
    return state["params"], False
  averaged, averaged_steps = averaging.average_and_save(
      workdir, state["params"], num=config.average_last, per_process=ckpt.per_process)
  logger.info("Averaged checkpoints %s", averaged_steps)
  return parallel.replicate(averaged, mesh), True
