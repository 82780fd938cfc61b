"""End-to-end runs of the real Transformer Engine and MS-AMP. They need an NVIDIA GPU and the library;
elsewhere they are skipped with the reason."""
import importlib.util

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.gpu


def _cuda_capability():
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


CAP = _cuda_capability()
needs_fp8_gpu = pytest.mark.skipif(CAP is None or CAP < (8, 9), reason="needs an NVIDIA GPU with compute capability >= 8.9")


@needs_fp8_gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed")
def test_te_audit_on_gpu():
    result = run_cli("audit", "tiny-llama", "--config", ROOT / "configs" / "te.yaml", "--format", "json", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    gemm = {c["phase"]: c for c in json.loads(result.stdout)["checks"]}["gemm"]
    assert gemm["observed"] == "fp8" and gemm["ok"]


@needs_fp8_gpu
@pytest.mark.skipif(importlib.util.find_spec("msamp") is None, reason="MS-AMP not installed (not on PyPI)")
def test_msamp_o2_trains_under_deepspeed_on_gpu():
    from tests.distributed.launch import TRAIN, deepspeed, describe, losses

    result = deepspeed(TRAIN, "--fp8dist-config", ROOT / "configs" / "msamp-o2.yaml", "--fp8dist-set", "train.steps=4",
                       nproc=1)
    assert result.returncode == 0, describe(result)
    assert len(losses(result.stdout)) == 4
