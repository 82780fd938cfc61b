"""`fp8dist audit MODEL`: check what can be checked here, run the measuring worker on N ranks (torchrun,
gloo on CPU) within a time bound, and report.

Before anything is launched, the parent checks the config, the model name and the environment (the FP8
backend's library and hardware; what DeepSpeed itself would refuse), so such errors exit 2 with fp8dist's
message instead of a torchrun failure dump. The ranks meet through torchrun's standalone rendezvous
(the store binds a port the OS assigns: no port picked in advance that another process can take).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from fp8dist.audit.report import build, markdown, table
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError, UnsupportedEnvironment

EXIT_OK, EXIT_MISMATCH = 0, 1
# torchrun's own failure report (torch.distributed.elastic), line by line: said better by fp8dist's message.
_ELASTIC_NOISE = ("torch.distributed.elastic", "ChildFailedError", "error_file", "traceback :", "To enable traceback",
                  "Root Cause", "Failures:", "<NO_OTHER_FAILURES>", "exitcode  :", "host      :", "rank      :",
                  "time      :", "fp8dist.audit.worker FAILED", "=====", "-----", "[0]:", "[1]:")


def check_before_launch(spec, model: str) -> None:
    """Everything that can fail without launching: the model name, the backend, the engine's own refusals."""
    from fp8dist.engines.preflight import preflight
    from fp8dist.models import check_model_name

    check_model_name(model)
    preflight(spec)


def _failure_tail(stderr: str, lines: int = 15) -> str:
    kept = [line for line in stderr.strip().splitlines()
            if not any(line.strip().startswith(noise) or "torch.distributed.elastic" in line for noise in _ELASTIC_NOISE)]
    return "\n".join(kept[-lines:])


def measure(model: str, config: str | None, nproc: int, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fp8dist-audit-") as tmp:
        out = os.path.join(tmp, "observed.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "fp8dist.audit.worker", model, config or "", str(steps), out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR":
               os.environ.get("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # its own process group: a timeout ends every rank
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except BaseException as exc:  # a timeout, or Ctrl-C that reached only this process: end every rank
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise Fp8distError(f"the audit run did not finish within {timeout:g} s and was stopped; raise --timeout "
                               "for a larger model or more --steps") from None
        if not os.path.exists(out):
            raise Fp8distError(f"the audit run failed (exit {proc.returncode}):\n{_failure_tail(stderr)}")
        with open(out, encoding="utf-8") as handle:
            observed = json.load(handle)
    if "_error" in observed:
        raise UnsupportedEnvironment(observed["_error"])
    return observed


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_audit(args) -> int:
    if args.nproc < 1 or args.steps < 1:
        raise Fp8distError("--nproc and --steps must be at least 1")
    if args.timeout <= 0:
        raise Fp8distError(f"--timeout must be positive seconds, got {args.timeout:g}")
    spec = load_config(args.config)  # config errors: exit 2 before anything starts
    check_before_launch(spec, args.model)
    observed = measure(args.model, args.config, args.nproc, args.steps, args.timeout)
    result = build(spec, args.model, observed, args.nproc)
    render = {"json": lambda r: json.dumps(r, indent=2) + "\n", "markdown": markdown, "table": table}[args.format]
    sys.stdout.write(render(result))
    return EXIT_OK if result["passed"] else EXIT_MISMATCH
