"""Precision backends (one class per backend, one small interface: fp8dist.backends.base.PrecisionBackend).

Importing the package registers every backend (backends.base.BACKENDS), so `get_backend(spec)` finds the one
`precision.fp8.backend` names without the base importing its subclasses. No module here imports torch at import
time.
"""
from fp8dist.backends import msamp, torchao, transformer_engine  # noqa: F401 - registers the backends
