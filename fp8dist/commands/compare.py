"""`fp8dist compare --config X --baseline Y --model M --steps N`: the loss curves of two configs from the same
initial weights on the same batches, the largest relative gap, a verdict against a tolerance, and a plot.

The parent checks both configs, the model, the ranks and the data before launching, and says every refusal at once
(fp8dist/runtime/comparison.py check_before_launch); the worker (one torchrun job,
`python -m fp8dist.runtime.comparison`) trains the baseline and then the config in the same processes, printing
progress lines the parent shows as they come.

Two ways to tell the config's numerics from noise (a loss gap alone cannot: two precisions without any FP8 part
too, and on an MoE model routing flips amplify any rounding):
- `--layer-steps 1,8`: at those steps, a per-layer report of activation and gradient SQNR against the baseline on
  the same weights and batch, and the first layer where the two part (fp8dist/runtime/layer_probes.py);
- `--fixed-routing`: an MoE model's config run replays the baseline's expert choices, so the loss gap and the
  expert outputs' SQNR carry no routing flips (fp8dist/runtime/routing_replay.py).

Exit codes: 0 within tolerance, 1 beyond it, 2 a usage, config, data or environment error.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any

from fp8dist.config.load import load_config
from fp8dist.errors import Checks, ExitCode, Fp8distError


def run_compare(args) -> int:
    from fp8dist.commands.compare_plot import check_writable
    from fp8dist.runtime.comparison import check_before_launch

    if args.steps < 1 or args.nproc < 1:
        raise Fp8distError("--steps and --nproc must be at least 1")
    if not 0 < args.tolerance <= 1:
        raise Fp8distError(f"--tolerance {args.tolerance:g}: the largest relative loss gap that passes, as a fraction "
                           f"of the baseline's loss ({args.tolerance:.0%} here)\n  fix: --tolerance 0.05 for 5% "
                           "(a value between 0 and 1)")
    if not args.timeout > 0:
        raise Fp8distError(f"--timeout must be positive seconds, got {args.timeout:g}")
    checks, specs = Checks(), {}
    layer_steps: tuple[int, ...] = ()
    for role, path in (("baseline", args.baseline), ("config", args.config)):
        with checks.one():
            specs[role] = load_config(path, overrides=args.overrides)
    if args.plot:
        with checks.one():
            check_writable(args.plot)
    if len(specs) == 2:  # both configs read: what they are refused for here, with the rest
        with checks.one():
            layer_steps = check_before_launch(specs, args.model, args.nproc, layer_steps=args.layer_steps,
                                              steps=args.steps, fixed_routing=args.fixed_routing, data=args.data)
    checks.raise_found()
    losses = _launch(args, layer_steps)
    layers = losses.pop("layers", None)
    result = verdict(losses, args.tolerance, args)
    result["fixed_routing"] = args.fixed_routing
    if layers is not None:
        result["layers"] = layers
    if args.plot:
        from fp8dist.commands.compare_plot import plot

        plot(result, args.plot)
        result["plot"] = args.plot
    render = {"json": as_json, "markdown": markdown, "table": table}[args.format]
    sys.stdout.write(render(result))
    return ExitCode.OK if result["passed"] else ExitCode.MISMATCH


def _launch(args, layer_steps: tuple[int, ...]) -> dict[str, Any]:
    from fp8dist.runtime.ranks import launch

    argv = [args.model, args.baseline, args.config, str(args.steps), args.data or "", "\n".join(args.overrides),
            ",".join(map(str, layer_steps)), "1" if args.fixed_routing else ""]
    return launch("fp8dist.runtime.comparison", argv, args.nproc, args.timeout, "comparison",
                  on_progress=lambda line: print(line, file=sys.stderr, flush=True))


def verdict(losses: dict[str, list[float]], tolerance: float, args=None) -> dict[str, Any]:
    """Per-step relative gaps |config - baseline| / |baseline|; a non-finite loss is an infinite gap."""
    gaps = []
    for got, base in zip(losses["config"], losses["baseline"]):
        finite = math.isfinite(got) and math.isfinite(base) and base != 0
        gaps.append(abs(got - base) / abs(base) if finite else math.inf)
    worst = max(gaps) if gaps else math.inf
    out: dict[str, Any] = {
        "passed": worst <= tolerance, "max_relative_gap": worst if math.isfinite(worst) else None,
        "tolerance": tolerance, "losses": losses, "relative_gaps": [g if math.isfinite(g) else None for g in gaps]}
    if args is not None:
        out.update(model=args.model, config=args.config, baseline=args.baseline, steps=args.steps,
                   data=args.data or "synthetic batches")
    return out


def as_json(result: dict[str, Any]) -> str:
    """Strict JSON: a non-finite loss is written as null (as an unbounded gap is)."""
    def finite(values):
        return [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]

    clean = {**result, "losses": {name: finite(values) for name, values in result["losses"].items()}}
    return json.dumps(clean, indent=2, allow_nan=False) + "\n"


def _gap_text(value) -> str:
    return "inf" if value is None else f"{value:.4%}"

def table(result: dict[str, Any]) -> str:
    lines = [f"fp8dist compare: {result['config']} vs baseline {result['baseline']} on {result['model']}, "
             f"{result['steps']} steps, data: {result['data']}", "",
             f"{'step':>4}  {'baseline':>10}  {'config':>10}  {'gap':>9}"]
    for i, (base, got, gap) in enumerate(zip(result["losses"]["baseline"], result["losses"]["config"],
                                             result["relative_gaps"]), 1):
        lines.append(f"{i:>4}  {base:>10.4f}  {got:>10.4f}  {_gap_text(gap):>9}")
    lines += ["", f"largest relative gap {_gap_text(result['max_relative_gap'])}, tolerance {result['tolerance']:.2%}: "
              + ("PASS" if result["passed"] else "FAIL")
              + (" (routing fixed: the config's run replayed the baseline's expert choices)"
                 if result.get("fixed_routing") else "")]
    for report in result.get("layers", ()):
        columns = _layer_columns(report)
        lines += ["", f"step {report['step']}, the config's precision on the baseline's weights and batch: "
                      f"{_loss_text(report)}; SQNR in dB against the baseline (higher: closer)",
                  "  ".join([f"{'layer':<28}", *(f"{c[1]:>13}" for c in columns)])]
        for row in report["layers"]:
            lines.append("  ".join([f"{row['layer']:<28}", *(f"{_db(row.get(c[0])):>13}" for c in columns)]))
        lines.append(parting_text(report))
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines) + "\n"


_LAYER_COLUMNS = (("activation_sqnr_db", "activation"), ("gradient_sqnr_db", "gradient"),
                  ("expert_output_sqnr_db", "expert output"))


def _layer_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [column for column in _LAYER_COLUMNS if any(column[0] in row for row in report["layers"])]


def _loss_text(report: dict[str, Any]) -> str:
    loss = report["loss"]
    def text(value) -> str:
        return "nan" if value is None else f"{value:.4f}"

    return (f"loss {text(loss['config'])} vs baseline {text(loss['baseline'])} (gap "
            f"{_gap_text(loss['relative_gap'])})")


def _db(value) -> str:
    if value is None:
        return "equal"
    return value if isinstance(value, str) else f"{value:.2f}"


def parting_text(report: dict[str, Any]) -> str:
    """Where the two runs part at one chosen step: activations in model order, gradients in backward order."""
    found = [(what, report[key]) for what, key in (("activations", "first_parting"),
                                                    ("gradients", "first_parting_gradient")) if report[key]]
    if not found:
        return "no layer parts (every activation and gradient SQNR within audit.numerics.min_sqnr_db)"
    return "; ".join(f"{what} first part at {first['layer']} ({_db(first['sqnr_db'])} dB < {first['limit']:g})"
                     for what, first in found) + "; `fp8dist audit --numerics` names the GEMMs inside it"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**fp8dist compare** `{result['config']}` vs baseline `{result['baseline']}` on `{result['model']}`: "
             f"**{'PASS' if result['passed'] else 'FAIL'}** "
             f"(largest relative gap {_gap_text(result['max_relative_gap'])}, "
             f"tolerance {result['tolerance']:.2%})", "", "| step | baseline | config | gap |", "|---|---|---|---|"]
    for i, (base, got, gap) in enumerate(zip(result["losses"]["baseline"], result["losses"]["config"],
                                             result["relative_gaps"]), 1):
        lines.append(f"| {i} | {base:.4f} | {got:.4f} | {_gap_text(gap)} |")
    for report in result.get("layers", ()):
        columns = _layer_columns(report)
        lines += ["", f"Step {report['step']} on the baseline's weights and batch: {_loss_text(report)}; SQNR in dB "
                      "against the baseline:", "",
                  "| layer | " + " | ".join(c[1] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {row['layer']} | " + " | ".join(_db(row.get(c[0])) for c in columns) + " |"
                  for row in report["layers"]]
        lines += ["", parting_text(report)]
    return "\n".join(lines) + "\n"
