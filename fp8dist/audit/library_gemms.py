"""Record the GEMMs that Transformer Engine and MS-AMP run.

Their FP8 GEMMs go from Python straight into C++ kernels (cuBLASLt), so a TorchDispatchMode never sees
them. This recorder wraps the Python entry points for as long as it is active, records the operand
formats, calls through unchanged, and puts everything back on exit:
- TE >= 2.0: `general_gemm(A, B, ...)`, imported by name into `transformer_engine.pytorch.module.linear`,
  `layernorm_linear`, `layernorm_mlp` and looked up there at call time (TE 2.20
  transformer_engine/pytorch/cpp_extensions/gemm.py; module/linear.py `wgrad_gemm`);
- TE 1.x (the v1.1 that MS-AMP 0.4 pins for `use_te`): `fp8_gemm(A, A_scale_inv, A_fp8_tensor, A_dtype, B,
  B_scale_inv, B_fp8_tensor, B_dtype, ...)`, imported the same way (TE v1.1 cpp_extensions/gemm.py);
- MS-AMP: the classmethod `msamp.operators.gemm.Gemm.fp8_gemm(mat_a, mat_b, out_qtype, ...)` on
  ScalingTensors; it runs the FP8 kernel only when `Device.is_fp8_supported()` (a GPU named "H100"),
  else it upcasts both operands and runs a 16-bit GEMM (MS-AMP v0.4.0 msamp/operators/gemm/gemm.py).
Only modules already imported are touched: the recorder never imports a library itself.
"""
from __future__ import annotations

import sys
from collections import Counter

from fp8dist.backends.storage import enum_short, is_tensor_like, storage

TE_MODULE_PREFIX = "transformer_engine.pytorch.module."
MSAMP_GEMM_MODULE = "msamp.operators.gemm.gemm"


def _operand(obj) -> str:
    return storage(obj).format if is_tensor_like(obj) else type(obj).__name__


# TE's `layout` names which dimension of A and of B the GEMM contracts: TN (forward: weight [N, K], input [M, K]),
# NN (input gradient: weight [N, K], output gradient [M, N]), NT (weight gradient: input [M, K], output gradient
# [M, N]) (TE 2.20 transformer_engine/pytorch/module/linear.py: the three general_gemm calls and their layouts).
CONTRACTED = {"TN": (-1, -1), "NN": (0, -1), "NT": (0, 0)}


def te_gemm_flops(A, B, layout: str) -> int:
    """2 * M * N * K of one TE GEMM from its operands' logical shapes; 0 where a shape is not known."""
    a_shape, b_shape = tuple(getattr(A, "shape", ())), tuple(getattr(B, "shape", ()))
    if len(a_shape) < 2 or len(b_shape) < 2 or layout not in CONTRACTED:
        return 0
    a_numel, b_numel = _numel(a_shape), _numel(b_shape)
    contracted = a_shape[CONTRACTED[layout][0]]
    return 2 * a_numel * b_numel // max(contracted, 1)


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _te_general_gemm(original, calls: Counter, ledger):
    def general_gemm(A, B, *args, **kwargs):
        formats = (_operand(A), _operand(B))
        calls[("te.general_gemm", formats)] += 1
        if ledger is not None:
            low = [f for f in formats if f.startswith(("fp8", "fp4"))]
            ledger.add_library_gemm("transformer_engine", low[0] if low else formats[0],
                                    te_gemm_flops(A, B, kwargs.get("layout", "TN")))
        return original(A, B, *args, **kwargs)

    return general_gemm


def _te1_fp8_gemm(original, calls: Counter):
    def fp8_gemm(*args, **kwargs):
        a = kwargs.get("A_dtype", args[3] if len(args) > 3 else None)
        b = kwargs.get("B_dtype", args[7] if len(args) > 7 else None)
        calls[("te.fp8_gemm", (enum_short(a), enum_short(b)))] += 1
        return original(*args, **kwargs)

    return fp8_gemm


class LibraryGemmRecorder:
    """Adds `(entry point, (format of A, format of B))` counts to `calls` while active, and TE's GEMM FLOPs to
    `ledger` (fp8dist.audit.gemm_flops). `notes` says when a library computed the recorded FP8 GEMMs in another
    precision (MS-AMP off H100), or left FLOPs uncounted (MS-AMP's GEMM entry point)."""

    def __init__(self, calls: Counter, ledger=None):
        self.calls = calls
        self.ledger = ledger
        self.notes: list[str] = []
        self._restore: list[tuple[object, str, object]] = []

    def _patch(self, owner, attr: str, replacement) -> None:
        self._restore.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def __enter__(self):
        for name, module in list(sys.modules.items()):
            if not name.startswith(TE_MODULE_PREFIX) or module is None:
                continue
            if callable(getattr(module, "general_gemm", None)):
                self._patch(module, "general_gemm", _te_general_gemm(module.general_gemm, self.calls, self.ledger))
            elif callable(getattr(module, "fp8_gemm", None)):
                self._patch(module, "fp8_gemm", _te1_fp8_gemm(module.fp8_gemm, self.calls))
        gemm = getattr(sys.modules.get(MSAMP_GEMM_MODULE), "Gemm", None)
        if gemm is not None:
            self._patch_msamp(gemm)
        return self

    def _patch_msamp(self, gemm_class) -> None:
        original = gemm_class.fp8_gemm  # bound to the class
        calls = self.calls

        def fp8_gemm(cls, mat_a, mat_b, *args, **kwargs):
            calls[("msamp.fp8_gemm", (enum_short(mat_a.qtype), enum_short(mat_b.qtype)))] += 1
            return original(mat_a, mat_b, *args, **kwargs)

        self._patch(gemm_class, "fp8_gemm", classmethod(fp8_gemm))
        self.notes.append("MS-AMP's FP8 GEMMs are counted by calls, not FLOPs (gemm_flops covers aten's GEMMs)")
        device = getattr(sys.modules.get("msamp.common.utils.device"), "Device", None)
        if device is not None and not device.is_fp8_supported():
            from fp8dist.facts.msamp import msamp_native_fp8
            self.notes.append(msamp_native_fp8(_gpu_name())[1])

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None
