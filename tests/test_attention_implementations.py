"""Which code computes attention (model.choose_attention_implementation) and
that the fused path agrees with the einsums and with float64 numpy.

cuDNN's kernel itself needs an NVIDIA GPU (compute capability >= 8.0) and is
not run here. On CPU the machine is faked to be such a GPU
(`model.attention_backend`), and `jax.nn.dot_product_attention` is wrapped
to record what it is asked for and to run XLA where cuDNN is asked: so the
choice, the mask handed over (packed segments, fully padded rows) and the
fused path's numbers are all checked, the kernel alone is not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import attention_choice
from transformer.model import transformer as M

TINY = dict(vocab_size=40, d_model=32, num_heads=4, d_ff=64,
            num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)

# Tolerances. float32: both paths and the float64 reference agree to ~1e-6 at
# the suite's "highest" matmul precision (conftest.py); 1e-5 leaves room.
# bfloat16: inputs are rounded to bfloat16 before the float64 reference sees
# them, so what is left is bfloat16 rounding of Q/sqrt(d_k) (einsums), of the
# weights before P V, and of the output: ~2^-8 relative; on unit-normal data
# (outputs and gradients up to ~3) the errors measured at most 0.014.
TOL = {"float32": 1e-5, "bfloat16": 3e-2}

SEGMENTS = np.array([[1, 1, 1, 2, 2, 0, 0, 0],    # two examples packed, then padding
                     [1, 1, 2, 2, 2, 2, 3, 3],    # three packed, no padding
                     [0, 0, 0, 0, 0, 0, 0, 0]])   # a row of padding only
TARGET_SEGMENTS = np.array([[1, 1, 2, 2, 0, 0],
                            [1, 2, 2, 3, 3, 3],
                            [0, 0, 0, 0, 0, 0]])


def masks(kind):
  """(mask or None, q_length, kv_length) for a kind of attention of the model."""
  seg, tgt = jnp.asarray(SEGMENTS), jnp.asarray(TARGET_SEGMENTS)
  if kind == "none":
    return None, 8, 8
  if kind == "packed":             # encoder self-attention
    return M.attention_mask(seg, seg), 8, 8
  if kind == "causal":             # decoder self-attention
    return M.attention_mask(seg, seg, causal=True), 8, 8
  if kind == "cross":              # decoder -> encoder: q_length 6, kv_length 8
    return M.attention_mask(tgt, seg), 6, 8
  if kind == "keys_only":          # broadcast over queries: [batch, 1, 1, kv_length]
    return (seg > 0)[:, None, None, :], 8, 8
  raise ValueError(kind)


# --------------------------------------------------------------------------
# float64 numpy reference: softmax(Q K^T / sqrt(d)) V and its gradients
# --------------------------------------------------------------------------


def np_attention_and_grads(q, k, v, mask, cotangent):
  """q [b, tq, h, d], k, v [b, tk, h, d], mask broadcastable to [b, h, tq, tk]
  or None, cotangent like the output (float64). A query row with no visible
  key gets uniform weights, and hidden scores are constants (no gradient).
  -> (out, (dq, dk, dv)) of sum(out * cotangent)."""
  q, k, v, g = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, cotangent))
  d = q.shape[-1]
  scores = q @ k.swapaxes(-1, -2) / np.sqrt(d)                     # [b, h, tq, tk]
  visible = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(
      np.asarray(mask), scores.shape)
  scores = np.where(visible, scores, -np.inf)
  no_key = ~visible.any(-1, keepdims=True)
  scores = np.where(no_key, 0.0, scores)                           # uniform weights
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = p @ v
  dv = p.swapaxes(-1, -2) @ g
  dp = g @ v.swapaxes(-1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  ds = np.where(visible, ds, 0.0)                                  # constants: no gradient
  dq = ds @ k / np.sqrt(d)
  dk = ds.swapaxes(-1, -2) @ q / np.sqrt(d)
  back = lambda a: a.transpose(0, 2, 1, 3)
  return back(out), tuple(back(a) for a in (dq, dk, dv))


def test_numpy_reference_matches_finite_differences():
  """The reference's analytic gradients, checked once by central differences."""
  rng = np.random.default_rng(0)
  mask, tq, tk = masks("causal")
  mask = np.asarray(mask)
  q, k, v, g = (rng.normal(size=(3, t, 2, 8)) for t in (tq, tk, tk, tq))
  _, grads = np_attention_and_grads(q, k, v, mask, g)
  loss = lambda q, k, v: (np_attention_and_grads(q, k, v, mask, g)[0] * g).sum()
  eps = 1e-6
  for which, x in enumerate((q, k, v)):
    for index in [(0, 1, 0, 3), (1, 4, 1, 0), (0, 6, 1, 7), (2, 2, 0, 5)]:
      up, down = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
      up[which][index] += eps
      down[which][index] -= eps
      numeric = (loss(*up) - loss(*down)) / (2 * eps)
      np.testing.assert_allclose(grads[which][index], numeric, atol=1e-6)


