"""Shared by the benchmark scripts: relaunch under torchrun, medians, and the `result` lines run.py reads.

Each script prints human-readable lines, then one line per measured quantity:
    result <name>=<value> goal=<goal> [label]
where <goal> is `<=X`, `>=X`, `=X` (within 1%) or `info` (a figure without a limit), so that
`benchmarks/run.py` can collect every figure of one run into a single table.
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_LINE = re.compile(r"^result (\S+)=(\S+) goal=(\S+)(?: (.*))?$")
EQUAL_TOLERANCE = 0.01


def under_torchrun() -> bool:
    return os.environ.get("LOCAL_RANK") is not None


def cpu_env() -> dict[str, str]:
    """fp8dist importable from the checkout, one OpenMP thread per rank, DeepSpeed on its CPU accelerator."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}


def relaunch(script: str, nproc: int = 2, args: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    """Run `script` under torchrun (default environment: CPU/gloo, `cpu_env`)."""
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(nproc), script, *(args or [])], env=env or cpu_env())


def median(values: list[float]) -> float:
    return statistics.median(values)


def result(name: str, value: float, goal: str, label: str = "") -> None:
    print(f"result {name}={value:.4f} goal={goal}" + (f" {label}" if label else ""), flush=True)


@dataclass(frozen=True)
class Result:
    name: str
    value: float
    goal: str
    label: str

    def verdict(self) -> str:
        """'meets', 'MISSES' or 'info'."""
        if self.goal == "info":
            return "info"
        op, limit = re.match(r"^(<=|>=|=)(.+)$", self.goal).groups()
        limit = float(limit)
        ok = {"<=": self.value <= limit, ">=": self.value >= limit,
              "=": abs(self.value - limit) <= EQUAL_TOLERANCE * abs(limit)}[op]
        return "meets" if ok else "MISSES"


def parse_results(text: str) -> list[Result]:
    out = []
    for line in text.splitlines():
        match = RESULT_LINE.match(line.strip())
        if match:
            name, value, goal, label = match.groups()
            out.append(Result(name, float(value), goal, label or ""))
    return out


def quiet_libraries() -> None:
    """Keep torchao's and DeepSpeed's start-up chatter out of the benchmark tables."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torchao", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
