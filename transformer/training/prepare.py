"""Prepare the training corpus once: the vocabulary, then the training split
tokenized into token shards that training reads from disk (data/prepared.py).

    python -m transformer.training.prepare --config=configs/wmt14_base.py --workdir=runs/base
    python train.py --config=configs/wmt14_base.py --workdir=runs/base   # data.prepared=True

The vocabulary is the one train.py would use (config.vocab_path, init_from's, or
<workdir>/vocab.model, trained there now on config.vocab_max_sentences sentences
evenly spaced over the corpus if missing). The shards go to
config.data.prepared_dir (default <workdir>/prepared). The corpus is streamed:
host memory holds one chunk of pairs, whatever the corpus's size.

With config.data.prepared=True, a single-process train.py prepares them itself
on first use; a multi-process run refuses to start without them (one process
would tokenize for an hour while the others time out waiting): run this first,
once for a directory every host sees, or on every host for workdirs of their own.
"""

from __future__ import annotations

import os
import sys

from transformer.data import prepared
from transformer.data import sources as data_sources
from transformer.runtime import workdir as workdir_lib
from transformer.training import run_setup

PREPARED_DIR = "prepared"  # in the workdir, unless config.data.prepared_dir names another


def prepared_dir(config, workdir: str) -> str:
  """Where the training split's shards are: config.data.prepared_dir or <workdir>/prepared."""
  return config.data.get("prepared_dir", "") or os.path.join(workdir, PREPARED_DIR)


def command(config_path: str = "<your config>", workdir: str = "<workdir>") -> str:
  return f"python -m transformer.training.prepare --config={config_path} --workdir={workdir}"


def train_corpus(config, workdir: str, tokenizer, pairs: data_sources.StreamedPairs, *,
                 may_prepare: bool) -> prepared.PreparedCorpus:
  """The training split's prepared corpus, checked against the vocabulary and
  `pairs` (the corpus, streamed); prepared first if `may_prepare` and it is not
  there yet (PreparedDataError naming the command otherwise)."""
  directory = prepared_dir(config, workdir)
  if prepared.read_manifest(directory) is None:
    if not may_prepare:
      raise prepared.PreparedDataError(
          f"config.data.prepared=True but {directory} is not prepared; with several "
          f"processes prepare it before training: `{command(workdir=workdir)}` (with this "
          "run's --config and overrides), once for a directory every host sees, or on every "
          "host where the workdirs are their own.")
    prepared.prepare(pairs, tokenizer, directory)
  return prepared.open_prepared(directory, tokenizer, pairs)


def prepare(config, workdir: str) -> prepared.PreparedCorpus:
  """The vocabulary (as train.py would make it) and the training split's shards."""
  path = workdir_lib.resolve(workdir)
  path.mkdir(parents=True, exist_ok=True)
  workdir = str(path)
  workdir_lib.check_config(workdir, config.to_dict())
  pairs = data_sources.stream_split(config.data, "train")
  tokenizer = run_setup.get_tokenizer(config, workdir, pairs)
  return train_corpus(config, workdir, tokenizer, pairs, may_prepare=True)


def main(argv=None) -> None:
  import logging
  from absl import app, flags
  from ml_collections import config_flags
  config_flag = config_flags.DEFINE_config_file(
      "config", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
          os.path.abspath(__file__)))), "configs", "default.py"),
      "The training config (configs/*.py) train.py will be given; --config.<field>=...")
  workdir_flag = flags.DEFINE_string("workdir", None, "The workdir train.py will be given.")
  flags.mark_flag_as_required("workdir")

  def run(_):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
      corpus = prepare(config_flag.value, workdir_flag.value)
    except (ValueError, OSError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    m = corpus.manifest
    print(f"{corpus.directory}: {m['num_examples']} pairs, {m['source_tokens']} source + "
          f"{m['target_tokens']} target tokens in {len(m['shards'])} shard(s). Train with "
          "--config.data.prepared=True.")

  app.run(run, argv)


if __name__ == "__main__":
  main()
