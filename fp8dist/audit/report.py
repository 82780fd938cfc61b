"""Compare observed with expected dtypes and render the result as a table, JSON or markdown."""
from __future__ import annotations

from typing import Any

from fp8dist.audit.expected import MULTI_RANK_PHASES, expected, normalize, numerics_expected
from fp8dist.backends.module_filter import ADAPTER_REASON
from fp8dist.config.parallel import PP
from fp8dist.config.spec import Spec


OK, MISMATCH, NOT_MEASURED = "ok", "MISMATCH", "NOT MEASURED"


def build(spec: Spec, model: str, observed: dict[str, Any], nproc: int,
          outside: dict[str, str] | None = None, data_size: int | None = None) -> dict[str, Any]:
    """One check per phase, the engine that ran first. A row is `ok` only when it was measured and matches:
    a value read from a setting, or no probe result at all, is NOT MEASURED and keeps the verdict from PASS.
    `outside`: phases that happen before the observed block (phase -> why), left out of the checks and said.
    `data_size`: the data-parallel ranks, whose gradients reduce (default: all `nproc` ranks). A row whose cell has
    `layouts` (the optimizer's block-quantized states: codes dtype, block size, scale dtype per state key) keeps
    them."""
    outside = outside or {}
    checks = []
    rows = {"engine": (spec.engine, "engine (recognised from the prepared model and optimizer)"),
            **expected(spec, data_size or nproc)}
    if "numerics" in observed:  # a step watched with numerics=True
        rows["numerics"] = numerics_expected(spec)
    for phase, (want, why) in rows.items():
        if phase in outside:
            continue
        got = observed.get(phase) or {"observed": "not observed", "detail": "no probe result for this phase",
                                      "measured": False}
        want, why = got.get("expects", (want, why))  # what the run asked for, where the config decided per module
        matches = normalize(got["observed"]) == normalize(want) and not got.get("fails")  # fails: the policy check
        status = NOT_MEASURED if not got["measured"] else (OK if matches else MISMATCH)
        checks.append({"phase": phase, "expected": want, "observed": got["observed"], "ok": status == OK,
                       "status": status, "why": why, "detail": got["detail"], "measured": got["measured"],
                       **({"layouts": got["layouts"]} if "layouts" in got else {})})
    ranks = data_size or nproc
    every = expected(spec, 2) if ranks < 2 else {}  # what 2 ranks would check: the rows 1 rank has nothing to observe
    not_observed = {phase: {"expected": want, "why": why, "detail": f"{ranks} data-parallel rank: nothing reduces or "
                            f"all-gathers, so this row was not observed ({more_ranks(nproc, ranks)})"}
                    for phase, (want, why) in every.items() if phase in MULTI_RANK_PHASES and phase not in outside}
    per_param = {k: round(v, 2) for k, v in observed.get("_bytes", {}).items()}
    return {"passed": all(c["ok"] for c in checks), "not_observed": not_observed, "model": model, "engine": spec.engine,
            "config": spec.source, "preset": spec.precision.preset, "nproc": nproc, "checks": checks,
            "bytes_per_param": per_param, "parameters": observed.get("_parameters"),
            "frozen_bytes_per_param": observed.get("_frozen_bytes"),
            "frozen_bytes_by_format": observed.get("_frozen_bytes_by_format"),
            "fp8_modules": observed.get("_decisions", []),
            "gemm_flops": observed.get("_gemm_flops"), "fp8_emulated": bool(observed.get("_fp8_emulated")),
            "communication_bytes": observed.get("_comm"),
            "communication_bytes_by_axis": observed.get("_comm_axes"), "outside_scope": outside,
            "kernel_matmuls": observed.get("_kernel_matmuls"),
            "speed": observed.get("_speed"),
            **({"numerics": observed["_numerics"]} if "_numerics" in observed else {})}


def shown(result: dict[str, Any], check: dict[str, Any]) -> str:
    """The observed cell as the table shows it: the gemm row says when its FP8 GEMMs were emulated."""
    emulated = check["phase"] == "gemm" and result.get("fp8_emulated")
    return f"{check['observed']} (emulated)" if emulated else check["observed"]


