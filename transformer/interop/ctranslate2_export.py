"""Export a workdir's model to a CTranslate2 model directory (serving engine).

    python -m transformer.interop.ctranslate2_export --workdir=runs/demo --output_dir=ct2/demo
    python -m transformer.interop.ctranslate2_export --workdir=runs/demo \\
        --output_dir=ct2/demo-int8 --quantization=int8

`ctranslate2.specs.TransformerSpec` is filled from numpy arrays (no torch) and
saved by a `ctranslate2.converters.Converter`. The mapping, for each layer:

  ours (flax, kernels [in, ...out])           CTranslate2 (weights [out, in])
  self_attention query/key/value              self_attention.linear[0]: fused [3d, d]
  self_attention out [h, d_k, d]              self_attention.linear[1]
  cross_attention query                       attention.linear[0]
  cross_attention key/value                   attention.linear[1]: fused [2d, d]
  cross_attention out                         attention.linear[2]
  *_norm/norm scale, bias                     the sub-layer's layer_norm gamma, beta
  feed_forward inner, outer                   ffn.linear_0, ffn.linear_1
  embeddings (x sqrt(d_model))                embeddings, scaled (multiply_by_sqrt_depth)
  E^T (tied) or output_projection             decoder.projection
  final_norm (pre-LN)                         encoder/decoder.layer_norm

CTranslate2's own sinusoid is not the paper's (sines then cosines), so the
position table is this model's (`sinusoidal_positional_encoding`), or the
learned one. Its LayerNorm epsilon is set to the model's. The vocabulary is
the SentencePiece model's pieces in id order; the source gets its EOS appended
by CTranslate2 (`add_source_eos`), as `Translator` appends it. The decoder
starts from BOS (`decoder_start_token`), so from BOS's embedding row, as here:
an imported transformers model's own start row (its `<pad>` row) travels in it.

Translating with it (tokens are SentencePiece pieces):

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="runs/demo/vocab.model")
    translator = ctranslate2.Translator("ct2/demo", intra_threads=2)
    result = translator.translate_batch([sp.encode("one red cat", out_type=str)],
                                        beam_size=4)
    print(sp.decode(result[0].hypotheses[0]))
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

from transformer.data.marian_tokenizer import MarianTokenizer
from transformer.data.tokenizer import UNK_ID, Tokenizer
from transformer.interop import layer_params, run_command
from transformer.model.config import TransformerConfig
from transformer.model.transformer import sinusoidal_positional_encoding

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16",
                 "int16", "float16", "bfloat16")


def _t(kernel: np.ndarray, fan_in_axes: int = 1) -> np.ndarray:
  """A flax kernel `[*in, *out]` as a CTranslate2 weight `[out, in]`, float32."""
  kernel = np.asarray(kernel, np.float32)
  fan_in = int(np.prod(kernel.shape[:fan_in_axes]))
  return np.ascontiguousarray(kernel.reshape(fan_in, -1).T)


def _b(bias: np.ndarray) -> np.ndarray:
  return np.asarray(bias, np.float32).reshape(-1)


def _norm(spec, params: dict) -> None:
  spec.gamma = np.asarray(params["scale"], np.float32)
  spec.beta = np.asarray(params["bias"], np.float32)


def _self_attention(spec, attention: dict, norm: dict) -> None:
  q, k, v, out = (attention[name] for name in ("query", "key", "value", "out"))
  spec.linear[0].weight = np.concatenate([_t(q["kernel"]), _t(k["kernel"]), _t(v["kernel"])])
  spec.linear[0].bias = np.concatenate([_b(q["bias"]), _b(k["bias"]), _b(v["bias"])])
  spec.linear[1].weight = _t(out["kernel"], fan_in_axes=2)
  spec.linear[1].bias = _b(out["bias"])
  _norm(spec.layer_norm, norm["norm"])


def _cross_attention(spec, attention: dict, norm: dict) -> None:
  q, k, v, out = (attention[name] for name in ("query", "key", "value", "out"))
  spec.linear[0].weight, spec.linear[0].bias = _t(q["kernel"]), _b(q["bias"])
  spec.linear[1].weight = np.concatenate([_t(k["kernel"]), _t(v["kernel"])])
  spec.linear[1].bias = np.concatenate([_b(k["bias"]), _b(v["bias"])])
  spec.linear[2].weight = _t(out["kernel"], fan_in_axes=2)
  spec.linear[2].bias = _b(out["bias"])
  _norm(spec.layer_norm, norm["norm"])


def _feed_forward(spec, ffn: dict, norm: dict) -> None:
  spec.linear_0.weight, spec.linear_0.bias = _t(ffn["inner"]["kernel"]), _b(ffn["inner"]["bias"])
  spec.linear_1.weight, spec.linear_1.bias = _t(ffn["outer"]["kernel"]), _b(ffn["outer"]["bias"])
  _norm(spec.layer_norm, norm["norm"])


def _positions(config: TransformerConfig, params: dict, side: str) -> np.ndarray:
  if config.positional == "learned":
    return np.asarray(params[side]["input_embedding"]["learned_positions"]["embedding"],
                      np.float32)
  return np.asarray(sinusoidal_positional_encoding(np.arange(config.max_len), config.d_model),
                    np.float32)


def model_spec(config: TransformerConfig, params, tokenizer: Tokenizer):
  """The `ctranslate2.specs.TransformerSpec` of this model, filled (float32)."""
  from ctranslate2.specs import common_spec, transformer_spec
  params = jax.tree.map(np.array, jax.device_get(params))  # (writable: quantizing is in place)
  activation = {"relu": common_spec.Activation.RELU,
                "gelu": common_spec.Activation.GELUTanh,  # flax's nn.gelu
                "swish": common_spec.Activation.SWISH}[config.activation]
  pre_norm = config.normalization == "pre"
  spec = transformer_spec.TransformerSpec.from_config(
      (config.num_encoder_layers, config.num_decoder_layers), config.num_heads,
      pre_norm=pre_norm, activation=activation)
  source = params["embeddings" if config.share_embeddings else "source_embeddings"]
  target = params["embeddings" if config.share_embeddings else "target_embeddings"]
  spec.encoder.embeddings[0].weight = np.asarray(source["embedding"]["embedding"], np.float32)
  spec.decoder.embeddings.weight = np.asarray(target["embedding"]["embedding"], np.float32)
  spec.encoder.scale_embeddings = spec.decoder.scale_embeddings = True
  spec.encoder.position_encodings.encodings = _positions(config, params, "encoder")
  spec.decoder.position_encodings.encodings = _positions(config, params, "decoder")
  for layer_spec, layer in zip(spec.encoder.layer, layer_params(
      params["encoder"], config.num_encoder_layers, config.scan_layers)):
    _self_attention(layer_spec.self_attention, layer["self_attention"],
                    layer["self_attention_norm"])
    _feed_forward(layer_spec.ffn, layer["feed_forward"], layer["feed_forward_norm"])
  for layer_spec, layer in zip(spec.decoder.layer, layer_params(
      params["decoder"], config.num_decoder_layers, config.scan_layers)):
    _self_attention(layer_spec.self_attention, layer["self_attention"],
                    layer["self_attention_norm"])
    _cross_attention(layer_spec.attention, layer["cross_attention"],
                     layer["cross_attention_norm"])
    _feed_forward(layer_spec.ffn, layer["feed_forward"], layer["feed_forward_norm"])
  if pre_norm:
    _norm(spec.encoder.layer_norm, params["encoder"]["final_norm"])
    _norm(spec.decoder.layer_norm, params["decoder"]["final_norm"])
  if config.logits_via_embedding:
    spec.decoder.projection.weight = spec.decoder.embeddings.weight
    bias = np.zeros(config.vocab_size, np.float32)
  else:
    projection = params["decoder"]["output_projection"]
    spec.decoder.projection.weight = _t(projection["kernel"])
    bias = _b(projection["bias"])
  if config.logits_bias:
    bias = bias + _b(params["decoder"]["logits_bias"])
  if config.logits_bias or not config.logits_via_embedding:
    spec.decoder.projection.bias = bias
  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  spec.config.bos_token = pieces[config.bos_id]
  spec.config.eos_token = pieces[config.eos_id]
  spec.config.unk_token = pieces[UNK_ID]
  spec.config.decoder_start_token = pieces[config.bos_id]
  spec.config.add_source_eos = True
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon
  return spec


def export(config: TransformerConfig, params, tokenizer: Tokenizer, output_dir: str, *,
           quantization: str = "float32", force: bool = False) -> str:
  """Writes the CTranslate2 model of (config, params, tokenizer) to
  `output_dir`, weights in `quantization`; returns the directory."""
  import ctranslate2

  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
  spec = model_spec(config, params, tokenizer)

  class _FromSpec(ctranslate2.converters.Converter):
    def _load(self):
      return spec

  return _FromSpec().convert(output_dir, quantization=quantization, force=force)


def export_workdir(workdir: str, output_dir: str, *, checkpoint: str | int = "auto",
                   quantization: str = "float32", force: bool = False) -> str:
  """Exports a workdir written by train.py or imported (the checkpoint
  `checkpoint` names, as decode.py's --checkpoint), with its SentencePiece
  model(s) beside the model: vocab.model, or an imported Marian model's
  source.spm and target.spm (`sentencepiece_files`)."""
  from transformer.decoding import loader
  translator = loader.load_translator(workdir, checkpoint)
  out = export(translator.config, translator.params, translator.tokenizer, output_dir,
               quantization=quantization, force=force)
  for name, data in sentencepiece_files(translator.tokenizer).items():
    with open(os.path.join(out, name), "wb") as f:
      f.write(data)
  return out


def sentencepiece_files(tokenizer) -> dict[str, bytes]:
  """{file name: SentencePiece model} that tokenize for the exported model."""
  if isinstance(tokenizer, MarianTokenizer):  # one model per side, pieces through one table
    return {"source.spm": tokenizer.source_model(), "target.spm": tokenizer.target_model()}
  return {"vocab.model": tokenizer.serialized_model()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m transformer.interop.ctranslate2_export",
      description="Export a workdir written by train.py to a CTranslate2 model directory.")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--checkpoint", default="auto",
                      help="auto | averaged | latest | <step> (as decode.py)")
  parser.add_argument("--quantization", default="float32", choices=QUANTIZATIONS)
  parser.add_argument("--force", action="store_true", help="replace an existing output_dir")
  args = parser.parse_args(argv)

  def work() -> int:
    out = export_workdir(args.workdir, args.output_dir, checkpoint=args.checkpoint,
                         quantization=args.quantization, force=args.force)
    print(f"wrote {out} ({args.quantization}) with its SentencePiece model(s): "
          f"{', '.join(sorted(n for n in os.listdir(out) if n.endswith(('.model', '.spm'))))}")
    return 0
  return run_command(work, exit_code=1)


if __name__ == "__main__":
  sys.exit(main())
