"""The `speed` section of `fp8dist estimate ... --gpu NAME` as text or markdown (the model: fp8dist/estimate/step.py
and speed.py; the JSON is SpeedEstimate.to_json)."""
from __future__ import annotations

from fp8dist.estimate.result import SpeedEstimate
from fp8dist.facts.hardware import GPUS

PART_LABELS = {"fp8_gemms": "FP8 GEMMs (bf16 twin: the same Linears in bf16)",
               "high_precision_gemms": "high-precision GEMMs (lm_head, excluded modules)",
               "casts": "casts and scales", "attention": "attention", "norms_elementwise": "norms / elementwise, loss",
               "recompute": "activation checkpointing recompute", "optimizer": "optimizer step",
               "communication_exposed": "communication, exposed",
               "pipeline_bubble": "pipeline bubble (idle by the schedule)"}
NO_GPU = (f"speed: not predicted; name a GPU to predict the step and FP8's gain (--gpu {' | '.join(GPUS)}, "
          "docs/speed.md)")


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 10 or ms == 0 else f"{ms:.3f}"


def render_speed(speed: SpeedEstimate, markdown: bool = False) -> list[str]:
    """Lines of the speed section: the headline, the parts side by side, communication, the Linears, why, what it
    assumes."""
    s = speed
    head = (f"Speed on {s.gpu} (predicted, docs/speed.md): {s.tokens_per_s:,.0f} tokens/s per GPU, the bf16 twin "
            f"{s.bf16_tokens_per_s:,.0f}: FP8 / bf16 = {s.fp8_over_bf16:.3f}; step {_ms(s.step_s)} ms against "
            f"{_ms(s.bf16_step_s)} ms")
    parts = [(PART_LABELS[p], _ms(s.parts[p]), _ms(s.bf16_parts[p])) for p in s.parts]
    parts.append(("step", _ms(s.step_s), _ms(s.bf16_step_s)))
    comm = [f"{axis}: {_bytes(row['bytes'])} a step per rank over {row['link']}, {_ms(row['seconds'])} ms (bf16 "
            f"twin: {_bytes(row['bf16_bytes'])}, {_ms(row['bf16_seconds'])} ms; "
            f"{'overlapped with compute' if row['overlapped'] else 'blocking'})"
            for axis, row in s.communication.items()]
    linears = [(f"{row.module}" + (f" x{row.count}" if row.count > 1 else ""), f"{row.m}x{row.k}x{row.n}", row.format,
                f"{row.speedup:.2f}x") for row in s.linears]
    why = list(s.reasons) or ["nothing stands out"]
    if markdown:
        lines = [f"**{head}**", "", "| part (ms per step) | config | bf16 twin |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in parts]
        lines += ["", "| Linear | M x K x N | format | speedup |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in linears]
        lines += [""] + [f"- communication, {line}" for line in comm] + [f"- why: {line}" for line in why]
        return lines + [f"- assumes: {line}" for line in s.notes]
    width = max(len(row[0]) for row in parts)
    lines = [head, "", f"{'part (ms per step)'.ljust(width)}  {'config':>10}  {'bf16 twin':>10}"]
    lines += [f"{a.ljust(width)}  {b:>10}  {c:>10}" for a, b, c in parts]
    widths = [max(len(row[i]) for row in linears) for i in range(3)] if linears else [0, 0, 0]
    lines += ["", "Linears (forward M tokens x K in x N out on a rank; speedup over bf16, casts included):"]
    lines += [f"  {a.ljust(widths[0])}  {b.ljust(widths[1])}  {c.ljust(widths[2])}  {d}" for a, b, c, d in linears]
    lines += ["", "Communication:"] + [f"  {line}" for line in comm or ["none (one rank)"]]
    lines += ["Why:"] + [f"  - {line}" for line in why] + ["Assumes:"] + [f"  - {line}" for line in s.notes]
    return lines
