"""Data files: the unified precision JSON Schema, the presets and the documented dtype tables.

Installed as the package `fp8dist.schemas` so that an installed wheel finds them (pyproject.toml).
"""
