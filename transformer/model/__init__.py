"""The model: the paper's modules (`transformer.py`, read top to bottom as
Section 3, with the incremental decoding step beside the teacher-forced path),
its hyper-parameters (`config.py`), and what makes it fast without changing
what it computes: the layers (`layers.py`), the decoding cache and its
attention kernel (`kv_cache.py`), the attention implementation per machine
(`attention_choice.py`) and dropout's random bits (`prng.py`)."""

from transformer.model.config import TransformerConfig

__all__ = ["Transformer", "TransformerConfig", "MultiHeadAttention", "count_params",
           "init_params", "scaled_dot_product_attention", "sinusoidal_positional_encoding"]


def __getattr__(name):
  """The names of model/transformer.py, imported on first use: that module
  imports flax (0.15-0.25 s on a 2-core CPU), which a decode.py whose
  compiled programs are on disk never needs (tests/test_executable_cache.py
  checks it)."""
  if name in __all__:
    from transformer.model import transformer as module
    return getattr(module, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  """The module's names and those `__getattr__` hands on (without importing
  them), so that `dir()`, completion and tools that look names up see them."""
  return sorted(set(globals()) | set(__all__))
