"""`fp8dist audit MODEL [--config C] [KEY=VALUE ...]`: check what can be checked here, run the measuring worker
(fp8dist.commands.audit_worker) on N ranks (torchrun, gloo on CPU) within a time bound, and report.

Before anything is launched, the parent checks the config, the model name and the environment (the FP8
backend's library and hardware; what DeepSpeed itself would refuse), so such errors exit 2 with fp8dist's
message instead of a torchrun failure dump. The ranks run under fp8dist.runtime.ranks (standalone rendezvous,
bounded time, one message on failure).
"""
from __future__ import annotations

import sys
from typing import Sequence

from fp8dist.audit.report import markdown, table
from fp8dist.commands.output import dump_json
from fp8dist.config.load import load_config
from fp8dist.errors import Checks, ExitCode, Fp8distError
from fp8dist.runtime.loading import check_efficient_loading
from fp8dist.runtime.models import check_mesh_fits
from fp8dist.runtime.preflight import preflight
from fp8dist.runtime.ranks import launch

TIMEOUT_S = 600  # default bound of an audit run (the CLI's --timeout)


def check_before_launch(spec, model: str, nproc: int) -> None:
    """Everything that can fail without launching, every refusal at once (Problems): the model name, the backend,
    the engine's own refusals, the ranks a hybrid shard group needs, the sizes a tensor-parallel mesh splits."""
    checks = Checks()
    for check in (lambda: check_efficient_loading(model, spec), lambda: check_mesh_fits(spec, model, nproc, "--nproc"),
                  lambda: preflight(spec)):
        with checks.one():
            check()
    checks.raise_found()


def measure(model: str, config: str | None, nproc: int, steps: int, timeout: float = TIMEOUT_S,
            overrides: Sequence[str] = (), numerics: bool = False) -> dict:
    """The watch's report of `steps` steps of MODEL under the config, on `nproc` ranks; `numerics`: with the FP8
    numerics check (fp8dist.audit.numerics)."""
    from fp8dist.commands.audit_worker import NUMERICS

    return launch("fp8dist.commands.audit_worker", [model, config or "", str(steps), "\n".join(overrides),
                                           NUMERICS if numerics else ""], nproc, timeout, "audit run",
                  lambda line: print(line, file=sys.stderr, flush=True))  # on_progress: policy auto's decisions


def run_audit(args) -> int:
    if args.nproc < 1 or args.steps < 1:
        raise Fp8distError("--nproc and --steps must be at least 1")
    if args.timeout <= 0:
        raise Fp8distError(f"--timeout must be positive seconds, got {args.timeout:g}")
    spec = load_config(args.config, overrides=args.overrides)  # config errors: exit 2 before anything starts
    check_before_launch(spec, args.model, args.nproc)
    result = measure(args.model, args.config, args.nproc, args.steps, args.timeout, args.overrides, args.numerics)
    render = {"json": dump_json, "markdown": markdown, "table": table}[args.format]
    sys.stdout.write(render(result))
    return ExitCode.OK if result["passed"] else ExitCode.MISMATCH
