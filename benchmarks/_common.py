"""Shared by the benchmark scripts: launches (ranks under torchrun, the fp8dist CLI), medians, and the `result`
lines run.py reads.

Each script prints human-readable lines, then one result line per measured quantity (fp8dist.runtime.ranks: the
one protocol of what a process hands back, `fp8dist-result result <name> {"value": v, "goal": g, "label": l}`),
where the goal is `<=X`, `>=X`, `=X` (within 1%) or `info` (a figure without a limit), so that `benchmarks/run.py`
can collect every figure of one run into a single table.
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fp8dist.runtime.ranks import emit, results

ROOT = Path(__file__).resolve().parents[1]
# Every script's --smoke: what tests/distributed/test_benchmarks_run.py runs, so that a change that breaks a benchmark
# turns the test suite red.
SMOKE_HELP = "smallest size: every figure once, to show the script runs (the test suite runs this); not a measurement"
EQUAL_TOLERANCE = 0.01


def under_torchrun() -> bool:
    return os.environ.get("LOCAL_RANK") is not None


def cpu_env() -> dict[str, str]:
    """fp8dist importable from the checkout, one OpenMP thread per rank, DeepSpeed on its CPU accelerator."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}


def torchrun(script: str, args: list[str], nproc: int = 2, env: dict[str, str] | None = None,
             stream: bool = False) -> subprocess.CompletedProcess:
    """`script args` on `nproc` ranks under torchrun (environment: `env`, else CPU/gloo `cpu_env`), its output
    captured (or shown as it comes with `stream`). Every launch of ranks in the benchmarks goes through here, so
    that tests/distributed/test_benchmarks_run.py can run the smokes' ranks in the test suite's kept worlds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script,
               *args]
    if stream:
        return subprocess.CompletedProcess(command, subprocess.call(command, env=env or cpu_env(), cwd=ROOT), "", "")
    return subprocess.run(command, capture_output=True, text=True, env=env or cpu_env(), cwd=ROOT)


def fp8dist_cli(*args: str) -> subprocess.CompletedProcess:
    """`fp8dist ARGS` in a fresh interpreter, as a user runs it, its output captured."""
    return subprocess.run([sys.executable, "-m", "fp8dist", *args], capture_output=True, text=True, env=cpu_env(),
                          cwd=ROOT)


def relaunch(script: str, nproc: int = 2, args: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    """Run `script` under torchrun, its output shown as it comes; the exit code."""
    return torchrun(script, args or [], nproc, env, stream=True).returncode


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, ...), in KiB."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_resident() -> None:
    """Reset VmHWM to the current resident size (Linux proc(5), /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def median(values: list[float]) -> float:
    return statistics.median(values)


def result(name: str, value: float, goal: str, label: str = "") -> None:
    emit("result", name, {"value": round(float(value), 6), "goal": goal, "label": label})


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
    return [Result(name, float(r["value"]), r["goal"], r.get("label", "")) for name, r in results(text, "result")]


def quiet_libraries() -> None:
    """Keep torchao's and DeepSpeed's start-up chatter out of the benchmark tables."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torchao", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def launcher_losses(config: str, steps: int, model: str = "tiny-llama") -> list[float]:
    """The per-step losses of `torchrun launch/train.py` (2 CPU ranks) for a config and model."""
    from fp8dist.runtime.loop import losses  # launch/train.py's step lines

    done = torchrun(str(ROOT / "launch" / "train.py"), ["--fp8dist-config", config, "--model", model, "--steps",
                                                        str(steps)])
    values = losses(done.stdout)
    if done.returncode != 0 or len(values) != steps:
        raise SystemExit(f"{config}: exit {done.returncode}, {len(values)} losses\n{done.stderr[-3000:]}")
    return values


# glibc malloc raises its mmap threshold each time a mapped block is freed (mallopt(3), M_MMAP_THRESHOLD: dynamic up
# to 32 MiB), after which freed tensors stay in the heap of whichever thread's arena held them: a process's resident
# high-water mark then varies run to run by more than the difference measured (seen here: one side 433 and 616 MiB in
# two runs). A fixed threshold (setting it turns the dynamic one off) maps every tensor of 64 KiB or more on its own
# and returns it when freed, so VmHWM follows the bytes alive.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def measure_side(script: str, side: str, *args: str) -> dict:
    """One side of a side-by-side benchmark in its own 2-rank torchrun launch (`script --side SIDE *args`), so that
    each process's high-water mark is its own (and follows the bytes alive: FIXED_MMAP_THRESHOLD): the payload rank 0
    printed for it (fp8dist.runtime.ranks.emit)."""
    done = torchrun(script, ["--side", side, *args], env={**cpu_env(), **FIXED_MMAP_THRESHOLD})
    found = dict(results(done.stdout, "side"))
    if done.returncode != 0 or side not in found:
        raise SystemExit(f"{side}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return found[side]