def table(result: dict[str, Any]) -> str:
    head = (f"fp8dist audit: {result['model']} on {result['engine']} ({result['nproc']} process"
            f"{'es' if result['nproc'] > 1 else ''}), config {result['config']}"
            + (f", preset {result['preset']}" if result["preset"] else ""))
    rows = [("phase", "expected", "observed", ""), ("-----", "--------", "--------", "")]
    rows += [(c["phase"], c["expected"], shown(result, c), c["status"]) for c in result["checks"]]
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [head, ""] + ["  ".join(str(r[i]).ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    for c in result["checks"]:
        if c["status"] == MISMATCH:
            lines.append(f"  ! {c['phase']}: expected {c['expected']} ({c['why']}), observed {c['observed']}: "
                         f"{c['detail']}")
        elif c["status"] == NOT_MEASURED:
            lines.append(f"  ? {c['phase']}: not measured ({c['detail']}); it cannot count as a match")
    if result["bytes_per_param"]:
        lines.append("")
        lines.append("bytes per parameter: " + ", ".join(f"{k} {v}" for k, v in result["bytes_per_param"].items()))
    counts = result.get("parameters")
    if counts and counts["frozen"]:
        by_format = result.get("frozen_bytes_by_format") or {}
        lines.append(f"parameters: {counts['trainable']:,} trainable (the bytes above), {counts['frozen']:,} frozen at "
                     f"{result['frozen_bytes_per_param']} bytes per parameter"
                     + (f" ({', '.join(f'{fmt} {v:g}' for fmt, v in by_format.items())})" if len(by_format) > 1
                        else ""))
    pipeline = result.get("pipeline")
    if pipeline:
        measured = ", ".join(f"rank {rank} {idle:.1%}" for rank, idle in pipeline["bubble_measured_by_rank"].items()
                             if idle is not None)
        by_axis = (result.get("communication_bytes_by_axis") or {}).get(PP, {})
        sent = ", ".join(f"{dtype} {cell['bytes']:,} B" for dtype, cell in by_axis.get("send", {}).items())
        lines.append(f"pipeline: {pipeline['stages']} stages, {pipeline['schedule']}, {pipeline['microbatches']} "
                     f"microbatches; bubble (idle fraction) {measured or 'not measured'}, theory "
                     f"{pipeline['bubble_theory']:.1%}" + (f"; sent between stages by rank 0: {sent}" if sent else ""))
    flops = result.get("gemm_flops")
    if flops and flops["weight_gemm_flops"]:
        formats = ", ".join(f"{fmt} {share:.1%}" for fmt, share in flops["by_format"].items())
        asked = (flops.get("policy") or {}).get("asked_fp8_share")
        lines.append(f"weight-GEMM FLOPs in FP8: {flops['fp8_share']:.1%} ({formats})"
                     + (", emulated" if result.get("fp8_emulated") else "")
                     + (f"; the policy asks {asked:.1%}" if asked is not None else ""))
        allowed: dict[str, list] = {}  # reason -> the rows it keeps in high precision
        for row in flops["high_precision"]:
            if row["allowed"]:
                allowed.setdefault(row["reason"], []).append(row)
            else:
                lines.append(f"  ! {row['module']}: {row['share']:.1%} in high precision ({row['reason']})")
        for reason, gemms in allowed.items():
            names = ", ".join(g["module"] for g in gemms[:3]) + (
                f" and {len(gemms) - 3} more" if len(gemms) > 3 else "")
            lines.append(f"  - {names}: {sum(g['share'] for g in gemms):.1%} in high precision ({reason})")
    converted = [m for m in result["fp8_modules"] if m["convert"]]
    if result["fp8_modules"]:
        kept = [m for m in result["fp8_modules"] if not m["convert"]]
        adapters = [m for m in kept if m["reason"] == ADAPTER_REASON]
        recipes: dict[str, int] = {}
        for m in converted:
            recipes[m.get("recipe") or "converted"] = recipes.get(m.get("recipe") or "converted", 0) + 1
        by_recipe = f" ({', '.join(f'{r} {n}' for r, n in recipes.items())})" if len(recipes) > 1 else ""
        lines.append(f"FP8 modules: {len(converted)} of {len(result['fp8_modules'])} converted{by_recipe}; kept: " +
                     ("; ".join([f"{m['fqn']} ({m['reason']})" for m in kept if m not in adapters]
                                + ([f"{len(adapters)} Linears: {ADAPTER_REASON}"] if adapters else [])) or "none"))
    kernels = result.get("kernel_matmuls")
    if kernels:  # info: a library kernel computed in its own precision, left out of the training row
        lines.append(f"  - {kernels['kernel']}: {sum(kernels['matmuls'].values())} matmuls in "
                     f"{'+'.join(sorted(kernels['matmuls']))} inside {kernels['calls']} calls given "
                     f"{'+'.join(sorted(kernels['inputs']))} inputs, not counted in the training row: "
                     f"{kernels['reason']}")
    predicted = result.get("speed")
    if predicted:  # info, never a failure: the step's GEMMs on the run's GPU (audit/speed_row.py)
        lines.append(f"  - speed (info): {predicted['observed']}: {predicted['detail']}")
    lines += numerics_lines(result.get("numerics"))
    for phase, why in result.get("outside_scope", {}).items():
        lines.append(f"  - {phase}: not part of this audit ({why})")
    for phase, row in result.get("not_observed", {}).items():
        lines.append(f"  ? {phase}: expected {row['expected']} ({row['why']}), not observed: {row['detail']}")
    lines.append("")
    lines.append(verdict(result))
    return "\n".join(lines) + "\n"


def numerics_lines(numerics: dict[str, Any] | None) -> list[str]:
    """The worst modules of a numerics check (fp8dist.audit.numerics), each by its metric nearest to or beyond its
    limit; `!` marks the failing ones."""
    if not numerics or not numerics["worst"]:
        return []
    lines = ["FP8 numerics, worst modules (underflow / saturated: share of the cast's values; SQNR: dB):"]
    for f in numerics["worst"]:
        what = " ".join(part for part in (f["module"], f["gemm"], f["operand"]) if part)
        bound = f"min {f['limit']:g}" if f["metric"] == "sqnr_db" else f"max {f['limit']:g}"
        value = "n/a" if f["value"] is None else f"{f['value']:.4g}"
        lines.append(f"  {'!' if f['fails'] else '-'} {what}: {f['metric']} {value} ({bound})")
    history = numerics.get("scaling_history") or []
    if history:
        tightest = min((row for row in history if row["headroom_bits"] is not None),
                       key=lambda row: row["headroom_bits"], default=None)
        stalest = max(history, key=lambda row: row["stale_passes"])
        lines.append(f"  delayed scaling, {len(history)} tensors: "
                     + (f"least headroom {tightest['headroom_bits']:g} bits ({tightest['module']} "
                        f"{tightest['direction']} {tightest['tensor']}); " if tightest else "")
                     + f"{sum(row['lagged_passes'] for row in history)} lagged passes; oldest amax setting a scale: "
                       f"{stalest['stale_passes']} passes ago ({stalest['module']} {stalest['tensor']})")
    return lines


def more_ranks(nproc: int, data_ranks: int) -> str:
    """The fix for rows one data-parallel rank cannot observe: twice the ranks where the others split the model
    (tensor, context or pipeline parallel), else 2."""
    return f"audit with --nproc {2 * nproc // data_ranks if nproc > 1 else 2} to check it"


def verdict(result: dict[str, Any]) -> str:
    statuses = {c["status"] for c in result["checks"]}
    unobserved = result.get("not_observed") or {}
    if result["passed"] and unobserved:
        return (f"PASS: every phase this run has was measured and matches the documented table; not observed on "
                f"{result['nproc']} process: {', '.join(unobserved)} ({more_ranks(result['nproc'], 1)})")
    if result["passed"]:
        return "PASS: every phase was measured and matches the documented table"
    if MISMATCH in statuses:
        return "FAIL: see MISMATCH rows"
    return "FAIL: no mismatch, but some phases were NOT MEASURED, so the audit cannot say PASS"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**fp8dist audit** `{result['model']}` on `{result['engine']}`, {result['nproc']} process(es), "
             f"config `{result['config']}`: **{'PASS' if result['passed'] else 'FAIL'}**", "",
             "| phase | expected | observed | ok | detail |", "|---|---|---|---|---|"]
    marks = {OK: "yes", MISMATCH: "**no**", NOT_MEASURED: "**not measured**"}
    for c in result["checks"]:
        detail = c["detail"].replace("|", "/")
        lines.append(f"| {c['phase']} | {c['expected']} | {shown(result, c)} | {marks[c['status']]} | {detail} |")
    for phase, row in (result.get("not_observed") or {}).items():
        lines.append(f"| {phase} | {row['expected']} | not observed | **not observed** | {row['detail']} |")
    if result["bytes_per_param"]:
        lines += ["", "Bytes per parameter: " + ", ".join(f"{k} {v}" for k, v in result["bytes_per_param"].items())]
    return "\n".join(lines) + "\n"
