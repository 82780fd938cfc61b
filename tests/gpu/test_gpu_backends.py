"""End-to-end runs of the real Transformer Engine and MS-AMP. They need an NVIDIA GPU and the library;
elsewhere they are skipped with the reason. Written against TE 2.20 and MS-AMP 0.4.0 (deepspeed 0.13.1)."""
import importlib.util
import json
import math

import pytest

import fp8dist.compat as compat
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.gpu


def _cuda_capability():
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


CAP = _cuda_capability()
needs_fp8_gpu = pytest.mark.skipif(CAP is None or CAP < compat.FP8_MIN_CAPABILITY,
                                   reason="needs an NVIDIA GPU with compute capability >= 8.9")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="Transformer Engine not installed (needs CUDA to build)")
needs_msamp = pytest.mark.skipif(importlib.util.find_spec("msamp") is None, reason="MS-AMP not installed (not on PyPI)")


def audit(config, nproc=1):
    result = run_cli("audit", "tiny-llama", "--config", ROOT / "configs" / f"{config}.yaml", "--nproc", nproc,
                     "--format", "json", timeout=900)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    data = json.loads(result.stdout)
    return data, {c["phase"]: c for c in data["checks"]}


@needs_fp8_gpu
@needs_te
@pytest.mark.parametrize("config", ["te", "deepspeed-te"])
def test_te_audit_sees_fp8_gemms(config):
    """Table A 'Nvidia TE': FP8 GEMMs seen at TE's general_gemm (HYBRID: e4m3 forward, e5m2 gradients)."""
    data, by_phase = audit(config)
    assert data["passed"], by_phase
    gemm = by_phase["gemm"]
    assert gemm["observed"] == "fp8" and "e4m3xe4m3" in gemm["detail"], gemm
    if config == "te":  # recipe delayed with fp8_format HYBRID
        assert "e5m2" in gemm["detail"], gemm
        assert by_phase["weights"]["observed"] == "fp32"  # primary weights stay high precision
    converted = [m for m in data["fp8_modules"] if m["convert"]]
    assert converted and all(m["fqn"] != "lm_head" for m in converted)


@needs_fp8_gpu
@needs_te
def test_te_trains_under_deepspeed():
    from tests.distributed.launch import TRAIN, deepspeed, describe, losses

    result = deepspeed(TRAIN, "--fp8dist-config", ROOT / "configs" / "deepspeed-te.yaml",
                       "--fp8dist-set", "train.steps=8", nproc=1)
    assert result.returncode == 0, describe(result)
    values = losses(result.stdout)
    assert len(values) == 8 and all(math.isfinite(v) for v in values) and sum(values[-4:]) < sum(values[:4])


@needs_fp8_gpu
@needs_msamp
def test_msamp_o2_trains_under_deepspeed_on_gpu():
    from tests.distributed.launch import TRAIN, deepspeed, describe, losses

    result = deepspeed(TRAIN, "--fp8dist-config", ROOT / "configs" / "msamp-o2.yaml", "--fp8dist-set", "train.steps=4",
                       nproc=1)
    assert result.returncode == 0, describe(result)
    assert len(losses(result.stdout)) == 4


@pytest.mark.skipif(CAP is None, reason="needs a CUDA GPU (MS-AMP emulates FP8 GEMMs off H100)")
@needs_msamp
@pytest.mark.parametrize("level", ["o1", "o2", "o3"])
def test_msamp_audit_against_table_a(level):
    """The MS-AMP rows of table A, measured on the Linear weights MS-AMP converts. MS-AMP's code (not its
    docs) casts weights to e4m3 with fp16 masters under DeepSpeed at every level (research/msamp.md 4): a
    failing O1/O2 'weights' row here is that finding, reported, not hidden."""
    data, by_phase = audit(f"msamp-{level}")
    assert by_phase["gemm"]["observed"] == "fp8", by_phase["gemm"]
    optimizer = "fp8+fp16" if level != "o1" else "fp32+fp32"
    assert by_phase["optimizer"]["ok"] and by_phase["optimizer"]["expected"] == optimizer, by_phase["optimizer"]
    if level == "o3":
        assert data["passed"], by_phase
