"""Figures without pyplot: the backend choice, a new figure, saving one.

Figures are built with `matplotlib.figure.Figure`, not `pyplot`, so that a
script drawing many of them keeps no global state and leaks no memory, and a
notebook shows each returned figure exactly once. Importing this module selects
the non-interactive Agg backend when there is no display (a server, a test, a
terminal over ssh), unless a backend was chosen already (`MPLBACKEND`, pyplot
imported, or running inside a Jupyter / Colab kernel).
"""

from __future__ import annotations

import io
import os
import sys

import matplotlib


def _choose_backend() -> None:
  """Agg when nothing can show a window and nobody chose a backend yet."""
  if os.environ.get("MPLBACKEND") or "matplotlib.pyplot" in sys.modules:
    return
  if "ipykernel" in sys.modules or "google.colab" in sys.modules:
    return
  headless = (sys.platform.startswith("linux")
              and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")))
  if headless:
    matplotlib.use("Agg")


_choose_backend()

from matplotlib.figure import Figure  # noqa: E402  (after the backend choice)

from transformer.data.text_io import write_atomically  # noqa: E402

MAX_FIGURE_INCHES = 60.0    # keep huge inputs from making unreadable giant images


def new_figure(width: float, height: float) -> Figure:
  """A constrained-layout Figure, scaled down to MAX_FIGURE_INCHES at most."""
  scale = min(1.0, MAX_FIGURE_INCHES / max(width, height))
  return Figure(figsize=(width * scale, height * scale), layout="constrained")


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = 120) -> str:
  """Writes `fig` to `path` (format from the extension, e.g. .png, .pdf, .svg).

  Parent directories are created; the file is written under a temporary name
  and renamed, so it is never seen half-written. Returns the path.
  """
  path = os.fspath(path)
  suffix = os.path.splitext(path)[1] or ".png"
  image = io.BytesIO()
  fig.savefig(image, format=suffix[1:], dpi=dpi)
  write_atomically(path, image.getvalue())
  return path
