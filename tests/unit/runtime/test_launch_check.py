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


@pytest.mark.parametrize("script, model, says", [
    ("torchrun.sh", "tiny-mixtral", "it has 8 MoE experts, which fp8dist's tensor parallel does not split"),
    ("deepspeed.sh", "tiny-llama", "parallel.tensor_size=3 does not divide the 2 ranks of this job"),
])
def test_a_launch_script_refuses_a_mesh_the_model_or_world_cannot_split(script, model, says):
    """The scripts hand --check their world size: the mesh and the model's sizes are refused before any rank."""
    size = 2 if model == "tiny-mixtral" else 3
    config = "fsdp2-bf16.yaml" if script == "torchrun.sh" else "deepspeed-bf16-zero2.yaml"
    result = run("bash", ROOT / "launch" / script, ROOT / "configs" / config, "2", "--model", model,
                 "--fp8dist-set", f"parallel.tensor_size={size}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count(says) == 1 and "fix: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.parametrize("model, world, says", [
    ("tiny-llama", "2", "it has no MoE experts for parallel.expert_size=2 to split"),
    ("tiny-mixtral", "3", "parallel.expert_size=2 does not divide the 3 data-parallel ranks of this job"),
])
def test_check_refuses_an_expert_mesh_the_model_or_world_cannot_split(model, world, says):
    result = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--world-size", world, "--model", model,
                 "--fp8dist-config", ROOT / "configs" / "fsdp2-moe-ep-mxfp8.yaml")
    assert result.returncode == 2 and says in result.stderr and "fix: " in result.stderr, result.stderr


def test_world_size_goes_with_check_only():
    result = run(sys.executable, ROOT / "launch" / "train.py", "--world-size", "2")
    assert result.returncode == 2 and "--world-size 2 goes with --check" in result.stderr, result.stderr


def test_check_refuses_bad_arguments_and_overrides():
    bad_set = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--fp8dist-set", "train.steps=zero")
    assert bad_set.returncode == 2 and "train.steps" in bad_set.stderr and "Traceback" not in bad_set.stderr
    no_dir = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--resume")
    assert no_dir.returncode == 2 and "--resume needs --checkpoint-dir" in no_dir.stderr


def test_check_reports_every_problem_at_once(tmp_path):
    """One --check lists all it refuses (arguments, config override, export destination, model), each with its fix,
    instead of one per run."""
    occupied = tmp_path / "occupied"
    occupied.write_text("not an export directory\n")
    result = run(sys.executable, ROOT / "launch" / "train.py", "--check", "--steps", "0", "--resume",
                 "--fp8dist-config", ROOT / "configs" / "fsdp2-bf16.yaml",
                 "--fp8dist-set", "parallel.cpu_ram_efficient_loading=true", "--export-hf", occupied)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "4 problems, each below with its fix; nothing was started" in result.stderr, result.stderr
    for fragment in ("1. --resume needs --checkpoint-dir", "2. --steps 0: must be at least 1", f"{occupied}: is a file",
                     "MODEL 'tiny-llama' is built in memory"):
        assert fragment in result.stderr, result.stderr
