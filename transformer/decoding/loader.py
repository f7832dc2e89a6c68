"""The one loader: a Translator from a workdir written by train.py.

The workdir is read once (`read_workdir`: `workdir.read`, its checkpoint
chosen through the record an earlier decode kept, `serving_params.resolve`)
into a `workdir.Workdir` value; the parameters of the checkpoint it chose are
restored with orbax, or read from the serving copy an earlier load kept while
the checkpoints are unchanged (`serving_params.load`); then the Translator.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import Mesh

from transformer import model
from transformer.model import param_size
from transformer.data.tokenizer import load_tokenizer
from transformer.decoding import executable_cache, serving_params
from transformer.decoding.translator import Translator
from transformer.runtime import errors, model_memory, parallel, signing
from transformer.runtime import workdir as workdir_lib

logger = logging.getLogger(__name__)


def read_workdir(workdir: str | os.PathLike, checkpoint: str | int = "auto"
                 ) -> workdir_lib.Workdir:
  """`workdir` read once for decoding (`workdir.read`): checkpoint "auto"
  (the averaged checkpoint if any and not stale, else the latest),
  "averaged", "latest" or a step, chosen from the record an earlier decode
  kept while the checkpoints are unchanged (`serving_params.resolve`).
  Nothing is loaded. Raises what `workdir.read` raises."""
  return workdir_lib.read(workdir, checkpoint, choose=serving_params.resolve)


def load_translator(workdir: str | os.PathLike | workdir_lib.Workdir,
                    checkpoint: str | int = "auto", *, with_info: bool = False,
                    param_sharding: str = "replicated", weights_dtype: str | None = None,
                    trust_compiled: str | os.PathLike | None = None):
  """A Translator for a workdir written by train.py.

  Args:
    workdir: holds model_config.json, the vocabulary and checkpoints; or
      the `Workdir` value `read_workdir` made of it (then `checkpoint` is the
      one it chose).
    checkpoint: "auto" (the averaged checkpoint if any, else the latest),
      "averaged", "latest", or a step number.
    with_info: also return what was loaded: `averaging.load_params`' info
      ("kind": "averaged" | "step", "step", "path", and "averaged_steps").
    param_sharding: "replicated", or "fsdp": each array restored straight into
      its slices over this process's devices (see `Translator`), never whole
      on one device.
    weights_dtype: None (the model's) or "bfloat16": the projections'
      weights in bfloat16 (see `Translator`).
    trust_compiled: the key of the machine whose seals you trust (a copy of
      your own workdir from another machine of yours): the path of its
      32-byte `signing.key`, or of a keyring directory of such `*.key`
      files. The files in `<workdir>/compiled/` whose tags verify under it
      are sealed with this machine's key and loaded
      (`executable_cache.trust`); the others are compiled afresh, as
      always without it (docs/security.md). None (or "") = off.
  Returns:
    The Translator, or (Translator, info) with `with_info=True`.
  Raises:
    FileNotFoundError (CheckpointNotFound among them) naming what is missing
    and what to do; ValueError for files that cannot be read (OptionError for
    a `checkpoint` that is no choice, or a `trust_compiled` that names no
    key: `trusted_keys`).
  """
  trusted = trusted_keys(trust_compiled)  # (first: a bad key path costs nothing)
  if not isinstance(workdir, workdir_lib.Workdir):
    workdir = read_workdir(workdir, checkpoint)
    if workdir.checkpoint_note:
      logger.warning("%s", workdir.checkpoint_note)
  model_config = workdir.model_config
  tokenizer = load_tokenizer(workdir.vocab_path, root=workdir.path)
  if tokenizer.vocab_size > model_config.vocab_size:  # (ids past the embedding otherwise)
    raise ValueError(f"{workdir.vocab_path} has {tokenizer.vocab_size} pieces, more than the "
                     f"model's vocab_size {model_config.vocab_size}: it is not this model's "
                     "vocabulary")
  model_dir = executable_cache.model_directory(workdir)
  executable_cache.trust(model_dir, trusted)
  sharded_over = len(jax.local_devices()) if param_sharding == "fsdp" else 1
  target = param_shapes(model_config, model_dir, fits=lambda size: model_memory.check_fits(
      model_config, str(workdir.path / workdir_lib.MODEL_CONFIG_FILE), "decoding",
      sharded_over=sharded_over, size=size))
  if param_sharding == "fsdp":
    mesh = Mesh(np.array(jax.local_devices()), (parallel.DATA_AXIS,))
    target = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=sharding),
                          target, parallel.state_shardings(target, mesh, "fsdp"))
    params, info = _restore(workdir, target)
  else:  # (a copy kept by the last load, while the checkpoints are unchanged)
    params, info = serving_params.load(workdir, target, lambda: _restore(workdir, target))
  translator = Translator(model_config, params, tokenizer, param_sharding=param_sharding,
                          weights_dtype=weights_dtype, workdir=workdir)
  return (translator, info) if with_info else translator


def trusted_keys(trust_compiled: str | os.PathLike | None) -> list[bytes]:
  """The keys `trust_compiled` names (`signing.trusted_keys`); none for
  None, False or "". OptionError for True (the old switch, which trusted
  any file that merely looked sealed) and for a path that holds no key."""
  if trust_compiled is True:
    raise errors.OptionError(
        signing.TRUST_OPTION, True, "name the key file (signing.key) of the machine whose "
        "seals you trust, e.g. trust_compiled=\"keys/laptop.key\": trust is a key, never a "
        "workdir's files")
  if trust_compiled is None or trust_compiled is False or trust_compiled == "":
    return []
  if os.fspath(trust_compiled).startswith("-"):  # (a command line took the next flag for it)
    raise errors.OptionError(
        signing.TRUST_OPTION, trust_compiled, "name the key file (signing.key) of the machine "
        "whose seals you trust, e.g. --trust_compiled=keys/laptop.key")
  return signing.trusted_keys(trust_compiled)


def param_shapes(model_config, model_dir=None, fits=None):
  """The parameters' shapes (`jax.ShapeDtypeStruct`s), traced from the model
  once and then kept with the compiled decoders, in the machine's cache and
  in `model_dir` (a workdir's `compiled/`): a trace of the whole model at
  every start otherwise. `model.init_params` is imported only then
  (`transformer.model.__getattr__`); the key's random key by its shape alone
  (making one compiles a small program). `fits(size)`, where given, sees the
  parameters' `param_size.ParameterSize` before any is allocated, and may
  refuse them (`model_memory.check_fits`): from the shapes, kept or traced
  (`jax.eval_shape` allocates nothing), and, for a model too deep to trace
  quickly (40 s for 512 + 512 layers), from three shallow traces first
  (`param_size.parameter_size`, `param_size.QUICK_TRACE_LAYERS`)."""
  def init(rng):
    depth = model_config.num_encoder_layers + model_config.num_decoder_layers
    if fits is not None and depth > param_size.QUICK_TRACE_LAYERS:
      fits(param_size.parameter_size(model_config))
    return model.init_params(model_config, rng)

  shapes = executable_cache.load_or_eval_shape(
      {"model": model_config.to_dict(), "of": "init_params"}, init,
      jax.eval_shape(jax.random.key, 0), model_dir=model_dir)
  if fits is not None:
    fits(param_size.tree_size(shapes))
  return shapes


def _restore(workdir: workdir_lib.Workdir, target) -> tuple[dict, dict]:
  """(params, info): the checkpoint `workdir` chose, restored with orbax into
  `target`."""
  from transformer.runtime import averaging  # (orbax, 0.2 s: not for a serving copy)
  try:
    return averaging.load_params(workdir.path, target, which=workdir.checkpoint,
                                 with_info=True)
  except FileNotFoundError as e:  # (a checkpoint deleted since it was listed)
    raise FileNotFoundError(f"cannot load the parameters: {e}") from e
  except ValueError as e:
    raise ValueError(f"cannot load the parameters: {e}") from e
