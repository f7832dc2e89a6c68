"""Import a Marian / OPUS-MT model into an ordinary workdir (decode.py, the
Python API, the notebook and fine-tuning with --config.init_from work on it).

    python -m transformer.interop.marian --model=Helsinki-NLP/opus-mt-de-en \
        --workdir=runs/opus-de-en
    python -m transformer.interop.marian --model=path/to/hf_model_dir --workdir=...
    python -m transformer.interop.marian --model=path/to/opus_mt_release --workdir=...

Two formats are read, both without torch (`marian_formats.py`):

  * a Hugging Face Marian model (`config.json`, `model.safetensors`,
    `source.spm`, `target.spm`, `vocab.json`): a local directory, or a hub id
    downloaded with `huggingface_hub` (`--revision` picks a branch or PR);
  * an OPUS-MT release of Marian-NMT (`decoder.yml` naming the model `.npz` and
    its vocabulary `.yml`, with `source.spm` and `target.spm` beside it).

What differs from this project's model, and how the import makes the models
equal (the imported model's scores equal Marian's, checked against
CTranslate2's own Marian converter in tests/test_marian.py):

  * The FFN activation (swish in OPUS-MT), the output-logits bias
    (`final_logits_bias`, Marian's `decoder_ff_logit_out_b`), LayerNorm
    epsilon 1e-5 and untied source / target embeddings are model options
    (`TransformerConfig.activation`, `logits_bias`, `layer_norm_epsilon`,
    `share_embeddings`, `logits_via_embedding`).
  * Marian's position table is `[sin | cos]` (all sines, then all cosines);
    the paper's interleaves them (dimension 2i the sine, 2i+1 the cosine). The
    model dimension of every residual-stream weight is permuted instead
    (`residual_permutation`): embeddings' columns, the rows of every matrix
    that reads the residual stream (Q, K, V, FFN inner), the columns and
    biases of every one that writes it (attention out, FFN outer), LayerNorm's
    scale and bias. LayerNorm and dot products do not care about the order of
    the dimensions, so the model is exactly the same function; no layout
    option has to be carried through the model, its exporter and its tests.
  * Marian's special ids (`</s>` 0, `<unk>` 1, Hugging Face's `<pad>` last and
    also the decoder's start) are moved into this project's (pad 0, eos 1,
    bos 2, unk 3) by permuting the embedding rows (`marian_tokenizer.py`).
  * The decoder starts from the model's own start row, stored as BOS's
    embedding row (so training, decoding and the CTranslate2 export all embed
    it first): for a transformers model its `<pad>` row (transformers starts
    from `decoder_start_token_id` = `<pad>`; the row is zero only where its
    converter appended it to a Marian-NMT model, not after training in
    transformers), for a Marian-NMT release a zero row (it starts from a zero
    vector).
  * PAD and BOS get a logits bias of -50 (NEVER), BOS's lowered further by the
    most its row (the start row, through the tied output) can add
    (`largest_logit`): never predicted, and the softmax is Marian's over its
    own vocabulary (Hugging Face's model keeps a little probability on
    `<pad>`, its `final_logits_bias` entry dropped here, and forbids it at
    generation instead).
  * The two SentencePiece models (source, target) through one piece table:
    `marian_tokenizer.MarianTokenizer`, stored in the workdir's `vocab.model`.

The workdir: model_config.json, vocab.model, source.spm, target.spm, the
parameters as its averaged checkpoint (`checkpoints_averaged/0`, what
`--checkpoint=auto` loads) and import.json (where it came from). train.py
refuses to train *in* it (that would replace the imported parameters):
fine-tune into a new workdir with `--config.init_from=<it>`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys

import jax
import numpy as np

from transformer.data import marian_tokenizer
from transformer.interop import run_command
from transformer.interop.marian_formats import (HF_FILES, MarianImportError, MarianModel,
                                                read_hf_directory)
from transformer.interop.marian_release import read_marian_release
from transformer.model.config import TransformerConfig
from transformer.model.transformer import init_params
from transformer.runtime import averaging, checkpoints
from transformer.runtime import workdir as workdir_lib

logger = logging.getLogger(__name__)

# Never predicted: PAD and BOS have no Marian id. exp(-50) is below float32's
# resolution of any softmax, yet small enough that label smoothing, which sums
# every logit, is not swamped (a -1e9 bias would add ~2e9 x eps / V to the loss).
NEVER = -50.0


# ----------------------------------------------------------------------------
# The d_model permutation and the parameters
# ----------------------------------------------------------------------------


def residual_permutation(d_model: int) -> np.ndarray:
  """perm `[d_model]`: dimension k here is Marian's dimension perm[k].

  The paper's table has sin_i at 2i and cos_i at 2i+1; Marian's has sin_i at
  i and cos_i at d/2 + i: so perm[2i] = i, perm[2i + 1] = d/2 + i."""
  half = np.arange(d_model // 2)
  return np.stack([half, d_model // 2 + half], axis=-1).reshape(-1)


def params_from_marian(weights: dict[str, np.ndarray], config: TransformerConfig,
                       decoder_start: np.ndarray | None = None) -> dict:
  """This project's parameter tree (unstacked layers) of Marian `weights`.

  decoder_start: `[d_model]`, Marian's layout (`MarianModel.decoder_start`):
    the row the decoder starts from, stored as BOS's row of the target
    embedding, which both decoder paths (teacher-forced, incremental) and the
    CTranslate2 export embed first. None: zeros, as Marian-NMT starts.
  """
  perm = residual_permutation(config.d_model)
  d, h, dk = config.d_model, config.num_heads, config.head_dim

  def get(name):
    if name not in weights:
      raise MarianImportError(f"the model has no parameter {name!r}")
    return np.asarray(weights[name], np.float32)

  def vector(name):
    return get(name).reshape(-1)

  def attention(prefix):
    def reads(x):  # Q, K, V: [d, d] reading the residual stream
      return {"kernel": get(f"{prefix}_W{x}")[perm].reshape(d, h, dk),
              "bias": vector(f"{prefix}_b{x}").reshape(h, dk)}
    return {"query": reads("q"), "key": reads("k"), "value": reads("v"),
            "out": {"kernel": get(f"{prefix}_Wo")[:, perm].reshape(h, dk, d),
                    "bias": vector(f"{prefix}_bo")[perm]}}

  def norm(prefix):  # post-LN's "<prefix>_ln_scale", pre-LN's "<prefix>_ln_scale_pre"
    suffix = "_pre" if config.normalization == "pre" else ""
    return {"norm": {"scale": vector(f"{prefix}_ln_scale{suffix}")[perm],
                     "bias": vector(f"{prefix}_ln_bias{suffix}")[perm]}}

  def feed_forward(prefix):
    return {"inner": {"kernel": get(f"{prefix}_W1")[perm], "bias": vector(f"{prefix}_b1")},
            "outer": {"kernel": get(f"{prefix}_W2")[:, perm], "bias": vector(f"{prefix}_b2")[perm]}}

  def layer(prefix, cross):
    out = {"self_attention": attention(f"{prefix}_self"),
           "self_attention_norm": norm(f"{prefix}_self_Wo"),
           "feed_forward": feed_forward(f"{prefix}_ffn"),
           "feed_forward_norm": norm(f"{prefix}_ffn_ffn")}
    if cross:
      out["cross_attention"] = attention(f"{prefix}_context")
      out["cross_attention_norm"] = norm(f"{prefix}_context_Wo")
    return out

  def embedding(name, start=None):  # [marian_vocab, d] -> [vocab here, d]: PAD's row zero,
    table = marian_tokenizer.ours_from_marian_rows(get(name)[:, perm], 0.0)
    if start is not None:            # BOS's the decoder's start row (else zero)
      table[marian_tokenizer.BOS_ID] = np.asarray(start, np.float32).reshape(-1)[perm]
    return {"embedding": {"embedding": table}}

  encoder = {f"layers_{i}": layer(f"encoder_l{i + 1}", cross=False)
             for i in range(config.num_encoder_layers)}
  decoder = {f"layers_{i}": layer(f"decoder_l{i + 1}", cross=True)
             for i in range(config.num_decoder_layers)}
  if config.normalization == "pre":
    for side, tree in (("encoder", encoder), ("decoder", decoder)):
      tree["final_norm"] = {"scale": vector(f"{side}_top_ln_scale")[perm],
                            "bias": vector(f"{side}_top_ln_bias")[perm]}
  params = {"encoder": encoder, "decoder": decoder}
  if config.share_embeddings:
    params["embeddings"] = target = embedding("Wemb", decoder_start)
  else:
    params["source_embeddings"] = embedding("encoder_Wemb")
    params["target_embeddings"] = target = embedding("decoder_Wemb", decoder_start)
  vocab = config.vocab_size - 2
  bias = (vector("decoder_ff_logit_out_b") if "decoder_ff_logit_out_b" in weights
          else np.zeros(vocab, np.float32))
  # Marian's softmax has no PAD or BOS; transformers bans <pad> at generation.
  decoder["logits_bias"] = marian_tokenizer.ours_from_marian_rows(bias, NEVER)
  if config.logits_via_embedding:  # the tied output reads BOS's row too: the start row
    bos_output_row = target["embedding"]["embedding"][marian_tokenizer.BOS_ID]
  else:                            # Marian's own output matrix, [vocab, d], BOS's row zero
    projection = marian_tokenizer.ours_from_marian_rows(
        get("decoder_ff_logit_out_Wt")[:, perm], 0.0)
    decoder["output_projection"] = {"kernel": np.ascontiguousarray(projection.T),
                                    "bias": np.zeros(config.vocab_size, np.float32)}
    bos_output_row = projection[marian_tokenizer.BOS_ID]
  # A non-zero start row adds y . row to BOS's logit: lowered by the most that
  # can add, BOS's logit stays <= NEVER whatever the decoder's output y.
  decoder["logits_bias"][marian_tokenizer.BOS_ID] -= largest_logit(
      bos_output_row, **_output_norm(decoder, config))
  _check_tree(params, config)
  return params


def largest_logit(row: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> float:
  """The largest y . row `[d_model]` (or 0 if that is negative) over every
  decoder output y = LayerNorm(x) with this `scale` and `bias` `[d_model]`:
  y = scale * n + bias, n normalised (mean 0, |n|^2 = d var / (var + eps) < d),
  so y . row = n . c + bias . row <= sqrt(d) |c| + bias . row, with c = scale *
  row less its mean (n has none; Cauchy-Schwarz), the supremum (n along c)."""
  row, scale, bias = (np.asarray(x, np.float64) for x in (row, scale, bias))
  c = scale * row
  bound = np.sqrt(row.size) * np.linalg.norm(c - c.mean()) + bias @ row
  return float(max(bound, 0.0))


def _output_norm(decoder: dict, config: TransformerConfig) -> dict:
  """The LayerNorm whose output the logits read: pre-LN's final one, post-LN's
  last layer's feed-forward one. -> {"scale", "bias"} `[d_model]`."""
  if config.normalization == "pre":
    return decoder["final_norm"]
  return decoder[f"layers_{config.num_decoder_layers - 1}"]["feed_forward_norm"]["norm"]


