"""CLI latency: `fp8dist translate` vs `python -c "import torch"`, wall time of whole processes.

    python benchmarks/cli_latency.py [--runs N]
    python benchmarks/cli_latency.py --smoke     # one run each: not a measurement

`translate` must stay light (no torch, DeepSpeed or torchao import), so a user can call it in a loop or a
launcher script. Both commands run as fresh interpreters, alternating A B, B A, ... so that drift hits
both alike; the ratio is median(translate) / median(import torch). Goal: <= 0.25.
A third figure, `fp8dist validate`, is reported for information.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, cpu_env, median, result  # noqa: E402

CONFIG = str(ROOT / "configs" / "deepspeed-bf16-zero2.yaml")
COMMANDS = {
    "translate": [sys.executable, "-m", "fp8dist", "translate", CONFIG, "--to", "deepspeed"],
    "validate": [sys.executable, "-m", "fp8dist", "validate", CONFIG],
    "import torch": [sys.executable, "-c", "import torch"],
}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=cpu_env(), cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    runs = 1 if args.smoke else args.runs
    for command in COMMANDS.values():  # warm the page cache for every interpreter and package once
        timed(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    names = list(COMMANDS)
    for i in range(runs):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(timed(COMMANDS[name]))
    print(f"{'command':16s}{'median s':>10s}{'min s':>10s}   ({runs} runs each, interleaved)")
    for name, values in times.items():
        print(f"{name:16s}{median(values):10.3f}{min(values):10.3f}")
    torch_s = median(times["import torch"])
    result("cli_translate_vs_import_torch", median(times["translate"]) / torch_s, "<=0.25",
           "`fp8dist translate` wall time / `python -c 'import torch'`")
    result("cli_validate_vs_import_torch", median(times["validate"]) / torch_s, "info",
           "`fp8dist validate`, same ratio")


if __name__ == "__main__":
    main()
