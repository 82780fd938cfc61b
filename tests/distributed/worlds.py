"""Gloo worlds that outlive a test: N real rank processes (tests/distributed/world_rank.py) started once per test
session and kept, each multi-process job of the suite run in them by name instead of a launch of its own - the
process-reuse idea of torch.testing._internal's MultiProcessTestCase variants. A launch costs 10-20 s on 2 cores
before the first step (torch, transformers, DeepSpeed and torchao imported again); a job in a world costs its
own work.

`WORLDS.run(target, *args, nproc=2)` runs `python -m target args` / `python script.py args` on every rank of the
`nproc` world, as torchrun would, and returns what a launch returns (a CompletedProcess: the exit code, every
rank's stdout and stderr, rank by rank); `WORLDS.call("module:function", ..., nproc=2)` calls a function on every
rank and returns rank 0's value, a rank's failure raised as `CaseFailed` naming the rank, the job and the rank's
own traceback. A world is started again after a failure, a timeout, or a job that left process state behind
(world_rank.py says which); a job can also ask for that with `fresh_after=True`. What must exercise a launcher
itself (torchrun, the deepspeed launcher, `fp8dist run`, a SIGKILL and resume, a rank's exit code through
torchrun) keeps real launches: tests/distributed/launch.py.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait
from pathlib import Path
from typing import Any

from tests.conftest import ROOT


# How long the peers of a rank whose job failed get to report before the world is ended (they may wait for the
# failed rank in a collective until gloo's own timeout).
PEER_GRACE_S = 10


class CaseFailed(AssertionError):
    """A job that raised on a rank: the rank, the job and the rank's own message."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class World:
    """`nproc` rank processes with torchrun's environment, connected to this process."""

    def __init__(self, nproc: int):
        self.nproc = nproc
        self.directory = Path(tempfile.mkdtemp(prefix=f"fp8dist-world{nproc}-"))
        self.processes: list[subprocess.Popen] = []
        self.connections: list = []
        self.jobs = 0

    def start(self, timeout: float = 180) -> None:
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc),
                "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(self.nproc), "FP8DIST_WORLD_KEY": key.hex()}
        for rank in range(self.nproc):
            log = open(self.directory / f"rank{rank}.log", "w")  # noqa: SIM115 - the rank keeps it open
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            self.processes.append(subprocess.Popen([sys.executable, "-m", "tests.distributed.world_rank",
                                                    f"{host}:{port}"], env=env, cwd=ROOT, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        by_rank: dict[int, Any] = {}

        def accept() -> None:
            while len(by_rank) < self.nproc:
                connection = listener.accept()
                by_rank[connection.recv()["rank"]] = connection

        accepting = threading.Thread(target=accept, daemon=True)
        accepting.start()
        deadline = time.monotonic() + timeout
        while accepting.is_alive():
            accepting.join(timeout=0.2)
            if accepting.is_alive() and (time.monotonic() > deadline
                                         or any(p.poll() is not None for p in self.processes)):
                self.stop()
                listener.close()
                raise RuntimeError(f"the {self.nproc}-rank world did not start:\n" + "\n".join(
                    f"rank {r}: {_tail(self.directory / f'rank{r}.log')}" for r in range(self.nproc)))
        listener.close()
        self.connections = [by_rank[rank] for rank in range(self.nproc)]

    @property
    def alive(self) -> bool:
        return bool(self.connections) and all(p.poll() is None for p in self.processes)

    def submit(self, job: dict, timeout: float) -> list[dict]:
        """Send `job` to every rank and wait for every rank's report; on a timeout every rank is killed and
        subprocess.TimeoutExpired raised with what they printed."""
        self.jobs += 1
        job = {**job, "env": {"MASTER_PORT": str(_free_port()), **job.get("env", {})}}
        outputs = [(self.directory / f"job{self.jobs}-rank{r}.out", self.directory / f"job{self.jobs}-rank{r}.err")
                   for r in range(self.nproc)]
        for connection, (out, err) in zip(self.connections, outputs):
            connection.send({**job, "stdout": str(out), "stderr": str(err)})
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        pending = {connection: rank for rank, connection in enumerate(self.connections)}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if any(report["code"] for report in reports.values()):
                    break  # the peers of a failed rank wait for it in a collective: they are ended with the world
                self.stop()
                text = "".join(_read(out) + _read(err) for out, err in outputs)
                raise subprocess.TimeoutExpired(job["target"], timeout, output=text)
            for connection in ready:
                rank = pending.pop(connection)
                try:
                    reports[rank] = connection.recv()
                except EOFError:  # the rank process died (a signal, os._exit): its exit code is the job's
                    self.processes[rank].wait(timeout=30)
                    reports[rank] = {"code": self.processes[rank].returncode or 1, "error": None, "result": None,
                                     "left": ["the rank process died"]}
                if reports[rank]["code"]:
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        for rank in range(self.nproc):
            reports.setdefault(rank, {"code": 1, "error": None, "result": None, "left": ["killed with its peer"]})
            reports[rank]["stdout"] = _read(outputs[rank][0])
            reports[rank]["stderr"] = _read(outputs[rank][1])
        return [reports[rank] for rank in range(self.nproc)]

    def stop(self) -> None:
        for connection in self.connections:
            try:
                connection.send(None)
            except OSError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes, self.connections = [], []
        shutil.rmtree(self.directory, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class Worlds:
    """One world per size, started when first asked for, started again where a job left it unusable."""

    def __init__(self):
        self.worlds: dict[int, World] = {}
        self.starts = 0
        self.jobs = 0

    def world(self, nproc: int) -> World:
        world = self.worlds.get(nproc)
        if world is None or not world.alive:
            if world is not None:
                world.stop()
            world = self.worlds[nproc] = World(nproc)
            world.start()
            self.starts += 1
        return world

    def _submit(self, nproc: int, job: dict, timeout: float, fresh_after: bool) -> list[dict]:
        world = self.world(nproc)
        self.jobs += 1
        try:
            reports = world.submit(job, timeout)
        except subprocess.TimeoutExpired:
            self.worlds.pop(nproc, None)
            raise
        if fresh_after or any(report["left"] for report in reports):
            world.stop()
            self.worlds.pop(nproc, None)
        return reports

    def run(self, target, *args, nproc: int = 2, timeout: float = 600, env: dict | None = None,
            fresh_after: bool = False) -> subprocess.CompletedProcess:
        """`python -m target *args` (or `python target *args` for a .py path) on every rank, as torchrun runs it:
        the job's exit code (the first non-zero rank's), stdout and stderr (rank by rank)."""
        job = {"kind": "module", "target": str(target), "args": [str(a) for a in args], "kwargs": {},
               "env": env or {}}
        reports = self._submit(nproc, job, timeout, fresh_after)
        code = next((report["code"] for report in reports if report["code"]), 0)
        return subprocess.CompletedProcess(["world", str(target), *map(str, args)], code,
                                           "".join(report["stdout"] for report in reports),
                                           "".join(report["stderr"] for report in reports))

    def call(self, target: str, *args, nproc: int = 2, timeout: float = 600, env: dict | None = None,
             fresh_after: bool = False, **kwargs) -> Any:
        """`module:function(*args, **kwargs)` on every rank; rank 0's value. A rank that raised fails the test
        with its rank, the job and its traceback."""
        job = {"kind": "function", "target": target, "args": list(args), "kwargs": kwargs, "env": env or {}}
        reports = self._submit(nproc, job, timeout, fresh_after)
        failed = [(rank, report) for rank, report in enumerate(reports) if report["code"]]
        if failed:
            rank, report = failed[0]
            raise CaseFailed(f"{target} failed on rank {rank} of {nproc}:\n{report['error'] or ''}"
                             f"\n--- rank {rank} stderr (tail) ---\n{report['stderr'][-3000:]}")
        return reports[0]["result"]

    def launch(self, module: str, args: list[str], nproc: int, timeout: float, what: str,
               on_progress=None) -> dict[str, Any]:
        """fp8dist.runtime.ranks.launch's contract (the CLI's N-rank jobs: `python -m module *args OUT.json`, rank 0's
        OUT.json back, a rank's `_error` or a failure as Fp8distError), its ranks this world's: the commands run
        in the test's process with their jobs here. The launcher's own handling (its timeout killing the process
        group, its failure tail without torchrun's report) is tested with real launches."""
        import json

        from fp8dist.errors import Fp8distError
        from fp8dist.runtime.ranks import PROGRESS, failure_tail, results

        with tempfile.TemporaryDirectory(prefix="fp8dist-ranks-") as tmp:
            out = os.path.join(tmp, "result.json")
            try:
                done = self.run(module, *args, out, nproc=nproc, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise Fp8distError(f"the {what} did not finish within {timeout:g} s and was stopped") from None
            if on_progress is not None:
                for _, line in results(done.stdout, PROGRESS):
                    on_progress(str(line))
            if not os.path.exists(out):
                raise Fp8distError(f"the {what} failed (exit {done.returncode}):\n"
                                   f"{failure_tail(done.stdout + done.stderr)}")
            with open(out, encoding="utf-8") as handle:
                result = json.load(handle)
        if "_error" in result:
            raise Fp8distError(result["_error"])
        return result

    def close(self) -> None:
        for world in self.worlds.values():
            world.stop()
        self.worlds.clear()


WORLDS = Worlds()
