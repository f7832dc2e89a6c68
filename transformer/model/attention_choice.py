"""Which code computes the Transformer's attention, Equation (1), on this
machine: cuDNN's flash attention or XLA's (both through
`jax.nn.dot_product_attention`), or the einsums of
`model.scaled_dot_product_attention`.

The choice: cuDNN on an NVIDIA GPU from Ampere on, for bfloat16/float16 and
the shapes and masks it takes (the constraints of
jax/_src/cudnn/fused_attention_stablehlo.py, 0.10.2), XLA on other GPUs and
for float32, the einsums on CPU (measured faster there) and TPU. cuDNN's
first GPU check (H200, JAX 0.11.2, 2026-11-26) found non-finite gradients
for padding queries, the rows whose every key is masked; a query that sees
no key now sees every key when cuDNN runs (`scaled_dot_product_attention`),
which made it pass `benchmarks/accelerator_check.py`; it then trained
wmt14_base's batch 1.20x faster than XLA (docs/what-runs-where.md).
`attention_implementation_name` says which in one line for the log.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def attention_backend() -> str:
  """This machine as `choose_attention_implementation` sees it: "gpu" for an
  NVIDIA GPU on which cuDNN's flash attention runs (compute capability 8.0,
  Ampere, or newer), "gpu-without-cudnn" for other GPUs (AMD, older NVIDIA),
  otherwise `jax.default_backend()` ("cpu", "tpu")."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  device = jax.local_devices()[0]
  try:
    major = int(device.compute_capability.split(".")[0])  # "8.0", "9.0", "10.0"
  except (AttributeError, ValueError):
    major = 0
  cuda = "cuda" in device.client.platform_version.lower()
  return "gpu" if cuda and major >= 8 else "gpu-without-cudnn"


def cudnn_problem(dtype, head_dim: int, attention_dropout_rate: float = 0.0,
                   max_head_dim: int = 128) -> str | None:
  """Why cuDNN's flash attention, as JAX 0.10's `jax.nn.dot_product_attention`
  reaches it (jax/_src/cudnn/fused_attention_stablehlo.py), cannot compute this
  attention; None when it can. Head dimensions up to 256 run from Hopper on,
  up to 128 everywhere; so `max_head_dim` is 128 when choosing for the user."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return (f"needs dtype='bfloat16' or 'float16' (cuDNN has no float32 kernel), "
            f"got dtype={jnp.dtype(dtype).name!r}")
  if head_dim % 8 or head_dim > max_head_dim:
    return (f"needs head_dim = d_model / num_heads a multiple of 8 and at most "
            f"{max_head_dim}, got {head_dim}")
  if attention_dropout_rate > 0:
    return (f"has no attention dropout (jax.nn.dot_product_attention takes no "
            f"dropout), got attention_dropout_rate={attention_dropout_rate}")
  return None


def choose_attention_implementation(
    requested: str | None, *, backend: str, dtype, head_dim: int,
    dropout: bool = False, return_weights: bool = False,
    odd_masked_length: bool = False) -> str:
  """Which code computes Equation (1): "cudnn" or "xla" (that implementation of
  `jax.nn.dot_product_attention`), or "einsum" (the einsums of
  `scaled_dot_product_attention`).

  Args:
    requested: `TransformerConfig.attention_implementation`: "xla" or "cudnn"
      is what runs (cuDNN falls back to XLA for `odd_masked_length`); None
      chooses by `backend` (`attention_backend()`'s names): on "gpu", cuDNN
      where it applies (bfloat16 or float16 `dtype`, `head_dim` a multiple of
      8 up to 128, no `odd_masked_length`) and XLA otherwise; XLA on any other
      GPU; the einsums on CPU (measured faster than XLA's
      dot_product_attention there) and, as before, on TPU.
    dropout, return_weights: the attention weights are dropped out or returned;
      only the einsums have them as an array, whatever is requested.
    odd_masked_length: a mask with an odd query or key length: JAX 0.10 turns
      the mask into a bias, and cuDNN's backward pass with a bias refuses odd
      lengths, so cuDNN (requested or chosen) falls back to XLA.
  """
  if dropout or return_weights:
    return "einsum"
  if requested == "cudnn" and odd_masked_length:
    return "xla"
  if requested is not None:
    return requested
  if backend == "gpu" and not odd_masked_length and cudnn_problem(dtype, head_dim) is None:
    return "cudnn"
  return "xla" if backend.startswith("gpu") else "einsum"


_IMPLEMENTATION_NAMES = {
    "cudnn": "cuDNN flash attention (jax.nn.dot_product_attention, implementation='cudnn')",
    "xla": "XLA (jax.nn.dot_product_attention, implementation='xla')",
    "einsum": "einsums (model.scaled_dot_product_attention)"}


def attention_implementation_name(config,
                                  backend: str | None = None) -> str:
  """One line for the log: which code computes attention for `config` on
  `backend` (`attention_backend()` names; None: this machine), and why not
  cuDNN where a GPU falls back to XLA. Incremental decoding steps are not
  covered: they attend with kv_cache's own einsums."""
  backend = attention_backend() if backend is None else backend
  choose = functools.partial(choose_attention_implementation, config.attention_implementation,
                             backend=backend, dtype=config.dtype, head_dim=config.head_dim)
  chosen = choose()
  line = (f"attention on {backend} ({config.dtype}, head_dim {config.head_dim}): "
          f"{_IMPLEMENTATION_NAMES[chosen]}")
  if chosen == "cudnn":
    line += "; XLA for an odd length under a mask"
  if config.attention_implementation is None and chosen == "xla" and backend == "gpu":
    line += f"; not cuDNN, which {cudnn_problem(config.dtype, config.head_dim)}"
  if config.attention_dropout_rate > 0 and chosen != choose(dropout=True):
    line += (f"; training steps: einsums (attention_dropout_rate="
             f"{config.attention_dropout_rate} drops out the weights)")
  return line
