"""Export a workdir's model to a Hugging Face transformers model folder.

    python -m transformer.interop.hf_export --workdir=runs/gettext --out=hf/gettext

The folder is what transformers' Auto classes load by themselves
(`AutoModelForSeq2SeqLM.from_pretrained`, `AutoTokenizer.from_pretrained`,
then `generate`) and what huggingface_hub's `hf upload` pushes to the hub: config.json, generation_config.json, model.safetensors
(float32), the tokenizer's source.spm, target.spm, vocab.json and
tokenizer_config.json, and README.md, a model card saying what the model is
and how it was trained. No torch is needed to write it (safetensors.numpy).

The transformers class that computes exactly this model:

  normalization   transformers class (model_type)
  post (paper)    MarianMTModel ("marian")
  pre             PegasusForConditionalGeneration ("pegasus"): Marian's code
                  with the LayerNorm before each sub-layer and one after each stack

both with MarianTokenizer (a SentencePiece model per side, pieces to ids
through vocab.json). The mapping is the inverse of the import
(`interop/marian.py`, which reads the folder back: the round trip is tested):

  * ids: Marian's layout, `</s>` 0, `<unk>` 1, the pieces from 2, `<pad>` last,
    which is also transformers' decoder start: BOS's rows (its embedding, its
    output row and bias) go there. PAD has no id (never an input that is not
    masked, never a target).
  * the model dimension is permuted from the paper's interleaved sinusoid
    (sin at 2i, cos at 2i+1) to transformers' [sin | cos] halves
    (`marian.residual_permutation`, inverted);
  * kernels become torch's `[out, in]`; the output bias (`logits_bias`, and an
    untied projection's bias) becomes `final_logits_bias`.

Refused, in one sentence naming the option (`NotExportable`), where no
transformers class computes the model exactly: a LayerNorm epsilon other
than 1e-5 (transformers' Marian and Pegasus fix torch's 1e-5, which is also
this project's default; older workdirs have 1e-6: `--approximate_epsilon`
exports one anyway, and the model card says so); learned positions; pre-LN
with separate source and target embeddings (Pegasus has one); a vocabulary
of another size than the model's.

Two differences remain by construction, both documented in the model card:
PAD's output logit is not in transformers' softmax (a trained model gives PAD
no probability to speak of: the log-probabilities agree to ~1e-5, tests), and
transformers' beam search divides a hypothesis' log-probability by
length^alpha where decode.py divides by ((5 + length) / 6)^alpha (GNMT's):
generation_config.json carries the workdir's alpha; at alpha 0 the two
searches are the same search.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import jax
import numpy as np

from transformer.data import marian_tokenizer, received
from transformer.interop import layer_params, run_command
from transformer.interop.marian import residual_permutation
from transformer.interop.marian_formats import marian_position_table
from transformer.model.config import TransformerConfig

TRANSFORMERS_EPSILON = 1e-5  # nn.LayerNorm's default, fixed in transformers' Marian and Pegasus
ACTIVATIONS = {"relu": "relu", "swish": "swish",
               "gelu": "gelu_pytorch_tanh"}  # (flax's nn.gelu is the tanh approximation)
HOSTS = {"post": ("marian", "MarianMTModel"),
         "pre": ("pegasus", "PegasusForConditionalGeneration")}


class NotExportable(ValueError):
  """A model no transformers class computes exactly, with the option to change."""


def check_exportable(config: TransformerConfig, *, approximate_epsilon: bool = False) -> None:
  """NotExportable naming the option, for a model transformers cannot hold
  (its config alone: checked before any weight is read)."""
  if config.positional != "sinusoidal":
    raise NotExportable(
        f"config.model.positional={config.positional!r}: transformers' Marian and Pegasus "
        "models compute sinusoidal positions only; this model cannot be exported exactly")
  if config.normalization == "pre" and not config.share_embeddings:
    raise NotExportable(
        "config.model.share_embeddings=False with normalization='pre': transformers' "
        "pre-LN host (Pegasus) has one embedding for the source and the target")
  if config.layer_norm_epsilon != TRANSFORMERS_EPSILON and not approximate_epsilon:
    raise NotExportable(
        f"config.model.layer_norm_epsilon={config.layer_norm_epsilon:g}: transformers' "
        f"Marian and Pegasus models compute LayerNorm with {TRANSFORMERS_EPSILON:g}, so the "
        "export would not be this model; train with --config.model.layer_norm_epsilon=1e-5 "
        "for an exact export, or pass --approximate_epsilon to write it with 1e-5 anyway")
  if config.d_model % 2:
    raise NotExportable(f"config.model.d_model={config.d_model} is odd: the [sin | cos] "
                        "position table of transformers needs an even width")


def hf_tensors(config: TransformerConfig, params) -> dict[str, np.ndarray]:
  """{transformers tensor name: float32 array} of this model, in Marian's ids."""
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
  d = config.d_model
  to_hf = np.argsort(residual_permutation(d))  # (transformers' dimension j is ours to_hf[j])
  marian_ids = marian_tokenizer.marian_to_ours(np.arange(config.vocab_size - 2))
  out: dict[str, np.ndarray] = {}

  def rows(x):  # ours' per-id rows -> Marian's, BOS's (the decoder start) last as <pad>
    return np.concatenate([x[marian_ids], x[[config.bos_id]]])

  def reads(name, dense):  # Q, K, V, FFN inner: [d, ...] reading the residual stream
    out[f"{name}.weight"] = dense["kernel"].reshape(d, -1)[to_hf].T
    out[f"{name}.bias"] = dense["bias"].reshape(-1)

  def writes(name, dense):  # attention out, FFN outer: [..., d] writing it
    out[f"{name}.weight"] = dense["kernel"].reshape(-1, d)[:, to_hf].T
    out[f"{name}.bias"] = dense["bias"].reshape(-1)[to_hf]

  def norm(name, tree):
    out[f"{name}.weight"], out[f"{name}.bias"] = tree["scale"][to_hf], tree["bias"][to_hf]

  def attention(name, tree):
    for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      reads(f"{name}.{theirs}", tree[ours])
    writes(f"{name}.out_proj", tree["out"])

  for side, count in (("encoder", config.num_encoder_layers),
                      ("decoder", config.num_decoder_layers)):
    for i, layer in enumerate(layer_params(params[side], count, config.scan_layers)):
      prefix = f"model.{side}.layers.{i}"
      attention(f"{prefix}.self_attn", layer["self_attention"])
      norm(f"{prefix}.self_attn_layer_norm", layer["self_attention_norm"]["norm"])
      if side == "decoder":
        attention(f"{prefix}.encoder_attn", layer["cross_attention"])
        norm(f"{prefix}.encoder_attn_layer_norm", layer["cross_attention_norm"]["norm"])
      reads(f"{prefix}.fc1", layer["feed_forward"]["inner"])
      writes(f"{prefix}.fc2", layer["feed_forward"]["outer"])
      norm(f"{prefix}.final_layer_norm", layer["feed_forward_norm"]["norm"])
    if config.normalization == "pre":
      norm(f"model.{side}.layer_norm", params[side]["final_norm"])
      # (Pegasus keeps its position table with the weights, Marian does not)
      out[f"model.{side}.embed_positions.weight"] = marian_position_table(config.max_len, d)

  def embedding(name):
    return rows(params[name]["embedding"]["embedding"][:, to_hf])

  if config.share_embeddings:
    out["model.shared.weight"] = target = embedding("embeddings")
  else:
    out["model.encoder.embed_tokens.weight"] = embedding("source_embeddings")
    out["model.decoder.embed_tokens.weight"] = target = embedding("target_embeddings")
  bias = np.zeros(config.vocab_size, np.float32)
  if not config.logits_via_embedding:
    projection = params["decoder"]["output_projection"]
    out["lm_head.weight"] = rows(projection["kernel"].T[:, to_hf])
    bias = bias + projection["bias"]
  elif not config.share_embeddings:  # (transformers ties it to the decoder's; kept explicit)
    out["lm_head.weight"] = target
  if config.logits_bias:
    bias = bias + params["decoder"]["logits_bias"]
  out["final_logits_bias"] = rows(bias)[None]
  return {name: np.ascontiguousarray(x, np.float32) for name, x in out.items()}


