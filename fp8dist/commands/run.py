"""`fp8dist run CONFIG [KEY=VALUE ...] [--nproc N] [--launcher torchrun|deepspeed] -- SCRIPT [ARGS ...]`: one entry
for every launch.

It checks first, in this one process, what can be refused before a rank starts (the config and its overrides,
the FP8 backend's library and hardware, the engine's own refusals, the world size a hybrid shard group needs),
so a refusal is one message and exit 2. Then it starts SCRIPT on N ranks with the launcher the config's engine
uses (torchrun for FSDP2, the deepspeed launcher for DeepSpeed; `--launcher` picks the other), handing it
`--fp8dist-config CONFIG` and each override as `--fp8dist-set KEY=VALUE` (what `fp8dist.add_config_arguments`
reads). The ranks' output streams through; the launcher's own failure report (torchrun's ChildFailedError dump)
does not: a failed rank's message is said once, and the exit code is the failed rank's own.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import IO, cast

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Checks, ExitCode, Fp8distError
from fp8dist.runtime.ranks import is_launcher_report

LAUNCHERS = ("torchrun", "deepspeed")
# The launchers' failure reports name the failed rank's exit code: torchrun's "failed (exitcode: 2) local_rank: 1"
# log line and its ChildFailedError dump ("exitcode  : 2"; torch 2.13 torch/distributed/elastic/multiprocessing/
# api.py and errors/__init__.py), the deepspeed launcher's "exits with return code = 2" (DeepSpeed 0.19
# deepspeed/launcher/launch.py). From that line on, the output is the launcher's report and its traceback.
_RANK_EXIT = re.compile(r"(?:exitcode\s*:\s*|exits with return code = )(-?\d+)")
# The deepspeed launcher's own log lines (runner.py, launch.py: the hostfile, the command, the ranks it spawned);
# fp8dist run says once what it launches instead.
_DEEPSPEED_LAUNCHER_LOG = re.compile(r"^\[[^]]+\] \[(INFO|WARNING)\] \[(runner|launch)\.py:\d+:")


def default_nproc() -> int:
    """One rank per visible CUDA GPU; 2 on a machine without one (gloo on the CPU)."""
    import torch

    return torch.cuda.device_count() or 2


def launcher_command(launcher: str, nproc: int, script_line: list[str]) -> list[str]:
    """The launcher's command line around `script_line` (the script and its arguments)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                *script_line]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), *script_line]


def script_arguments(config: str, overrides: list[str], args: list[str]) -> list[str]:
    sets = [word for override in overrides for word in ("--fp8dist-set", override)]
    return ["--fp8dist-config", config, *sets, *args]


def check_before_launch(args) -> str:
    """Everything one process can refuse before a rank starts, every refusal at once (Problems); returns the
    launcher to use."""
    from fp8dist.runtime.preflight import preflight

    checks, spec = Checks(), None
    if not args.script:
        checks.add(Fp8distError("no script to run\n  fix: name it after `--`: fp8dist run CONFIG -- train.py "
                                "[ARGS ...]"))
    elif not Path(args.script[0]).is_file():
        checks.add(Fp8distError(f"script {args.script[0]!r} does not exist\n  fix: name the training script to "
                                "launch, after `--`"))
    if args.nproc is not None and args.nproc < 1:
        checks.add(Fp8distError(f"--nproc {args.nproc}: must be at least 1"))
    with checks.one():
        spec = load_config(args.config, overrides=args.overrides)
    if spec is not None:
        if args.nproc is None or args.nproc >= 1:
            with checks.one():
                ParallelDims.of(spec, args.nproc or default_nproc(), "--nproc")  # before the ranks start
        with checks.one():
            preflight(spec)
    checks.raise_found()
    assert spec is not None  # raise_found raised when the config was refused
    return args.launcher or profile_for(spec).launcher


def run(args) -> int:
    launcher = check_before_launch(args)
    script, *rest = args.script
    nproc = args.nproc or default_nproc()
    forwarded = [script, *script_arguments(args.config, args.overrides, rest)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    print(f"fp8dist run: {launcher}, {nproc} ranks: {' '.join(forwarded)}", file=sys.stderr, flush=True)
    command = launcher_command(launcher, nproc, forwarded)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rank_exit: int | None = None
    recent: collections.deque[str] = collections.deque(maxlen=2 * nproc)
    try:
        for line in cast(IO[str], proc.stdout):  # a pipe: Popen was given stdout=PIPE
            found = _RANK_EXIT.search(line)
            if found and rank_exit is None:
                rank_exit = int(found.group(1))
            if rank_exit is not None or is_launcher_report(line) or _DEEPSPEED_LAUNCHER_LOG.match(line):
                continue
            if line in recent and line.strip():  # every rank saying the same thing at once: said once
                continue
            recent.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return int(ExitCode.INTERRUPTED)
    if code == 0:
        return int(ExitCode.OK)
    if rank_exit is not None and rank_exit > 0:
        return rank_exit
    print(f"fp8dist run: {launcher} exited {code}", file=sys.stderr)
    return code if code > 0 else int(ExitCode.ERROR)
