"""The paper's big model on WMT 2014 English -> German (Table 3, row "big").

    python train.py --config=configs/wmt14_big.py --workdir=runs/big

d_model 1024, 16 heads, d_ff 4096, dropout 0.3, 300k steps, average of the
last 20 checkpoints. See configs/wmt14_base.py for data preparation.
"""

from transformer.configs import wmt14_base


def get_config():
  config = wmt14_base.get_config()
  config.model.update(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
  config.num_train_steps = 300_000
  config.keep_checkpoints = 20
  config.average_last = 20
  return config
