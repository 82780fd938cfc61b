"""A bounded N-rank job (`fp8dist audit` / `compare` --timeout, fp8dist.runtime.ranks.launch) ends every process it
started: torchrun runs each rank in a session of its own, so killing torchrun's process group alone left the ranks
running, reparented to PID 1 (issue 46 item 3: `fp8dist audit tiny-llama --timeout 5` exited 2, its rank still alive
134 s later)."""
import os
import time
from pathlib import Path

import pytest

from fp8dist.errors import Fp8distError
from fp8dist.runtime.ranks import launch
from tests.conftest import ROOT

pytestmark = pytest.mark.distributed  # 2 ranks under the real torchrun

NPROC = 2


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (killed, not yet reaped by PID 1) is not alive."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from Linux's /proc")
def test_a_timeout_ends_every_rank_not_only_the_launcher(tmp_path, monkeypatch):
    """Ranks that never finish, killed by the bound once both have started: none survives. The bound is doubled
    until the ranks were running when it struck (a loaded machine may take longer to start them)."""
    monkeypatch.chdir(ROOT)  # `python -m tests.unit.runtime.sleeping_rank` from the repository root
    bound = 4.0
    while True:
        ranks = tmp_path / f"bound-{bound:g}"
        ranks.mkdir()
        with pytest.raises(Fp8distError, match=f"the sleep did not finish within {bound:g} s and was stopped"):
            launch("tests.unit.runtime.sleeping_rank", [str(ranks)], NPROC, bound, "sleep")
        pids = [int(path.read_text()) for path in sorted(ranks.glob("rank*.pid"))]
        if len(pids) == NPROC or bound > 120:
            break
        bound *= 2
    assert len(pids) == NPROC, f"the ranks did not start within {bound:g} s"
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; PID 1 reaps the orphans in its own time
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:  # do not leave them to the next test either
        os.kill(pid, 9)
    assert survivors == [], f"rank processes {survivors} outlived the bound"
