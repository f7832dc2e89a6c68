"""The one loader: a Translator from a workdir written by train.py (the model
config, the vocabulary and the checkpoint chosen by `workdir.resolve_checkpoint`)."""

from __future__ import annotations

import functools

import jax

from transformer.data.tokenizer import load_tokenizer
from transformer.decoding.translator import Translator
from transformer.model.transformer import init_params
from transformer.runtime import averaging, multihost
from transformer.runtime.workdir import (check_files, load_model_config, resolve_checkpoint,
                                         vocab_path)


def load_translator(workdir: str, checkpoint: str | int = "auto", *,
                    with_info: bool = False):
  """A Translator for a workdir written by train.py.

  Args:
    workdir: holds model_config.json, the vocabulary and checkpoints.
    checkpoint: "auto" (the averaged checkpoint if any, else the latest),
      "averaged", "latest", or a step number.
    with_info: also return what was loaded: `averaging.load_params`' info
      ("kind": "averaged" | "step", "step", "path", and "averaged_steps").
  Returns:
    The Translator, or (Translator, info) with `with_info=True`.
  Raises:
    FileNotFoundError (CheckpointNotFound among them) naming what is missing
    and what to do; ValueError for files that cannot be read (OptionError for
    a `checkpoint` that is no choice).
  """
  check_files(workdir)
  which = resolve_checkpoint(workdir, checkpoint)
  workdir = str(multihost.resolve(workdir))  # orbax restores only from absolute paths
  model_config = load_model_config(workdir)
  tokenizer = load_tokenizer(vocab_path(workdir))
  target = jax.eval_shape(functools.partial(init_params, model_config), jax.random.key(0))
  try:
    params, info = averaging.load_params(workdir, target, which=which, with_info=True)
  except FileNotFoundError as e:  # (a checkpoint deleted since it was listed)
    raise FileNotFoundError(f"cannot load the parameters: {e}") from e
  except ValueError as e:
    raise ValueError(f"cannot load the parameters: {e}") from e
  translator = Translator(model_config, params, tokenizer)
  return (translator, info) if with_info else translator
