"""Run every benchmark in one go and print one table of what was measured against its goal.

    python benchmarks/run.py                 # all of them (CPU: ~15 minutes on 2 cores)
    python benchmarks/run.py --only overhead numerics
    python benchmarks/run.py --quick         # fewer repetitions: a smoke run, not a measurement

Each script runs as its own process (so that their torchrun jobs never share a machine with each other) and
prints `result name=value goal=...` lines (benchmarks/_common.py); this collects them. The GPU throughput
script refuses on a machine without an FP8 GPU; that is listed, not counted as a miss. Exit code: 0 when every
figure with a goal meets it, 1 when one misses, 2 when a benchmark itself failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, cpu_env, parse_results  # noqa: E402

# name -> (script, extra args for --quick)
BENCHMARKS = {
    "overhead": ("overhead.py", ["--pairs", "6", "--rounds", "2"]),
    "watch_overhead": ("watch_overhead.py", ["--pairs", "4", "--rounds", "2"]),
    "comm_bytes": ("comm_bytes.py", []),
    "memory": ("memory.py", ["--only", "fsdp2-bf16", "deepspeed-bf16-zero2"]),
    "loading_memory": ("loading_memory.py", ["--sizes", "200M", "--ranks", "2"]),
    "checkpoint_io": ("checkpoint_io.py", ["--quick"]),
    "cli_latency": ("cli_latency.py", ["--runs", "3"]),
    "numerics": ("numerics.py", ["--steps", "10"]),
    "moe": ("moe.py", ["--steps", "10"]),
    "lora": ("lora.py", ["--steps", "2"]),
    "gpu_throughput": ("gpu_throughput.py", ["--steps", "5", "--warmup", "2"]),
}
GPU_REFUSED = 2  # gpu_throughput.py's exit code without an FP8 GPU


def run(name: str, quick: bool) -> tuple[int, str]:
    script, quick_args = BENCHMARKS[name]
    print(f"\n=== {name}: python benchmarks/{script}{' ' + ' '.join(quick_args) if quick else ''}", flush=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *(quick_args if quick else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cpu_env(), cwd=ROOT)
    lines = []
    for line in proc.stdout:  # stream: these take minutes
        lines.append(line)
        print(line, end="", flush=True)
    return proc.wait(), "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run; ratios are noisier)")
    args = parser.parse_args()
    rows, failed, refused = [], [], []
    for name in args.only:
        code, output = run(name, args.quick)
        if name == "gpu_throughput" and code == GPU_REFUSED:
            refused.append(output.strip().splitlines()[0] if output.strip() else "refused")
        elif code != 0:
            failed.append(f"{name} (exit {code})")
        rows += [(name, r) for r in parse_results(output)]
    print("\n=== summary" + (" (--quick: smoke run, not a measurement)" if args.quick else ""))
    width = max([len(r.name) for _, r in rows] + [10])
    print(f"{'benchmark':16s}{'figure':{width + 2}s}{'value':>10s}  {'goal':8s}{'verdict':9s}what")
    for bench, r in rows:
        print(f"{bench:16s}{r.name:{width + 2}s}{r.value:10.4f}  {r.goal:8s}{r.verdict():9s}{r.label}")
    for line in refused:
        print(f"{'gpu_throughput':16s}{line}")
    for name in failed:
        print(f"FAILED: {name}")
    if failed:
        return 2
    return 1 if any(r.verdict() == "MISSES" for _, r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
