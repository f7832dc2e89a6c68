"""The benchmarks' measuring tools against hand-counted FLOPs."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def test_matmuls_alone_finds_every_matmul_of_forward_backward_and_scans():
  """A two-layer MLP's loss gradient inside a 3-step scan: 3 x (2 forward +
  4 backward matmuls, minus the input gradient of the first layer, which
  nothing needs), counted by hand."""
  n, d, f = 8, 16, 32
  w1, w2, x = jnp.ones((d, f)), jnp.ones((f, d)), jnp.ones((n, d))

  def loss(ws, x):
    return jnp.sum(jnp.tanh(x @ ws[0]) @ ws[1])

  def train(ws, x):
    def body(ws, _):
      grads = jax.grad(loss)(ws, x)
      return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), None
    return jax.lax.scan(body, ws, None, length=3)[0]

  run, operands, flops = common.matmuls_alone(train, (w1, w2), x)
  forward = 2 * n * d * f * 2                       # x W1, h W2
  backward = 2 * n * d * f * 3                      # dW2, dh, dW1 (no dx: x is not differentiated)
  assert flops == 3 * (forward + backward)
  outputs = run(operands)
  assert len(outputs) == 3 * 5
  assert sorted(o.shape for o in outputs) == sorted(
      3 * [(n, f), (n, d), (f, d), (n, f), (d, f)])


def test_training_flop_model_counts_the_step_matmuls():
  """The closed-form FLOP model of `common.training_flops_per_step` equals the
  FLOPs of the dot_generals the real training step performs."""
  from transformer import model as M
  config = M.TransformerConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=48,
                               num_encoder_layers=2, num_decoder_layers=1,
                               dropout_rate=0.0)
  params = M.init_params(config, jax.random.key(0))
  batch, src_len, tgt_len = 2, 5, 7
  src = jnp.full((batch, src_len), 5)
  tgt = jnp.full((batch, tgt_len), 6)

  def step(params):
    def loss(params):
      return jnp.sum(M.Transformer(config).apply({"params": params}, src, tgt))
    return jax.grad(loss)(params)

  _, _, flops = common.matmuls_alone(step, params)
  assert flops == common.training_flops_per_step(config, batch, src_len, tgt_len)


def test_program_hash_ignores_where_the_code_lives_but_not_what_it_computes():
  """fingerprint.program_hash: the same computation written in two places (other
  lines, other function names) hashes the same; another computation does not."""
  from benchmarks import fingerprint
  x = jnp.ones((4, 8))

  def scaled(v):
    return jnp.tanh(v * 2.0) + 1.0

  def moved_elsewhere(v):
    return jnp.tanh(v * 2.0) + 1.0

  def other(v):
    return jnp.tanh(v * 3.0) + 1.0

  compile_ = lambda f: jax.jit(f).lower(x).compile()
  assert "scaled" in compile_(scaled).as_text()  # the source location is in the text
  assert fingerprint.program_hash(compile_(scaled)) == fingerprint.program_hash(
      compile_(moved_elsewhere))
  assert fingerprint.program_hash(compile_(scaled)) != fingerprint.program_hash(
      compile_(other))


def test_rated_peaks_by_device_kind():
  from transformer import flops

  class Device:
    def __init__(self, platform, kind):
      self.platform, self.device_kind = platform, kind
  assert flops.rated_peak(Device("gpu", "NVIDIA H100 80GB HBM3")) == 989e12
  assert flops.rated_peak(Device("gpu", "NVIDIA A100-SXM4-40GB")) == 312e12
  assert flops.rated_peak(Device("tpu", "TPU v5 lite")) == 197e12
  assert flops.rated_peak(Device("gpu", "Some Future GPU")) is None
  assert flops.rated_peak(Device("cpu", "cpu")) is None
