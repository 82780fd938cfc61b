"""Jobs that check the worlds themselves (tests/distributed/test_worlds.py): run in every rank of a kept world."""
from __future__ import annotations

import os
import sys
import time


def all_reduce_ranks() -> dict:
    """Each rank's rank summed over a fresh process group, with the pid that ran it."""
    import torch
    import torch.distributed as dist

    from fp8dist.runtime import process_group

    process_group.init()
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says hello")
    return {"sum": float(total), "pid": os.getpid(), "world": dist.get_world_size()}


def fail_on(rank: int) -> None:
    """Raise on one rank, after the group is up; the others wait for it in a collective."""
    import torch.distributed as dist

    from fp8dist.runtime import process_group

    process_group.init()
    if dist.get_rank() == rank:
        raise ValueError(f"case failed on purpose on rank {rank}")
    dist.barrier()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def patch_linear() -> dict:
    """Leave a patched torch.nn.functional.linear behind, as DeepSpeed ZeRO-3 does; whether the job found torch's."""
    import torch

    original = torch.nn.functional.linear
    torch.nn.functional.linear = lambda *args, **kwargs: original(*args, **kwargs)
    return {"pid": os.getpid(), "found_torchs": original is torch._C._nn.linear}


if __name__ == "__main__":  # as a script: exit with the code given, after a line on each stream and a warning
    import warnings

    print(f"argv {sys.argv[1:]}")
    print("to stderr", file=sys.stderr)
    warnings.warn("shown once per place per process")
    from fp8dist.runtime.process_group import leave

    leave(int(sys.argv[1]))
