"""Cost of the FP8 numerics check (`fp8dist.audit.watch(..., numerics=True)`, `fp8dist audit --numerics`).

    python benchmarks/numerics_overhead.py [--pairs 6]    # one process (FSDP2 on a 1-rank gloo group, as `audit`)
    python benchmarks/numerics_overhead.py --smoke        # every figure once, tiny models: not a measurement

One model per case, prepared by fp8dist's FSDP2 engine (first-step audit off) on a one-rank gloo group in this
process (what `fp8dist audit MODEL --nproc 1` runs), FP8 emulated on the CPU. Timed steps rotate plain / watched /
watched with numerics (the order shifts every pair, so that drift hits all three alike); each figure is the median
over pairs of that step's time over the pair's plain step:
- `numerics watched step / plain step`, goal <= 3: the audited step with the numerics check (issue 33's bound);
- `watched step / plain step` (info): the same watch without it, so the difference is the check's own cost.
Cases: small-llama under torchao float8 tensorwise (float8 all-gather: the probes gather the high-precision
weights) and rowwise, small-mixtral with MXFP8 experts (grouped GEMMs) and float8 Linears.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, median, quiet_libraries, result  # noqa: E402

MICRO_BATCH, SEQ_LEN, WARMUP = 2, 128, 1
CASES = {"float8 tensorwise": ("small-llama", "configs/fsdp2-torchao-float8.yaml"),
         "float8 rowwise": ("small-llama", "configs/fsdp2-torchao-rowwise.yaml"),
         "moe mxfp8 experts": ("small-mixtral", "configs/fsdp2-moe-mxfp8.yaml")}
SMOKE_MODELS = {"small-llama": "tiny-llama", "small-mixtral": "tiny-mixtral"}


def prepared(model_name: str, config: str):
    """(model, optimizer, spec, step() -> None) from fp8dist's FSDP2 engine, first-step audit off."""
    from fp8dist import load_config
    from fp8dist.engines import fsdp2
    from fp8dist.runtime.models import causal_lm_batch, load_model

    spec = load_config(str(ROOT / config))
    model = load_model(model_name, spec.precision.load_dtype, seed=0).model
    run = fsdp2.prepare(model, spec, audit="off")
    batch = causal_lm_batch(model.config.vocab_size)(MICRO_BATCH, SEQ_LEN, 0)
    return run.model, run.optimizer, spec, lambda: fsdp2.train_step(run, [batch], spec.train.gradient_clipping)


def measure(model_name: str, config: str, pairs: int) -> tuple[float, float, dict[str, float]]:
    """(median numerics-watched / plain, median watched / plain, median seconds per kind of step)."""
    from fp8dist.audit import watch

    model, optimizer, spec, step = prepared(model_name, config)

    def watched(numerics: bool):
        def run() -> None:
            with watch(model, optimizer, spec, on_mismatch="ignore", numerics=numerics) as audit:
                step()
            if numerics and "numerics" not in audit.report:
                raise SystemExit("the numerics watch produced no numerics")  # the comparison is of a real check
        return run

    kinds = {"plain": step, "watched": watched(False), "numerics": watched(True)}
    for _ in range(WARMUP):
        for run in kinds.values():
            run()
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for index in range(pairs):
        order = list(kinds)[index % 3:] + list(kinds)[:index % 3]
        for kind in order:
            start = time.perf_counter()
            kinds[kind]()
            seconds[kind].append(time.perf_counter() - start)
    ratios = {kind: median([t / p for t, p in zip(seconds[kind], seconds["plain"])])
              for kind in ("numerics", "watched")}
    return ratios["numerics"], ratios["watched"], {kind: median(values) for kind, values in seconds.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6, help="timed rounds of plain / watched / numerics steps")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    pairs = 1 if args.smoke else args.pairs
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    quiet_libraries()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print(f"micro-batch {MICRO_BATCH} x {SEQ_LEN} tokens, 1 process (FSDP2, 1-rank gloo group), {pairs} rounds, "
              "FP8 emulated")
        print(f"{'case':22s}{'model':15s}{'plain ms':>10s}{'watched ms':>12s}{'numerics ms':>13s}{'watched':>9s}"
              f"{'numerics':>10s}", flush=True)
        for name, (model_name, config) in CASES.items():
            model_name = SMOKE_MODELS[model_name] if args.smoke else model_name
            numerics, watched, times = measure(model_name, config, pairs)
            print(f"{name:22s}{model_name:15s}{times['plain'] * 1e3:10.1f}{times['watched'] * 1e3:12.1f}"
                  f"{times['numerics'] * 1e3:13.1f}{watched:9.3f}{numerics:10.3f}", flush=True)
            key = name.replace(" ", "_")
            result(f"numerics_watched_step_{key}", numerics, "<=3",
                   f"{name}: step watched with numerics=True / plain step")
            result(f"watched_step_{key}", watched, "info", f"{name}: step watched without numerics / plain step")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