# --------------------------------------------------------------------------
# Faking the machine; recording what jax.nn.dot_product_attention is asked
# --------------------------------------------------------------------------


@pytest.fixture
def fused_calls(monkeypatch):
  """Records the `implementation` and mask shape of every call of
  `jax.nn.dot_product_attention`, and runs XLA where cuDNN is asked (this
  machine has no cuDNN): the list of (implementation, mask shape or None)."""
  calls = []
  real = jax.nn.dot_product_attention

  def recording(query, key, value, *args, mask=None, implementation=None, **kwargs):
    calls.append((implementation, None if mask is None else tuple(mask.shape)))
    if implementation == "cudnn":
      # What cuDNN accepts: a bias of the full [.., q_length, kv_length].
      assert mask is None or mask.shape[-2:] == (query.shape[1], key.shape[1])
      implementation = "xla"
    return real(query, key, value, *args, mask=mask, implementation=implementation, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  return calls


def fake_backend(monkeypatch, backend):
  monkeypatch.setattr(M, "attention_backend", lambda: backend)  # what the model calls
  monkeypatch.setattr(attention_choice, "attention_backend", lambda: backend)


def inputs(dtype, tq, tk, seed=0, heads=2, head_dim=8):
  """Random q, k, v and an output cotangent, rounded to `dtype` (numpy float64
  copies of the rounded values feed the reference)."""
  rng = np.random.default_rng(seed)
  arrays = [jnp.asarray(rng.normal(size=(3, t, heads, head_dim)), dtype)
            for t in (tq, tk, tk, tq)]
  return arrays, [np.asarray(a.astype(jnp.float32), np.float64) for a in arrays]


def attention_and_grads(q, k, v, mask, g, implementation):
  """Output and d/d(q, k, v) of sum(out * g) through scaled_dot_product_attention."""
  def loss(q, k, v):
    out, _ = M.scaled_dot_product_attention(q, k, v, mask, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out
  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


# --------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------


@pytest.mark.parametrize("requested,backend,dtype,head_dim,extra,expected", [
    (None, "gpu", "bfloat16", 64, {}, "cudnn"),
    (None, "gpu", "float16", 128, {}, "cudnn"),
    (None, "gpu", "float32", 64, {}, "xla"),                  # cuDNN: no float32 kernel
    (None, "gpu", "bfloat16", 64, {"dropout": True}, "einsum"),  # jax.nn has no dropout
    (None, "gpu", "bfloat16", 64, {"return_weights": True}, "einsum"),
    (None, "gpu", "bfloat16", 12, {}, "xla"),                 # not a multiple of 8
    (None, "gpu", "bfloat16", 256, {}, "xla"),                # > 128: Hopper only
    (None, "gpu", "bfloat16", 64, {"odd_masked_length": True}, "xla"),
    (None, "gpu-without-cudnn", "bfloat16", 64, {}, "xla"),   # AMD, NVIDIA < Ampere
    (None, "cpu", "bfloat16", 64, {}, "einsum"),
    (None, "cpu", "float32", 64, {}, "einsum"),
    (None, "tpu", "bfloat16", 64, {}, "einsum"),
    ("xla", "cpu", "float32", 64, {}, "xla"),
    ("xla", "gpu", "bfloat16", 64, {}, "xla"),
    ("cudnn", "gpu", "bfloat16", 256, {}, "cudnn"),
    ("cudnn", "gpu", "bfloat16", 64, {"odd_masked_length": True}, "xla"),
    ("cudnn", "gpu", "bfloat16", 64, {"return_weights": True}, "einsum"),
])
def test_choice_table(requested, backend, dtype, head_dim, extra, expected):
  assert attention_choice.choose_attention_implementation(
      requested, backend=backend, dtype=jnp.dtype(dtype), head_dim=head_dim,
      **extra) == expected


def _device(capability, platform_version):
  client = type("Client", (), {"platform_version": platform_version})()
  return type("Device", (), {"compute_capability": capability, "client": client})()


@pytest.mark.parametrize("default_backend,device,expected", [
    ("gpu", _device("8.0", "PJRT C API\ncuda 12080"), "gpu"),              # A100
    ("gpu", _device("9.0", "PJRT C API\ncuda 12080"), "gpu"),              # H100
    ("gpu", _device("10.0", "PJRT C API\ncuda 12080"), "gpu"),             # B200
    ("gpu", _device("7.5", "PJRT C API\ncuda 12080"), "gpu-without-cudnn"),  # T4 (Colab)
    ("gpu", _device("gfx90a", "PJRT C API\nrocm 60300"), "gpu-without-cudnn"),
    ("cpu", None, "cpu"),
    ("tpu", None, "tpu"),
])
def test_attention_backend_needs_cuda_ampere_for_cudnn(monkeypatch, default_backend,
                                                       device, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: default_backend)
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [device])
  assert M.attention_backend() == expected


@pytest.mark.parametrize("changes,fields", [
    (dict(dtype="float32"), ("attention_implementation", "dtype", "bfloat16")),
    (dict(dtype="bfloat16", attention_dropout_rate=0.1),
     ("attention_implementation", "attention_dropout_rate")),
    (dict(dtype="bfloat16", d_model=36, num_heads=3),
     ("attention_implementation", "head_dim", "d_model / num_heads")),
])
def test_impossible_cudnn_config_raises_naming_the_fields(changes, fields):
  with pytest.raises(ValueError) as err:
    M.TransformerConfig(**{**TINY, **changes, "attention_implementation": "cudnn"})
  message = str(err.value)
  assert message.startswith("TransformerConfig.attention_implementation='cudnn'")
  for field in fields:
    assert field in message
  assert "attention_implementation=None" in message   # what to do instead


@pytest.mark.parametrize("changes", [
    dict(dtype="bfloat16", attention_implementation="cudnn"),
    dict(dtype="float16", attention_implementation="cudnn"),
    dict(dtype="bfloat16", d_model=1024, num_heads=4, attention_implementation="cudnn"),  # 256: Hopper
    dict(dtype="float32", attention_implementation=None, attention_dropout_rate=0.1),
    dict(dtype="float32", attention_implementation="xla"),
])
def test_possible_configs_are_accepted(changes):
  M.TransformerConfig(**{**TINY, **changes})


def test_log_line_says_which_implementation_and_why():
  bf16 = M.TransformerConfig(**TINY, dtype="bfloat16")
  name = attention_choice.attention_implementation_name
  default = name(bf16, "gpu")
  assert "cuDNN flash attention" in default and "implementation='cudnn'" in default
  assert "XLA for an odd length" in default
  assert name(bf16.replace(attention_implementation="cudnn"), "gpu") == default
  f32 = name(bf16.replace(dtype="float32"), "gpu")
  assert "implementation='xla'" in f32 and "not cuDNN" in f32 and "dtype='float32'" in f32
  assert "implementation='xla'" in name(bf16, "gpu-without-cudnn")
  assert "einsums" in name(bf16, "cpu") and "cuDNN" not in name(bf16, "cpu")
  assert "implementation='xla'" in name(bf16.replace(attention_implementation="xla"), "gpu")
  dropout = name(bf16.replace(attention_dropout_rate=0.1), "gpu")
  assert "cuDNN" in dropout and "training steps: einsums" in dropout
  assert "\n" not in dropout


def test_log_line_defaults_to_this_machine(monkeypatch):
  fake_backend(monkeypatch, "gpu")
  assert "cuDNN" in attention_choice.attention_implementation_name(M.TransformerConfig(**TINY, dtype="bfloat16"))


# --------------------------------------------------------------------------
# What runs: routing through scaled_dot_product_attention
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype,implementation,expected", [
    ("gpu", "bfloat16", None, "cudnn"),    # the default on an Ampere+ NVIDIA GPU
    ("gpu", "bfloat16", "cudnn", "cudnn"),
    ("gpu", "float32", None, "xla"),
    ("gpu-without-cudnn", "bfloat16", None, "xla"),
    ("cpu", "bfloat16", None, None),       # None: the einsums, no jax.nn call
    ("cpu", "float32", "xla", "xla"),
    ("gpu", "bfloat16", "xla", "xla"),
])
def test_default_reaches_the_chosen_implementation(monkeypatch, fused_calls, backend,
                                                   dtype, implementation, expected):
  fake_backend(monkeypatch, backend)
  mask, tq, tk = masks("packed")
  (q, k, v, _), _ = inputs(dtype, tq, tk)
  M.scaled_dot_product_attention(q, k, v, mask, implementation=implementation)
  assert fused_calls == ([] if expected is None else [(expected, (3, 1, 8, 8))])


