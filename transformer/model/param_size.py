"""What a model's parameters weigh, known from its config before any of them
is allocated: the count and bytes of `init_params`' pytree, from
`jax.eval_shape` (abstract: nothing is allocated, whatever the sizes).

Tracing a whole model takes time in proportion to its depth (2-core CPU:
0.35 s for 6 + 6 layers, 2.2 s for 32 + 32, 9.6 s for 128 + 128, so about
40 s for the 512 + 512 a config may ask for), and a refusal should come
within seconds. The layers of a side are identical, so the size is linear
in each side's depth: three shallow traces, of 1 + 1, 2 + 1 and 1 + 2
layers (about 0.1 s each once flax is imported), give it exactly for any
depth (`tests/test_received_sizes.py` checks it against the full trace).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from transformer.model.config import TransformerConfig


# Up to this many layers (both sides together) the whole model traces in well
# under a second (2-core CPU: 0.27 s for 6 + 6, 0.49 s for 12 + 12), so a
# caller that traces it anyway (decoding's `loader.param_shapes`) may size it
# from that trace, before anything is allocated, rather than spend three
# shallow traces (~0.22 s) first.
QUICK_TRACE_LAYERS = 24


@dataclasses.dataclass(frozen=True)
class ParameterSize:
  """How many parameters, and how many bytes they take in their dtypes."""

  count: int
  bytes: int

  def __add__(self, other: "ParameterSize") -> "ParameterSize":
    return ParameterSize(self.count + other.count, self.bytes + other.bytes)

  def __sub__(self, other: "ParameterSize") -> "ParameterSize":
    return ParameterSize(self.count - other.count, self.bytes - other.bytes)

  def __mul__(self, times: int) -> "ParameterSize":
    return ParameterSize(self.count * times, self.bytes * times)


def tree_size(shapes) -> ParameterSize:
  """The size of a pytree of arrays or `jax.ShapeDtypeStruct`s (Python ints:
  no overflow, whatever the shapes)."""
  count = total = 0
  for leaf in jax.tree.leaves(shapes):
    elements = 1
    for n in leaf.shape:
      elements *= int(n)
    count += elements
    total += elements * np.dtype(leaf.dtype).itemsize
  return ParameterSize(count, total)


def traced_size(config: TransformerConfig) -> ParameterSize:
  """The size of `config`'s parameters from one abstract trace of the whole
  model (time in proportion to its depth; `parameter_size` is the fast one)."""
  from transformer.model.transformer import init_params  # (flax: only when asked)
  key = jax.eval_shape(jax.random.key, 0)  # (by its shape: making a key compiles)
  return tree_size(jax.eval_shape(lambda rng: init_params(config, rng), key))


def parameter_size(config: TransformerConfig) -> ParameterSize:
  """The exact size of `config`'s parameters, in three shallow traces
  (module docstring): what the 1 + 1 layer model has, plus what each further
  encoder layer (2 + 1 less 1 + 1) and decoder layer (1 + 2 less 1 + 1) adds."""
  base = traced_size(config.replace(num_encoder_layers=1, num_decoder_layers=1))
  encoder_layer = traced_size(config.replace(num_encoder_layers=2, num_decoder_layers=1)) - base
  decoder_layer = traced_size(config.replace(num_encoder_layers=1, num_decoder_layers=2)) - base
  return (base + encoder_layer * (config.num_encoder_layers - 1)
          + decoder_layer * (config.num_decoder_layers - 1))
