"""Every benchmark runs, at its smallest size (`--smoke`), and prints every figure it promises
(benchmarks/run.py BENCHMARKS): a change in the library that breaks a benchmark script (a changed signature, a
changed report key) turns the suite red instead of `python benchmarks/run.py` exiting 2 for the next user. The
figures themselves are not judged here: smoke sizes measure nothing (benchmarks/README.md)."""
import fnmatch
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import cpu_env, parse_results  # noqa: E402
from run import BENCHMARKS, GPU_REFUSED, command  # noqa: E402

pytestmark = pytest.mark.distributed  # most of them launch 2 gloo ranks


def test_every_script_is_listed():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")} - {"run.py"}
    assert scripts == {b.script for b in BENCHMARKS.values()}


def gpu_refuses() -> bool:
    import torch

    from fp8dist.facts.hardware import FP8_MIN_CAPABILITY
    return not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= FP8_MIN_CAPABILITY)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_runs_and_prints_what_it_promises(name):
    done = subprocess.run(command(name, "smoke"), capture_output=True, text=True, env=cpu_env(), cwd=ROOT,
                          timeout=600)
    output = done.stdout + done.stderr
    if name == "gpu_throughput" and gpu_refuses():
        assert done.returncode == GPU_REFUSED and "refusing" in done.stderr and "Traceback" not in output, output
        return
    assert done.returncode == 0, output[-5000:]
    printed = {r.name: r.value for r in parse_results(done.stdout)}
    missing = [p for p in BENCHMARKS[name].promises if not fnmatch.filter(printed, p)]
    assert not missing, f"{name} did not print {missing}; it printed {sorted(printed)}\n{output[-3000:]}"
