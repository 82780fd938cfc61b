"""The kept gloo worlds themselves (tests/distributed/worlds.py): a job runs on every rank of a world that outlives
it, a rank's failure comes back naming the rank, the job and the rank's own traceback, what a job changed in the
process is put back for the next, and a world that a failure or a timeout left unusable is started again."""
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
    script = ROOT / "tests" / "distributed" / "scripts" / "world_cases.py"
    for _ in range(2):  # the second job says what a fresh process says: the warning again
        done = WORLDS.run(script, 0)
        assert done.returncode == 0 and done.stdout == "argv ['0']\n" * 2  # both ranks' streams
        assert done.stderr.count("to stderr\n") == 2
        assert done.stderr.count("UserWarning: shown once per place per process") == 2
    assert WORLDS.run(script, 3).returncode == 3  # the exit code `leave` was given


def test_a_rank_that_fails_is_named_and_the_world_is_started_again():
    before = WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"]
    with pytest.raises(CaseFailed) as failed:
        WORLDS.call(f"{CASES}:fail_on", 1)  # rank 0 waits for rank 1 in a barrier
    message = str(failed.value)
    assert "fail_on failed on rank 1 of 2" in message and "ValueError: case failed on purpose on rank 1" in message
    assert 'world_cases.py", line' in message  # the rank's own traceback
    assert WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"] != before


def test_what_a_job_changes_in_torch_is_put_back_for_the_next():
    first = WORLDS.call(f"{CASES}:patch_linear")  # as DeepSpeed ZeRO-3 patches torch.nn.functional.linear
    second = WORLDS.call(f"{CASES}:patch_linear")
    assert first["found_torchs"] and second["found_torchs"] and first["pid"] == second["pid"]


def test_a_job_past_its_timeout_ends_the_world():
    before = WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"]
    with pytest.raises(subprocess.TimeoutExpired):
        WORLDS.call(f"{CASES}:sleep", 60, timeout=2)
    assert WORLDS.call(f"{CASES}:all_reduce_ranks")["pid"] != before
