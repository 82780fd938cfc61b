"""fp8dist inside other frontends: the audit as an HF Trainer callback (`AuditCallback`); for Accelerate,
`fp8dist.audit.watch` around the first step of an `accelerator.prepare`d loop (README, "Audit any run").

Importing this package imports neither torch nor transformers; each helper loads its module on first use.
"""
from __future__ import annotations

__all__ = ["AuditCallback"]


def __getattr__(name: str):
    if name == "AuditCallback":
        from fp8dist.integrations.trainer import AuditCallback

        return AuditCallback
    raise AttributeError(f"module 'fp8dist.integrations' has no attribute {name!r}")
