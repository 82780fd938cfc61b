"""The kept gloo worlds themselves (tests/distributed/worlds.py): a job runs on every rank of a world that outlives
it, a rank's failure comes back naming the rank, the job and the rank's own traceback, and a world that a job
left unusable (a failure, a timeout, process state a fresh process would not have) is started again."""
import subprocess

import pytest

from tests.conftest import ROOT
from tests.distributed.worlds import WORLDS, CaseFailed

pytestmark = pytest.mark.distributed
CASES = "tests.distributed.scripts.world_cases"


def test_a_world_outlives_its_jobs_and_each_job_gets_a_fresh_process_group():
    first = WORLDS.call(f"{CASES}:all_reduce_ranks")
    second = WORLDS.call(f"{CASES}:all_reduce_ranks")
    assert first["sum"] == second["sum"] == 1.0 and first["world"] == 2
    assert first["pid"] == second["pid"]  # the same rank process ran both
    four = WORLDS.call(f"{CASES}:all_reduce_ranks", nproc=4)
    assert four["sum"] == 6.0 and four["world"] == 4


def test_a_script_runs_as_torchrun_runs_it():
    done = WORLDS.run(ROOT / "tests" / "distributed" / "scripts" / "world_cases.py", 3)
    assert done.returncode == 3  # the exit code `leave` was given
    assert done.stdout == "argv ['3']\n" * 2 and done.stderr == "to stderr\n" * 2  # both ranks' streams


def test_a_rank_that_fails_is_named_and_the_world_is_started_again():
    before = WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"]
    with pytest.raises(CaseFailed) as failed:
        WORLDS.call(f"{CASES}:fail_on", 1)  # rank 0 waits for rank 1 in a barrier
    message = str(failed.value)
    assert "fail_on failed on rank 1 of 2" in message and "ValueError: case failed on purpose on rank 1" in message
    assert 'world_cases.py", line' in message  # the rank's own traceback
    assert WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"] != before


def test_state_a_fresh_process_would_not_have_gets_a_fresh_world():
    patched = WORLDS.call(f"{CASES}:patch_linear")  # as DeepSpeed ZeRO-3 patches torch.nn.functional.linear
    assert WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"] != patched


def test_a_job_past_its_timeout_ends_the_world():
    before = WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"]
    with pytest.raises(subprocess.TimeoutExpired):
        WORLDS.call(f"{CASES}:sleep", 60, timeout=2)
    assert WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"] != before
