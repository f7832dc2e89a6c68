"""The one loader: a Translator from a workdir written by train.py (the model
config, the vocabulary and the checkpoint chosen by `workdir.resolve_checkpoint`,
restored with orbax, or read from the serving copy an earlier load kept while
the checkpoints are unchanged: `serving_params.py`)."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

from transformer import model
from transformer.data.tokenizer import load_tokenizer
from transformer.decoding import executable_cache, serving_params
from transformer.decoding.translator import Translator
from transformer.runtime import multihost, parallel
from transformer.runtime.workdir import check_files, load_model_config, vocab_path

logger = logging.getLogger(__name__)


def load_translator(workdir: str, checkpoint: str | int = "auto", *,
                    with_info: bool = False, param_sharding: str = "replicated",
                    weights_dtype: str | None = None):
  """A Translator for a workdir written by train.py.

  Args:
    workdir: holds model_config.json, the vocabulary and checkpoints.
    checkpoint: "auto" (the averaged checkpoint if any, else the latest),
      "averaged", "latest", or a step number.
    with_info: also return what was loaded: `averaging.load_params`' info
      ("kind": "averaged" | "step", "step", "path", and "averaged_steps").
    param_sharding: "replicated", or "fsdp": each array restored straight into
      its slices over this process's devices (see `Translator`), never whole
      on one device.
    weights_dtype: None (the model's) or "bfloat16": the projections'
      weights in bfloat16 (see `Translator`).
  Returns:
    The Translator, or (Translator, info) with `with_info=True`.
  Raises:
    FileNotFoundError (CheckpointNotFound among them) naming what is missing
    and what to do; ValueError for files that cannot be read (OptionError for
    a `checkpoint` that is no choice).
  """
  check_files(workdir)
  workdir = str(multihost.resolve(workdir))  # orbax restores only from absolute paths
  which, note = serving_params.resolve(workdir, checkpoint)
  if note:
    logger.warning("%s", note)
  model_config = load_model_config(workdir)
  tokenizer = load_tokenizer(vocab_path(workdir))
  # The parameters' shapes, traced from the model once and then kept with the
  # compiled decoders (a trace of the whole model at every start otherwise;
  # `model.init_params` is imported only then: `transformer.model.__getattr__`;
  # the key by its shape alone: making one compiles a small program).
  target = executable_cache.load_or_eval_shape(
      {"model": model_config.to_dict(), "of": "init_params"},
      lambda rng: model.init_params(model_config, rng), jax.eval_shape(jax.random.key, 0))
  if param_sharding == "fsdp":
    mesh = Mesh(np.array(jax.local_devices()), (parallel.DATA_AXIS,))
    target = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=sharding),
                          target, parallel.state_shardings(target, mesh, "fsdp"))
    params, info = _restore(workdir, which, target)
  else:  # (a copy kept by the last load, while the checkpoints are unchanged)
    params, info = serving_params.load(workdir, which, target,
                                       lambda: _restore(workdir, which, target))
  translator = Translator(model_config, params, tokenizer, param_sharding=param_sharding,
                          weights_dtype=weights_dtype)
  return (translator, info) if with_info else translator


def _restore(workdir: str, which: str | int, target) -> tuple[dict, dict]:
  """(params, info): checkpoint `which` ("averaged" or a step) of `workdir`,
  restored with orbax into `target`."""
  from transformer.runtime import averaging  # (orbax, 0.2 s: not for a serving copy)
  try:
    return averaging.load_params(workdir, target, which=which, with_info=True)
  except FileNotFoundError as e:  # (a checkpoint deleted since it was listed)
    raise FileNotFoundError(f"cannot load the parameters: {e}") from e
  except ValueError as e:
    raise ValueError(f"cannot load the parameters: {e}") from e
