"""Jobs of N ranks behind a CLI command (`fp8dist audit`, `fp8dist compare`): launched with torchrun's
standalone rendezvous (the store binds a port the OS assigns: none picked in advance that another process can
take), bounded in time, their result handed back through one JSON file, their failures said in one message
without torchrun's failure dump."""
from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, NoReturn

from fp8dist.errors import Fp8distError
from fp8dist.runtime import process_group

# One protocol for what a rank process hands back on its stdout (the compare worker's progress, the test rank
# scripts' cases, the benchmarks' figures): one line `fp8dist-result <kind> <name> <json payload>`.
RESULT = "fp8dist-result"
PROGRESS = "progress"  # a line the parent shows as it comes (launch's on_progress)
JOB_ENV = "FP8DIST_RANKS_JOB"  # set in the ranks of a launch: what a rank says goes back as PROGRESS lines
# torchrun's own failure report (torch.distributed.elastic), line by line: said better by fp8dist's message.
_ELASTIC_NOISE = ("torch.distributed.elastic", "ChildFailedError", "error_file", "traceback :", "To enable traceback",
                  "Root Cause", "Failures:", "<NO_OTHER_FAILURES>", "exitcode  :", "host      :", "rank      :",
                  "time      :", "=====", "-----", "[0]:", "[1]:")


def emit(kind: str, name: str, payload: Any = None) -> None:
    """Print one result line (`name` without spaces; `payload` JSON, NaN and Infinity as null)."""
    print(f"{RESULT} {kind} {name} {json.dumps(_finite(payload))}", flush=True)


def results(text: str, kind: str) -> list[tuple[str, Any]]:
    """(name, payload) of every `kind` line in `text`, in order. A peer's log text that the terminal interleaved
    after the payload on the same line is ignored."""
    found = []
    for line in text.splitlines():
        parts = line.strip().split(" ", 3)
        if len(parts) == 4 and parts[0] == RESULT and parts[1] == kind:
            payload, _ = json.JSONDecoder().raw_decode(parts[3])
            found.append((parts[2], payload))
    return found


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def is_launcher_report(line: str) -> bool:
    """A line of torchrun's own failure report (said better by fp8dist's message)."""
    text = line.strip()
    return (any(text.startswith(noise) for noise in _ELASTIC_NOISE)
            or "torch.distributed.elastic" in line or "torch/distributed/elastic" in line
            or re.fullmatch(r"\S+ FAILED", text) is not None)  # torchrun's "<module> FAILED" banner


def failure_tail(output: str, lines: int = 15) -> str:
    """The end of what the ranks printed before torchrun's own report: the agent logs `failed (exitcode: N)` and
    then raises ChildFailedError with its own traceback (torch/distributed/elastic/multiprocessing/api.py), which
    would otherwise push the rank's error out of the tail."""
    text = output.strip().splitlines()
    report = next((i for i, line in enumerate(text) if "failed (exitcode:" in line), len(text))
    kept = [line for line in text[:report] if not is_launcher_report(line)]
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
               "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if has_cuda() else "cpu"), JOB_ENV: "1"}
        # One pipe for both streams, drained by a thread: progress shown as it comes, the tail kept for errors,
        # and no rank ever blocks on a full pipe. Its own session: a timeout ends it and everything below it.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=200)

        def drain():
            for line in proc.stdout:
                progress = results(line, PROGRESS) if line.startswith(RESULT) else []
                if progress and on_progress is not None:
                    on_progress(str(progress[0][1]))
                else:
                    tail.append(line)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except BaseException as exc:  # a timeout, or Ctrl-C that reached only this process: end every rank
            end_process_tree(proc)
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


def end_process_tree(proc: subprocess.Popen) -> None:
    """Kill `proc` and every process below it, whatever session each moved to, and reap `proc`.

    Killing the launcher's process group is not enough: torchrun starts each rank in a session of its own (torch
    2.13 torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py: `start_new_session=True`),
    so the ranks outlive it, reparented to PID 1, still holding their memory and ports. The tree is frozen first
    (SIGSTOP, walked again until nothing new appears: a stopped process starts no other and is not restarted), then
    every process group led by a process of the tree, and every process of it, gets SIGKILL."""
    stopped: set[int] = set()
    while True:
        found = _process_tree(proc.pid) - stopped
        if not found:
            break
        for pid in found:
            _signal(os.kill, pid, signal.SIGSTOP)
        stopped |= found
    leaders = {pid for pid in stopped if _group_of(pid) == pid}
    for pgid in leaders:
        _signal(os.killpg, pgid, signal.SIGKILL)
    for pid in stopped - leaders:
        _signal(os.kill, pid, signal.SIGKILL)
    proc.wait()


def _signal(send: Callable[[int, int], None], pid: int, sig: int) -> None:
    try:
        send(pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already (or reaped and its id taken by another user's)
        pass


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _process_tree(root: int) -> set[int]:
    """`root` and its descendants alive now (psutil where installed; else Linux's /proc; else `root` alone)."""
    try:
        import psutil
    except ImportError:
        return _proc_tree(root)
    try:
        return {root} | {child.pid for child in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _proc_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {root}
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                    fields = handle.read().rpartition(")")[2].split()  # the name may hold spaces and parentheses
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def finish(result: dict[str, Any], out_path: str) -> NoReturn:
    """The end of a rank process launched by `launch`: rank 0 writes the result (without a process group, its
    setup failed, every rank writes it), then the rank leaves (fp8dist.runtime.process_group.leave)."""
    if process_group.rank() == 0 or not process_group.is_initialized():
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    process_group.leave(0)
