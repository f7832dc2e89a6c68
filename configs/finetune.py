"""Fine-tuning a pretrained model on your own parallel data: a model imported
from OPUS-MT (docs/interop.md) or any workdir train.py wrote.

    python -m transformer.interop.marian --model=Helsinki-NLP/opus-mt-de-en --workdir=runs/opus-de-en
    python train.py --config=configs/finetune.py --workdir=runs/tuned \
        --config.init_from=runs/opus-de-en \
        --config.data.train_path=in_domain.tsv --config.data.eval_path=in_domain_dev.tsv

The model and the vocabulary are init_from's: config.model holds only the
fields a fine-tuning run chooses (dropout, dtype, ...). A fresh Adam, a short warm-up to a rate well below a
training from scratch's, then the paper's inverse-square-root decay; the
average of the last checkpoints is the final model where validation says it is
no worse than the last step (config.keep_average).

Chosen by measurement (docs/interop.md, "Fine-tune it"; benchmarks/bench_finetune.py,
2026-11-25, 2-core CPU): a small-corpus model trained on general software
messages (gettext, 95%), fine-tuned for 300 steps on command-line option help
(the other 5%). learning_rate_scale 0.02 / 0.1 / 0.5 took the option-help test
BLEU from 9.8 to 27.1 / 40.9 / 50.2, and the general test BLEU from 25.6 to
31.4 / 27.0 / 25.0: 0.1 gains most of the domain and loses none of the rest.
That model was trained for 12 minutes only; from a strong model (OPUS-MT) a
smaller rate may keep more: compare 0.02 on your validation set.
"""

import ml_collections

from transformer.configs import default


def get_config():
  config = default.get_config()
  config.init_from = ""          # the workdir whose model is fine-tuned: required
  config.require_init_from = True
  config.data.source = "tsv"

  config.batch_size = 64
  config.max_length = 64
  # Only how the model trains and computes: what it is comes from init_from.
  config.model = ml_collections.ConfigDict(dict(
      dropout_rate=0.1, attention_dropout_rate=0.0, dtype="float32", param_dtype="float32",
      scan_layers=False, remat=False))

  config.num_train_steps = 1000
  config.warmup_steps = 100
  config.learning_rate_scale = 0.1     # peak 6.3e-4 at d_model 256, 4.4e-4 at 512

  config.log_every = 50
  config.eval_every = 100
  config.num_bleu_examples = 200      # greedy, on the first 200 validation pairs
  config.checkpoint_every = 100
  config.keep_checkpoints = 5
  config.average_last = 5
  return config
