"""What a training run sets up before its first step: the config check (a
ValueError naming the field), the model config from `config.model` and the
vocabulary, and the vocabulary itself (trained on the first run, sent from
process 0 to the others, kept in the workdir so that it alone can decode)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import ml_collections

from transformer.data import received
from transformer.data import sources as data_sources
from transformer.data import tokenizer as tokenizer_lib
from transformer.model.config import TransformerConfig
from transformer.runtime import model_memory, multihost, parallel
from transformer.runtime import workdir as workdir_lib
from transformer.runtime import workdir_records
from transformer.decoding.options import PAPER_LENGTH_PENALTY

logger = logging.getLogger(__name__)




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


def vocabulary_file(config) -> str:
  """The vocabulary a run must use as it is: config.vocab_path, else that of
  the workdir it starts from (config.init_from); "" to train one."""
  if config.get("vocab_path"):
    return config.vocab_path
  if config.get("init_from"):
    return init_from_vocabulary(config.init_from)
  return ""


def init_from_vocabulary(source: str) -> str:
  """The vocabulary of the workdir `source` (config.init_from) by the workdir's
  rule, refused (ValueError, one sentence) when that rule leads out of it: a
  workdir from elsewhere whose vocab.model is missing and whose config.json
  names a vocab_path outside it is data that points at this machine's files."""
  path = workdir_lib.vocab_path(source)
  if not _within(source, path):
    raise ValueError(
        f"config.init_from={source}: it has no {workdir_lib.VOCAB_FILE}, and its "
        f"{workdir_lib.CONFIG_FILE} names the vocabulary {path}, outside it; a workdir is "
        f"read only within itself: copy that file to {source}/{workdir_lib.VOCAB_FILE} if "
        "you trust it, or set --config.vocab_path.")
  return path


def _within(directory: str, path: str) -> bool:
  """Whether `path` names a file inside `directory` (local paths resolved,
  symbolic links followed; addresses such as gs://... compared as text)."""
  if workdir_lib.is_local(directory) and workdir_lib.is_local(path):
    directory, path = os.path.realpath(directory), os.path.realpath(path)
    return os.path.commonpath([directory, path]) == directory
  return os.path.normpath(path).startswith(os.path.normpath(directory).rstrip("/") + "/")


def train_vocabulary(config, train_pairs, path: str) -> tokenizer_lib.Tokenizer:
  """A SentencePiece vocabulary of config.vocab_size pieces trained on at most
  config.vocab_max_sentences sentences (default 1,000,000): the source and
  target of pairs evenly spaced over the whole training corpus
  (`sources.sample_sentences`), on every core this process may use. Written
  to `path` when it is local (the caller writes a gs://... one). Logs the
  sample's size and the time taken."""
  max_sentences = int(config.get("vocab_max_sentences", tokenizer_lib.DEFAULT_MAX_SENTENCES))
  threads = tokenizer_lib.available_cores()
  start = time.perf_counter()
  sample = list(data_sources.sample_sentences(train_pairs, max_sentences))
  logger.info("Training a SentencePiece vocabulary of %d pieces on %d sentences (%d of the "
              "%d training pairs, evenly spaced; config.vocab_max_sentences=%d), %d threads "
              "-> %s", config.vocab_size, len(sample), len(sample) // 2, len(train_pairs),
              max_sentences, threads, path)
  tokenizer = tokenizer_lib.train_tokenizer(
      sample, path if workdir_lib.is_local(path) else None, config.vocab_size,
      model_type=config.get("vocab_model_type", "unigram"), max_sentences=len(sample),
      num_threads=threads)
  logger.info("Trained the vocabulary (%d pieces) on %d sentences in %.1f s.",
              tokenizer.vocab_size, len(sample), time.perf_counter() - start)
  return tokenizer


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
      if vocabulary_file(config):  # (init_from's: read only inside that workdir)
        root = None if config.get("vocab_path") else config.get("init_from") or None
        model = tokenizer_lib.load_tokenizer(vocabulary_file(config), root).serialized_model()
      elif received.exists(path):
        model = tokenizer_lib.load_tokenizer(path, workdir).serialized_model()
      else:
        model = train_vocabulary(config, train_pairs, path).serialized_model()
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
    stored = (received.read_bytes(path, root=workdir, kind="vocabulary")
              if received.exists(path) else None)
    if stored is None or (stored != model and not is_main):
      if stored is not None:
        logger.warning("%s differs from process 0's vocabulary: replaced by it.", path)
      workdir_lib.write_file(path, model)
  return tokenizer_lib.tokenizer_from_bytes(model, vocabulary_file(config) or path)