def test_cudnn_gets_a_mask_broadcast_to_the_full_score_shape(monkeypatch, fused_calls):
  """A padding mask shaped [batch, 1, 1, kv_length] reaches cuDNN as
  [batch, 1, q_length, kv_length] (its bias must be; jax issue 28974)."""
  fake_backend(monkeypatch, "gpu")
  mask, tq, tk = masks("keys_only")
  (q, k, v, _), _ = inputs("bfloat16", tq, tk)
  M.scaled_dot_product_attention(q, k, v, mask, implementation="cudnn")
  assert fused_calls == [("cudnn", (3, 1, tq, tk))]


@pytest.mark.parametrize("kind", ["packed", "causal", "cross", "keys_only"])
def test_cudnn_gets_no_query_without_a_key(monkeypatch, kind):
  """cuDNN gave non-finite gradients for queries whose every key is hidden
  (padding; its first GPU check): the mask it gets lets such a query see
  every key, and is the model's mask on every other query."""
  fake_backend(monkeypatch, "gpu")
  handed = []
  real = jax.nn.dot_product_attention

  def recording(query, key, value, *args, mask=None, implementation=None, **kwargs):
    handed.append(np.asarray(mask))
    return real(query, key, value, *args, mask=mask, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  mask, tq, tk = masks(kind)
  (q, k, v, _), _ = inputs("bfloat16", tq, tk)
  M.scaled_dot_product_attention(q, k, v, mask, implementation="cudnn")
  model_mask = np.broadcast_to(np.asarray(mask), (3, 1, tq, tk))
  empty = ~model_mask.any(-1)                                   # [batch, 1, tq]
  assert empty[2].all() and not empty[1].any()                  # row 2: padding only
  [given] = handed
  assert given.shape == (3, 1, tq, tk)
  np.testing.assert_array_equal(given[~empty], model_mask[~empty])
  assert given[empty].all()


def test_odd_length_under_a_mask_falls_back_to_xla(monkeypatch, fused_calls):
  """JAX 0.10's cuDNN backward pass refuses a mask (bias) with an odd length:
  a requested cuDNN runs XLA there."""
  fake_backend(monkeypatch, "gpu")
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0]])
  (q, k, v, _), _ = inputs("bfloat16", 7, 7)
  q, k, v = q[:1], k[:1], v[:1]
  M.scaled_dot_product_attention(q, k, v, M.attention_mask(seg, seg), implementation="cudnn")
  M.scaled_dot_product_attention(q, k, v, None, implementation="cudnn")  # no mask: no bias
  assert [c[0] for c in fused_calls] == ["xla", "cudnn"]


