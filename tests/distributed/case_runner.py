"""The loop of the multi-case rank scripts (tests/distributed/scripts/*_runs.py): every rank runs each case;
rank 0 (and any rank whose case failed, with its traceback) prints a `case` result line
(fp8dist.runtime.ranks.emit) for the test to read;
a failed case does not stop the next."""
from __future__ import annotations

import traceback
from typing import Callable

from fp8dist.runtime.ranks import emit


def run_cases(cases: dict[str, Callable[[], dict]], only: list[str] | tuple = ()) -> None:
    import torch.distributed as dist

    for name, case in cases.items():
        if only and name not in only:
            continue
        try:
            out = case()
        except Exception as exc:  # report, then go on with the next case (the peers raised the same or time out)
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        if dist.get_rank() == 0 or "error" in out:
            emit("case", name, out)
        dist.barrier()
