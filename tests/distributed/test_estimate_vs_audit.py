"""`fp8dist estimate` against measurement: for every CPU-runnable example config, on tiny-llama and
small-llama over 2 ranks, the estimated bytes per parameter of each store are within 5% of what the audit
measures in a real run (one launch for all)."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.estimate.memory import estimate
from fp8dist.runtime.ranks import results
from tests.conftest import ROOT
from tests.distributed.launch import describe, in_world

pytestmark = pytest.mark.distributed
CPU_CONFIGS = ["fp32", "fp16-amp", "fsdp2-bf16-pure", "fsdp2-bf16", "fsdp2-torchao-float8", "fsdp2-torchao-rowwise",
               "deepspeed-bf16-zero1", "deepspeed-bf16-zero2", "deepspeed-bf16-zero3", "deepspeed-torchao-float8"]
MODELS = ["tiny-llama", "small-llama"]
STORES = {"weights": "weights", "master": "master_weights", "gradients": "gradients", "optimizer": "optimizer"}
WORLD = 2


@pytest.fixture(scope="module")
def measured():
    script = ROOT / "tests" / "distributed" / "scripts" / "estimate_vs_audit.py"
    result = in_world(script, ",".join(CPU_CONFIGS), ",".join(MODELS), timeout=900)
    assert result.returncode == 0, describe(result)
    return {tuple(name.split("/")): payload for name, payload in results(result.stdout, "case")}


@pytest.mark.parametrize("config", CPU_CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_estimate_within_5_percent_of_the_audit(measured, config, model):
    observed = measured[(config, model)]
    spec = load_config(ROOT / "configs" / f"{config}.yaml")
    result = estimate(model, spec, WORLD)
    assert {"weights", "gradients", "optimizer"} <= set(observed), observed
    assert ("master" in observed) is (spec.engine == "deepspeed" and result.bytes_per_param["master_weights"] > 0)
    for audit_key, store in STORES.items():
        if audit_key not in observed:
            continue
        assert observed[audit_key] == pytest.approx(result.bytes_per_param[store], rel=0.05), (audit_key, observed)
