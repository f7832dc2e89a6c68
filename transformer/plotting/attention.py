"""Pictures of the model's insides: attention heat maps, positional encodings, masks.

Shared by `decode.py --plot_attention` and the Colab notebook. Every function
returns a `matplotlib.figure.Figure` (or draws into a given `ax` and returns its
figure); save it with `figures.save_figure(fig, path)` or let a notebook display it.

Attention heat maps follow the paper's appendix figures: rows are the target
(query) pieces, columns the source (key) pieces, darker = more attention:

    weights [layers, heads, tgt, src]            (Translator.cross_attention)
    plot_cross_attention(weights, src, tgt)                  one panel per
        decoder layer, the heads averaged (mode="layers", the default)
    plot_cross_attention(weights, src, tgt, mode="heads")    one panel per head
        of one layer (the last by default)
    save_cross_attention_plots(translator, sources, translations, directory)
        one such picture (mode="layers") per sentence, as decode.py writes them
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np
import tqdm

from transformer.plotting.figures import Figure, new_figure, save_figure

ATTENTION_CMAP = "Blues"
CELL_INCHES = 0.28          # size of one heat-map cell
MIN_PANEL_INCHES = 2.4      # smallest panel side


def _label_fontsize(n: int) -> float:
  """Smaller tick labels for long sequences."""
  return float(np.clip(11.0 - 0.08 * n, 5.0, 9.0))


def _as_matrix(x, name: str) -> np.ndarray:
  a = np.asarray(x, dtype=np.float32)
  if a.ndim != 2:
    raise ValueError(f"{name} must be a 2-D [tgt, src] matrix, got shape {a.shape}")
  return a


def _check_tokens(matrix: np.ndarray, source_tokens, target_tokens) -> None:
  if source_tokens is not None and len(source_tokens) != matrix.shape[1]:
    raise ValueError(f"{len(source_tokens)} source tokens for attention weights with "
                     f"{matrix.shape[1]} source (key) positions: shape {matrix.shape}")
  if target_tokens is not None and len(target_tokens) != matrix.shape[0]:
    raise ValueError(f"{len(target_tokens)} target tokens for attention weights with "
                     f"{matrix.shape[0]} target (query) positions: shape {matrix.shape}")


def _panel_size(rows: int, cols: int) -> tuple[float, float]:
  """(width, height) in inches of one heat-map panel with its labels."""
  return (max(MIN_PANEL_INCHES, CELL_INCHES * cols + 1.4),
          max(MIN_PANEL_INCHES, CELL_INCHES * rows + 1.2))


def _heatmap(ax, matrix, x_labels, y_labels, title, vmin, vmax, cmap,
             x_name, y_name):
  image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto",
                    interpolation="nearest")
  rows, cols = matrix.shape
  if x_labels is not None:
    ax.set_xticks(np.arange(cols), labels=[str(t) for t in x_labels], rotation=90,
                  fontsize=_label_fontsize(cols))
  if y_labels is not None:
    ax.set_yticks(np.arange(rows), labels=[str(t) for t in y_labels],
                  fontsize=_label_fontsize(rows))
  ax.tick_params(length=0)
  if x_name:
    ax.set_xlabel(x_name)
  if y_name:
    ax.set_ylabel(y_name)
  if title:
    ax.set_title(title, fontsize=10)
  return image


def plot_attention(weights, source_tokens: Sequence[str] | None,
                   target_tokens: Sequence[str] | None, title: str | None = None,
                   ax=None, *, vmax: float | None = 1.0, colorbar: bool | None = None,
                   cmap: str = ATTENTION_CMAP) -> Figure:
  """Heat map of one attention matrix.

  Args:
    weights: `[tgt, src]` attention weights (each row sums to 1): row i is how
      target position i attends over the source positions.
    source_tokens: `src` labels for the x axis (None: numbered ticks).
    target_tokens: `tgt` labels for the y axis (None: numbered ticks).
    title: panel title.
    ax: draw into this Axes (of any figure, e.g. from pyplot); None: a new Figure.
    vmax: colour of the darkest cell (1.0: weights comparable across plots;
      None: the largest weight of this matrix).
    colorbar: add a colour bar (default: only when a new figure is made).
    cmap: matplotlib colour map.
  Returns:
    The Figure.
  """
  matrix = _as_matrix(weights, "weights")
  _check_tokens(matrix, source_tokens, target_tokens)
  if ax is None:
    fig = new_figure(*_panel_size(*matrix.shape))
    ax = fig.add_subplot()
    colorbar = True if colorbar is None else colorbar
  fig = ax.figure
  image = _heatmap(ax, matrix, source_tokens, target_tokens, title, 0.0, vmax, cmap,
                   "source", "target")
  if colorbar:
    fig.colorbar(image, ax=ax, shrink=0.8)
  return fig


def plot_cross_attention(weights, source_tokens: Sequence[str] | None,
                         target_tokens: Sequence[str] | None, mode: str = "layers",
                         *, layer: int = -1, title: str | None = None,
                         vmax: float | None = 1.0, cmap: str = ATTENTION_CMAP) -> Figure:
  """Grid of encoder-decoder attention heat maps, as in the paper's appendix.

  Args:
    weights: `[layers, heads, tgt, src]` (e.g. `Translator.cross_attention`).
    source_tokens, target_tokens: axis labels (`src` and `tgt` of them).
    mode: "layers": one panel per decoder layer, its heads averaged;
      "heads": one panel per head of decoder layer `layer`.
    layer: the layer shown in "heads" mode (default: the last one).
    title: figure title (e.g. the sentence).
    vmax: as in `plot_attention`; all panels share one colour scale and one bar.
    cmap: matplotlib colour map.
  Returns:
    The Figure: the panels in order (row-major grid, at most 4 per row), then
    one colour bar, in `fig.axes`.
  """
  w = np.asarray(weights, dtype=np.float32)
  if w.ndim != 4:
    raise ValueError(f"weights must be [layers, heads, tgt, src], got shape {w.shape}")
  num_layers, num_heads = w.shape[:2]
  if mode == "layers":
    panels = w.mean(axis=1)
    names = [f"layer {i + 1} (mean of {num_heads} heads)" for i in range(num_layers)]
  elif mode == "heads":
    if not -num_layers <= layer < num_layers:
      raise ValueError(f"layer={layer}: the weights have {num_layers} layers")
    index = layer % num_layers
    panels = w[index]
    names = [f"layer {index + 1}, head {h + 1}" for h in range(num_heads)]
  else:
    raise ValueError(f"mode={mode!r}: choose 'layers' or 'heads'")
  _check_tokens(panels[0], source_tokens, target_tokens)

  n = len(panels)
  ncols = min(n, 4)
  nrows = math.ceil(n / ncols)
  pw, ph = _panel_size(*panels[0].shape)
  fig = new_figure(pw * ncols + 0.8, ph * nrows + (0.4 if title else 0.0))
  axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
  image = None
  for k, ax in enumerate(axes.flat):
    if k >= n:
      fig.delaxes(ax)
      continue
    row, col = divmod(k, ncols)
    image = _heatmap(ax, panels[k], source_tokens, target_tokens, names[k], 0.0, vmax,
                     cmap, "source" if row == nrows - 1 else None,
                     "target" if col == 0 else None)
    # sharex/sharey hide inner tick labels: show them on every panel, the
    # pieces are what one reads.
    ax.tick_params(labelbottom=True, labelleft=True)
  fig.colorbar(image, ax=[a for a in axes.flat[:n]], shrink=0.8)
  if title:
    fig.suptitle(title, fontsize=11)
  return fig


def positional_encoding(max_len: int, d_model: int) -> np.ndarray:
  """`[max_len, d_model]` table of `model.sinusoidal_positional_encoding`."""
  import jax.numpy as jnp

  from transformer.model.transformer import sinusoidal_positional_encoding

  return np.asarray(sinusoidal_positional_encoding(jnp.arange(max_len), d_model))


def plot_positional_encoding(max_len: int, d_model: int, ax=None,
                             title: str | None = None) -> Figure:
  """The sinusoidal positional encoding (Section 3.5) as a positions x dimensions picture.

  Dimension 2i is sin(pos / 10000^(2i/d_model)) and 2i+1 the cosine: the
  wavelengths grow geometrically from 2*pi (left) to 10000 * 2*pi (right).
  """
  if max_len < 1 or d_model < 2 or d_model % 2:
    raise ValueError(f"max_len={max_len} must be >= 1 and d_model={d_model} even and >= 2")
  table = positional_encoding(max_len, d_model)
  if ax is None:
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
  fig = ax.figure
  image = ax.imshow(table, cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto",
                    interpolation="nearest")
  ax.set_xlabel("dimension")
  ax.set_ylabel("position")
  ax.set_title(title or f"sinusoidal positional encoding (d_model={d_model})", fontsize=10)
  fig.colorbar(image, ax=ax)
  return fig


def plot_attention_mask(mask, tokens: Sequence[str] | None = None, ax=None,
                        title: str | None = None) -> Figure:
  """Which keys (columns) each query (row) may attend to, e.g. the decoder's causal mask.

  Args:
    mask: `[q_length, kv_length]` booleans (True = visible); leading size-1
      axes, as in `model.attention_mask` output `[1, 1, q, kv]`, are dropped.
    tokens: labels for both axes (self-attention), or None.
  """
  m = np.asarray(mask)
  while m.ndim > 2 and m.shape[0] == 1:
    m = m[0]
  if m.ndim != 2:
    raise ValueError(f"mask must be [q_length, kv_length], got shape {np.shape(mask)}")
  if tokens is not None and (len(tokens) != m.shape[0] or len(tokens) != m.shape[1]):
    raise ValueError(f"{len(tokens)} tokens for a mask of shape {m.shape}")
  if ax is None:
    fig = new_figure(*_panel_size(*m.shape))
    ax = fig.add_subplot()
  fig = ax.figure
  _heatmap(ax, m.astype(np.float32), tokens, tokens, title or "attention mask", 0.0, 1.0,
           "Greys", "key position", "query position")
  return fig


def save_cross_attention_plots(translator, sources: Sequence[str], translations: Sequence[str],
                               directory: str, *, progress: bool = False,
                               first_line: int = 0) -> int:
  """Writes `<directory>/<first_line + i + 1>.png` for every non-empty source i: the
  encoder-decoder attention of `translations[i]` (`translator.cross_attention`,
  a `translation.Translator`'s), one panel per decoder layer with its heads
  averaged. Shows a tqdm bar on stderr with `progress`. Returns how many
  pictures were written."""
  todo = [i for i, source in enumerate(sources) if source.strip()]
  for i in tqdm.tqdm(todo, desc="plot", unit="sent", disable=not progress,
                     dynamic_ncols=True):
    source_pieces, target_pieces, weights = translator.cross_attention(
        sources[i], translations[i])
    fig = plot_cross_attention(weights, source_pieces, target_pieces, mode="layers",
                               title=f"line {first_line + i + 1}: encoder-decoder attention")
    save_figure(fig, os.path.join(directory, f"{first_line + i + 1}.png"))
  return len(todo)
