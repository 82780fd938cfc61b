"""Every benchmark runs, at its smallest size (`--smoke`), and prints every figure it promises
(benchmarks/run.py BENCHMARKS): a change in the library that breaks a benchmark script (a changed signature, a
changed report key) turns the suite red instead of `python benchmarks/run.py` exiting 2 for the next user. The
figures themselves are not judged here: smoke sizes measure nothing (benchmarks/README.md).

The smokes share the suite's kept gloo worlds (tests/distributed/worlds.py) instead of launching their own: a
script that launches itself under torchrun runs as a job of a world (its ranks' code, as torchrun would run it);
any other runs its own process's code here, with its launches (benchmarks/_common.py `torchrun`, `fp8dist_cli`,
and the CLI's N-rank jobs) in the worlds; cli_latency.py, which times fresh interpreters, runs as its own process."""
import fnmatch
import logging
import os
import runpy
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402
from _common import cpu_env, parse_results  # noqa: E402
from run import BENCHMARKS, GPU_REFUSED, command  # noqa: E402

pytestmark = pytest.mark.distributed  # most of them launch 2 gloo ranks
# The scripts whose own process only relaunches them under torchrun (`relaunch`): their ranks, on this many.
RANKS_ONLY = {"overhead": 2, "watch_overhead": 2, "comm_bytes": 2, "tensor_parallel": 4, "expert_parallel": 2,
              "pipeline_parallel": 2,  # pp 2 x one data rank (its --dp-shard 2 runs 4; the smoke does not)
              "numerics_overhead": 1}  # numerics_overhead: one process with a 1-rank group of its own
OWN_PROCESS = {"cli_latency"}  # what it measures is fresh interpreters


def test_every_script_is_listed():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")} - {"run.py"}
    assert scripts == {b.script for b in BENCHMARKS.values()}


def gpu_refuses() -> bool:
    import torch

    from fp8dist.facts.hardware import FP8_MIN_CAPABILITY
    return not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= FP8_MIN_CAPABILITY)


def torchrun_in_world(script, args, nproc=2, env=None, stream=False):
    """benchmarks/_common.torchrun's contract, the ranks a job of the kept `nproc`-rank world."""
    from tests.distributed.launch import in_world

    differs = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v and k != "PYTHONPATH"}
    done = in_world(script, *args, nproc=nproc, env=differs)
    if stream:  # what the launch would have shown as it came
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
    return done


def run_here(name, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """The script's own process in this one (`python benchmarks/X.py --smoke`), its launches in the worlds."""
    from tests.distributed.launch import cli_in_world

    monkeypatch.setattr(_common, "torchrun", torchrun_in_world)
    monkeypatch.setattr(_common, "fp8dist_cli", lambda *args: cli_in_world(*args))
    script = command(name, "smoke")[1:]
    monkeypatch.setattr(sys, "argv", script)
    monkeypatch.chdir(ROOT)
    code = 0
    levels = {name: logging.getLogger(name).level for name in logging.Logger.manager.loggerDict}
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as stop:  # a message instead of a code: printed, exit 1, as the interpreter does
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    finally:  # the script quiets the libraries' loggers (quiet_libraries): not for the tests after it
        for name in list(logging.Logger.manager.loggerDict):
            logging.getLogger(name).setLevel(levels.get(name, logging.NOTSET))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(script, code, out, err)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_runs_and_prints_what_it_promises(name, monkeypatch, capsys):
    if name in OWN_PROCESS or (name == "gpu_throughput" and not gpu_refuses()):
        done = subprocess.run(command(name, "smoke"), capture_output=True, text=True, env=cpu_env(), cwd=ROOT,
                              timeout=600)
    elif name in RANKS_ONLY:
        from tests.distributed.launch import in_world

        done = in_world(ROOT / "benchmarks" / BENCHMARKS[name].script, "--smoke", nproc=RANKS_ONLY[name])
    else:
        done = run_here(name, monkeypatch, capsys)
    output = done.stdout + done.stderr
    if name == "gpu_throughput" and gpu_refuses():
        assert done.returncode == GPU_REFUSED and "refusing" in done.stderr and "Traceback" not in output, output
        return
    assert done.returncode == 0, output[-5000:]
    printed = {r.name: r.value for r in parse_results(done.stdout)}
    missing = [p for p in BENCHMARKS[name].promises if not fnmatch.filter(printed, p)]
    assert not missing, f"{name} did not print {missing}; it printed {sorted(printed)}\n{output[-3000:]}"
