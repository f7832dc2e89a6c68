"""Tests of transformer/plotting/attention.py: the right panels, labels and data; readable PNGs."""

import os

import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from transformer import plotting

SRC = ["▁one", "▁red", "▁cat", "</s>"]
TGT = ["▁eine", "▁rote", "▁Katze", "▁", "</s>"]


def _weights(layers=3, heads=2, tgt=len(TGT), src=len(SRC), seed=0):
  rng = np.random.default_rng(seed)
  return rng.dirichlet(np.ones(src), size=(layers, heads, tgt)).astype(np.float32)


def _labels(ax):
  return ([t.get_text() for t in ax.get_xticklabels()],
          [t.get_text() for t in ax.get_yticklabels()])


def _image_data(ax):
  return np.asarray(ax.images[0].get_array())


def _png(path):
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[2] in (3, 4)
  return image


def _assert_not_blank(image):
  rgb = image[..., :3].reshape(-1, 3)
  assert rgb.std() > 0.05
  assert len(np.unique(np.round(rgb, 2), axis=0)) > 10


def test_plot_attention_one_matrix():
  w = _weights()[0, 0]
  fig = plotting.plot_attention(w, SRC, TGT, title="hello")
  assert isinstance(fig, Figure)
  assert len(fig.axes) == 2  # the heat map and its colour bar
  ax = fig.axes[0]
  assert _labels(ax) == (SRC, TGT)
  np.testing.assert_allclose(_image_data(ax), w)
  assert ax.get_title() == "hello"


def test_plot_attention_into_given_axes():
  fig = Figure()
  ax1, ax2 = fig.subplots(1, 2)
  w = _weights()[0, 1]
  assert plotting.plot_attention(w, SRC, TGT, ax=ax2) is fig
  assert len(fig.axes) == 2  # no colour bar added to someone else's figure
  assert not ax1.images and _labels(ax2) == (SRC, TGT)


def test_plot_attention_checks_token_counts():
  w = _weights()[0, 0]
  with pytest.raises(ValueError, match="source"):
    plotting.plot_attention(w, SRC[:-1], TGT)
  with pytest.raises(ValueError, match="target"):
    plotting.plot_attention(w, SRC, TGT + ["x"])
  with pytest.raises(ValueError, match="2-D"):
    plotting.plot_attention(_weights(), SRC, TGT)


@pytest.mark.parametrize("layers,heads", [(3, 2), (1, 4), (6, 8)])
def test_plot_cross_attention_layers(layers, heads):
  w = _weights(layers, heads)
  fig = plotting.plot_cross_attention(w, SRC, TGT, title="sentence")
  panels = fig.axes[:-1]
  assert len(fig.axes) == layers + 1  # one panel per layer + one shared colour bar
  for k, ax in enumerate(panels):
    assert _labels(ax) == (SRC, TGT)
    np.testing.assert_allclose(_image_data(ax), w[k].mean(axis=0), rtol=1e-6)
    assert ax.get_title().startswith(f"layer {k + 1}")


def test_plot_cross_attention_heads():
  w = _weights(3, 4)
  fig = plotting.plot_cross_attention(w, SRC, TGT, mode="heads")
  assert len(fig.axes) == 4 + 1
  for h, ax in enumerate(fig.axes[:-1]):
    assert _labels(ax) == (SRC, TGT)
    np.testing.assert_allclose(_image_data(ax), w[-1, h])  # the last layer's heads
  fig = plotting.plot_cross_attention(w, SRC, TGT, mode="heads", layer=0)
  np.testing.assert_allclose(_image_data(fig.axes[1]), w[0, 1])
  with pytest.raises(ValueError, match="mode"):
    plotting.plot_cross_attention(w, SRC, TGT, mode="rows")
  with pytest.raises(ValueError, match="layer"):
    plotting.plot_cross_attention(w, SRC, TGT, mode="heads", layer=3)
  with pytest.raises(ValueError, match="layers, heads"):
    plotting.plot_cross_attention(w[0], SRC, TGT)


