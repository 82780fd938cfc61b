"""One process group per job, and one way for every rank process to end.

`init` is the only place that picks the collective backend (NCCL where CUDA exists, else gloo; DeepSpeed's own
`init_distributed` for DeepSpeed engines, which sets up deepspeed.comm over the same torch group), with the
config's `train.process_group_timeout_s` as the bound of every collective.

`leave` is the only way a rank process ends: its output flushed, the process group torn down when every rank got
there (a barrier, then destroy_process_group), then `os._exit` without interpreter finalisation. Finalisation is
where a finished rank aborted: gloo's worker threads can still hold async work whose tensors carry Python
references, and destroying them while the interpreter is torn down raises SIGABRT ("terminate called without an
active exception"; pytorch/pytorch PR #179291, abandoned upstream). A rank that leaves with an error does not wait
for its peers: its closed connections stop them at once.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import NoReturn

# This process's rank and the job's size are fp8dist.distributed's (one set of rank helpers); here for the callers
# that start the group through this module.
from fp8dist.distributed import barrier, is_initialized, rank, world_size

__all__ = ["barrier", "device_type", "init", "is_initialized", "leave", "local_rank", "rank", "tear_down",
           "world_size"]


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init(timeout_s: float | None = None, *, deepspeed: bool = False) -> None:
    """Initialise the default process group once per process (a second call does nothing)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank())
    if deepspeed:
        import deepspeed as ds

        from fp8dist.engines.deepspeed.jit_ops import SHM_COMM, say_builds

        if not cuda:  # DeepSpeed's CPU collectives are a C++ op it builds on first use
            say_builds((SHM_COMM,))
        ds.init_distributed(**({"timeout": timeout} if timeout else {}))
        return
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)  # None: torch's default for the backend


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def leave(code: int = 0) -> NoReturn:
    """End this rank process with `code` (see the module docstring). Never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        tear_down()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def tear_down() -> None:
    """All ranks leave the process group together: a barrier, then destroy_process_group (a second call, or a call
    without a group, does nothing). A rank that tears gloo down while a peer still talks aborts the job."""
    if not is_initialized():
        return
    import torch.distributed as dist

    try:
        barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a peer is already gone: there is nothing left to tear down together
        print(f"fp8dist: the process group was not torn down together ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr, flush=True)
