"""launch/train.py with DeepSpeed configs for real on CPU with gloo: ZeRO-2 through `deepspeed --num_gpus 2` (the
launcher), ZeRO-3, float8 and the refusals as jobs of the kept 2-rank world (tests/distributed/worlds.py)."""
import math

import pytest

from tests.conftest import ROOT
from tests.distributed.launch import TRAIN, deepspeed, describe, in_world, losses

pytestmark = pytest.mark.distributed


# ZeRO-0/1 and torchao float8 on DeepSpeed also run in the option matrix (tests/distributed/test_option_runs.py);
# these train 12 steps and check that the loss goes down.
@pytest.mark.parametrize("config", ["deepspeed-bf16-zero2", "deepspeed-bf16-zero3"])
def test_deepspeed_trains(config):
    launch = deepspeed if config.endswith("zero2") else in_world  # the launcher once; ZeRO-3 in the kept world
    result = launch(TRAIN, "--fp8dist-config", ROOT / "configs" / f"{config}.yaml", "--fp8dist-set", "train.steps=12")
    assert result.returncode == 0, describe(result)
    values = losses(result.stdout)
    assert len(values) == 12 and all(math.isfinite(v) for v in values), describe(result)
    # 4 synthetic batches cycle: compare the same batches at the start and at the end.
    assert sum(values[-4:]) < sum(values[:4]), values


def test_torchao_float8_zero3_under_deepspeed():
    result = in_world(TRAIN, "--fp8dist-config", ROOT / "configs" / "deepspeed-torchao-float8.yaml",
                       "--fp8dist-set", "deepspeed.zero_stage=3", "--fp8dist-set", "train.steps=3")
    assert result.returncode == 0, describe(result)
    assert all(math.isfinite(v) for v in losses(result.stdout))


@pytest.mark.parametrize("config,needs", [
    ("msamp-o3", ["MS-AMP is not installed", "0.12.4-0.17.4", "needs a CUDA GPU", "environment of its own",
                  "fix: write the DeepSpeed JSON"]),
    ("deepspeed-te", ["Transformer Engine is not installed", "fix: on a CUDA machine"]),
])
def test_gpu_only_backends_refused_cleanly_here(config, needs):
    """Where the library cannot exist (no CUDA): exit 2, every missing piece named, where it runs, no traceback."""
    import importlib.util

    if importlib.util.find_spec("msamp" if config.startswith("msamp") else "transformer_engine"):
        pytest.skip("the library is installed here")
    result = in_world(TRAIN, "--fp8dist-config", ROOT / "configs" / f"{config}.yaml", timeout=200)
    assert result.returncode == 2, describe(result)
    for fragment in needs:
        assert fragment in result.stderr, describe(result)
    assert "Traceback" not in result.stderr and "step 1 loss" not in result.stdout
