"""Model FLOPs and the peak they are measured against: model FLOPs utilisation
(MFU) = model FLOPs per step x steps per second / peak FLOP/s.

The FLOP model counts the matrix multiplications of the paper's Transformer
(`training_flops_per_step`: 6 x matmul weights x the tokens they act on, plus
attention's QK^T and AV). The peak is measured on CPU (`matmul_rate`: a
2048^3 float32 matmul, best of a few) and, on GPUs and TPUs, the device's rated
dense bfloat16 peak (`rated_peak`) where its kind is known. train.py logs MFU
with every training window; benchmarks/bench_train.py uses the same functions.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from transformer.model.transformer import TransformerConfig

# Dense bfloat16 peak FLOP/s per device, from the vendors' data sheets; matched
# against `device.device_kind` (lower case, first match wins).
RATED_PEAKS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12), ("h100", 989e12),      # SXM; the PCIe H100 is 756e12
    ("a100", 312e12), ("l4", 121e12), ("a10", 125e12),
    ("v6", 918e12), ("v5p", 459e12), ("v5 lite", 197e12), ("v5e", 197e12),
    ("v4", 275e12), ("v3", 123e12),
)


def matmul_weights(config: TransformerConfig) -> dict[str, int]:
  """Matmul weight counts (no biases, LayerNorm or embedding lookups): per
  encoder layer; per decoder layer, split into the weights that act on target
  positions and the cross-attention W^K, W^V that act on the source (encoder
  output); and the output projection."""
  d, f = config.d_model, config.d_ff
  attention = 4 * d * d            # W^Q, W^K, W^V, W^O
  ffn = 2 * d * f                  # W_1, W_2
  return {"encoder_layer": attention + ffn,
          "decoder_layer_on_target": attention + 2 * d * d + ffn,  # self; cross W^Q, W^O
          "decoder_layer_on_source": 2 * d * d,                  # cross W^K, W^V
          "output_projection": d * config.vocab_size}


def forward_flops(config: TransformerConfig, batch: int, src_len: int,
                  tgt_len: int) -> int:
  """Model FLOPs of one forward pass (teacher forcing, logits over all targets).

    2 * W_enc * N_enc * (batch * src_len)           encoder layer weights x source tokens
  + 2 * W_dec * N_dec * (batch * tgt_len)           decoder layer weights x target tokens
  + 2 * W_mem * N_dec * (batch * src_len)           cross-attention W^K, W^V x source tokens
  + 2 * d_model * vocab * (batch * tgt_len)         output projection x target tokens
  + batch * 4 * d_model * (N_enc * src^2            attention scores QK^T and AV,
                           + N_dec * tgt^2          2 * 2 * len_q * len_k * d_model
                           + N_dec * tgt * src)     per layer and sequence

  with W_enc = 4 d^2 + 2 d d_ff, W_dec = 6 d^2 + 2 d d_ff, W_mem = 2 d^2 (matmul weights only,
  a multiply-add counted as 2 FLOPs). The decoder self-attention is counted as
  the full tgt x tgt square, with no discount for the causal mask (the kernels
  compute the whole square). Embedding lookups, biases, LayerNorm, softmax and
  the loss count 0.
  """
  w = matmul_weights(config)
  n_enc, n_dec = config.num_encoder_layers, config.num_decoder_layers
  src_tokens, tgt_tokens = batch * src_len, batch * tgt_len
  dense = 2 * (w["encoder_layer"] * n_enc * src_tokens
               + w["decoder_layer_on_target"] * n_dec * tgt_tokens
               + w["decoder_layer_on_source"] * n_dec * src_tokens
               + w["output_projection"] * tgt_tokens)
  attention = batch * 4 * config.d_model * (
      n_enc * src_len * src_len + n_dec * tgt_len * tgt_len + n_dec * tgt_len * src_len)
  return int(dense + attention)


def decoding_flops(config: TransformerConfig, source_lengths: Sequence[int],
                   target_lengths: Sequence[int], hypotheses: int = 1) -> int:
  """Model FLOPs of translating sentences with a key/value cache: what any
  engine must compute for them, whatever its batching (the padding and the
  finished rows a batch carries count 0). Per sentence of s source and t
  target tokens (each counting its EOS):

    2 * W_enc * N_enc * s + 2 * W_mem * N_dec * s   the source: encoder layers and
                                                    cross-attention W^K, W^V, once
  + 4 * d_model * N_enc * s^2                       encoder self-attention QK^T, AV
  + h * (2 * (W_dec * N_dec + d_model * vocab) * t  each hypothesis: a decoder step per
         + 4 * d_model * N_dec * (t (t + 1) / 2     token, self-attention over the
                                  + t * s))         tokens so far and cross over s

  with `forward_flops`' weight counts; h = `hypotheses` (beam search: the
  beam, each hypothesis counted as long as the output, a lower bound).
  """
  w = matmul_weights(config)
  n_enc, n_dec, d = config.num_encoder_layers, config.num_decoder_layers, config.d_model
  total = 0
  for s, t in zip(source_lengths, target_lengths, strict=True):
    source = 2 * (w["encoder_layer"] * n_enc + w["decoder_layer_on_source"] * n_dec) * s
    source += 4 * d * n_enc * s * s
    step = 2 * (w["decoder_layer_on_target"] * n_dec + w["output_projection"])
    target = step * t + 4 * d * n_dec * (t * (t + 1) // 2 + t * s)
    total += source + hypotheses * target
  return int(total)


def training_flops_per_step(config: TransformerConfig, batch: int, src_len: int,
                            tgt_len: int) -> int:
  """Model FLOPs of one training step: forward + backward = 3 x forward.

    6 * (W_enc * N_enc * batch * src_len
         + W_dec * N_dec * batch * tgt_len
         + W_mem * N_dec * batch * src_len
         + d_model * vocab * batch * tgt_len)
  + 3 * batch * 4 * d_model * (N_enc * src^2 + N_dec * tgt^2 + N_dec * tgt * src)

  i.e. 6 x (matmul weights) x (tokens they act on) plus 3 x the forward
  attention-score and attention-value matmuls (QK^T and AV, 2 x 2 x len_q x
  len_k x d_model each layer and sequence: encoder self, decoder self, decoder
  cross). Decoder self-attention counts the full square, without a causal
  discount. See `forward_flops`; embedding lookups count 0, so do the optimizer
  update, biases, LayerNorm and softmax.
  """
  return 3 * forward_flops(config, batch, src_len, tgt_len)


def matmul_rate(n: int = 2048, repeats: int = 2, dtype=jnp.float32) -> float:
  """FLOP/s of an n x n x n float32 matmul right now (best of `repeats`): the
  peak, re-measured next to each timing so both see the same neighbours."""
  a = jnp.ones((n, n), dtype)
  dot = jax.jit(jnp.dot)
  jax.block_until_ready(dot(a, a))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(dot(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def rated_peak(device=None) -> float | None:
  """The rated dense bfloat16 FLOP/s of `device` (default: the first one), or
  None for CPUs and kinds not in RATED_PEAKS."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None
  kind = device.device_kind.lower()
  return next((peak for name, peak in RATED_PEAKS if name in kind), None)


@functools.cache
def peak_flops() -> tuple[float, str]:
  """(peak FLOP/s of the whole run, how it was had), MFU's denominator. CPU:
  a float32 matmul measured on this machine (`matmul_rate`, 0.4-0.6 s on 2
  cores; simulated CPU devices share its cores, so it is not multiplied by
  them), once per process: later runs of the process (a notebook's) divide
  by the peak its first run measured (the benchmarks time theirs beside
  each measurement: `matmul_rate`).
  GPU/TPU: the rated peak of every device (`rated_peak`), or for a kind not
  listed a bfloat16 matmul measured on one device, times the device count."""
  device, count = jax.devices()[0], jax.device_count()
  if device.platform == "cpu":
    return matmul_rate(), "float32 matmul peak of this machine, measured (2048^3)"
  rated = rated_peak(device)
  if rated is not None:
    return rated * count, f"rated bfloat16 peak of {count} x {device.device_kind}"
  return (matmul_rate(4096, repeats=5, dtype=jnp.bfloat16) * count,
          f"bfloat16 matmul peak measured on one {device.device_kind} (4096^3), x {count}")