def test_plot_positional_encoding_is_the_papers_formula():
  fig = plotting.plot_positional_encoding(50, 16)
  assert len(fig.axes) == 2
  table = _image_data(fig.axes[0])
  assert table.shape == (50, 16)  # positions x dimensions
  pos = np.arange(50)[:, None].astype(np.float64)
  i = np.arange(8)[None, :]
  angles = pos / 10000.0 ** (2 * i / 16)
  np.testing.assert_allclose(table[:, 0::2], np.sin(angles), atol=1e-5)
  np.testing.assert_allclose(table[:, 1::2], np.cos(angles), atol=1e-5)
  with pytest.raises(ValueError):
    plotting.plot_positional_encoding(10, 15)


def test_plot_attention_mask_causal():
  from transformer.model.transformer import attention_mask
  import jax.numpy as jnp

  segments = jnp.ones((1, 5), jnp.int32)
  mask = attention_mask(segments, segments, causal=True)  # [1, 1, 5, 5]
  tokens = ["<s>", "a", "b", "c", "d"]
  fig = plotting.plot_attention_mask(mask, tokens)
  ax = fig.axes[0]
  np.testing.assert_array_equal(_image_data(ax), np.tril(np.ones((5, 5))))
  assert _labels(ax) == (tokens, tokens)
  with pytest.raises(ValueError):
    plotting.plot_attention_mask(mask, tokens[:3])


def test_save_figure_writes_readable_png(tmp_path):
  w = _weights(2, 2)
  path = tmp_path / "sub" / "attention.png"
  fig = plotting.plot_cross_attention(w, SRC, TGT)
  assert plotting.save_figure(fig, path) == str(path)
  image = _png(path)
  assert image.shape[0] > 100 and image.shape[1] > 200
  _assert_not_blank(image)
  assert os.listdir(tmp_path / "sub") == ["attention.png"]  # no temp file left

  # The picture shows the data: other weights, other pixels.
  other = tmp_path / "other.png"
  plotting.save_figure(plotting.plot_cross_attention(_weights(2, 2, seed=1), SRC, TGT), other)
  other_image = _png(other)
  assert other_image.shape == image.shape
  assert np.abs(other_image - image).max() > 0.1

  pe = tmp_path / "pe.png"
  plotting.save_figure(plotting.plot_positional_encoding(64, 32), pe)
  _assert_not_blank(_png(pe))


def test_training_curves_from_metrics_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(
      '{"step": 10, "split": "train", "time": 100.0, "loss": 5.0, "minutes": 0.5}\n'
      '{"step": 20, "split": "train", "time": 160.0, "loss": 4.0, "minutes": 1.5}\n'
      '{"step": 20, "split": "eval", "time": 170.0, "loss": 4.5, "bleu": 12.0, "minutes": 1.7}\n'
      '{"step": 20, "split": "test", "time": 180.0, "bleu": 14.0, "chrf": 40.0, "minutes": 2.0}\n'
      '{"step": 30, "split": "tra')          # a line cut short by a killed run
  records = plotting.read_metrics(path)
  assert [r["split"] for r in records] == ["train", "train", "eval", "test"]
  fig = plotting.plot_training_curves(records, title="run")
  loss_ax, bleu_ax = fig.axes
  lines = {line.get_label(): line for line in loss_ax.lines}
  assert list(lines["train"].get_xdata()) == [10, 20]
  assert list(lines["train"].get_ydata()) == [5.0, 4.0]
  assert list(lines["validation"].get_ydata()) == [4.5]
  bleu = {line.get_label(): line for line in bleu_ax.lines}
  assert list(bleu["validation"].get_xdata()) == [1.7]   # minutes, not steps
  assert list(bleu["test"].get_ydata()) == [14.0]
  # Without "minutes" (older records): minutes since the first record.
  old = [dict(r) for r in records]
  for r in old:
    r.pop("minutes")
  bleu = {l.get_label(): l for l in plotting.plot_training_curves(old).axes[1].lines}
  assert list(bleu["validation"].get_xdata()) == [pytest.approx((170.0 - 100.0) / 60)]
