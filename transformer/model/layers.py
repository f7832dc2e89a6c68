"""Building blocks tuned for speed, each computing exactly what a flax / JAX piece
computes, with the same parameters, so that `model.py` reads as the paper and a
checkpoint does not care which is used.

  piece                   matches exactly                    why it exists (measured on CPU)
  Dense                   flax.linen.DenseGeneral            gradients as 2-D matrix products:
                          (names, shapes, initial values)    no transposed copies of W, dy or x;
                                                             base-model step 7-8% faster
  layer_norm, LayerNorm   flax.linen.LayerNorm (float32)     a written-out VJP whose row means are
                                                             matrix-vector products; step ~5% faster
  tied_output_projection  jnp.einsum("...d,vd->...v") and    the embedding's gradient as (y^T g)^T:
                          its autodiff                       1.5x faster than XLA's g^T y + copy
  Dropout                 flax.linen.Dropout, mask for mask  the mask hashed inside the kernel that
                          (same "dropout" RNG stream)        applies it (prng.py): 3-4x faster
  stack_layers,           N layers applied in turn (a        `scan`: one compiled layer, compile time
  run_layers              Python loop over a list)           flat in depth; `remat`: less memory

Each is tested against the piece it matches (tests/test_layers.py, tests/test_prng.py;
the stacks: tests/test_model.py, scan and remat against the plain loop).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model import prng

Array = jax.Array


class Dense(nn.Module):
  """y = x W + b, contracting the last `in_dims` axes of x with the first of W.

  `flax.linen.DenseGeneral`'s parameters (names, shapes, initialisation: the
  kernel is initialised as a `[prod(in), prod(features)]` matrix and reshaped),
  computed as one matrix product of x flattened to `[tokens, prod(in)]` with W
  flattened to `[prod(in), prod(features)]`. Why: for a multi-axis kernel such
  as W^Q `[d_model, heads, d_k]`, the gradients dx = dy W^T and dW = x^T dy
  contract several axes at once, and XLA first copies W, dy or x transposed
  to bring them to matrix form; as 2-D products they need no copy (on CPU
  the base model's training step had ~200 such copies).

  With `matmul_dtype` (e.g. bfloat16), x and W enter the product in that
  dtype and it sums in `dtype`: on a CPU with AVX512-BF16 a bfloat16 product
  runs about twice as fast as a float32 one (decoding 1.2-1.4x faster with
  the same BLEU, docs/benchmarks.md); a W already stored so is not cast again.

  Shapes: x `[..., *in]` -> `[..., *features]`, where `in` = x.shape[-in_dims:].
  """

  features: int | tuple[int, ...]
  in_dims: int = 1
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  matmul_dtype: Any = None
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.zeros

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    in_shape = x.shape[x.ndim - self.in_dims:]
    fan_in, fan_out = math.prod(in_shape), math.prod(features)
    kernel = self.param(
        "kernel", lambda rng, shape, dtype: self.kernel_init(
            rng, (fan_in, fan_out), dtype).reshape(shape),
        in_shape + features, self.param_dtype)
    bias = self.param(
        "bias", lambda rng, shape, dtype: self.bias_init(
            rng, (fan_out,), dtype).reshape(shape),
        features, self.param_dtype)
    product = self.matmul_dtype or self.dtype
    y = jnp.dot(x.reshape(-1, fan_in).astype(product),
                kernel.reshape(fan_in, fan_out).astype(product), preferred_element_type=self.dtype)
    y = y + bias.reshape(fan_out).astype(self.dtype)
    return y.reshape(x.shape[:x.ndim - self.in_dims] + features)


def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
  """Layer normalisation (Ba et al., 2016) over the last axis, in float32:
  x_hat = (x - mean) / sqrt(var + epsilon), y = x_hat * scale + bias.

  Autodiff's gradients, written out (with g the output's gradient, s = scale):
      dx = (g s - mean(g s) - x_hat mean(g s x_hat)) / sqrt(var + epsilon),
      dscale = sum over positions of g x_hat,  dbias = sum of g,
  where the two row means are matrix-vector products, g @ s and (g x_hat) @ s.
  Why: XLA on CPU hands a row reduction of g * s to YNNPACK, which cannot
  broadcast s itself, so every LayerNorm backward first wrote s broadcast to
  the activations' size; this VJP made the base model's CPU step ~5% faster.

  Shapes: x `[..., d]`, scale and bias `[d]` -> float32 `[..., d]`. The casts
  to float32 sit outside the custom VJP, so autodiff returns each gradient in
  its input's dtype (bfloat16 activations, float32 parameters).
  """
  f32 = lambda a: a.astype(jnp.float32)
  return _layer_norm_float32(f32(x), f32(scale), f32(bias), epsilon)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_float32(x, scale, bias, epsilon):
  return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
  centred = x - x.mean(-1, keepdims=True)
  inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, -1, keepdims=True) + epsilon)
  x_hat = centred * inv_std
  return x_hat * scale + bias, (x_hat, inv_std, scale)


def _layer_norm_bwd(epsilon, residuals, g):
  del epsilon
  x_hat, inv_std, scale = residuals
  d = x_hat.shape[-1]
  g_x_hat = g * x_hat
  # Row means written as matrix-vector products: on TPUs (bfloat16 passes by
  # default) and GPUs (TF32) a float32 dot is not a float32 sum unless asked.
  highest = jax.lax.Precision.HIGHEST
  mean_gs = jnp.dot(g, scale, precision=highest)[..., None] / d
  mean_gs_x_hat = jnp.dot(g_x_hat, scale, precision=highest)[..., None] / d
  dx = inv_std * (g * scale - mean_gs - x_hat * mean_gs_x_hat)
  positions = tuple(range(g.ndim - 1))
  return dx, g_x_hat.sum(positions), g.sum(positions)


_layer_norm_float32.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.Module):
  """`layer_norm` with learned `scale` (ones) and `bias` (zeros): the same
  parameters as `flax.linen.LayerNorm`, so checkpoints carry over.
  Statistics and output in float32 even when computing in bfloat16."""

  epsilon: float = 1e-6
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (x.shape[-1],)
    scale = self.param("scale", nn.initializers.ones, features, self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, features, self.param_dtype)
    return layer_norm(x, scale, bias, self.epsilon)


@jax.custom_vjp
def tied_output_projection(y: Array, embedding: Array) -> Array:
  """The pre-softmax linear transformation with the embedding's weights:
  `y` `[..., d_model]` x `embedding` `[vocab, d_model]` -> `[..., vocab]` (y E^T).

  Plain autodiff, but the embedding's gradient is computed as (y^T g)^T: XLA
  otherwise folds the transpose into the matmul, computes g^T y, and first
  copies the whole `[tokens, vocab]` gradient g transposed. y^T g measured 1.5x
  faster than g^T y on CPU (`[2048, 8192]` g: 187 vs 132 GFLOP/s).
  """
  return jnp.einsum("...d,vd->...v", y, embedding)


def _tied_output_projection_fwd(y, embedding):
  return tied_output_projection(y, embedding), (y, embedding)


def _tied_output_projection_bwd(residuals, g):
  y, embedding = residuals
  # As 2-D products: contracting [batch, length] at once would first copy y
  # transposed (see `Dense`).
  y2, g2 = y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])
  d_y = jnp.dot(g2, embedding).reshape(y.shape)
  d_embedding_t = jnp.dot(y2.T, g2)  # [d_model, vocab]
  # The barrier keeps XLA from rewriting transpose(y^T g) back into g^T y.
  return d_y, jax.lax.optimization_barrier(d_embedding_t).T


tied_output_projection.defvjp(_tied_output_projection_fwd, _tied_output_projection_bwd)


class Dropout(nn.Module):
  """`flax.linen.Dropout`, mask for mask (same random bits from the same
  "dropout" RNG), with the mask hashed in the same fused kernel that applies it
  (`prng.dropout`: 3-4x faster on CPU, where JAX lowers its Threefry hash as a
  loop). Keep the class name: flax names an unnamed instance `Dropout_0`, and
  the RNG stream follows the module's path."""

  rate: float
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    if self.deterministic or self.rate == 0.0:
      return x
    return prng.dropout(x, self.rate, self.make_rng("dropout"))