def hf_config(config: TransformerConfig) -> dict:
  """config.json: the transformers config of this model (Marian's ids)."""
  model_type, architecture = HOSTS[config.normalization]
  pad = config.vocab_size - 2  # (Marian's ids and <pad>: vocab_size - 2 + 1)
  hf = {
      "architectures": [architecture], "model_type": model_type,
      "d_model": config.d_model, "vocab_size": pad + 1,
      "encoder_layers": config.num_encoder_layers, "decoder_layers": config.num_decoder_layers,
      "encoder_attention_heads": config.num_heads, "decoder_attention_heads": config.num_heads,
      "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
      "activation_function": ACTIVATIONS[config.activation],
      "max_position_embeddings": config.max_len, "scale_embedding": True,
      "tie_word_embeddings": config.logits_via_embedding,
      "pad_token_id": pad, "eos_token_id": 0, "decoder_start_token_id": pad,
      "bos_token_id": None, "forced_eos_token_id": None,
      "dropout": config.dropout_rate, "attention_dropout": config.attention_dropout_rate,
      "activation_dropout": 0.0, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
      "init_std": 0.02, "is_encoder_decoder": True, "use_cache": True, "dtype": "float32"}
  if model_type == "marian":
    hf.update(share_encoder_decoder_embeddings=config.share_embeddings,
              decoder_vocab_size=pad + 1)
  return hf


