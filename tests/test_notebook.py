"""notebooks/transformer_tour.ipynb runs top to bottom and draws its pictures.

The notebook is executed with nbclient in a fresh kernel of *this* interpreter
(a kernelspec written to a temporary directory, so nothing needs to be
installed with `jupyter kernelspec`), with a short training run
(TOUR_TRAIN_STEPS) in a temporary workdir (TOUR_WORKDIR). Cells tagged
"figure" must each produce at least one image/png output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "transformer_tour.ipynb"
TRAIN_STEPS = 30
CELL_TIMEOUT_S = 300
FIGURE_TAG = "figure"


def _tags(cell) -> list[str]:
  return list(cell.get("metadata", {}).get("tags", []))


def _kernel_manager(tmp_path: Path):
  """A KernelManager for a kernel running this very interpreter."""
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager

  kernels = tmp_path / "kernels"
  spec_dir = kernels / "tour-test-python"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "tour test kernel",
      "language": "python",
  }))
  specs = KernelSpecManager(kernel_dirs=[str(kernels)])
  return KernelManager(kernel_name="tour-test-python", kernel_spec_manager=specs)


def _kernel_env(workdir: Path) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update({
      "TOUR_TRAIN_STEPS": str(TRAIN_STEPS),
      "TOUR_WORKDIR": str(workdir),
      "JAX_PLATFORMS": "cpu",
      "PYDEVD_DISABLE_FILE_VALIDATION": "1",
  })
  # The kernel must import this checkout even when it is not pip-installed.
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


def test_notebook_is_saved_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert not cell.get("outputs") and cell.get("execution_count") is None, \
          f"cell {i} of {NOTEBOOK.name} has outputs: clear them before committing"
  figures = [c for c in nb.cells if FIGURE_TAG in _tags(c)]
  assert len(figures) >= 6, "the figure cells must be tagged 'figure'"
  assert all(c.cell_type == "code" for c in figures)


@pytest.mark.slow  # (20-40 s on 2 cores: `python -m pytest -m slow`)
def test_notebook_runs_top_to_bottom_and_draws(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  workdir = tmp_path / "tour"
  env = _kernel_env(workdir)
  for key in [k for k in os.environ if k.startswith(("JAX_", "XLA_"))]:
    monkeypatch.delenv(key)
  for key, value in env.items():
    monkeypatch.setenv(key, value)

  client = nbclient.NotebookClient(
      nb, km=_kernel_manager(tmp_path), timeout=CELL_TIMEOUT_S,
      resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  start = time.perf_counter()
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"a notebook cell failed:\n{e}")
  elapsed = time.perf_counter() - start
  print(f"notebook executed in {elapsed:.0f}s")

  for i, cell in enumerate(nb.cells):
    if cell.cell_type != "code":
      continue
    errors = [o for o in cell.outputs if o.get("output_type") == "error"]
    assert not errors, f"cell {i}: {errors}"
    if FIGURE_TAG in _tags(cell):
      images = [o for o in cell.outputs
                if o.get("output_type") in ("display_data", "execute_result")
                and "image/png" in o.get("data", {})]
      assert images, (f"figure cell {i} drew no image/png; outputs: "
                      f"{[o.get('output_type') for o in cell.outputs]}\n{cell.source}")

  # The training cell really trained, into the workdir it was given.
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines()]
  assert max(r["step"] for r in records) == TRAIN_STEPS
  assert (workdir / "vocab.model").exists()
