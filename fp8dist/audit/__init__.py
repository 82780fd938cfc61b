"""The dtype audit: `fp8dist audit MODEL` (fp8dist.commands.audit) and `fp8dist.audit.watch` for any training loop.

Importing this package imports no torch; `watch` and `AuditMismatch` load fp8dist.audit.watching on first use.
"""
from __future__ import annotations

__all__ = ["watch", "Watch", "AuditMismatch"]


def __getattr__(name: str):
    if name in __all__:
        from fp8dist.audit import watching

        return getattr(watching, name)
    raise AttributeError(f"module 'fp8dist.audit' has no attribute {name!r}")
