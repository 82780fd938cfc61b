"""The audit's `speed` row (info, never a failure): the predicted FP8 / bf16 ratio of the step as it ran, from the
weight GEMMs the audit observed (gemm_flops.WeightGemmLedger: each module's forward shape M x K x N and the format
its GEMMs ran in) and the speed model (fp8dist/speed.py) on the run's GPU (hardware.gpu, or the device's name). The
ratio counts the observed Linears' three GEMMs and the recipe's casts only: attention, norms, the optimizer and
communication are the same on both sides and left out (`fp8dist estimate --gpu` predicts the whole step)."""
from __future__ import annotations

from typing import Any

import fp8dist.speed as speed
from fp8dist.audit.gemm_flops import WeightGemmLedger, is_low_precision
from fp8dist.config.spec import Spec
from fp8dist.errors import Fp8distError
from fp8dist.facts.hardware import run_gpu


def speed_row(spec: Spec, ledger: WeightGemmLedger, device_name: str | None) -> dict[str, Any] | None:
    """{"observed": the ratio or why there is none, "detail": ..., "gpu", "fp8_over_bf16", "losing": [...]}; None
    for a run without FP8 (nothing to compare: no row, the first screen's audit stays as it was)."""
    gpu = run_gpu(spec.hardware.gpu, device_name)
    recipe = spec.fp8.recipe
    base: dict[str, Any] = {"gpu": gpu, "fp8_over_bf16": None, "losing": [], "linears": []}
    if recipe is None:
        return None
    if gpu is None:
        where = device_name or "no GPU (CPU)"
        return {**base, "observed": "no prediction",
                "detail": f"hardware.gpu is auto and this machine's device ({where}) is not a GPU the speed model "
                          f"knows ({', '.join(speed.GPU_NAMES)}); set hardware.gpu to predict for one"}
    try:
        speed.check_supported(recipe[0], gpu, recipe[1])
    except Fp8distError as error:
        return {**base, "observed": "no prediction", "detail": str(error)}
    formats: dict[str, set[str]] = {}
    for (module, fmt), _ in ledger.flops.items():
        formats.setdefault(module, set()).add(fmt)
    bf16_total = ran_total = 0.0
    for module, (m, k, n) in sorted(ledger.shapes.items()):
        if not m:
            continue
        times = speed.linear_times(m, k, n, recipe[0], gpu, backend=recipe[1], compiled=spec.compile)
        in_fp8 = any(is_low_precision(f) for f in formats.get(module, ()))
        bf16_total += times.bf16
        ran_total += times.fp8 if in_fp8 else times.bf16
        row = {"module": module, "m": m, "k": k, "n": n, "format": "fp8" if in_fp8 else "bf16",
               "speedup": round(times.speedup, 3)}
        base["linears"].append(row)
        if in_fp8 and times.speedup < 1.0:
            base["losing"].append(row)
    if not ran_total:
        return {**base, "observed": "no prediction", "detail": "no Linear weight GEMM was observed"}
    ratio = bf16_total / ran_total
    losing = sorted(base["losing"], key=lambda r: r["speedup"])
    said = "; ".join(f"{r['module']} {r['k']}x{r['n']} at M={r['m']}: {r['speedup']:.2f}x" for r in losing[:4])
    more = f" and {len(losing) - 4} more" if len(losing) > 4 else ""
    detail = (f"predicted on {gpu.upper()} ({recipe[0]}, {'compiled' if spec.compile else 'not compiled'}) for the "
              f"{len(base['linears'])} Linears' GEMMs and casts as they ran, against all of them in bf16: "
              f"{ratio:.2f}x the speed" + (f"; FP8 loses on {len(losing)}: {said}{more}" if losing else
                                                   "; no FP8 GEMM predicted to lose"))
    if spec.fp8.emulated:
        detail += " (this run emulated FP8: the prediction is for the GPU named, not this machine)"
    return {**base, "losing": losing, "fp8_over_bf16": round(ratio, 3), "observed": f"{ratio:.2f}x", "detail": detail}
