"""`fp8dist audit MODEL`: run the measuring worker on N ranks (torchrun, gloo on CPU) and report."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

from fp8dist.audit.report import build, markdown, table
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError, UnsupportedEnvironment

EXIT_OK, EXIT_MISMATCH = 0, 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: str, config: str | None, nproc: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fp8dist-audit-") as tmp:
        out = os.path.join(tmp, "observed.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               "-m", "fp8dist.audit.worker", model, config or "", str(steps), out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR":
               os.environ.get("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if not os.path.exists(out):
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise Fp8distError(f"the audit run failed (exit {proc.returncode}):\n{tail}")
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
    spec = load_config(args.config)  # config errors: exit 2 before anything starts
    observed = measure(args.model, args.config, args.nproc, args.steps)
    result = build(spec, args.model, observed, args.nproc)
    render = {"json": lambda r: json.dumps(r, indent=2) + "\n", "markdown": markdown, "table": table}[args.format]
    sys.stdout.write(render(result))
    return EXIT_OK if result["passed"] else EXIT_MISMATCH
