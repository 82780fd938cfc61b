"""`fp8dist run CONFIG [KEY=VALUE ...] -- SCRIPT ARGS`: one entry over torchrun and the deepspeed launcher, checking
first; a refusal or a failed rank reads as one message with the rank's exit code, without the launcher's dump."""
import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.distributed
DUMP = ("ChildFailedError", "torch.distributed.elastic", "torch/distributed/elastic", "Traceback", "[launch.py:",
        "[runner.py:")


def fp8dist_run(*words):
    return run_cli("run", *words, env={"OMP_NUM_THREADS": "1"}, timeout=400)


@pytest.mark.parametrize("config", ["fsdp2-bf16", "deepspeed-bf16-zero2"])
def test_the_config_and_its_overrides_reach_every_rank(config):
    done = fp8dist_run(f"configs/{config}.yaml", "train.steps=2", "--nproc", "2", "--", "launch/train.py",
                       "--model", "tiny-llama")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2 loss" in done.stdout and "step 3 loss" not in done.stdout  # the override, as --fp8dist-set
    assert f"on {config.split('-')[0]} (2 processes)" in done.stdout  # the engine of the config, 2 ranks
    launcher = "deepspeed" if config.startswith("deepspeed") else "torchrun"
    assert f"fp8dist run: {launcher}, 2 ranks" in done.stderr
    assert not [d for d in DUMP if d in done.stdout + done.stderr], done.stdout[-3000:] + done.stderr[-3000:]


def test_a_refusal_starts_no_rank():
    done = fp8dist_run("configs/fsdp2-bf16.yaml", "optimizer.lr=abc", "--", "launch/train.py")
    assert done.returncode == 2
    assert "invalid override 'optimizer.lr=abc'" in done.stderr and "fix:" in done.stderr
    assert "fp8dist run: torchrun" not in done.stderr and done.stdout == ""  # nothing launched


@pytest.mark.parametrize("config", ["fsdp2-bf16", "deepspeed-bf16-zero2"])
def test_a_failed_rank_is_one_message_with_its_exit_code(config):
    done = fp8dist_run(f"configs/{config}.yaml", "--", "launch/train.py", "--resume")  # no --checkpoint-dir
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count("--resume needs --checkpoint-dir") == 1, out[-3000:]
    assert not [d for d in DUMP if d in out], out[-3000:]
