"""Interoperability: export to serving engines (CTranslate2, `ctranslate2_export.py`)."""
