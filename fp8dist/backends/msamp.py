"""Microsoft MS-AMP backend, written against MS-AMP v0.4.0 (Azure/MS-AMP 51f34ac: msamp/__init__.py,
msamp/nn/linear.py, msamp/optim/{adam,adamw,adamw_base}.py, msamp/deepspeed/__init__.py,
msamp/deepspeed/runtime/{config,engine}.py).

- Under DeepSpeed (every level, O3 included) the `msamp` section of the translated config is read by
  `msamp.deepspeed.initialize`, imported under an alias: `from msamp import deepspeed` would shadow
  DeepSpeed's namespace (Azure/MS-AMP#183). That initialize calls msamp.initialize itself (O3 as O2).
- Without an engine, O1/O2 go through `msamp.initialize(model, optimizer, opt_level, use_te)`, which
  accepts torch Adam/AdamW only and rejects O3; amsgrad fails at step time, so it is refused here.
- MS-AMP swaps the layers itself, inside those calls. fp8dist's module filter reaches it through the flag
  its LinearReplacer skips on (`use_fp32_linear`); with `use_te` fp8dist swaps to te.Linear first and MS-AMP's
  TeReplacer takes the TE weights, the forward then runs in TE's autocast (MS-AMP's cifar10_deepspeed_te.py).
MS-AMP is not on PyPI, needs a CUDA GPU, and runs real FP8 GEMMs only on GPUs named "H100".
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from fp8dist.backends.base import PrecisionBackend, register
from fp8dist.backends.module_filter import Decision, decide, linear_infos, policy_of
from fp8dist.backends.transformer_engine import TransformerEngine, installed_te_version
from fp8dist.errors import Fp8distError, UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.facts.msamp import (MSAMP_IMAGE, MSAMP_MAX_TE, MSAMP_REJECTED_OPTIMIZER_DEFAULTS, MSAMP_RELEASE_DEEPSPEED,
                                 installed_msamp, msamp_install_hint, msamp_native_fp8, msamp_supports_deepspeed)
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.translate.fsdp2 import FSDP2Plan

NOT_INSTALLED = f"MS-AMP is not installed, and {msamp_install_hint()}"
WHERE_IT_RUNS = (f"write the DeepSpeed JSON with `fp8dist translate CONFIG --to deepspeed --deepspeed-version "
                 f"{fmt(MSAMP_RELEASE_DEEPSPEED)}` and run it with msamp.deepspeed.initialize in MS-AMP's "
                 f"own environment ({MSAMP_IMAGE}); for FP8 in fp8dist's runtime use precision.fp8.backend=te "
                 "on a GPU, or torchao (with emulate=true on a CPU)")
# LinearReplacer._replace leaves an nn.Linear alone when this attribute is true (msamp/nn/linear.py).
KEEP_LINEAR_FLAG = "use_fp32_linear"


def _import_msamp():
    try:
        import msamp
    except Exception as exc:  # its import also loads TE internals and libmsamp_dist.so
        raise UnsupportedEnvironment(f"{NOT_INSTALLED} (`import msamp` failed: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else ''})", WHERE_IT_RUNS) from None
    return msamp


@register
class MSAMP(PrecisionBackend):
    name = "msamp"

    def __init__(self, spec, plan: FSDP2Plan | None = None):
        super().__init__(spec, plan)
        self.te: TransformerEngine | None = TransformerEngine(spec, plan) if spec.fp8.msamp.use_te else None

    def check_environment(self, device: dict[str, Any]) -> None:
        """Every reason MS-AMP cannot run here, in one error: a CPU user learns all that is missing at once."""
        problems = []
        try:
            _import_msamp()
        except UnsupportedEnvironment as exc:
            problems.append(str(exc).split("\n  fix:")[0])
        te = installed_te_version()
        if te is not None and te[:2] > MSAMP_MAX_TE[:2]:
            problems.append(f"Transformer Engine {fmt(te)} is installed: `import msamp` needs TE <= "
                            f"{fmt(MSAMP_MAX_TE[:2])} (it loads transformer_engine_extensions, renamed "
                            "in TE 1.8)")
        ds = versions.installed_version("deepspeed")
        if ds:  # MS-AMP runs on DeepSpeed only (the config rules refuse it elsewhere)
            ok, reason = msamp_supports_deepspeed(parse_version(ds), installed_msamp())
            if not ok:
                problems.append(f"MS-AMP cannot drive the installed DeepSpeed: {reason}")
        if not device.get("cuda_available"):
            problems.append("MS-AMP needs a CUDA GPU; none is visible")
        if problems:
            raise UnsupportedEnvironment("precision.fp8.backend=msamp cannot run here:\n" +
                                         "\n".join(f"  - {p}" for p in problems), WHERE_IT_RUNS)
        native, why = msamp_native_fp8(device.get("name"))
        if not native:
            import logging

            logging.getLogger("fp8dist").warning(why)
        if self.te is not None:
            self.te.check_environment(device)

    def convert_module(self, model) -> list[Decision]:
        """Decide which Linears MS-AMP may take and mark the others; MS-AMP swaps them later, itself."""
        if self.te is not None:
            return self.te.convert_module(model)
        rules = self.spec.fp8.modules
        # No divisibility rule: MS-AMP pads GEMM operands to multiples of 16 (msamp/operators/gemm/gemm.py).
        decisions = decide(linear_infos(model), rules.exclude, rules.skip_first_last, None,
                           speed_rule=self.speed_rule, policy=policy_of(self.spec.fp8))  # overrides: none only
        for decision in decisions:
            setattr(model.get_submodule(decision.fqn), KEEP_LINEAR_FLAG, not decision.convert)
        return [Decision(d.fqn, d.convert, "left to MS-AMP's FP8Linear" if d.convert else d.reason)
                for d in decisions]

    def forward_context(self):
        return self.te.forward_context() if self.te is not None else nullcontext()

    def checkpoint_context_fn(self):
        return self.te.checkpoint_context_fn() if self.te is not None else None

    def prepare_optimizer(self, optimizer) -> bool:
        """Check `optimizer` and make msamp.initialize accept it; True when the low-bit optimizer MS-AMP will
        build needs `restore_decoupled_decay` (see MSAMP_REJECTED_OPTIMIZER_DEFAULTS)."""
        import torch

        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise Fp8distError(f"msamp.initialize accepts torch.optim.Adam/AdamW only, got {type(optimizer).__name__}"
                               "\n  fix: pass a torch.optim.AdamW (or Adam), or none: fp8dist builds optimizer.name")
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise Fp8distError("MS-AMP's low-bit Adam supports amsgrad=False only (msamp/optim/adamw.py)"
                               "\n  fix: create the optimizer with amsgrad=False")
        for key in MSAMP_REJECTED_OPTIMIZER_DEFAULTS:
            optimizer.defaults.pop(key, None)
        return isinstance(optimizer, torch.optim.AdamW) and issubclass(torch.optim.AdamW, torch.optim.Adam)

    @staticmethod
    def restore_decoupled_decay(low_bit_optimizer) -> None:
        """LBAdam differs from LBAdamW only by `use_adam` (msamp/optim/adam.py, adamw.py): turn AdamW's
        decoupled weight decay back on where MS-AMP took an AdamW for an Adam."""
        low_bit_optimizer.use_adam = False

    def initialize(self, model, optimizer):
        """Engine-less O1/O2: msamp.initialize(model, optimizer, opt_level, use_te) -> (model, optimizer)."""
        level = self.spec.fp8.msamp.opt_level
        if level == "O3":
            raise Fp8distError("precision.fp8.msamp.opt_level=O3: O3 exists only inside DeepSpeed ZeRO 1/2, "
                               "msamp.initialize rejects it\n  fix: use fp8dist.engines.deepspeed.initialize "
                               "(engine=deepspeed), or opt_level=O2")
        restore = self.prepare_optimizer(optimizer)
        msamp = _import_msamp()
        model, low_bit = msamp.initialize(model, optimizer, opt_level=level, use_te=self.spec.fp8.msamp.use_te)
        if restore:
            self.restore_decoupled_decay(low_bit)
        return model, low_bit

    def deepspeed_initialize(self, **kwargs):
        """`msamp.deepspeed.initialize(**kwargs)`, imported without shadowing `deepspeed`; same return tuple."""
        restore = self.prepare_optimizer(kwargs["optimizer"])
        _import_msamp()
        from msamp import deepspeed as msamp_deepspeed

        engine, optimizer, dataloader, scheduler = msamp_deepspeed.initialize(**kwargs)
        if restore:  # MSAMPDeepSpeedEngine keeps msamp.initialize's optimizer as basic_optimizer (engine.py)
            self.restore_decoupled_decay(engine.basic_optimizer)
        return engine, optimizer, dataloader, scheduler
