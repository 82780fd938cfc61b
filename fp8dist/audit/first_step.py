"""The audit of an engine's first optimizer step (fp8dist.engines.base.Engine.train_step), handed to the engines
by the package's composition root (fp8dist/__init__.py): the step runs under `fp8dist.audit.watch`, its table is
printed once on rank 0 and `mode` (warn | raise) is applied. A step the optimizer did not take (non-finite fp16
gradients: nothing stepped, no gradients or states to show) has its observation dropped, and the next step is
audited instead."""
from __future__ import annotations

import contextlib

from fp8dist.audit.watching import watch


@contextlib.contextmanager
def first_step_audit(engine, mode: str):
    """Yields the Watch; its `report` is None afterwards when the step was skipped."""
    with watch(engine.model, engine.optimizer, engine.spec, on_mismatch="defer",
               step=getattr(engine, "step_number", 1) or 1) as audit:
        yield audit
    if engine.skipped_note is not None:
        audit.report = None
        return
    audit.conclude(mode, verbose=True)
