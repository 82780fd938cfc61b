"""launch/train.py --check and the launch scripts: a config, machine or argument the run cannot take is refused by
one process with one message and exit 2, before torchrun or deepspeed starts a rank (no per-rank copies of the
message, no launcher failure report)."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run(*args, timeout=180):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_check_says_a_runnable_config_can_run():
    result = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--fp8dist-config",
                 ROOT / "configs" / "fsdp2-torchao-float8.yaml")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "can run here (engine fsdp2, FP8 backend torchao, --model tiny-llama)" in result.stdout


@pytest.mark.parametrize("script", ["torchrun.sh", "deepspeed.sh"])
def test_a_launch_script_refuses_before_any_rank_starts(script):
    result = run("bash", ROOT / "launch" / script, ROOT / "configs" / "te.yaml", "2")  # no TE on this machine
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("precision.fp8.backend=te but Transformer Engine is not installed") == 1
    assert "fix: " in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr and "rank" not in result.stdout


def test_check_refuses_bad_arguments_and_overrides():
    bad_set = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--fp8dist-set", "train.steps=zero")
    assert bad_set.returncode == 2 and "train.steps" in bad_set.stderr and "Traceback" not in bad_set.stderr
    no_dir = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--resume")
    assert no_dir.returncode == 2 and "--resume needs --checkpoint-dir" in no_dir.stderr
