"""A run whose own speed rule (precision.fp8.min_speedup) kept every Linear in the compute dtype ran what it asked
for: the gemm row expects the compute dtype and says why, instead of failing for FP8 GEMMs the config decided
against (on a real GPU the default `auto` does so for a small model). Real FSDP2 on a one-rank gloo group."""
import pytest
import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.engines import fsdp2
from fp8dist.runtime.models import load_model
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _gemm(min_speedup):
    spec = load_config(str(ROOT / "configs" / "fsdp2-torchao-float8.yaml"),
                       overrides=["hardware.gpu=l40s", f"precision.fp8.min_speedup={min_speedup}"])
    loaded = load_model("tiny-llama", spec.precision.load_dtype, seed=0)
    run = fsdp2.prepare(loaded.model, spec, audit="off")
    with watch(run.model, run.optimizer, spec, on_mismatch="ignore") as audit:
        fsdp2.train_step(run, [loaded.make_batch(2, 32, 0)], spec.train.gradient_clipping)
    return audit.report, next(c for c in audit.report["checks"] if c["phase"] == "gemm")


def test_every_linear_kept_by_the_speed_rule_expects_the_compute_dtype(one_rank):
    report, gemm = _gemm(1000)
    assert gemm["expected"] == gemm["observed"] == "bf16" and gemm["ok"], gemm
    assert "min_speedup kept every Linear" in gemm["why"] and report["gemm_flops"]["fp8_share"] == 0
    assert report["passed"] is True


def test_a_rule_that_converts_some_still_expects_fp8(one_rank):
    report, gemm = _gemm(0.0125)  # the option matrix's split on this model: attention kept, the MLP converted
    assert gemm["expected"] == "fp8" and gemm["ok"] and 0 < report["gemm_flops"]["fp8_share"] < 1, gemm