def test_weights_and_dropout_use_the_einsums_on_gpu(monkeypatch, fused_calls):
  fake_backend(monkeypatch, "gpu")
  mask, tq, tk = masks("packed")
  (q, k, v, _), _ = inputs("bfloat16", tq, tk)
  _, weights = M.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
  assert weights.shape == (3, 2, tq, tk)
  M.scaled_dot_product_attention(q, k, v, mask, dropout_rate=0.1,
                                 dropout_rng=jax.random.key(0))
  assert fused_calls == []


# --------------------------------------------------------------------------
# The numbers: fused (XLA, and cuDNN's routing) vs einsums vs float64 numpy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["none", "packed", "causal", "cross", "keys_only"])
def test_fused_and_einsum_paths_match_float64_reference(monkeypatch, fused_calls, dtype, kind):
  """Outputs and d/d(q, k, v): the einsums (CPU's default), the default on a
  faked GPU (cuDNN's routing in bfloat16, XLA in float32), cuDNN's routing on
  request (bfloat16; run by XLA here) and `implementation="xla"`, each against
  float64 numpy and against each other. Row 2 of the batch is padding only
  (every query row fully masked). cuDNN's routing lets a query with no
  visible key see every key (`test_cudnn_gets_no_query_without_a_key`): its
  outputs are compared on the other queries, and its gradients under a
  cotangent that is zero on such queries, as a real loss is."""
  mask, tq, tk = masks(kind)
  (q, k, v, g), (q64, k64, v64, g64) = inputs(dtype, tq, tk, seed=len(kind))
  mask64 = None if mask is None else np.asarray(mask)
  sees_a_key = (np.ones((3, tq), bool) if mask is None else
                np.broadcast_to(mask64, (3, 1, tq, tk)).any(-1)[:, 0])   # [batch, tq]
  g_real = g * jnp.asarray(sees_a_key)[:, :, None, None].astype(g.dtype)
  references = {False: np_attention_and_grads(q64, k64, v64, mask64, g64),
                True: np_attention_and_grads(q64, k64, v64, mask64,
                                             g64 * sees_a_key[:, :, None, None])}
  tol = TOL[dtype]
  results = {}
  gpu_default = "cudnn" if dtype == "bfloat16" else "xla"  # (head_dim 8; no float32 kernel)
  cudnn = [("cudnn requested", "gpu", "cudnn", "cudnn")] if dtype == "bfloat16" else []
  for name, backend, implementation, runs in [("einsum", "cpu", None, None),
                                              ("gpu default", "gpu", None, gpu_default),
                                              *cudnn,
                                              ("xla", "cpu", "xla", "xla")]:
    fake_backend(monkeypatch, backend)
    calls = len(fused_calls)
    via_cudnn = runs == "cudnn"
    out, grads = attention_and_grads(q, k, v, mask, g_real if via_cudnn else g, implementation)
    assert [c[0] for c in fused_calls[calls:]] == ([] if runs is None else [runs])
    assert out.dtype == jnp.dtype(dtype)
    ref_out, ref_grads = references[via_cudnn]
    rows = sees_a_key if via_cudnn else np.ones_like(sees_a_key)
    for got, want, what in zip((out, *grads), (ref_out, *ref_grads), ("out", "dq", "dk", "dv")):
      got = np.asarray(got.astype(jnp.float32))
      assert np.isfinite(got).all(), (name, what)
      if what == "out":
        got, want = got[rows], want[rows]
      np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{name} {what}")
    results[name] = (out, *grads)
  for a, b in zip(results["einsum"], results["xla"]):
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)),
                               np.asarray(b.astype(jnp.float32)), atol=tol, rtol=tol)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_fully_padded_rows_get_uniform_weights_and_no_nan(implementation):
  """A query with every key hidden averages all values (uniform weights) in
  both paths, and its gradients are finite: q gets none (its scores are
  constants), v gets the uniform share."""
  mask, tq, tk = masks("packed")
  (q, k, v, g), (_, _, v64, g64) = inputs("float32", tq, tk, seed=5)
  out, (dq, dk, dv) = attention_and_grads(q, k, v, mask, g, implementation)
  out, dq, dv = np.asarray(out), np.asarray(dq), np.asarray(dv)
  for a in (out, dq, np.asarray(dk), dv):
    assert np.isfinite(a).all()
  np.testing.assert_allclose(out[2], np.broadcast_to(v64[2].mean(0), out[2].shape), atol=1e-5)
  np.testing.assert_allclose(out[0, 5:], np.broadcast_to(v64[0].mean(0), out[0, 5:].shape),
                             atol=1e-5)
  np.testing.assert_array_equal(dq[2], 0.0)
  np.testing.assert_allclose(dv[2], np.broadcast_to(g64[2].sum(0) / tk, dv[2].shape), atol=1e-5)