def stack_layers(layer_cls, scanned_cls, num_layers: int, args: tuple, *, scan: bool,
                 remat: bool, scan_methods: dict):
  """N identical layers `layer_cls(*args)`: a Python list (parameters
  `layers_0`, `layers_1`, ... when assigned to `self.layers` in `setup`), or
  with `scan` one `scanned_cls(*args)` under nn.scan (parameters `layers`,
  stacked on axis 0): compiled once, so compile time stays flat in depth.
  `scanned_cls` is `layer_cls` in nn.scan's (carry, ...) -> (carry, output)
  form; `scan_methods` names its methods with their `in_axes`. With `remat`,
  each layer's activations are recomputed in the backward pass (less memory)."""
  cls = scanned_cls if scan else layer_cls
  if remat:  # under nn.scan, CSE cannot merge the recomputation anyway
    cls = nn.remat(cls, prevent_cse=not scan)
  if not scan:
    return [cls(*args) for _ in range(num_layers)]
  common = dict(variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True}, length=num_layers)
  methods = {name: dict(common, **axes) for name, axes in scan_methods.items()}
  return nn.scan(cls, methods=methods)(*args)


def run_layers(layers, scan: bool, x: Array, *args) -> Array:
  """x through every layer of `stack_layers`, each also given `args`."""
  if scan:
    return layers(x, *args)[0]
  for layer in layers:
    x = layer(x, *args)
  return x