def check_train_config(config) -> None:
  """Raises ValueError, naming the field and what to do, for a config that
  cannot train: called before anything is read, written or compiled."""
  if config.get("require_init_from") and not config.get("init_from"):
    raise ValueError("config.init_from is empty: this config fine-tunes a pretrained model; "
                     "set --config.init_from=<the workdir of that model> (one train.py wrote, "
                     "or python -m transformer.interop.marian imported).")
  unknown = _unknown_model_fields(config)
  if unknown:
    raise ValueError(f"config.model has unknown field(s) {unknown}; valid fields are "
                     f"{sorted(f.name for f in dataclasses.fields(TransformerConfig))}.")
  for name in ("num_train_steps", "batch_size", "max_length", "grad_accum_steps",
               "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    if int(config[name]) < 1:
      raise ValueError(f"config.{name}={config[name]} must be >= 1.")
  if int(config.average_last) > int(config.keep_checkpoints):
    raise ValueError(
        f"config.average_last={config.average_last} cannot average more checkpoints than "
        f"config.keep_checkpoints={config.keep_checkpoints} keeps: set "
        f"--config.keep_checkpoints={config.average_last} or lower --config.average_last.")
  if int(config.data.get("workers", 0)) < -1:
    raise ValueError(f"config.data.workers={config.data.workers} must be >= 0 (worker "
                     "processes building the training batches) or -1 (auto).")
  if config.get("shared_workdir", "auto") not in multihost.SHARED_WORKDIR_CHOICES:
    raise ValueError(f"config.shared_workdir={config.shared_workdir!r} must be one of "
                     f"{multihost.SHARED_WORKDIR_CHOICES} (auto: found out at the start).")
  if config.get("state_sharding", "replicated") not in parallel.STATE_SHARDINGS:
    raise ValueError(f"config.state_sharding={config.state_sharding!r} must be one of "
                     f"{parallel.STATE_SHARDINGS}.")
  if float(config.get("train_minutes", 0)) < 0:
    raise ValueError(f"config.train_minutes={config.train_minutes} must be >= 0 "
                     "(0: no time budget).")
  _check_schedule(config)
  low, high = workdir_records.DECODING_FIELDS["length_penalty"]
  alphas = [("length_penalty", config.get("length_penalty", PAPER_LENGTH_PENALTY))] + [
      ("length_penalty_candidates", a) for a in config.get("length_penalty_candidates", ())]
  for name, alpha in alphas:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not low <= alpha <= high:
      raise ValueError(f"config.{name}: {alpha!r} is not a number in [{low}, {high}] (beam "
                       f"search's alpha; the paper's {PAPER_LENGTH_PENALTY}).")
  if config.get("keep_average", "if_no_worse") not in ("if_no_worse", "always"):
    raise ValueError(f"config.keep_average={config.keep_average!r} must be 'if_no_worse' or "
                     "'always'.")
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


def _check_schedule(config) -> None:
  """config.lr_schedule and, for "budget", its fields (ValueError naming them)."""
  from transformer.training.steps import SCHEDULES  # (jax-free callers import this module)
  schedule = config.get("lr_schedule", "paper")
  if schedule not in SCHEDULES:
    raise ValueError(f"config.lr_schedule={schedule!r} must be one of {SCHEDULES}.")
  if schedule != "budget":
    return
  if float(config.get("train_minutes", 0)) <= 0:
    raise ValueError("config.lr_schedule='budget' follows a time budget: set "
                     "--config.train_minutes (> 0), or use --config.lr_schedule=paper.")
  for name in ("warmup_fraction", "decay_fraction"):
    if not 0 < float(config[name]) < 1:
      raise ValueError(f"config.{name}={config[name]} must be between 0 and 1 (a share of "
                       "the steps the budget affords).")
  if float(config.warmup_fraction) + float(config.decay_fraction) > 1:
    raise ValueError(f"config.warmup_fraction={config.warmup_fraction} + config.decay_"
                     f"fraction={config.decay_fraction} must be at most 1.")
  if float(config.learning_rate) <= 0:
    raise ValueError(f"config.learning_rate={config.learning_rate} must be > 0 (the peak).")


def load_init_from_config(config) -> TransformerConfig:
  """The model config of the workdir config.init_from names, once it is known
  to hold a model config, a vocabulary and a checkpoint, and that this
  machine can fine-tune it (`model_memory.check_fits`); ValueError naming the
  option otherwise (before this run reads, trains or allocates anything)."""
  source = config.init_from
  try:
    model = workdir_lib.read(source, "auto")
    sharded = config.get("state_sharding", "replicated") == "fsdp"
    model_memory.check_fits(model.model_config, str(model.path / workdir_lib.MODEL_CONFIG_FILE),
                            "fine-tuning", sharded_over=jax.device_count() if sharded else 1)
    return model.model_config
  except (OSError, ValueError) as e:
    raise ValueError(f"config.init_from={source}: {e}") from None


# The fields of config.model a run that starts from another workdir's parameters
# (config.init_from) chooses itself: how it trains and computes, not what the
# model is. Every other field (sizes, layout, activation, ids) is that workdir's.
TRAINING_FIELDS = ("dropout_rate", "attention_dropout_rate", "dtype", "param_dtype",
                   "scan_layers", "remat", "attention_implementation")


def init_from_model_config(config, source_config: TransformerConfig,
                           vocab_size: int) -> TransformerConfig:
  """The model of a run with config.init_from: the source workdir's
  (`source_config`, `load_init_from_config`), with this config's
  TRAINING_FIELDS. The architecture fields of config.model that differ are
  not used (logged); a vocabulary of another size is refused."""
  if vocab_size != source_config.vocab_size:
    raise ValueError(
        f"config.init_from={config.init_from}: its model has a vocabulary of "
        f"{source_config.vocab_size} ids, config.vocab_path={config.get('vocab_path')} has "
        f"{vocab_size}; leave vocab_path empty to use that workdir's vocabulary.")
  fields = {name: config.model[name] for name in TRAINING_FIELDS if name in config.model}
  ignored = [f"{name}={value!r} (its {getattr(source_config, name)!r})"
             for name, value in sorted(config.model.items())
             if name not in TRAINING_FIELDS and hasattr(source_config, name)
             and getattr(source_config, name) != value]
  if ignored:
    logger.warning("config.init_from=%s: the model is that workdir's; not used from "
                   "config.model: %s", config.init_from, ", ".join(ignored))
  try:
    return source_config.replace(**fields)
  except ValueError as e:
    raise ValueError(f"{e} (set it with --config.model.<field>=...)") from e
