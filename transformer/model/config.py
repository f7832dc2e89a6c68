"""The Transformer's hyper-parameters, with the paper's names (Table 3), and the
checks that name a bad field before anything is traced."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from transformer.model.attention_choice import cudnn_problem


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the Transformer. Defaults are the paper's base model."""

  vocab_size: int = 37000          # shared source/target vocabulary
  d_model: int = 512               # width of every residual-stream vector
  num_heads: int = 8               # h
  d_ff: int = 2048                 # inner width of the feed-forward network
  num_encoder_layers: int = 6      # N (encoder)
  num_decoder_layers: int = 6      # N (decoder)
  max_len: int = 256               # longest sequence (learned positions, checks)
  dropout_rate: float = 0.1        # P_drop: sub-layer outputs, embeddings + PE
  attention_dropout_rate: float = 0.0  # on the attention weights (not in the paper)
  share_embeddings: bool = True    # one embedding for source and target tokens
  logits_via_embedding: bool = True  # pre-softmax projection = embedding^T
  normalization: str = "post"      # "post" (paper) or "pre" (LayerNorm first)
  activation: str = "relu"         # feed-forward non-linearity: "relu", "gelu" or
                                   # "swish" (OPUS-MT / Marian models)
  logits_bias: bool = False        # a learned bias on the output logits (Marian's)
  positional: str = "sinusoidal"   # "sinusoidal" (paper) or "learned"
  layer_norm_epsilon: float = 1e-5  # torch's: exported to transformers exactly
  dtype: str = "float32"           # compute dtype ("bfloat16" on accelerators)
  param_dtype: str = "float32"     # storage dtype of the parameters
  matmul_dtype: str | None = None  # the projections' weights and inputs ("bfloat16":
                                   # decoding on CPUs with AVX512-BF16), summed in
                                   # `dtype`; None: `dtype` (Translator(weights_dtype=))
  scan_layers: bool = False        # stack layers with nn.scan (flat compile time)
  remat: bool = False              # recompute layer activations in the backward pass
  attention_implementation: str | None = None  # None (by machine), "xla", "cudnn": see
                                               # choose_attention_implementation
  pad_id: int = 0
  eos_id: int = 1
  bos_id: int = 2

  def __post_init__(self):
    _check_config(self)  # a ValueError naming the field and what it must be

  @property
  def head_dim(self) -> int:
    """d_k = d_v = d_model / h."""
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values) -> "TransformerConfig":
    """Builds a config from a mapping, ignoring keys that are not fields.

    The mapping may come from a file someone else wrote (a workdir's
    model_config.json, an imported model's config): a value of the wrong
    type or out of range (`MAX_SIZES`) is a ValueError naming the field, never
    a TypeError from deep inside (the caller names the file)."""
    if not isinstance(values, Mapping):
      raise ValueError(f"a model config must be a mapping of field names to values, not "
                       f"{type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


_DTYPES = ("float32", "bfloat16", "float16")
# The largest size a config may ask for: far above any model this code trains or
# imports (the paper's big model: d_model 1024, d_ff 4096; the largest published
# Transformers: d_model ~18k, d_ff ~74k, vocabularies ~256k), yet small enough
# that a hand-edited or hostile model_config.json is refused in one sentence
# instead of asking for terabytes when the parameters are traced or restored.
MAX_SIZES = {"vocab_size": 1 << 22, "d_model": 1 << 16, "num_heads": 1 << 10,
             "d_ff": 1 << 18, "max_len": 1 << 20, "num_encoder_layers": 512,
             "num_decoder_layers": 512}
_BOOLS = ("share_embeddings", "logits_via_embedding", "logits_bias", "scan_layers", "remat")
MATMUL_DTYPES = (None, "bfloat16")  # (`matmul_dtype`; `Translator(weights_dtype=)`)
_CHOICES = {"normalization": ("post", "pre"), "activation": ("relu", "gelu", "swish"),
            "positional": ("sinusoidal", "learned"), "dtype": _DTYPES,
            "param_dtype": _DTYPES, "matmul_dtype": MATMUL_DTYPES,
            "attention_implementation": (None, "xla", "cudnn")}


def _check_config(config: TransformerConfig) -> None:
  """Raises a ValueError naming the first field of `config` with a bad value."""
  def check(field, ok, problem):
    if not ok(getattr(config, field)):
      shown = repr(getattr(config, field))
      shown = shown if len(shown) <= 60 else f"{shown[:40]}... ({len(shown)} characters)"
      raise ValueError(f"TransformerConfig.{field}={shown}: {problem}")

  for field, most in MAX_SIZES.items():
    check(field, lambda v: _is_int(v) and 1 <= v <= most,
          f"must be a positive integer of at most {most:,}")
  check("d_model", lambda v: v % config.num_heads == 0, f"must be divisible by num_heads="
        f"{config.num_heads} (each head gets d_model / num_heads dimensions)")
  for field in ("dropout_rate", "attention_dropout_rate"):
    check(field, lambda v: _is_number(v) and 0.0 <= v < 1.0, "must be a number in [0, 1)")
  check("layer_norm_epsilon", lambda v: _is_number(v) and 0.0 <= v <= 1.0,
        "must be a number in [0, 1]")
  for field in _BOOLS:
    check(field, lambda v: isinstance(v, bool), "must be true or false")
  for field, choices in _CHOICES.items():
    check(field, lambda v: isinstance(v, (str, type(None))) and v in choices,
          f"must be one of {choices} (the first is the default)")
  for field in ("pad_id", "eos_id", "bos_id"):
    check(field, lambda v: _is_int(v) and 0 <= v < config.vocab_size,
          f"must be a token id in [0, vocab_size={config.vocab_size})")
  # Forcing cuDNN where it cannot run fails here, not deep inside a jit trace.
  cudnn = cudnn_problem(config.dtype, config.head_dim, config.attention_dropout_rate,
                         max_head_dim=256) if config.attention_implementation == "cudnn" else None
  check("attention_implementation", lambda v: cudnn is None,
        f"{cudnn}; change that, or set attention_implementation=None (cuDNN where "
        "it applies, else XLA) or 'xla'")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))
