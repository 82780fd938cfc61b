"""Pipeline parallel (parallel.pipeline_size) on gloo: every torch schedule fp8dist offers against one process
without it, and pipeline_size 2 x dp_shard 2 with torchao float8 audited, its bubble measured, resumed bitwise and
exported whole (tests/distributed/scripts/pipeline_runs.py; three launches for all cases)."""
import pytest

from tests.conftest import ROOT
from tests.distributed.launch import cases

pytestmark = pytest.mark.distributed
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "pipeline_runs.py"


@pytest.fixture(scope="module")
def baseline():
    return cases(SCRIPT, "baseline", nproc=1)


@pytest.fixture(scope="module")
def schedules():
    return cases(SCRIPT, "schedules", nproc=2)


@pytest.fixture(scope="module")
def mesh():
    return cases(SCRIPT, "mesh", nproc=4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_each_schedule_trains_as_one_process_does(baseline, schedules, schedule):
    """fp32, gradient clipping at 1.0 (the first step's norm is about 4: the norm must be the whole model's, summed
    over the stages, or the clipped steps drift apart): every step's loss within 1e-5 of one process's."""
    ours, one = schedules[schedule]["losses"], baseline["fp32"]["losses"]
    assert len(ours) == len(one) == 4
    assert max(abs(a - b) for a, b in zip(ours, one)) < 1e-5, (ours, one)


def test_pipeline_by_tensor_parallel_trains_as_one_process_does(baseline, mesh):
    """pp 2 x tp 2 (one data rank; sequence parallel is off with pipeline parallel): the same losses within 1e-5."""
    ours, one = mesh["tensor_parallel"]["losses"], baseline["fp32"]["losses"]
    assert max(abs(a - b) for a, b in zip(ours, one)) < 1e-5, (ours, one)


def test_the_interleaved_schedule_equals_1f1b(schedules):
    ours, reference = schedules["interleaved_1f1b"]["losses"], schedules["1f1b"]["losses"]
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-6, (ours, reference)


def test_float8_on_pipeline_by_data_mesh_audits_every_stage(mesh):
    """The audit PASSes on every rank; the GEMM share is the whole model's (each stage's ledger merged: lm_head,
    excluded by the config, runs on the last stage only and is the one high-precision GEMM); activations and their
    gradients cross the pp axis in the compute dtype, FSDP's traffic the dp_shard axis (weights in float8)."""
    case = mesh["float8"]
    assert case["passed"] is True and case["failing"] == [], case["observed"]
    assert case["high_precision"] == ["lm_head"] and 0.9 < case["fp8_share"] < 1, case
    assert "fp8" in case["observed"]["gemm"] and case["observed"]["weight_all_gather"] == "fp8", case["observed"]
    pp, data = case["by_axis"]["pp"], case["by_axis"]["dp_shard"]
    assert pp["send"]["bf16"]["bytes"] > 0 and pp["recv"]["bf16"]["bytes"] > 0, pp
    assert "reduce_scatter" in data and "all_gather" in data, data
    assert "stage 0: layers 0-1" in case["stages"], case["stages"]


def test_the_bubble_is_measured_beside_the_schedules_theory(mesh):
    """1F1B with 2 ranks and 4 microbatches idles 1/5 of the step by design. Measured: each rank's time waiting on
    its neighbour over the schedule's time (gloo on a shared CPU: a loose band around the theory, not equality)."""
    case = mesh["float8"]
    assert case["bubble_theory"] == pytest.approx(0.2)
    assert len(case["idle"]) == 4 and all(0 < idle < 0.8 for idle in case["idle"]), case["idle"]


def test_a_pipeline_checkpoint_resumes_bitwise_and_exports_whole(mesh):
    case = mesh["checkpoint"]
    assert case["resumed"] == case["losses"][2:] and case["weights_bitwise"] is True, case
    first, last = case["names_by_rank"][0], case["names_by_rank"][-1]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first, first
    assert "lm_head.weight" in last and "model.layers.3.mlp.up_proj.weight" in last, last
    assert case["exported"]["names_match"] and case["exported"]["equal"], case["exported"]
