"""Pictures: attention heat maps, positional encodings and masks (`attention.py`,
for decode.py --plot_attention and the notebook), learning curves
(`curves.py`), on pyplot-free figures (`figures.py`)."""

from transformer.plotting.attention import (plot_attention, plot_attention_mask,
                                            plot_cross_attention, plot_positional_encoding,
                                            positional_encoding, save_cross_attention_plots)
from transformer.plotting.curves import plot_training_curves, read_metrics
from transformer.plotting.figures import new_figure, save_figure

__all__ = ["plot_attention", "plot_attention_mask", "plot_cross_attention",
           "plot_positional_encoding", "positional_encoding", "save_cross_attention_plots",
           "plot_training_curves", "read_metrics", "new_figure", "save_figure"]
