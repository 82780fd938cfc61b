"""Jobs of N ranks behind a CLI command (`fp8dist audit`, `fp8dist compare`): launched with torchrun's
standalone rendezvous (the store binds a port the OS assigns: none picked in advance that another process can
take), bounded in time, their result handed back through one JSON file, their failures said in one message
without torchrun's failure dump."""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from fp8dist.errors import Fp8distError

PROGRESS = "fp8dist-progress "  # a rank's stdout line the parent shows as it comes
# torchrun's own failure report (torch.distributed.elastic), line by line: said better by fp8dist's message.
_ELASTIC_NOISE = ("torch.distributed.elastic", "ChildFailedError", "error_file", "traceback :", "To enable traceback",
                  "Root Cause", "Failures:", "<NO_OTHER_FAILURES>", "exitcode  :", "host      :", "rank      :",
                  "time      :", "=====", "-----", "[0]:", "[1]:")


def failure_tail(output: str, lines: int = 15) -> str:
    kept = [line for line in output.strip().splitlines()
            if not any(line.strip().startswith(noise) or "torch.distributed.elastic" in line for noise in _ELASTIC_NOISE)
            and not re.fullmatch(r"\S+ FAILED", line.strip())]  # torchrun's "<module> FAILED" banner
    return "\n".join(kept[-lines:])


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(module: str, args: list[str], nproc: int, timeout: float, what: str,
           on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `python -m module *args OUT.json` on `nproc` ranks and return what rank 0 wrote to OUT.json.
    A rank's `{"_error": ...}` becomes an Fp8distError (exit 2), and so do a timeout and a crash."""
    with tempfile.TemporaryDirectory(prefix="fp8dist-ranks-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", module, *args, out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if has_cuda() else "cpu")}
        # One pipe for both streams, drained by a thread: progress shown as it comes, the tail kept for errors,
        # and no rank ever blocks on a full pipe. Its own process group: a timeout ends every rank.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=200)

        def drain():
            for line in proc.stdout:
                if line.startswith(PROGRESS) and on_progress is not None:
                    on_progress(line[len(PROGRESS):].rstrip())
                else:
                    tail.append(line)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except BaseException as exc:  # a timeout, or Ctrl-C that reached only this process: end every rank
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise Fp8distError(f"the {what} did not finish within {timeout:g} s and was stopped; raise --timeout "
                               "for a larger model or more --steps") from None
        reader.join(timeout=10)
        if not os.path.exists(out):
            raise Fp8distError(f"the {what} failed (exit {proc.returncode}):\n{failure_tail(''.join(tail))}")
        with open(out, encoding="utf-8") as handle:
            result = json.load(handle)
    if "_error" in result:
        raise Fp8distError(result["_error"])
    return result


def finish(result: dict[str, Any], out_path: str) -> int:
    """In a rank: rank 0 writes the result, then all ranks leave together (a rank that tears gloo down while
    a peer still talks aborts the job). Without a process group (its setup failed) every rank writes it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
