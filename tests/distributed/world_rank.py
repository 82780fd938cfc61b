"""One rank of a world that outlives a test (tests/distributed/worlds.py): started once with the environment
torchrun gives a rank, it connects back to the test process and runs the jobs it is sent, one at a time, as
torchrun would have run them in a fresh process:

    python -m tests.distributed.world_rank HOST:PORT      (FP8DIST_WORLD_KEY: the connection's key, hex)

A job is a module run as `__main__` with its argv (`python -m module args...`, a rank script, launch/train.py) or
a function called by name. What the job writes on file descriptors 1 and 2 (C-level writes included) goes to
files the parent reads back, as it reads a launched process's stdout and stderr. `fp8dist.runtime.process_group
.leave` ends the job instead of the process; the job's process group is torn down at its end, so each job starts
without one, as a launched job does. The rank says when a job left state behind that the next job must not
inherit (a failed or non-zero job): the parent then starts a fresh world. What a job changes that a fresh process
would not have and that can be put back is put back after it: the process group (torn down), the environment,
the working directory, sys.path, the default dtype, compiled code, Accelerate's state, what was said once per
process (warnings, fp8dist's notes), DeepSpeed's communication backend and groups, and the
`torch.nn.functional.linear` that DeepSpeed ZeRO-3 replaces.
"""
from __future__ import annotations

import copy
import importlib
import os
import runpy
import sys
import traceback
import warnings
from multiprocessing.connection import Client


class JobLeft(BaseException):
    """Raised by the patched `leave`: the job ended with this exit code (a BaseException, so that a job's own
    `except Exception` does not swallow it)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _patch_leave() -> None:
    """Before any job imports it: `leave` (and `finish`, which calls it through the module) ends the job only."""
    from fp8dist.runtime import process_group

    def leave(code: int = 0):
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 0:
            process_group.tear_down()
        raise JobLeft(int(code))

    process_group.leave = leave


def _redirect(stdout_path: str, stderr_path: str) -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return saved


def _restore(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


def _run(job: dict) -> int:
    """Run one job; its exit code as the process would have had it."""
    if job["kind"] == "module":
        sys.argv = [job["target"], *job["args"]]
        if job["target"].endswith(".py"):  # as `python script.py` has it: the script's folder first
            sys.path.insert(0, os.path.dirname(os.path.abspath(job["target"])))
        try:
            if job["target"].endswith(".py"):
                runpy.run_path(job["target"], run_name="__main__")
            else:
                runpy.run_module(job["target"], run_name="__main__", alter_sys=True)
        except JobLeft as left:
            return left.code
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return 0
    module, _, name = job["target"].partition(":")
    __import__(module)
    function = sys.modules[module]
    for part in name.split("."):
        function = getattr(function, part)
    job["result"] = function(*job["args"], **job["kwargs"])
    return 0


# DeepSpeed keeps its communication backend and its process groups (data, expert, AutoTP) in module globals,
# None or empty at import (deepspeed 0.19 comm/comm.py `cdb`, utils/groups.py): put back after each job, so that
# the next job's deepspeed.init_distributed starts them again on its own process group.
DEEPSPEED_STATE_MODULES = ("deepspeed.comm.comm", "deepspeed.utils.groups")


def _state_at_import(module_name: str) -> dict:
    module = importlib.import_module(module_name)
    return {name: value for name, value in vars(module).items()
            if not name.startswith("__") and (value is None or (type(value) in (dict, list, set) and not value))}


def _put_back(states: dict[str, dict]) -> None:
    for module_name, state in states.items():
        module = sys.modules[module_name]
        for name, value in state.items():
            setattr(module, name, copy.copy(value))


def _put_back_linear(linear) -> None:
    """DeepSpeed ZeRO-3 replaces torch.nn.functional.linear for the rest of the process (deepspeed 0.19
    runtime/zero/partition_parameters.py: zero3_linear_wrap, installed when its engine starts, never removed)."""
    import torch

    torch.nn.functional.linear = linear


# What a process says once (a fresh rank process has said nothing yet): forgotten after each job, so that the next
# job says it again as its own launch would.
SAID_ONCE_PER_PROCESS = (("fp8dist.engines.advice", "_SAID"), ("fp8dist.engines.deepspeed.jit_ops", "_said"))


def _forget_what_was_said(warning_filters: list) -> None:
    """Python shows a warning once per place per process (each module's __warningregistry__); a job may also add
    filters. Both back to the process's start."""
    warnings.filters[:] = warning_filters
    warnings._filters_mutated()  # type: ignore[attr-defined] - drops the registries' cached "already shown" marks
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()
    for module_name, attribute in SAID_ONCE_PER_PROCESS:
        said = getattr(sys.modules.get(module_name), attribute, None)
        if said is not None:
            said.clear()


def _reset_after_job(environ: dict, cwd: str, path: list[str], default_dtype, warning_filters: list) -> None:
    import torch

    from fp8dist.runtime import process_group

    process_group.tear_down()
    _forget_what_was_said(warning_filters)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()  # compiled code and recompile counts of one job must not decide the next job's
    torch.set_default_dtype(default_dtype)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # Accelerate keeps its process state in class-level singletons
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path


def main(address: str) -> None:
    host, port = address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("FP8DIST_WORLD_KEY")))
    _patch_leave()
    import torch

    linear = torch.nn.functional.linear
    environ, cwd, path, default_dtype = dict(os.environ), os.getcwd(), list(sys.path), torch.get_default_dtype()
    warning_filters = list(warnings.filters)
    deepspeed_state = {name: _state_at_import(name) for name in DEEPSPEED_STATE_MODULES}
    connection.send({"rank": int(os.environ["RANK"]), "pid": os.getpid()})
    while True:
        try:
            job = connection.recv()
        except EOFError:
            os._exit(0)
        if job is None:
            os._exit(0)
        os.environ.update(job["env"])
        saved = _redirect(job["stdout"], job["stderr"])
        error = None
        try:
            code = _run(job)
        except BaseException:  # noqa: BLE001 - reported to the test with the rank's traceback
            code, error = 1, traceback.format_exc()
            print(error, file=sys.stderr)
        finally:
            _restore(saved)
        left = [] if code == 0 else [f"the job exited {code}"]
        try:
            _reset_after_job(environ, cwd, path, default_dtype, warning_filters)
            _put_back(deepspeed_state)
            _put_back_linear(linear)
        except Exception as exc:  # noqa: BLE001 - a group that cannot be torn down: this world is done
            left.append(f"the process group could not be torn down ({type(exc).__name__}: {exc})")
        result = job.get("result") if code == 0 and error is None else None
        connection.send({"code": code, "error": error, "result": result, "left": left})


if __name__ == "__main__":
    main(sys.argv[1])
