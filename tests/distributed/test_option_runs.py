"""The option matrix's runs: every case of tests/option_matrix.py RUNS trains for real on 2 ranks (gloo),
all in one torchrun launch (tests/distributed/scripts/option_runs.py), and reports what it observed."""

import pytest

from fp8dist.runtime.ranks import results
from tests.conftest import ROOT
from tests.distributed.launch import describe, in_world
from tests.option_matrix import RUNS

pytestmark = pytest.mark.distributed
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "option_runs.py"


@pytest.fixture(scope="module")
def reports():
    result = in_world(SCRIPT, timeout=1200)
    found: dict[str, dict] = {}
    for case_id, facts in results(result.stdout, "case"):
        if facts.pop("rank") == 0 or "error" in facts:
            found.setdefault(case_id, {}).update(facts)
    return found, result


@pytest.mark.parametrize("case", RUNS, ids=[c.id for c in RUNS])
def test_option_runs(case, reports):
    found, result = reports
    assert case.id in found, f"case {case.id} did not report\n{describe(result)}"
    facts = found[case.id]
    assert "error" not in facts, f"{facts['error']}\n{facts.get('traceback', '')}"
    assert facts["finite"] and facts["losses"], facts
    for key, want in case.expect.items():
        assert facts[key] == want, f"{key}: expected {want!r}, observed {facts[key]!r} ({facts})"


def test_fp16_overflow_on_one_rank_is_skipped_on_every_rank(reports):
    """Rank 1 alone gets an inf gradient at step 2: both ranks skip it, the scale backs off on both, and the
    run goes on (the weights are unchanged by the skipped step: asserted on each rank by the script)."""
    facts = reports[0]["fsdp2-fp16-amp-offload-overflow"]
    assert facts["skipped_by_rank"] == [[2], [2]]
    assert facts["loss_scales"][1] == facts["loss_scales"][0] / 2


def test_compile_keeps_the_root_sharded_and_accumulation_without_sync(reports):
    """Per-block compile before fully_shard: the root stays an FSDPModule, so with 2 micro-batches the
    reduce-scatter still runs once per unit per optimizer step (not once per micro-batch)."""
    facts = reports[0]["fsdp2-compile-accumulate"]
    assert facts["compiled"] and facts["root_is_fsdp"]
    assert facts["reduce_scatters_per_step"] == facts["fsdp_units"]


@pytest.mark.parametrize("case", RUNS, ids=[c.id for c in RUNS])
def test_every_run_passes_its_first_step_audit(case, reports):
    """Each option's real run is audited on step 1 by its engine's train step (audit.first_step, default warn):
    what the config says is what the run did, phase by phase, on every rank."""
    facts = reports[0][case.id]
    if "audit_passed" in case.expect:  # a case whose audit must fail: test_option_runs checks how
        return
    if case.config.get("audit", {}).get("first_step") == "off":
        assert facts["audit_passed"] is None, facts
        return
    assert facts["audit_passed"] is True, f"phases that differ: {facts['audit_failing']}: {facts['audit_mismatches']}"


def test_an_earlier_torch_autocast_engine_does_not_change_the_next_engines_reduce_dtype(reports):
    """DeepSpeed keeps torch_autocast in module globals that no engine resets; the next engine in the process
    then reduced its gradients in bf16 although communication_data_type said fp32 (the first-step audit saw
    it). fp8dist's initialize resets them: ds-torchao-float8 runs after ds-fp16-amp-autocast in this job."""
    order = [c.id for c in RUNS]
    assert order.index("ds-fp16-amp-autocast") < order.index("ds-torchao-float8")
    facts = reports[0]["ds-torchao-float8"]
    assert facts["audit_passed"] is True and "communication" not in facts["audit_failing"], facts


def test_moe_runs_put_the_experts_flops_in_fp8_on_both_engines(reports):
    """Experts in MXFP8 on FSDP2 and on DeepSpeed ZeRO-2 and ZeRO-3: the audit counts at least 75% of the weight-GEMM
    FLOPs in FP8 (the rest: lm_head and routers); with experts=none the experts' FLOPs stay in bf16."""
    found, _ = reports
    converted = ("fsdp2-moe-mxfp8-experts", "ds-zero2-moe-mxfp8-experts", "ds-zero3-moe-auto-experts")
    shares = {case: found[case]["fp8_share"] for case in (*converted, "fsdp2-moe-experts-none")}
    assert all(shares[case] >= 0.75 for case in converted), shares
    assert shares["fsdp2-moe-experts-none"] < 0.5, shares