def _check_tree(params: dict, config: TransformerConfig) -> None:
  """The tree has exactly the model's parameter names and shapes."""
  expected = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(
      jax.eval_shape(lambda: init_params(config, jax.random.key(0))))[0]}
  got = {jax.tree_util.keystr(p): x.shape
         for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  for name in sorted(set(expected) | set(got)):
    if expected.get(name) != got.get(name):
      raise MarianImportError(f"parameter {name}: the model needs {expected.get(name, 'none')}, "
                         f"the import made {got.get(name, 'none')}")


def read_model(model: str, *, revision: str | None = None) -> MarianModel:
  """A Marian model from a local directory (Hugging Face or OPUS-MT release)
  or, when no such directory exists, a Hugging Face hub id."""
  if os.path.isdir(model):
    if os.path.exists(os.path.join(model, "decoder.yml")):
      return read_marian_release(model)
    return read_hf_directory(model)
  if os.path.exists(model):
    raise MarianImportError(f"{model} is a file: give the directory of a Hugging Face Marian "
                       "model or of an OPUS-MT release (with decoder.yml)")
  return read_hf_directory(download(model, revision))


def download(repo_id: str, revision: str | None = None) -> str:
  """The local directory of hub model `repo_id` (huggingface_hub's cache)."""
  try:
    import huggingface_hub
  except ImportError:
    raise MarianImportError(f"{repo_id} is not a local directory, and downloading it from the "
                       "Hugging Face hub needs huggingface_hub: pip install "
                       "'transformer[interop]'") from None
  path = huggingface_hub.snapshot_download(
      repo_id, revision=revision,
      allow_patterns=[*HF_FILES, "target_vocab.json", "tokenizer_config.json"])
  if not os.path.exists(os.path.join(path, "model.safetensors")):
    files = huggingface_hub.list_repo_files(repo_id, revision=revision)
    if "pytorch_model.bin" in files:
      raise MarianImportError(
          f"{repo_id} has pytorch_model.bin but no model.safetensors at revision "
          f"{revision or 'main'}: the .bin file is a torch pickle, which this importer does "
          "not read. Look for a safetensors conversion among the repository's pull requests "
          "and pass --revision=refs/pr/<N>")
  return path


def import_model(model: str, workdir: str, *, revision: str | None = None,
                 force: bool = False) -> str:
  """Imports `model` (`read_model`) into a new workdir; returns the workdir.

  Raises FileExistsError if `workdir` already holds a model (`force` replaces
  an imported one; a workdir train.py wrote is never replaced)."""
  source = read_model(model, revision=revision)
  tokenizer = marian_tokenizer.MarianTokenizer(source.source_spm, source.target_spm,
                                               source.pieces)
  try:
    params = params_from_marian(source.weights, source.config, source.decoder_start)
  except MarianImportError as e:
    raise MarianImportError(f"{source.origin}: {e}") from None
  except (ValueError, IndexError, TypeError) as e:  # (a reshape or index of a wrong shape)
    raise MarianImportError(f"{source.origin}: its parameters do not have the shapes its "
                            f"config gives ({type(e).__name__}: {str(e)[:200]})") from None
  _prepare(workdir, force)
  info = {"imported_from": model, "path": source.origin, "revision": revision,
          "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "marian_vocab_size": len(source.pieces)}
  for name, data in ((workdir_lib.MODEL_CONFIG_FILE,
                      json.dumps(source.config.to_dict(), indent=2, sort_keys=True)),
                     (workdir_lib.VOCAB_FILE, tokenizer.serialized_model()),
                     ("source.spm", source.source_spm), ("target.spm", source.target_spm),
                     (workdir_lib.IMPORT_FILE, json.dumps(info, indent=2).encode())):
    workdir_lib.write_file(os.path.join(workdir, name), data)
  averaging.save_averaged(workdir, params, [0], metadata={"imported_from": model})
  logger.info("Imported %s into %s (%d parameters).", model, workdir,
              sum(np.size(x) for x in jax.tree.leaves(params)))
  return workdir


def _prepare(workdir: str, force: bool) -> None:
  if not os.path.exists(os.path.join(workdir, workdir_lib.MODEL_CONFIG_FILE)):
    os.makedirs(workdir, exist_ok=True)
    return
  if not os.path.exists(os.path.join(workdir, workdir_lib.IMPORT_FILE)):
    raise FileExistsError(f"{workdir} holds a model train.py wrote; import into a new "
                          "directory")
  if not force:
    raise FileExistsError(f"{workdir} already holds an imported model; pass --force to "
                          "replace it")
  for name in (checkpoints.AVERAGED_DIR, checkpoints.CHECKPOINT_DIR):
    shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description="Import a Marian / OPUS-MT model (Hugging Face or Marian-NMT format) "
                  "into a workdir that decode.py and train.py --config.init_from read.")
  parser.add_argument("--model", required=True,
                      help="a Hugging Face Marian directory, an OPUS-MT release directory "
                           "(with decoder.yml), or a hub id such as Helsinki-NLP/opus-mt-de-en")
  parser.add_argument("--workdir", required=True, help="the new workdir")
  parser.add_argument("--revision", default=None, help="hub branch, tag or refs/pr/<N>")
  parser.add_argument("--force", action="store_true",
                      help="replace a model imported into --workdir before")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")

  def work() -> int:
    workdir = import_model(args.model, args.workdir, revision=args.revision, force=args.force)
    print(f"Imported {args.model} into {workdir}. Translate: python decode.py "
          f"--workdir={workdir} --input=<file>")
    return 0
  return run_command(work, exit_code=2)


if __name__ == "__main__":
  sys.exit(main())
