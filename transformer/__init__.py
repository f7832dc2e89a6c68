"""The Transformer of "Attention Is All You Need" in JAX/Flax.

A notebook needs only this:

    import transformer

    config = transformer.demo_config(num_train_steps=600)     # ml_collections config
    result = transformer.train(config, "runs/notebook")        # train (resumes if run again)
    translator = transformer.load_translator("runs/notebook")
    translator.translate(["forty-two red apples"], method="beam")
    source, target, weights = translator.cross_attention("forty-two red apples")

Or with sentence pairs held in memory:

    transformer.train(config, "runs/mine", train_pairs=[("hello", "hallo"), ...],
                      eval_pairs=[...])

On Linux, `transformer.keep_freed_memory()` before the first computation
makes every training step on CPU 10-15% faster (see `transformer.runtime.host_memory`;
train.py calls it itself). For decoding with a Translator, whose lanes are
threads, `keep_freed_memory(one_heap=False)`, as decode.py calls it.

The library, in sub-packages by layer (docs/architecture.md); imports go one
way, from the top of this list down:

  transformer.training   the loop, the jitted steps, evaluation, the run monitor,
                         metrics and the end-of-run report
  transformer.decoding   search (greedy, beam, sampling), the Translator (strings
                         in, strings out) and the loader of a workdir
  transformer.plotting   attention pictures and learning curves
  transformer.runtime    workdir, checkpoints, averaging, devices and hosts, disk,
                         caches, host memory
  transformer.data       sentence-pair sources, the grain pipeline, the tokenizer,
                         text I/O, the demo task
  transformer.model      the paper's modules (model/transformer.py reads as
                         Section 3), the fast layers, the KV cache
  transformer.configs    the recipes (the checkout's configs/ folder)
"""

import importlib.util
import os
import sys

from transformer.runtime.host_memory import keep_freed_memory
from transformer.model import TransformerConfig



def _recipes_from_a_checkout() -> None:
  """`transformer.configs` is the checkout's configs/ folder (pyproject.toml's
  package-dir installs it so); for a checkout put on sys.path without being
  installed (the notebook run from notebooks/), the same folder is loaded here."""
  if "transformer.configs" in sys.modules or importlib.util.find_spec("transformer.configs"):
    return
  folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  if os.path.isfile(os.path.join(folder, "__init__.py")):
    spec = importlib.util.spec_from_file_location(
        "transformer.configs", os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_recipes_from_a_checkout()

__all__ = [
    "Transformer", "TransformerConfig", "MultiHeadAttention", "count_params",
    "init_params", "scaled_dot_product_attention", "sinusoidal_positional_encoding",
    "demo_config", "train", "load_translator", "Translator", "keep_freed_memory",
]


def demo_config(**overrides):
  """The embedded demo's config (configs/default.py) with top-level fields
  overridden, e.g. demo_config(num_train_steps=300). Nested fields:
  config.model.d_model = 64 on the returned object."""
  from transformer.configs import default
  config = default.get_config()
  config.update(overrides)
  return config


def train(config, workdir: str, *, train_pairs=None, eval_pairs=None, quiet: bool = False):
  """Trains (or resumes) into `workdir`; returns a `training.TrainResult`.
  Holds the workdir while it trains (a second run there raises
  `run_lock.WorkdirLocked`) and resumes only with the config it was trained
  with (`workdir.check_config`); the run's log is <workdir>/train.log."""
  from transformer.runtime import compile_cache
  from transformer.training import loop as training
  compile_cache.enable()
  return training.train_and_evaluate(config, workdir, quiet=quiet,
                                     train_pairs=train_pairs, eval_pairs=eval_pairs)


def load_translator(workdir: str, checkpoint="auto", *, weights_dtype: str | None = None,
                    trust_compiled: str | os.PathLike | None = None):
  """A `decoding.translator.Translator` for a trained workdir (`decoding.loader.load_translator`;
  `weights_dtype="bfloat16"`: faster on CPUs with AVX512-BF16, see `Translator`;
  `trust_compiled="keys/laptop.key"`: a copy of your own workdir from the
  machine whose signing.key that is (or a directory of such `*.key` files):
  the compiled decoders sealed under it are sealed anew here and loaded,
  docs/security.md)."""
  from transformer.decoding import loader
  from transformer.runtime import compile_cache
  compile_cache.enable()
  return loader.load_translator(workdir, checkpoint, weights_dtype=weights_dtype,
                                trust_compiled=trust_compiled)


def __getattr__(name):
  """The model's names and the Translator, imported on first use (the model
  imports flax: `transformer.model`'s docstring says why that waits)."""
  if name == "Translator":
    from transformer.decoding.translator import Translator
    return Translator
  from transformer import model
  if name in model.__all__:
    return getattr(model, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
