"""Tests of transformer/model/layers.py: each speed kernel against the flax / JAX piece
it matches (parameters) and against float64 numpy or autodiff (values, gradients).
Dropout is tested in test_prng.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import layers as L


def test_tied_output_projection_gradients_match_numpy():
  """The custom VJP of y E^T against the matrix-calculus gradients in numpy:
  d/dy <g, y E^T> = g E and d/dE <g, y E^T> = g^T y (over all positions)."""
  rng = np.random.default_rng(0)
  y = rng.standard_normal((3, 5, 8)).astype(np.float32)
  embedding = rng.standard_normal((11, 8)).astype(np.float32)
  g = rng.standard_normal((3, 5, 11)).astype(np.float32)
  logits, vjp = jax.vjp(L.tied_output_projection, jnp.asarray(y), jnp.asarray(embedding))
  np.testing.assert_allclose(logits, y @ embedding.T, rtol=1e-5, atol=1e-5)
  d_y, d_embedding = vjp(jnp.asarray(g))
  np.testing.assert_allclose(d_y, g @ embedding, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(d_embedding, g.reshape(-1, 11).T @ y.reshape(-1, 8),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("features,in_dims,x_shape", [
    ((4, 8), 1, (2, 5, 24)),   # W^Q / W^K / W^V: [d_model, heads, d_k]
    (24, 2, (2, 5, 4, 8)),     # W^O: [heads, d_v, d_model]
    (7, 1, (6, 12)),           # a plain matrix, e.g. the FFN's W_1
])
def test_dense_is_flax_dense_general_and_its_gradients_match_numpy(features, in_dims, x_shape):
  """`Dense` keeps `nn.DenseGeneral`'s parameters (names, shapes, the same
  initial values from the same key), so checkpoints carry over; its output
  and gradients are the matrix-calculus ones, in float64 numpy."""
  import flax.linen as nn
  x = jax.random.normal(jax.random.key(1), x_shape)
  ours = L.Dense(features, in_dims=in_dims, bias_init=nn.initializers.normal(1.0))
  axis = tuple(range(-in_dims, 0)) if in_dims > 1 else -1
  flax_dense = nn.DenseGeneral(features, axis=axis, kernel_init=nn.initializers.xavier_uniform(),
                               bias_init=nn.initializers.normal(1.0))
  params = ours.init(jax.random.key(2), x)
  reference_params = flax_dense.init(jax.random.key(2), x)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, reference_params)

  kernel = np.asarray(params["params"]["kernel"], np.float64)
  bias = np.asarray(params["params"]["bias"], np.float64)
  fan_in = int(np.prod(x_shape[len(x_shape) - in_dims:]))
  x2 = np.asarray(x, np.float64).reshape(-1, fan_in)
  w2, b2 = kernel.reshape(fan_in, -1), bias.reshape(-1)
  out, vjp = jax.vjp(lambda p, x: ours.apply(p, x), params, x)
  np.testing.assert_allclose(np.asarray(out).reshape(len(x2), -1), x2 @ w2 + b2, rtol=1e-5, atol=1e-5)
  g = np.random.default_rng(3).standard_normal(out.shape)
  d_params, d_x = vjp(jnp.asarray(g, jnp.float32))
  g2 = g.reshape(len(x2), -1)
  np.testing.assert_allclose(np.asarray(d_x).reshape(x2.shape), g2 @ w2.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(d_params["params"]["kernel"]).reshape(w2.shape),
                             x2.T @ g2, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(d_params["params"]["bias"]).reshape(-1),
                             g2.sum(0), rtol=1e-5, atol=1e-5)


def test_dense_with_a_matmul_dtype_multiplies_in_it_and_sums_in_float32():
  """`Dense(matmul_dtype=bfloat16)` (decoding with bfloat16 weights): x and W
  rounded to bfloat16, their products summed in float32 (float64 numpy of the
  rounded values, which a float32 product misses, and so does a sum kept in
  bfloat16 over 1,024 terms); a W stored in bfloat16 gives the same."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((6, 1024)), jnp.float32)
  dense = L.Dense(8, matmul_dtype=jnp.bfloat16, bias_init=jax.nn.initializers.normal(1.0))
  params = dense.init(jax.random.key(0), x)
  kernel, bias = params["params"]["kernel"], params["params"]["bias"]
  rounded = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  expected = rounded(x) @ rounded(kernel) + np.asarray(bias, np.float64)
  with jax.default_matmul_precision("highest"):
    out = dense.apply(params, x)
    stored = dense.apply({"params": {"kernel": kernel.astype(jnp.bfloat16), "bias": bias}}, x)
    float32 = L.Dense(8).apply(params, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(stored, out)
  assert np.abs(np.asarray(float32, np.float64) - expected).max() > 1e-3


def test_layer_norm_matches_numpy_and_its_gradients_match_autodiff():
  """`layer_norm`'s forward against float64 numpy, its hand-written VJP against
  JAX's autodiff of the textbook formula, and `LayerNorm`'s parameters against
  `flax.linen.LayerNorm`'s (same names, shapes and initial values)."""
  import flax.linen as nn
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 16)).astype(np.float32) * 3 + 1
  scale = rng.standard_normal(16).astype(np.float32)
  bias = rng.standard_normal(16).astype(np.float32)
  eps = 1e-6
  x64 = x.astype(np.float64)
  x_hat = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + eps)
  out, vjp = jax.vjp(lambda x, s, b: L.layer_norm(x, s, b, eps), x, scale, bias)
  np.testing.assert_allclose(out, x_hat * scale + bias, rtol=1e-5, atol=1e-5)

  def textbook(x, s, b):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * s + b
  g = rng.standard_normal(x.shape).astype(np.float32)
  _, reference_vjp = jax.vjp(textbook, x, scale, bias)
  for ours, reference in zip(vjp(g), reference_vjp(g)):
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)

  params = L.LayerNorm().init(jax.random.key(0), x)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params,
                         nn.LayerNorm().init(jax.random.key(0), x))


def test_layer_norm_gradient_row_means_ask_for_highest_precision():
  """The VJP's two matrix-vector products are row sums: on TPUs / GPUs a
  float32 dot at default precision is a bfloat16 / TF32 one. Every dot of the
  backward pass must carry Precision.HIGHEST, whatever the default is."""
  x = jnp.ones((4, 8), jnp.float32)
  scale, bias = jnp.ones((8,)), jnp.zeros((8,))
  grad = jax.grad(lambda x, s, b: L.layer_norm(x, s, b, 1e-6).sum(), argnums=(0, 1, 2))
  with jax.default_matmul_precision("default"):
    jaxpr = jax.make_jaxpr(grad)(x, scale, bias)
  dots = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        dots.append(eqn.params["precision"])
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)
  walk(jaxpr.jaxpr)
  assert len(dots) == 2, dots
  highest = jax.lax.Precision.HIGHEST
  assert all(p == (highest, highest) for p in dots), dots


def test_the_suite_runs_at_highest_matmul_precision():
  """conftest.py pins it, so that numpy comparisons hold on TF32 / bfloat16 MXUs."""
  assert jax.config.jax_default_matmul_precision == "highest"
