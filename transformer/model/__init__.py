"""The model: the paper's modules (`transformer.py`, read top to bottom as
Section 3, with the incremental decoding step beside the teacher-forced path),
its hyper-parameters (`config.py`), and what makes it fast without changing
what it computes: the layers (`layers.py`), the decoding cache and its
attention kernel (`kv_cache.py`), the attention implementation per machine
(`attention_choice.py`) and dropout's random bits (`prng.py`)."""

from transformer.model.config import TransformerConfig
from transformer.model.transformer import (MultiHeadAttention, Transformer, count_params,
                                           init_params, scaled_dot_product_attention,
                                           sinusoidal_positional_encoding)

__all__ = ["Transformer", "TransformerConfig", "MultiHeadAttention", "count_params",
           "init_params", "scaled_dot_product_attention", "sinusoidal_positional_encoding"]
