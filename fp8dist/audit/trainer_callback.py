"""The dtype audit as a `transformers.Trainer` callback.

`AuditCallback`: the dtype audit of the first optimizer step of `transformers.Trainer.train()`.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AuditCallback("fp8dist.yaml")])
    trainer.train()                      # step 1 is observed; the table is printed once on rank 0
    trainer.callback_handler.callbacks[-1].report

The watch opens at `on_step_begin` of the first step and closes at its `on_step_end`, so it sees every
micro-batch's forward and backward, the gradient reduction, and the optimizer step, as the Trainer runs them
(transformers 5 trainer.py `_inner_training_loop`). The Trainer hands callbacks the unwrapped model and its
optimizer; the engine is recognised from them (DeepSpeed from its optimizer, FSDP2 from the sharded model,
DDP from the gradient all-reduces on the wire).
"""
from __future__ import annotations

from transformers import TrainerCallback

from fp8dist.audit.watching import watch


class AuditCallback(TrainerCallback):
    """config: fp8dist config (path, dict or Spec) the run is meant to follow. on_mismatch: warn (default:
    one table on rank 0) | raise (fp8dist.audit.AuditMismatch ends `train()` on every rank) | ignore.
    After step 1: `report` (the `fp8dist audit --format json` document) and `passed`."""

    def __init__(self, config, on_mismatch: str = "warn"):
        self.config, self.on_mismatch = config, on_mismatch
        self.report: dict | None = None
        self.passed: bool | None = None
        self._watch = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.report is None and self._watch is None:
            self._watch = watch(model, optimizer, self.config, on_mismatch=self.on_mismatch, verbose=True,
                                name=type(model).__name__)
            self._watch.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._watch is not None:
            audit, self._watch = self._watch, None
            try:
                audit.__exit__(None, None, None)
            finally:
                self.report, self.passed = audit.report, audit.passed
