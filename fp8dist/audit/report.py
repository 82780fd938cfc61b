"""Compare observed with expected dtypes and render the result as a table, JSON or markdown."""
from __future__ import annotations

from typing import Any

from fp8dist.audit.expected import expected, normalize
from fp8dist.config.spec import Spec


def build(spec: Spec, model: str, observed: dict[str, Any], nproc: int) -> dict[str, Any]:
    checks = []
    for phase, (want, why) in expected(spec, nproc).items():
        got = observed.get(phase)
        if got is None:
            checks.append({"phase": phase, "expected": want, "observed": "not observed", "ok": False,
                           "why": why, "detail": "no probe result for this phase", "measured": False})
            continue
        ok = normalize(got["observed"]) == normalize(want)
        checks.append({"phase": phase, "expected": want, "observed": got["observed"], "ok": ok, "why": why,
                       "detail": got["detail"], "measured": got["measured"]})
    per_param = {k: round(v, 2) for k, v in observed.get("_bytes", {}).items()}
    return {"passed": all(c["ok"] for c in checks), "model": model, "engine": spec.engine,
            "config": spec.source, "preset": spec.precision.preset, "nproc": nproc, "checks": checks,
            "bytes_per_param": per_param, "fp8_modules": observed.get("_decisions", []),
            "communication_bytes": observed.get("_comm")}


def table(result: dict[str, Any]) -> str:
    head = (f"fp8dist audit: {result['model']} on {result['engine']} ({result['nproc']} process"
            f"{'es' if result['nproc'] > 1 else ''}), config {result['config']}"
            + (f", preset {result['preset']}" if result["preset"] else ""))
    rows = [("phase", "expected", "observed", ""), ("-----", "--------", "--------", "")]
    rows += [(c["phase"], c["expected"], c["observed"], "ok" if c["ok"] else "MISMATCH") for c in result["checks"]]
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [head, ""] + ["  ".join(str(r[i]).ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    for c in result["checks"]:
        if not c["ok"]:
            lines.append(f"  ! {c['phase']}: expected {c['expected']} ({c['why']}), observed {c['observed']}: "
                         f"{c['detail']}")
    if result["bytes_per_param"]:
        lines.append("")
        lines.append("bytes per parameter: " + ", ".join(f"{k} {v}" for k, v in result["bytes_per_param"].items()))
    converted = [m for m in result["fp8_modules"] if m["convert"]]
    if result["fp8_modules"]:
        lines.append(f"FP8 modules: {len(converted)} of {len(result['fp8_modules'])} converted; kept: " +
                     ("; ".join(f"{m['fqn']} ({m['reason']})" for m in result["fp8_modules"] if not m["convert"])
                      or "none"))
    lines.append("")
    lines.append("PASS: every observed dtype matches the documented table" if result["passed"]
                 else "FAIL: see MISMATCH rows")
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**fp8dist audit** `{result['model']}` on `{result['engine']}`, {result['nproc']} process(es), "
             f"config `{result['config']}`: **{'PASS' if result['passed'] else 'FAIL'}**", "",
             "| phase | expected | observed | ok | detail |", "|---|---|---|---|---|"]
    for c in result["checks"]:
        detail = c["detail"].replace("|", "/")
        lines.append(f"| {c['phase']} | {c['expected']} | {c['observed']} | {'yes' if c['ok'] else '**no**'} | {detail} |")
    if result["bytes_per_param"]:
        lines += ["", "Bytes per parameter: " + ", ".join(f"{k} {v}" for k, v in result["bytes_per_param"].items())]
    return "\n".join(lines) + "\n"
