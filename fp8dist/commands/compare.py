"""`fp8dist compare --config X --baseline Y --model M --steps N`: the loss curves of two configs from the same
initial weights on the same batches, the largest relative gap, a verdict against a tolerance, and a plot.

The parent checks both configs, the model and the data before launching; the worker (one torchrun job,
`python -m fp8dist.commands.compare`) trains the baseline and then the config in the same processes, printing
progress lines the parent shows as they come.

Exit codes: 0 within tolerance, 1 beyond it, 2 a usage, config, data or environment error.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Sequence

from fp8dist.config.load import load_config
from fp8dist.dtypes import torch_dtype
from fp8dist.errors import ExitCode, Fp8distError
from fp8dist.runtime.ranks import PROGRESS, emit


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
    for spec in specs.values():
        preflight(spec)
    if args.data:
        from pathlib import Path

        from fp8dist.runtime.data import read_texts

        read_texts(Path(args.data))  # binary, empty or unreadable: exit 2 here, not in the ranks
    if args.plot:
        _check_writable(args.plot)
    losses = _launch(args)
    result = verdict(losses, args.tolerance, args)
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


def _check_writable(path: str) -> None:
    import importlib.util
    from pathlib import Path

    target = Path(path)
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise Fp8distError(f"--plot {path}: name a .png file in an existing, writable directory")
    if importlib.util.find_spec("matplotlib") is None:
        raise Fp8distError("--plot needs matplotlib, which is not installed\n  fix: pip install matplotlib "
                           "(part of fp8dist[train])")


def _launch(args) -> dict[str, list[float]]:
    from fp8dist.runtime.ranks import launch

    argv = [args.model, args.baseline, args.config, str(args.steps), args.data or "", "\n".join(args.overrides)]
    return launch("fp8dist.commands.compare", argv, args.nproc, args.timeout, "comparison",
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
              + ("PASS" if result["passed"] else "FAIL")]
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**fp8dist compare** `{result['config']}` vs baseline `{result['baseline']}` on `{result['model']}`: "
             f"**{'PASS' if result['passed'] else 'FAIL'}** (largest relative gap {_gap_text(result['max_relative_gap'])}, "
             f"tolerance {result['tolerance']:.2%})", "", "| step | baseline | config | gap |", "|---|---|---|---|"]
    for i, (base, got, gap) in enumerate(zip(result["losses"]["baseline"], result["losses"]["config"],
                                             result["relative_gaps"]), 1):
        lines.append(f"| {i} | {base:.4f} | {got:.4f} | {_gap_text(gap)} |")
    return "\n".join(lines) + "\n"


# --- the worker (one torchrun job) ----------------------------------------------------------------

def _train(name: str, session, steps: int, rank: int) -> list[float]:
    losses = []
    for step in range(steps):
        losses.append(session.step(step)[0])
        if rank == 0:
            emit(PROGRESS, name, f"{name} step {step + 1}/{steps} loss {losses[-1]:.4f}")
    return losses


def worker(model_name: str, baseline: str, config: str, steps: int, data: str,
           overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Both runs in this rank's process: the baseline, then the config, from the same initial weights (built in
    fp32 from the same seed, then cast to each run's load dtype) on the same batches, with the same random stream
    for whatever the run draws (dropout)."""
    import torch

    from fp8dist.config.parallel import parallel_dims
    from fp8dist.engines.registry import facts_for
    from fp8dist.runtime import loop, process_group
    from fp8dist.runtime.data import SYNTHETIC_BATCHES, BatchMaker, file_batches, token_stream
    from fp8dist.runtime.adapters import apply_adapter
    from fp8dist.runtime.models import load_model

    result: dict[str, Any] = {}
    try:
        specs = {"baseline": load_config(baseline, overrides=overrides),
                 "config": load_config(config, overrides=overrides)}
        # one group for both runs (DeepSpeed's init serves an FSDP2 config too)
        process_group.init(deepspeed=any(facts_for(spec).deepspeed_process_group for spec in specs.values()))
        rank, seed = process_group.rank(), specs["baseline"].train.seed  # the parent checked both train sections
        # both runs read batches by the data ranks of the run that splits the model most (tp and cp peers: one)
        batch_dims = max((parallel_dims(s, process_group.world_size()) for s in specs.values()),
                         key=lambda dims: dims.tp * dims.cp)
        make_batch: BatchMaker | None = None
        pool: int | None = SYNTHETIC_BATCHES
        for name, spec in specs.items():
            loaded = load_model(model_name, "fp32", seed=seed)
            loaded.model.to(torch_dtype(spec.precision.load_dtype))
            loaded.model = apply_adapter(loaded.model, spec.adapter, spec.precision.weight_dtype, seed)
            if make_batch is None:
                make_batch = loaded.make_batch
                if data:
                    vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
                    if vocab is None:
                        raise Fp8distError(f"--data needs a model with `config.vocab_size`; {model_name} has none")
                    ids, how = token_stream(data, model_name, vocab)
                    make_batch, pool = file_batches(ids), None  # fresh windows every step
                    if rank == 0:
                        emit(PROGRESS, "data", f"data: {len(ids)} tokens, {how}")
            session = loop.start(spec, loaded, make_batch=make_batch, pool=pool, batch_dims=batch_dims)
            torch.manual_seed(seed)
            result[name] = _train(name, session, steps, rank)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits 2 with it
        result = {"_error": str(exc) if isinstance(exc, Fp8distError) else f"{type(exc).__name__}: {exc}"}
    return result


if __name__ == "__main__":
    from fp8dist.runtime.ranks import finish

    finish(worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5],
                  [o for o in sys.argv[6].split("\n") if o]), sys.argv[7])
