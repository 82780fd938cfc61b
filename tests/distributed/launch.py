"""Run real 2-process jobs on gloo (CPU) with the real launchers."""
import os
import socket
import subprocess
import sys

from fp8dist.runtime.loop import losses  # noqa: F401 - the tests read train.py's lines with it
from tests.conftest import ROOT

TRAIN = ROOT / "launch" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def torchrun(script, *args, nproc=2, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)


def deepspeed(script, *args, nproc=2, timeout=400):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)


def library_noise(output: str) -> list[str]:
    """The lines of a run's output that fp8dist.library_noise should have kept out."""
    import re

    from fp8dist.library_noise import BENIGN

    return [line for line in output.splitlines() if any(re.search(m.pattern.lstrip("^"), line) for m in BENIGN)]


def describe(result) -> str:
    return f"rc={result.returncode}\nSTDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-5000:]}"


def cases(script, *args, nproc: int, timeout: int = 600) -> dict:
    """{case: result} of a multi-case rank script (tests/distributed/case_runner.py) launched on `nproc` ranks: the
    launch must succeed and no case may have raised (their tracebacks are the assertion's message)."""
    from fp8dist.runtime.ranks import results

    result = torchrun(script, *args, nproc=nproc, timeout=timeout)
    assert result.returncode == 0, describe(result)
    found = dict(results(result.stdout, "case"))
    errors = {name: case["traceback"] for name, case in found.items() if "error" in case}
    assert not errors, errors
    return found
