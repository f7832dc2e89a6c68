"""Interoperability: export to serving engines (CTranslate2, `ctranslate2_export.py`)
and to Hugging Face transformers (`hf_export.py`), and import of Marian /
OPUS-MT models (`marian.py`)."""

import sys
from collections.abc import Callable

import jax
import numpy as np

# What the `interop` extra installs (pyproject.toml), by import name.
EXTRA_MODULES = ("ctranslate2", "safetensors", "huggingface_hub", "yaml")


def missing_extra(error: ModuleNotFoundError) -> str | None:
  """The one-line error for a module of the `interop` extra that is not
  installed, or None for any other missing module (a bug, not the install)."""
  name = (error.name or "").split(".")[0]
  if name not in EXTRA_MODULES:
    return None
  return (f"{name} is not installed; the interop extra installs it: "
          f"pip install -e \".[interop]\" (or pip install \"{name if name != 'yaml' else 'pyyaml'}\")")


def run_command(work: Callable[[], int], exit_code: int) -> int:
  """A command's `work()` (its exit status), with what a user can act on (a
  bad file or option, a missing extra) one line on stderr and `exit_code`,
  not a traceback."""
  try:
    return work()
  except (OSError, ValueError, RuntimeError) as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
  except ModuleNotFoundError as e:
    if (message := missing_extra(e)) is None:
      raise
    print(f"error: {message}", file=sys.stderr)
  return exit_code


def layer_params(stack: dict, count: int, scanned: bool) -> list[dict]:
  """The parameters of each of the `count` layers of an encoder or decoder
  `stack` (its params subtree), `scan_layers`' leading layer axis unstacked."""
  if not scanned:
    return [stack[f"layers_{i}"] for i in range(count)]
  return [jax.tree.map(lambda x, i=i: np.asarray(x)[i], stack["layers"]) for i in range(count)]
