"""A recipe for your own small parallel corpus on modest hardware (a laptop
CPU, a free Colab): tens of thousands of short sentence pairs, 20 minutes.

    python train.py --config=configs/small_corpus.py --workdir=runs/mine \
        --config.data.train_path=train.tsv --config.data.eval_path=valid.tsv \
        --config.data.test_path=test.tsv

Files are `source<TAB>target`, one pair a line (or set data.source=files and
data.train_src / train_tgt ...). The run stops after `train_minutes` in all
(vocabulary, compilation, training, the final averaging and evaluation
included) and ends with the test split's BLEU / chrF, its translations and
curves.png in the workdir.

Chosen by measurement on ../shared/corpora/gettext-en-fr (53k English->French
software messages, 2 CPU cores; docs/benchmarks.md), and
nothing in it tied to the speed of the machine it was tuned on:

  * pre-LN: the paper's post-LN stalled at the unigram level with a short
    warm-up (NLL 6.3 = the targets' unigram entropy for 225 steps); pre-LN
    learns from the first steps, which a 20-minute budget needs.
  * the model's width by this machine's measured speed (model_for_budget,
    training/budget_model.py): the widest of d_model 512 / 256 (the FLAX
    example's size: 4 heads, d_ff 1024) / 128 (d_ff 512), 3 + 3 layers,
    whose training step, timed here, leaves ~700 steps in the budget; a
    narrow model takes ~2.5x the steps on a slow CPU; an 8k unigram SentencePiece
    vocabulary; batches of 64 rows of 64 tokens (sentences of ~10 tokens are
    packed ~5 to a row).
  * the budget's schedule (lr_schedule="budget"): a warm-up over 5% of the
    steps the measured speed affords, 2e-3, then a linear decay to zero over
    the last 30%, fixed when it starts (training/time_budget.py).
  * the average of the decay's last 4 checkpoints, kept only where validation
    says it is no worse than the last step.
  * beam search's length penalty alpha 1.0, not the paper's 0.6: with 0.6
    the translations were short (brevity penalty 0.83-0.93 on validation);
    1.0 was the best, or within 0.1 BLEU of it, at 5 and 20 minutes
    (training/length_choice.py). decode.py uses it for the workdir.
"""

from transformer.configs import default


def get_config():
  config = default.get_config()
  config.data.source = "tsv"
  config.vocab_size = 8000
  config.vocab_model_type = "unigram"

  config.batch_size = 64
  config.max_length = 64
  config.model.update(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                      num_decoder_layers=3, max_len=256, dropout_rate=0.1,
                      normalization="pre")

  config.train_minutes = 20.0
  config.num_train_steps = 1_000_000   # the time budget ends the run
  config.lr_schedule = "budget"        # warm-up, stable, decay: fractions of the run
  config.learning_rate = 2e-3
  config.warmup_fraction = 0.05
  config.decay_fraction = 0.3
  config.model_for_budget = "auto"     # d_model 512, 256 or 128: timed on this machine

  config.log_every = 50
  config.budget_eval_minutes = 5.0    # greedy, on 200 validation pairs
  config.num_bleu_examples = 200
  config.checkpoint_every = 100       # (for a kill; the decay's are saved besides)
  config.keep_checkpoints = 5
  config.average_last = 4             # of the decay: kept only if validation agrees
  config.length_penalty = 1.0         # beam's alpha: measured on validation (length_choice.py)
  return config
