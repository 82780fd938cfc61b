"""Run real 2- and 4-process jobs on gloo (CPU): in the suite's kept worlds (`in_world`, tests/distributed/worlds.py)
where the job is not about the launcher, with the real launchers (`torchrun`, `deepspeed`) where it is."""
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


def in_world(script, *args, nproc=2, timeout=600, env=None, fresh_after=False):
    """`script` (a .py path or a module name) with `args` on every rank of the kept `nproc`-rank world, as
    `torchrun --nproc_per_node nproc script args` runs it: the same CompletedProcess (exit code, stdout, stderr)."""
    from tests.distributed.worlds import WORLDS

    return WORLDS.run(script, *args, nproc=nproc, timeout=timeout, env=env, fresh_after=fresh_after)


def cli_in_world(*args, timeout=600) -> subprocess.CompletedProcess:
    """`fp8dist ARGS` as tests/conftest.py's run_cli runs it (exit code, stdout, stderr), the command in this
    process and its N-rank job (`--nproc`) on the kept worlds instead of a torchrun launch of its own."""
    import contextlib
    import io
    from unittest import mock

    from fp8dist import cli
    from tests.distributed.worlds import WORLDS

    def launch(module, argv, nproc, job_timeout, what, on_progress=None):
        return WORLDS.launch(module, argv, nproc, min(job_timeout, timeout), what, on_progress)

    out, err = io.StringIO(), io.StringIO()
    with mock.patch("fp8dist.runtime.ranks.launch", launch), mock.patch("fp8dist.commands.audit.launch", launch), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as stop:  # argparse
            code = stop.code if isinstance(stop.code, int) else 2
    return subprocess.CompletedProcess(["fp8dist", *map(str, args)], code, out.getvalue(), err.getvalue())


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
    """{case: result} of a multi-case rank script (tests/distributed/case_runner.py) run on the kept `nproc`-rank
    world: the job must succeed and no case may have raised (their tracebacks are the assertion's message)."""
    from fp8dist.runtime.ranks import results

    result = in_world(script, *args, nproc=nproc, timeout=timeout)
    assert result.returncode == 0, describe(result)
    found = dict(results(result.stdout, "case"))
    errors = {name: case["traceback"] for name, case in found.items() if "error" in case}
    assert not errors, errors
    return found
