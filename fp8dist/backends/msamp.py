"""Microsoft MS-AMP backend, written against MS-AMP v0.4.0 (Azure/MS-AMP 51f34ac: msamp/__init__.py,
msamp/deepspeed/__init__.py, msamp/deepspeed/runtime/config.py).

- Under DeepSpeed (every level, O3 included) the `msamp` section of the translated config is read by
  `msamp.deepspeed.initialize`, imported under an alias: `from msamp import deepspeed` would shadow
  DeepSpeed's namespace (Azure/MS-AMP#183). That initialize calls msamp.initialize itself.
- Without an engine, O1/O2 go through `msamp.initialize(model, optimizer, opt_level, use_te)`, which
  accepts torch Adam/AdamW only and rejects O3; amsgrad fails at step time, so it is refused here.
MS-AMP is not on PyPI, needs a CUDA GPU, and runs real FP8 GEMMs only on GPUs named "H100".
"""
from __future__ import annotations

from typing import Any

from fp8dist import compat
from fp8dist.backends.base import PrecisionBackend
from fp8dist.errors import Fp8distError, UnsupportedEnvironment

NOT_INSTALLED = ("MS-AMP is not installed. It is not on PyPI: install it from source "
                 "(github.com/Azure/MS-AMP, v0.4.0) or run in the ghcr.io/azure/msamp:v0.4.0-cuda12.2 image, on a "
                 "CUDA GPU with deepspeed 0.13.1")


def _import_msamp():
    try:
        import msamp
    except Exception as exc:  # its import also loads TE internals and libmsamp_dist.so
        raise UnsupportedEnvironment(f"{NOT_INSTALLED} (`import msamp` failed: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else ''})",
                                     "on a CPU machine use backend=torchao with precision.fp8.torchao.emulate=true") from None
    return msamp


def msamp_deepspeed_initialize():
    """`msamp.deepspeed.initialize`, imported without shadowing `deepspeed`."""
    _import_msamp()
    from msamp import deepspeed as msamp_deepspeed

    return msamp_deepspeed.initialize


class MSAMP(PrecisionBackend):
    name = "msamp"

    def check_environment(self, device: dict[str, Any]) -> None:
        _import_msamp()
        ds = compat.installed_version("deepspeed")
        if self.spec.engine == "deepspeed" and ds:
            ok, reason = compat.msamp_supports_deepspeed(compat.parse_version(ds))
            if not ok:
                raise UnsupportedEnvironment(f"MS-AMP cannot drive the installed DeepSpeed: {reason}",
                                             "pip install deepspeed==0.13.1 (MS-AMP 0.4's pin)")
        if not device.get("cuda_available"):
            raise UnsupportedEnvironment("MS-AMP needs a CUDA GPU; none is visible")
        native, why = compat.msamp_native_fp8(device.get("name"))
        if not native:
            import logging

            logging.getLogger("fp8dist").warning(why)

    def initialize(self, model, optimizer):
        """Engine-less O1/O2: msamp.initialize(model, optimizer, opt_level, use_te) -> (model, optimizer)."""
        import torch

        level = self.spec.fp8.msamp.opt_level
        if level == "O3":
            raise Fp8distError("MS-AMP O3 exists only inside DeepSpeed ZeRO 1/2: use engine=deepspeed")
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise Fp8distError(f"msamp.initialize accepts torch.optim.Adam/AdamW only, got {type(optimizer).__name__}")
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise Fp8distError("MS-AMP's low-bit Adam supports amsgrad=False only")
        msamp = _import_msamp()
        return msamp.initialize(model, optimizer, opt_level=level, use_te=self.spec.fp8.msamp.use_te)
