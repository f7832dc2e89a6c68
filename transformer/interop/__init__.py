"""Interoperability: export to serving engines (CTranslate2, `ctranslate2_export.py`)
and import of Marian / OPUS-MT models (`marian.py`)."""

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