# --------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _logits_and_grads(cfg):
  def loss(params, src, dec_in, src_seg, tgt_seg, cotangent):
    logits = M.Transformer(cfg).apply({"params": params}, src, dec_in, src_seg, tgt_seg)
    return jnp.sum(logits.astype(jnp.float32) * cotangent), logits
  return jax.jit(jax.grad(loss, has_aux=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_xla_equals_default_path(dtype):
  """A tiny Transformer (dropout off), packed and padded rows: logits with
  attention_implementation="xla" equal CPU's default (the einsums), and in
  float32 so do the parameter gradients. bfloat16 logits (~N(0, 1), max ~2.7)
  differ by rounding alone through 2 + 2 layers (measured 0.024): bound 0.05.
  (bfloat16 gradients differ from float32's by 3-12% in either path, too
  loose a bound to tell the paths apart; the attention-level test above
  checks bfloat16 gradients against float64.)"""
  cfg = M.TransformerConfig(**TINY, dtype=dtype)
  params = M.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(3)
  src_seg, tgt_seg = jnp.asarray(SEGMENTS[:2]), jnp.asarray(TARGET_SEGMENTS[:2])
  src = jnp.where(src_seg > 0, jnp.asarray(rng.integers(4, cfg.vocab_size, src_seg.shape)), 0)
  tgt = jnp.where(tgt_seg > 0, jnp.asarray(rng.integers(4, cfg.vocab_size, tgt_seg.shape)), 0)
  dec_in = M.shift_right(tgt, cfg.bos_id, tgt_seg)
  cotangent = jnp.asarray(rng.normal(size=(*tgt.shape, cfg.vocab_size)), jnp.float32)
  cotangent = cotangent * (tgt_seg > 0)[..., None]   # padding positions: out of the loss
  args = (params, src, dec_in, src_seg, tgt_seg, cotangent)
  grads_default, logits_default = _logits_and_grads(cfg)(*args)
  grads_xla, logits_xla = _logits_and_grads(cfg.replace(attention_implementation="xla"))(*args)
  tol = 2e-5 if dtype == "float32" else 5e-2
  real = np.asarray(tgt_seg > 0)
  np.testing.assert_allclose(np.asarray(logits_xla, np.float32)[real],
                             np.asarray(logits_default, np.float32)[real], atol=tol, rtol=tol)
  for a, b in zip(jax.tree.leaves(grads_xla), jax.tree.leaves(grads_default)):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    if dtype == "float32":   # gradients up to ~19: 2e-5 absolute, measured 7e-6
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
