"""Context parallel on 2 CUDA GPUs: torch's context_parallel shards SDPA only on the CUDA flash / memory-efficient /
cuDNN kernels, so this cannot run on the CPU machine (there the config is refused: tests/option_matrix.py
`context-parallel-without-cuda`). A 2-GPU run with parallel.context_size 2 (one data rank) must train the same
losses as one GPU without it on the same batches."""
import pytest

from fp8dist.runtime.loop import losses
from tests.conftest import ROOT
from tests.distributed.launch import describe, torchrun

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# bf16 ring attention merges the blocks in another order than one kernel over the whole sequence.
BF16_LOSS_TOLERANCE = 1e-2


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (context parallel shards CUDA SDPA kernels only)")
def test_context_parallel_trains_the_losses_of_one_gpu():
    args = ["--model", "tiny-llama", "--steps", "4", "--fp8dist-config", ROOT / "configs" / "fsdp2-bf16.yaml",
            "--fp8dist-set", "train.seq_len=128"]
    split = torchrun(ROOT / "launch" / "train.py", *args, "--fp8dist-set", "parallel.context_size=2", nproc=2)
    whole = torchrun(ROOT / "launch" / "train.py", *args, nproc=1)
    assert split.returncode == 0, describe(split)
    assert whole.returncode == 0, describe(whole)
    cp, one = losses(split.stdout), losses(whole.stdout)
    assert len(cp) == len(one) == 4, (split.stdout, whole.stdout)
    assert max(abs(a - b) / b for a, b in zip(cp, one)) < BF16_LOSS_TOLERANCE, (cp, one)
    assert "PASS" in split.stdout, describe(split)
