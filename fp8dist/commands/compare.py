"""`fp8dist compare --config X --baseline Y --model M --steps N`: the loss curves of two configs from the same
initial weights on the same batches, the largest relative gap, a verdict against a tolerance, and a plot.

The parent checks both configs, the model and the data before launching; the worker (one torchrun job,
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
import os
import sys
from typing import Any

from fp8dist.config.load import load_config
from fp8dist.errors import ExitCode, Fp8distError


# --- the parent ---------------------------------------------------------------------------------

def run_compare(args) -> int:
    from fp8dist.runtime.preflight import preflight
    from fp8dist.runtime.models import check_model_name

    if args.steps < 1 or args.nproc < 1:
        raise Fp8distError("--steps and --nproc must be at least 1")
    if not args.tolerance > 0:
        raise Fp8distError(f"--tolerance must be a positive relative gap, got {args.tolerance:g}")
    if not args.timeout > 0:
        raise Fp8distError(f"--timeout must be positive seconds, got {args.timeout:g}")
    specs = {"baseline": load_config(args.baseline, overrides=args.overrides),
             "config": load_config(args.config, overrides=args.overrides)}
    check_same_batches(specs["baseline"], specs["config"])
    check_engine_order(specs["baseline"], specs["config"])
    check_model_name(args.model)
    from fp8dist.runtime.layer_probes import parse_steps

    layer_steps = parse_steps(args.layer_steps, args.steps) if args.layer_steps else ()
    check_probes(specs, layer_steps, args.fixed_routing)
    if args.fixed_routing:
        check_has_experts(args.model)
    for spec in specs.values():
        preflight(spec)
    if args.data:
        from pathlib import Path

        from fp8dist.runtime.data import read_texts

        read_texts(Path(args.data))  # binary, empty or unreadable: exit 2 here, not in the ranks
    if args.plot:
        _check_writable(args.plot)
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


# The batches (and the initial weights' seed) come from these keys; both configs must agree on them.
BATCH_KEYS = ("micro_batch_size", "seq_len", "gradient_accumulation_steps", "seed")


def check_same_batches(baseline, config) -> None:
    differ = [f"train.{key} ({getattr(config.train, key)} vs baseline {getattr(baseline.train, key)})"
              for key in BATCH_KEYS if getattr(config.train, key) != getattr(baseline.train, key)]
    if differ:
        raise Fp8distError("compare runs both configs on the same batches from the same weights, but they differ in "
                           + ", ".join(differ) + "\n  fix: give both configs the same train section values")


def check_engine_order(baseline, config) -> None:
    """The baseline's engine is built first, in the same process: after DeepSpeed AutoTP, DeepSpeed 0.19.8 keeps its
    groups in module globals (deepspeed/utils/groups.py) and a DeepSpeed engine without AutoTP cannot start next."""
    autotp = [spec.engine == "deepspeed" and spec.parallel.tensor_size > 1 for spec in (baseline, config)]
    if autotp == [True, False] and config.engine == "deepspeed":
        raise Fp8distError("--baseline runs DeepSpeed AutoTP and --config DeepSpeed without it: the second engine "
                           "cannot start after AutoTP in one process\n  fix: swap --config and --baseline")


def check_probes(specs: dict[str, Any], layer_steps: tuple[int, ...], fixed_routing: bool) -> None:
    """--layer-steps needs engines that run probe passes between steps; both flags need eager blocks (their taps and
    the routing replay are module hooks and a TorchFunctionMode, which a compiled block would trace or skip)."""
    from fp8dist.engines.registry import facts_for

    flags = " and ".join(flag for flag, on in (("--layer-steps", layer_steps), ("--fixed-routing", fixed_routing))
                         if on)
    if not flags:
        return
    for role, spec in specs.items():
        if layer_steps and not facts_for(spec).runs_probes:
            raise Fp8distError(f"--layer-steps: the {role}'s engine ({spec.engine}) cannot run a probe pass between "
                               "optimizer steps (an extra backward would move DeepSpeed's gradient-accumulation "
                               "boundary and fill its reduce buckets)\n  fix: compare engine: fsdp2 configs for "
                               "the layer report, or drop --layer-steps")
        split = [f"parallel.{key}={getattr(spec.parallel, key)}" for key in ("tensor_size", "context_size")
                 if getattr(spec.parallel, key) > 1]
        if layer_steps and split:
            raise Fp8distError(f"--layer-steps: the {role} splits each block's output over ranks ({', '.join(split)}: "
                               "sequence or head shards), and the report compares whole outputs per rank\n  fix: "
                               "compare configs without tensor or context parallel for the layer report")
        if layer_steps and spec.adapter.enabled and spec.adapter.base_dtype == "nf4":
            raise Fp8distError(f"--layer-steps: the {role} holds an NF4 base, which loading another run's weights "
                               "would re-quantize shard by shard (torchao's NF4Tensor copy_, with a scale mean per "
                               "shard) and not restore bitwise\n  fix: compare with adapter.base_dtype=auto for the "
                               "layer report")
        if layer_steps and spec.fp8.backend in ("te", "msamp"):
            raise Fp8distError(f"--layer-steps: the {role} runs {spec.fp8.backend}, whose modules keep FP8 state "
                               "(amax histories, scales) that a probe pass would move and the weights swap cannot "
                               "restore\n  fix: the layer report runs torchao configs; `fp8dist audit --numerics` "
                               "reads TE's delayed scaling")
        if spec.compile:
            raise Fp8distError(f"{flags}: the {role} compiles its blocks (compile: true), and the taps need them "
                               "eager\n  fix: add the override compile=false")


def check_has_experts(model_name: str) -> None:
    """--fixed-routing on a model whose config says it has no experts (a factory model's is not known here: the
    ranks refuse it when they find no router)."""
    from fp8dist.config.parallel import expert_count
    from fp8dist.runtime.models import config_values

    values = config_values(model_name)
    if values is not None and not expert_count(values):
        raise Fp8distError(f"--fixed-routing replays a Mixture-of-Experts model's expert choices, and {model_name} "
                           "has no experts\n  fix: drop --fixed-routing, or compare an MoE model")


def _check_writable(path: str) -> None:
    import importlib.util
    from pathlib import Path

    target = Path(path)
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise Fp8distError(f"--plot {path}: name a .png file in an existing, writable directory")
    if importlib.util.find_spec("matplotlib") is None:
        raise Fp8distError("--plot needs matplotlib, which is not installed\n  fix: pip install matplotlib "
                           "(part of fp8dist[train])")


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
             f"**{'PASS' if result['passed'] else 'FAIL'}** (largest relative gap {_gap_text(result['max_relative_gap'])}, "
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
