"""The embedded demo: English number phrases -> German, offline, minutes on a CPU
(the task: transformer/data/demo_task.py).

    python train.py                          # this config, workdir runs/demo
    python train.py --config.num_train_steps=200 --config.model.d_model=64

Every field can be overridden with --config.<field>=<value>.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Data (transformer/data/pipeline.py: load_split documents every source's fields).
  config.data = ml_collections.ConfigDict(dict(
      source="demo",            # demo | tsv | files | tfds
      demo_seed=0, demo_num_train=20_000, demo_num_eval=500, demo_num_test=500,
      train_path="", eval_path="", test_path="",             # tsv
      train_src="", train_tgt="", eval_src="", eval_tgt="",  # files
      test_src="", test_tgt="",
      tfds_name="", tfds_train_split="train", tfds_eval_split="validation",
      tfds_test_split="test", source_lang="en", target_lang="de", tfds_data_dir="",
      # True: train from the training split tokenized once into token shards on disk
      # (python -m transformer.training.prepare; automatic on first use with one
      # process): host memory flat in the corpus's size, nothing re-tokenized.
      prepared=False,
      prepared_dir="",          # empty: <workdir>/prepared
      # Grain worker processes building the training batches (0: in this process;
      # -1: auto, 4 per GPU/TPU and 0 on a CPU). Each count gives its own batches:
      # a run resumes with the count it started with.
      workers=0,
  ))
  config.vocab_path = ""        # empty: train SentencePiece into <workdir>/vocab.model
  # Fine-tuning: start from another workdir's parameters (its checkpoint
  # "auto" chooses) with a fresh optimizer and that workdir's vocabulary.
  config.init_from = ""
  config.vocab_size = 400       # pieces of the trained vocabulary (a soft limit)
  # BPE splits the demo's compounds into morpheme-like pieces
  # ("dreihundert zwei undvierzig"); "unigram" is SentencePiece's default.
  config.vocab_model_type = "bpe"

  # Batches: `batch_size` rows of `max_length` tokens (packed), per update
  # `grad_accum_steps` of them.
  config.batch_size = 64
  config.max_length = 32
  config.pack = True
  config.grad_accum_steps = 1
  # How the parameters and Adam state sit on the devices: "replicated" (each
  # device a copy) or "fsdp" (split over the devices: ~1/n each, for models that
  # do not fit replicated; parameters gathered and gradients reduce-scattered
  # once per update).
  config.state_sharding = "replicated"
  # Several processes: whether they share one workdir ("yes": a shared disk or a
  # bucket), each have their own ("no"), or "auto": found out at the start with a
  # marker file (say "yes" where a network disk is too slow to show it).
  config.shared_workdir = "auto"

  # The model (transformer.model.TransformerConfig fields; vocab_size and the
  # special ids come from the vocabulary).
  config.model = ml_collections.ConfigDict(dict(
      d_model=128, num_heads=4, d_ff=512, num_encoder_layers=3, num_decoder_layers=3,
      max_len=128, dropout_rate=0.1, attention_dropout_rate=0.0,
      share_embeddings=True, logits_via_embedding=True, normalization="post",
      activation="relu", positional="sinusoidal", dtype="float32",
      param_dtype="float32", scan_layers=False, remat=False,
      layer_norm_epsilon=1e-5,  # torch's, which transformers' models fix (interop/hf_export.py)
  ))

  # Optimisation (the paper's Adam and schedule; scale 1 = the paper's rate).
  config.num_train_steps = 400
  config.train_minutes = 0.0   # > 0: stop in time to save, average and evaluate within it
  # "paper": lr = learning_rate_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
  # "budget" (needs train_minutes): warm-up over warmup_fraction of the steps the
  # measured speed affords, learning_rate, then a linear decay to zero over the
  # last decay_fraction of the run (training/time_budget.py).
  config.lr_schedule = "paper"
  config.warmup_steps = 1000   # still warming up at the end: a gentle, steady rise
  config.learning_rate_scale = 1.0
  config.learning_rate = 1e-3   # "budget": the peak
  config.warmup_fraction = 0.05
  config.decay_fraction = 0.3
  config.budget_eval_minutes = 5.0  # "budget": an evaluation every N minutes (not eval_every)
  # "auto" (with train_minutes): config.model's width chosen from this machine's
  # measured speed, the largest that the budget trains for enough steps
  # (training/budget_model.py); "": config.model as it is.
  config.model_for_budget = ""
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.grad_clip_norm = 0.0   # 0 = off (the paper does not clip)
  config.label_smoothing = 0.1
  config.seed = 0

  # Logging, evaluation, checkpoints.
  config.log_every = 50
  config.eval_every = 200
  config.eval_batch_size = 64
  config.num_eval_examples = 0        # 0 = the whole validation split (loss)
  config.num_bleu_examples = 200      # validation sentences decoded for BLEU
  config.eval_decode_method = "greedy"
  config.eval_beam_size = 4
  config.checkpoint_every = 200
  config.keep_checkpoints = 3
  config.average_last = 1             # >1: average the last N checkpoints at the end
  # "if_no_worse": the average is the final model only where its validation
  # BLEU (else loss) is no worse than the last step's; "always": as the paper.
  config.keep_average = "if_no_worse"
  # The report at the end, when the data has a test split: BLEU, chrF and the
  # translations of the final (averaged) model, and curves.png.
  config.test_report = True
  config.test_decode_method = "beam"  # with eval_beam_size (decode.py's default, beam 4)
  # Beam search's length penalty (alpha) for the test split and, where it is
  # not the paper's 0.6, decode.py's default for the workdir (decoding.json);
  # or the candidates tried at the end on the validation BLEU pairs, the best
  # kept (training/length_choice.py; (): none tried).
  config.length_penalty = 0.6
  config.length_penalty_candidates = ()
  return config
