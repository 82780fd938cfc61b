"""The engine interface: what fp8dist's runtime loop, the audit and the checkpoints ask of an engine, in the spirit of
Lightning Fabric's Strategy. Torch-free, so that `import fp8dist` stays light.

An engine is set up from a model and a validated spec (`fp8dist.engines.registry.setup`) and answers:
- `model`: what the training loop calls (FSDP2: the sharded root module; DeepSpeed: the DeepSpeedEngine);
  `optimizer`: what the loop steps; `backend`: the precision backend (fp8dist.backends) and its `decisions`
  (which Linears it converted, and why not the others);
- `accumulate(batches)`: forward and backward over the micro-batches of one optimizer step (the backend's
  forward context, the fp16 loss scaling, gradient sync on the last micro-batch only), returning the mean loss;
- `apply_gradients()`: unscale, clip and step; False when the step was skipped (non-finite fp16 gradients), and
  `skipped_note` then says why;
- `checkpointing(model_name, scheduler)`: its fp8dist.engines.checkpoint.EngineCheckpointing;
- `inspector()`: its fp8dist.engines.inspector.Inspector, which the audit asks where the run keeps its numbers;
- `input_device`: where the batches go.
`train_step(batches)` is written once here: one optimizer step, the first one under the first-step audit.

The first-step audit belongs to a layer above the engines (fp8dist.audit); the engines never import it. It is
handed in: `provide_first_step_audit` is called once by the package's composition root (fp8dist/__init__.py),
and a caller may pass its own with `first_step_audit=` at setup.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager

from fp8dist.config.spec import Spec
from fp8dist.engines.advice import say_policy

AUDIT_MODES = ("warn", "raise", "off")
# (engine, mode) -> a context manager around the first optimizer step; it yields an object whose `report` is the
# audit's report after the block (None when the step was not audited: skipped by fp16 loss scaling).
FirstStepAudit = Callable[["Engine", str], ContextManager[Any]]
_provided: list[FirstStepAudit] = []


def provide_first_step_audit(audit: FirstStepAudit) -> None:
    """Install the default first-step audit (fp8dist.audit's watch); the composition root calls it once."""
    _provided[:] = [audit]


def default_first_step_audit() -> FirstStepAudit | None:
    return _provided[0] if _provided else None


# (spec, the rank's whole model, the first steps' micro-batches, the GPU the speed model predicts for or None, rank)
# -> the spec with precision.fp8.policy auto's calibrated overrides (fp8dist.audit.calibration, a layer above)
Calibrate = Callable[[Spec, Any, list, "str | None", int], Spec]
_calibration: list[Calibrate] = []


def provide_calibration(calibrate: Calibrate) -> None:
    """Install precision.fp8.policy auto's calibration (fp8dist.audit's); the composition root calls it once."""
    _calibration[:] = [calibrate]


def provided_calibration() -> Calibrate | None:
    return _calibration[0] if _calibration else None


class Engine:
    """One prepared run (see the module docstring). Subclasses set `model`, `optimizer`, `backend`, `decisions`."""

    name: ClassVar[str] = ""

    def __init__(self, spec: Spec, backend, decisions: list, *, audit: str | None = None,
                 first_step_audit: FirstStepAudit | None = None):
        self.spec, self.backend, self.decisions = spec, backend, list(decisions)
        say_policy(spec, self.decisions)
        self.audit_mode = audit or spec.audit.first_step
        self.first_step_audit = first_step_audit or default_first_step_audit()
        self.audit_report: dict | None = None  # the report of the audited first step (the first one that stepped)
        # Optimizer steps begun (the next is step_number + 1): precision.schedule switches by it; a resume sets it
        # (fp8dist.engines.checkpoint.resume)
        self.step_number = 0
        self.switch_audited = spec.switch_step is None  # the first step after the schedule's switch is audited too
        self.model: Any = None
        self.optimizer: Any = None

    # -- what each engine provides --------------------------------------------------------------------------
    def accumulate(self, batches: list[dict]) -> float:
        raise NotImplementedError

    def apply_gradients(self) -> bool:
        raise NotImplementedError

    @property
    def skipped_note(self) -> str | None:
        """Why the last step was skipped, or None when it stepped."""
        return None

    def checkpointing(self, model_name: str = "", scheduler=None):
        raise NotImplementedError

    def inspector(self):
        raise NotImplementedError

    @property
    def input_device(self):
        raise NotImplementedError

    # -- probes between steps (engines whose facts say `runs_probes`: fp8dist compare --layer-steps) ---------
    def full_weights(self) -> dict[str, Any]:
        """Every parameter whole, on the CPU, by its state-dict name (each rank gets them all)."""
        raise NotImplementedError

    def weights(self, full: dict[str, Any]) -> ContextManager[None]:
        """The model runs on `full` (another run's `full_weights`) inside the block, on its own weights after it."""
        raise NotImplementedError

    def probe(self, batch: dict) -> tuple[float, float]:
        """Forward and backward of one micro-batch outside the run's steps, its gradients dropped: (the loss, the
        factor the loss was multiplied by before backward: the fp16 loss scale, else 1)."""
        raise NotImplementedError

    # -- written once ---------------------------------------------------------------------------------------
    def train_step(self, batches: list[dict]) -> float:
        """One optimizer step over `batches` (gradient accumulation); returns the mean loss. The first step that
        the optimizer takes runs under the first-step audit unless `audit.first_step` is off; its report is kept
        in `audit_report`."""
        with self.first_step():
            loss = self.accumulate(batches)
            self.apply_gradients()
        return loss

    @contextlib.contextmanager
    def first_step(self):
        """One optimizer step (a loop that runs the halves of a step itself, `accumulate` and `apply_gradients`,
        wraps them in this): counts it and applies precision.schedule at its number (the backend's `at_step`); the
        first-step audit around it until a step has been audited, and again around the first step after the
        schedule's switch. Yields the audit, or None when there is nothing to audit; keeps the first report in
        `audit_report`."""
        self.step_number += 1
        if self.backend is not None:
            self.backend.at_step(self.step_number)
        switch = self.spec.switch_step
        at_switch = not self.switch_audited and switch is not None and self.step_number >= switch
        if (self.audit_report is not None and not at_switch) or self.audit_mode == "off" \
                or self.first_step_audit is None:
            yield None
            return
        with self.first_step_audit(self, self.audit_mode) as audit:
            yield audit
        if getattr(audit, "report", None) is not None:
            self.audit_report = self.audit_report or audit.report
            self.switch_audited = self.switch_audited or at_switch


def training_mode(model) -> None:
    """`model` (and every submodule) in training mode, as a trainer puts it (transformers 5 Trainer.training_step:
    `model.train()`). from_pretrained returns a model in eval mode (modeling_utils.py from_pretrained: `model.eval()`),
    where dropout does nothing: the config's attention / hidden dropout would silently not act for a model loaded
    from a directory or the Hub, while acting for one built from a config (PEFT's adapters, made after loading, are
    in training mode either way)."""
    model.train()


def forward_loss(model, batch: dict):
    """Loss of one batch, as every engine computes it: Hugging Face models return `.loss`; plain modules return the
    loss (or a tensor, whose mean is taken)."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        if hasattr(out, "to_tuple"):  # a Hugging Face ModelOutput without a loss (a base model): its first output
            out = out.to_tuple()
        loss = out if not isinstance(out, (tuple, list)) else out[0]
        loss = loss.float().mean() if loss.dim() else loss
    return loss
