"""This process's place in the job: its rank, the number of ranks, a barrier, and one rank acting for all.

The one set of rank helpers of fp8dist: fp8dist.runtime.process_group starts and ends the process group, every
other module asks here. torch is imported inside the functions, and only once torch.distributed is loaded, so
the light commands (validate, translate, schema, import, estimate) import fp8dist without torch.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

from fp8dist.errors import Fp8distError

Result = TypeVar("Result")


def is_initialized() -> bool:
    """Whether this process is in a started default process group (answered without importing torch)."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group; before the group starts, the launcher's RANK (torchrun
    and the deepspeed launcher set it), 0 without a launcher."""
    if is_initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks in the default process group; 1 without one."""
    if is_initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return 1


def barrier() -> None:
    """Wait until every rank of the default process group gets here (nothing to wait for alone)."""
    if is_initialized() and world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def on_rank_zero(what: str, action: Callable[[], Result]) -> Result:
    """Run `action` on rank 0 only (the process itself without a process group) and give its result, or its error,
    to every rank: a failure there raises the same Fp8distError everywhere instead of leaving the other ranks
    waiting in a collective. `what` says what was being done, for errors that are not an Fp8distError. The
    result must pickle (torch.distributed.broadcast_object_list carries it)."""
    grouped = is_initialized()
    outcome: list[Any] = [None]
    if not grouped or rank() == 0:
        try:
            outcome[0] = ("ok", action())
        except Fp8distError as exc:
            outcome[0] = ("error", str(exc))
        except Exception as exc:  # an OSError, a malformed manifest: said with what was being done
            outcome[0] = ("error", f"{what}: {type(exc).__name__}: {exc}")
    if grouped and world_size() > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        raise Fp8distError(outcome[0][1])
    result: Result = outcome[0][1]
    return result
