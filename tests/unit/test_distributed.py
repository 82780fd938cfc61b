"""fp8dist.distributed, the one set of rank helpers: alone (no process group) and in a one-rank gloo group started in
this process; and that fp8dist.runtime.process_group answers with the same functions."""
import sys

import pytest

from fp8dist import distributed
from fp8dist.errors import Fp8distError
from fp8dist.runtime import process_group


def test_alone_the_process_is_the_whole_job_and_its_launchers_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert (distributed.is_initialized(), distributed.rank(), distributed.world_size()) == (False, 0, 1)
    monkeypatch.setenv("RANK", "3")  # a rank process of torchrun before its process group starts
    assert distributed.rank() == 3
    distributed.barrier()  # nobody to wait for


def test_rank_zero_acts_alone_and_its_errors_are_everyones(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # without a process group the process acts, whatever its launcher's rank
    assert distributed.on_rank_zero("counting", lambda: [1, 2]) == [1, 2]

    def refuse():
        raise Fp8distError("x: refused\n  fix: y")

    with pytest.raises(Fp8distError) as refused:
        distributed.on_rank_zero("checking x", refuse)
    assert str(refused.value) == "x: refused\n  fix: y"  # an Fp8distError as it was raised

    def fail():
        raise OSError(28, "No space left on device")

    with pytest.raises(Fp8distError, match=r"^writing DIR: OSError: \[Errno 28\] No space left on device$"):
        distributed.on_rank_zero("writing DIR", fail)


def test_the_light_commands_ask_without_importing_torch():
    """is_initialized() answers from sys.modules until torch.distributed is loaded (it is in this test process,
    so a fresh interpreter asks)."""
    import subprocess

    code = ("import sys; from fp8dist import distributed; "
            "print(distributed.is_initialized(), distributed.world_size(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "1", "False"]


def test_in_a_process_group_the_groups_rank_wins_and_tear_down_leaves_it(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "5")  # what a launcher said; the group's own rank is what counts once it exists
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert (distributed.is_initialized(), distributed.rank(), distributed.world_size()) == (True, 0, 1)
        assert distributed.on_rank_zero("counting", lambda: "done") == "done"
        assert process_group.rank is distributed.rank and process_group.world_size is distributed.world_size
        process_group.tear_down()  # the barrier (nothing to wait for), then the group is gone
        assert not distributed.is_initialized() and distributed.rank() == 5
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
