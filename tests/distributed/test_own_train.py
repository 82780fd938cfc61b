"""examples/own_train.py, a user's own loop with fp8dist's arguments, loader, engine setup, step-1 audit and
checkpoints, run as users run it: under torchrun (FSDP2) and under the deepspeed launcher (ZeRO-2), then resumed."""
import re

import pytest

from tests.conftest import ROOT
from tests.distributed.launch import deepspeed, describe, torchrun

pytestmark = pytest.mark.distributed
SCRIPT = ROOT / "examples" / "own_train.py"


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([-\d.naif]+)", stdout, flags=re.M)]


@pytest.mark.parametrize("launcher,config", [(torchrun, "fsdp2-bf16"), (deepspeed, "deepspeed-bf16-zero2")],
                         ids=["torchrun-fsdp2", "deepspeed-zero2"])
def test_own_script_trains_audits_saves_and_resumes(launcher, config, tmp_path):
    args = ["--fp8dist-config", ROOT / "configs" / f"{config}.yaml", "--checkpoint-dir", tmp_path / "ckpt"]
    first = launcher(SCRIPT, *args, "--steps", "2")
    assert first.returncode == 0, describe(first)
    assert "step 1 loss" in first.stdout and "audit PASS" in first.stdout, describe(first)
    assert "saved" in first.stdout and len(losses(first.stdout)) == 2, describe(first)
    again = launcher(SCRIPT, *args, "--steps", "4", "--resume")
    assert again.returncode == 0, describe(again)
    assert "resumed at step 2" in again.stdout, describe(again)
    assert re.search(r"^step 3 loss [\d.]+ audit PASS$", again.stdout, flags=re.M), describe(again)
    assert len(losses(again.stdout)) == 2 and all(v == v for v in losses(again.stdout)), describe(again)
