"""The paper's base model on WMT 2014 English -> German (Table 3, row "base").

Prepare the data once (needs TensorFlow for the build step only):
    pip install tensorflow
    tfds build wmt14_translate/de-en --file_format=array_record
Then (the first command tokenizes the corpus into <workdir>/prepared once; a
single-process train.py would do it itself):
    python -m transformer.training.prepare --config=configs/wmt14_base.py --workdir=runs/base
    python train.py --config=configs/wmt14_base.py --workdir=runs/base

Batches: 96 rows x 256 tokens, packed, = 24,576 source and about as many target
token slots per update: the paper's "approximately 25000 source tokens and
25000 target tokens". On fewer accelerators, keep the product
batch_size x grad_accum_steps at 96 (e.g. --config.batch_size=24
--config.grad_accum_steps=4).
"""

from transformer.configs import default


def get_config():
  config = default.get_config()
  config.data.source = "tfds"
  config.data.tfds_name = "wmt14_translate/de-en"
  config.data.tfds_train_split = "train"
  config.data.tfds_eval_split = "validation"   # newstest2013
  config.data.tfds_test_split = "test"         # newstest2014
  config.data.source_lang = "en"
  config.data.target_lang = "de"
  # Tokenized once into token shards (<workdir>/prepared): 4.5M pairs are not
  # held in memory nor tokenized again every epoch. Several processes: run
  # `python -m transformer.training.prepare` with the same flags first.
  config.data.prepared = True
  # The batches built in grain worker processes, 4 per GPU (one core packs ~0.6
  # of what an H100 trains on); none on a CPU.
  config.data.workers = -1
  config.vocab_size = 37000                    # shared source-target vocabulary
  config.vocab_model_type = "bpe"              # the paper: byte-pair encoding
  config.vocab_max_sentences = 2_000_000

  config.batch_size = 96
  config.max_length = 256
  config.grad_accum_steps = 1

  config.model.update(
      d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6,
      max_len=512, dropout_rate=0.1, dtype="bfloat16")

  config.num_train_steps = 100_000
  config.warmup_steps = 4000
  config.learning_rate_scale = 1.0
  config.label_smoothing = 0.1

  config.log_every = 100
  config.eval_every = 5000
  config.eval_batch_size = 64
  config.num_eval_examples = 0
  config.num_bleu_examples = 1000
  config.eval_decode_method = "beam"
  config.checkpoint_every = 1000               # the paper: every 10 minutes
  config.keep_checkpoints = 5
  config.average_last = 5                      # the paper averaged the last 5
  return config