def generation_config(config: TransformerConfig, length_penalty: float,
                      beam_size: int = 4) -> dict:
  """generation_config.json: decode.py's defaults where transformers has them."""
  pad = config.vocab_size - 2
  return {"decoder_start_token_id": pad, "eos_token_id": 0, "pad_token_id": pad,
          "bad_words_ids": [[pad]], "forced_eos_token_id": None, "num_beams": beam_size,
          "length_penalty": length_penalty, "max_length": config.max_len}


def tokenizer_files(tokenizer, vocab_size: int, max_len: int) -> dict[str, bytes]:
  """source.spm, target.spm, vocab.json and tokenizer_config.json of
  transformers' MarianTokenizer for this project's tokenizer (either kind)."""
  if tokenizer.vocab_size != vocab_size:
    raise NotExportable(
        f"config.model.vocab_size={vocab_size} but the vocabulary has "
        f"{tokenizer.vocab_size} pieces: the export needs a piece for every output row")
  pieces = [tokenizer.id_to_piece(int(i)) for i in marian_tokenizer.marian_to_ours(
      np.arange(tokenizer.vocab_size - 2))]
  marian_tokenizer.check_marian_pieces(pieces, "the workdir's vocabulary")
  pad = len(pieces)
  vocab = {piece: i for i, piece in enumerate(pieces)}
  if len(vocab) != len(pieces) or "<pad>" in vocab:
    raise NotExportable("the workdir's vocabulary has a piece twice (or a piece '<pad>'), "
                        "so vocab.json cannot map pieces to ids")
  vocab["<pad>"] = pad
  if isinstance(tokenizer, marian_tokenizer.MarianTokenizer):
    source, target = tokenizer.source_model(), tokenizer.target_model()
  else:
    source = target = tokenizer.serialized_model()
  special = {i: {"content": piece, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
             for i, piece in ((0, "</s>"), (1, "<unk>"), (pad, "<pad>"))}
  tokenizer_config = {
      "tokenizer_class": "MarianTokenizer", "added_tokens_decoder": special,
      "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
      "model_max_length": max_len, "separate_vocabs": False, "source_lang": None,
      "target_lang": None, "sp_model_kwargs": {}}
  return {"source.spm": source, "target.spm": target,
          "vocab.json": json.dumps(vocab, ensure_ascii=False, indent=0).encode(),
          "tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode()}


def model_card(config: TransformerConfig, *, name: str, training: dict | None,
               imported: dict | None, checkpoint: dict, length_penalty: float,
               parameters: int) -> str:
  """README.md: what the model is, how it was trained, how to use it."""
  model_type, architecture = HOSTS[config.normalization]
  data = (training or {}).get("data", {})
  languages = [x for x in (data.get("source_lang"), data.get("target_lang"))
               if isinstance(x, str) and re.fullmatch(r"[A-Za-z_-]{2,16}", x)]  # (codes only)
  front = ["---", "library_name: transformers", "pipeline_tag: translation",
           f"tags: [translation, {model_type}, jax, flax]"]
  if languages:
    front.append(f"language: [{', '.join(languages)}]")
  pair = f" ({' to '.join(languages)})" if len(languages) == 2 else ""
  norm = ("pre-LN (LayerNorm before each sub-layer)" if config.normalization == "pre"
          else "post-LN, as in the paper")
  embeddings = ("one embedding for source, target and output"
                if config.share_embeddings and config.logits_via_embedding
                else "embeddings as trained (config.json)")
  lines = front + [
      "---", "", f"# {name}", "",
      f"A Transformer encoder-decoder for translation{pair}, trained with the JAX/Flax "
      "`transformer` project and exported with `python -m transformer.interop.hf_export`.",
      "", "## The model", "",
      f"- {architecture} (`{model_type}`): {norm}, {config.num_encoder_layers} + "
      f"{config.num_decoder_layers} layers, d_model {config.d_model}, {config.num_heads} "
      f"heads, FFN {config.d_ff} ({config.activation}), {parameters:,} parameters;",
      f"- one SentencePiece vocabulary of {config.vocab_size - 2} pieces (`source.spm`, "
      f"`target.spm`, `vocab.json`), sinusoidal positions up to {config.max_len} tokens, "
      f"{embeddings}.",
      "", "## Training", ""]
  if imported:
    lines.append(f"- imported from `{imported.get('imported_from')}` (a Marian / OPUS-MT "
                 "model), then exported again.")
  if training:
    lines.append(f"- data: {_corpus(data)}")
    budget = _number(training.get("train_minutes")) or 0
    length = (f"{budget:g} minutes (a time budget)" if budget
              else f"{_number(training.get('num_train_steps'))} steps")
    lines.append(f"- trained for {length}, batches of {_number(training.get('batch_size'))} "
                 f"rows of {_number(training.get('max_length'))} tokens" +
                 (f", {_plain(training['lr_schedule'])} learning-rate schedule"
                  if training.get("lr_schedule") else ""))
  if checkpoint.get("kind") == "averaged":
    lines.append(f"- the weights: the average of the checkpoints of steps "
                 f"{', '.join(str(s) for s in checkpoint.get('averaged_steps', []))}")
  elif checkpoint.get("step") is not None:
    lines.append(f"- the weights: the checkpoint of step {checkpoint['step']}")
  lines += ["", "## Use", "", "```python",
            "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            f'model = AutoModelForSeq2SeqLM.from_pretrained("{name}")',
            'batch = tokenizer(["Open the file."], return_tensors="pt", padding=True)',
            "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
            "```", "",
            "## How it differs from the original", "",
            "- Beam search: generation_config.json asks for 4 beams and length_penalty "
            f"{length_penalty:g}. transformers divides a hypothesis' log-probability by "
            "length^alpha, the original decoder by ((5 + length) / 6)^alpha: with "
            "length_penalty=0 both run the same search.",
            "- The original model also scores a padding id, which has no id here: its "
            "probability, near zero in a trained model, is left out of the softmax."]
  if config.layer_norm_epsilon != TRANSFORMERS_EPSILON:  # (--approximate_epsilon)
    lines.append(f"- **Approximate:** trained with LayerNorm epsilon "
                 f"{config.layer_norm_epsilon:g}; transformers computes with "
                 f"{TRANSFORMERS_EPSILON:g}, so its outputs differ slightly from the "
                 "original's.")
  return "\n".join(lines) + "\n"


def _number(value) -> int | float | None:
  """A number of the (received) config.json, or None: nothing else reaches the card."""
  return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _plain(value, limit: int = 60) -> str:
  """A string of the (received) config.json as plain words on one line:
  letters, digits and ._-/ only, at most `limit` of them."""
  return re.sub(r"[^\w./-]", "", str(value))[:limit] or "?"


def _corpus(data: dict) -> str:
  """The training data in a few words, from config.json's `data`."""
  source = data.get("source")
  if source == "demo":
    return "the project's embedded demo task (English number phrases to German)"
  named = {"tsv": data.get("train_path"), "files": data.get("train_src"),
           "tfds": data.get("tfds_name")}.get(source)
  return (f"{_plain(source)} `{_plain(os.path.basename(str(named)))}`" if named
          else _plain(source))


def _read_training_config(path: str) -> dict | None:
  """The workdir's config.json (train.py's) as data, or None where there is none."""
  where = os.path.join(path, "config.json")
  if not received.exists(where):
    return None
  try:
    value = json.loads(received.read_bytes(where, root=path, kind="config"))
  except ValueError as e:
    raise ValueError(f"{where} is not valid JSON ({e})") from None
  return value if isinstance(value, dict) else None


def export_workdir(workdir: str, out: str, *, checkpoint: str | int = "auto",
                   approximate_epsilon: bool = False, force: bool = False) -> str:
  """Writes the transformers folder of `workdir`'s model (the checkpoint
  `checkpoint` names, as decode.py's --checkpoint) to `out`; returns `out`.

  Raises NotExportable (a ValueError) naming the option for a model no
  transformers class computes exactly, FileExistsError for a non-empty `out`
  without `force`. Nothing is written to `out` until every file is made."""
  from safetensors.numpy import save as save_safetensors

  from transformer.decoding import loader, options
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not force:
    raise FileExistsError(f"--out={out} exists and is not empty; pass --force to replace it")
  read = loader.read_workdir(workdir, checkpoint)
  check_exportable(read.model_config, approximate_epsilon=approximate_epsilon)
  translator, info = loader.load_translator(read, with_info=True)
  config = translator.config
  length_penalty = read.decoding.get("length_penalty", options.PAPER_LENGTH_PENALTY)
  tensors = hf_tensors(config, translator.params)
  files = tokenizer_files(translator.tokenizer, config.vocab_size, config.max_len)
  files["model.safetensors"] = save_safetensors(tensors, metadata={"format": "pt"})
  files["config.json"] = json.dumps(hf_config(config), indent=2).encode()
  files["generation_config.json"] = json.dumps(generation_config(config, length_penalty),
                                               indent=2).encode()
  files["README.md"] = model_card(
      config, name=os.path.basename(os.path.normpath(out)),
      training=_read_training_config(str(read.path)), imported=read.imported,
      checkpoint=info, length_penalty=length_penalty, parameters=sum(int(np.size(x)) for x in jax.tree.leaves(translator.params))).encode()
  _write_folder(out, files)
  return out


def _write_folder(out: str, files: dict[str, bytes]) -> None:
  """Writes `files` into a new folder beside `out`, then puts it in place."""
  staging = os.path.join(os.path.dirname(os.path.abspath(out)),
                         f".{os.path.basename(os.path.abspath(out))}.{os.getpid()}.partial")
  shutil.rmtree(staging, ignore_errors=True)  # (a killed run's)
  os.makedirs(staging)  # (the umask's permissions, as any folder the user makes)
  try:
    for name, data in files.items():
      with open(os.path.join(staging, name), "wb") as f:
        f.write(data)
    if os.path.isdir(out) and not os.path.islink(out):
      shutil.rmtree(out)
    elif os.path.lexists(out):
      os.remove(out)
    os.replace(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m transformer.interop.hf_export",
      description="Export a workdir's model to a folder that Hugging Face transformers' "
                  "Auto classes load (MarianMTModel or Pegasus, MarianTokenizer).")
  parser.add_argument("--workdir", required=True, help="a workdir train.py wrote, or imported")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--checkpoint", default="auto",
                      help="auto | averaged | latest | <step> (as decode.py)")
  parser.add_argument("--approximate_epsilon", action="store_true",
                      help="write a model trained with another LayerNorm epsilon than 1e-5 "
                           "with transformers' 1e-5 (not exact; the model card says so)")
  parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
  args = parser.parse_args(argv)

  def work() -> int:
    out = export_workdir(args.workdir, args.out, checkpoint=args.checkpoint,
                         approximate_epsilon=args.approximate_epsilon, force=args.force)
    print(f"wrote {out}: load it with transformers' AutoModelForSeq2SeqLM.from_pretrained("
          f"{out!r}) and AutoTokenizer.from_pretrained({out!r})")
    return 0
  return run_command(work, exit_code=2)


if __name__ == "__main__":
  sys.exit(main())
