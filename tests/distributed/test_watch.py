"""`fp8dist.audit.watch` on training loops fp8dist did not prepare (real FSDP2, DeepSpeed, DDP, Accelerate,
HF Trainer on gloo): correct loops pass; each loop with a precision bug users have shipped fails, naming
the phase; DeepSpeed's communication is measured on the wire."""
import json

import pytest

from fp8dist.runtime.ranks import results
from tests.conftest import ROOT
from tests.distributed.launch import _env, describe, in_world

pytestmark = pytest.mark.distributed
SCRIPTS = ROOT / "tests" / "distributed" / "scripts"


def parse(result) -> dict:
    return dict(results(result.stdout, "case"))


@pytest.fixture(scope="module")
def cases():
    result = in_world(SCRIPTS / "watch_runs.py", timeout=600)
    assert result.returncode == 0, describe(result)
    found = parse(result)
    errors = {name: case["traceback"] for name, case in found.items() if "error" in case}
    assert not errors, errors
    return found


@pytest.mark.parametrize("name", ["fsdp2-correct", "fsdp2-float8-correct", "deepspeed-zero1", "deepspeed-zero2",
                                  "deepspeed-zero3", "deepspeed-zero2-bf16-reduce", "fsdp2-lora-correct"])
def test_a_correct_hand_written_loop_passes(cases, name):
    case = cases[name]
    assert case["passed"] is True and case["failing"] == [], case
    assert case["observed"]["engine"] == ("deepspeed" if name.startswith("deepspeed") else "fsdp2")


@pytest.mark.parametrize("name,phases,observed", [
    # (a) accelerate #3979: the upcast never happened; the optimizer steps bf16 shards with bf16 moments
    ("fsdp2-upcast-is-a-no-op", {"weights", "master_weights", "optimizer"},
     {"weights": "bf16", "master_weights": "bf16", "optimizer": "bf16+bf16"}),
    # (a) the optimizer built before an upcast that made new parameters: it steps stale bf16 tensors
    ("fsdp2-optimizer-before-upcast", {"master_weights", "optimizer"}, {"master_weights": "bf16", "optimizer": "none"}),
    # (b) float8 asked for, the model never converted
    ("fsdp2-float8-not-converted", {"gemm", "weight_all_gather"}, {"gemm": "bf16", "weight_all_gather": "bf16"}),
    # (c) float8 all-gather asked for, the weights not wrapped for it
    ("fsdp2-float8-gather-not-wrapped", {"weight_all_gather"}, {"gemm": "fp8", "weight_all_gather": "bf16"}),
    # (d) bf16 mixed precision in the config, every matmul in fp32
    ("fsdp2-computes-in-fp32", {"training"}, {"training": "fp32"}),
    # (e) AdamW moments in bf16 where the config says fp32
    ("fsdp2-bf16-adam-states", {"optimizer"}, {"optimizer": "bf16+bf16"}),
    # a LoRA run whose loop upcasts the whole model: an fp32 copy of the frozen base (2 ranks, FSDP2 by hand)
    ("fsdp2-lora-base-upcast", {"frozen_weights"}, {"frozen_weights": "fp32", "frozen_state": "none"}),
    # DDP where the config says FSDP2: the engine itself is the mismatch
    ("ddp-with-an-fsdp2-config", {"engine"}, {"engine": "ddp"}),
])
def test_a_broken_loop_fails_naming_the_phase(cases, name, phases, observed):
    case = cases[name]
    assert case["passed"] is False and phases <= set(case["failing"]), case
    for phase, value in observed.items():
        assert case["observed"][phase] == value, (phase, case)


def test_deepspeed_autotp_dropping_float8_fails_the_gemm_row(cases):
    """Float8 conversion then DeepSpeed AutoTP: AutoTP replaced all 14 Float8Linears (nn.Linear subclasses) with
    its own layers; the watch sees bf16 GEMMs, names the replacing class, and puts the TP all-reduces on `tp`."""
    case = cases["deepspeed-autotp-float8"]
    assert case["float8_linears"] == [14, 0], case
    assert case["passed"] is False and "gemm" in case["failing"] and case["observed"]["gemm"] == "bf16", case
    assert "LinearAllreduce is not an FP8 module" in case["details"]["gemm"], case["details"]["gemm"]
    assert case["wire_by_axis"]["tp"]["all_reduce"]["bf16"]["calls"] >= 8, case["wire_by_axis"]


def test_stale_optimizer_is_explained(cases):
    detail = cases["fsdp2-optimizer-before-upcast"]["details"]["master_weights"]
    assert "not the model's parameters" in detail, detail


def test_raise_raises_on_every_rank(cases):
    assert cases["fsdp2-mismatch-raises"]["raised_on"] == ["fp8dist audit of the watched step: FAIL: see MISMATCH rows"] * 2


@pytest.mark.parametrize("name,kind", [("deepspeed-zero1", "all_reduce"), ("deepspeed-zero2", "all_reduce"),
                                       ("deepspeed-zero3", "reduce_scatter")])
def test_deepspeed_communication_is_measured_on_the_wire(cases, name, kind):
    wire = cases[name]["wire"]
    assert cases[name]["observed"]["communication"] == "fp32"
    assert wire[kind]["fp32"]["bytes"] > 100_000, wire


def test_bf16_reduce_sends_half_the_bytes_of_fp32(cases):
    fp32 = cases["deepspeed-zero2"]["wire"]["all_reduce"]["fp32"]["bytes"]
    bf16 = cases["deepspeed-zero2-bf16-reduce"]["wire"]["all_reduce"]["bf16"]["bytes"]
    assert cases["deepspeed-zero2-bf16-reduce"]["observed"]["communication"] == "bf16"
    assert bf16 * 2 == pytest.approx(fp32, rel=0.01), (bf16, fp32)


def test_accelerate_on_cpu_falls_back_to_ddp_in_bf16_and_the_audit_says_so(tmp_path):
    """examples/accelerate_watch.py as a user runs it on CPU: Accelerate 1.15 given an FSDP2 plugin does not
    shard without CUDA; it runs DDP with bf16 weights and bf16 AdamW states."""
    import subprocess
    import sys

    report = tmp_path / "report.json"
    env = {**_env(), "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(ROOT / "examples" / "accelerate_watch.py"), "--report", str(report)],
                            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 1, describe(result)  # the example exits 1 when the audit fails
    data = json.loads(report.read_text())
    observed = {c["phase"]: c["observed"] for c in data["checks"]}
    assert data["distributed_type"] == "DistributedType.MULTI_CPU" and data["passed"] is False
    assert observed["engine"] == "ddp" and observed["weights"] == "bf16" and observed["optimizer"] == "bf16+bf16"
    assert observed["communication"] == "bf16"
    assert "MISMATCH" in result.stderr and result.stdout.count("step ") == 3  # one table (rank 0), then training


def test_hf_trainer_with_deepspeed_and_the_audit_callback_passes():
    result = in_world(SCRIPTS / "watch_frontends.py", "trainer-deepspeed", timeout=400)
    assert result.returncode == 0, describe(result)
    case = parse(result)["trainer-deepspeed"]
    assert case["passed"] is True and case["observed"]["engine"] == "deepspeed", case
    assert case["observed"]["master_weights"] == "fp32" and case["observed"]["communication"] == "fp32"


def test_hf_trainer_with_a_peft_lora_model_on_zero3_passes_with_the_frozen_base_kept_small():
    """The Trainer recipe of training_arguments_kwargs' docstring for `adapter.kind=lora`: the script wraps the model
    with PEFT (fp8dist's lora_config), the callback recognises the frozen base: bf16, no state, only adapters stepped."""
    result = in_world(SCRIPTS / "watch_frontends.py", "trainer-deepspeed-lora", timeout=400)
    assert result.returncode == 0, describe(result)
    case = parse(result)["trainer-deepspeed-lora"]
    assert case["passed"] is True and case["observed"]["engine"] == "deepspeed", case
    assert case["observed"]["frozen_weights"] == "bf16" and case["observed"]["frozen_state"] == "none", case
    assert case["observed"]["master_weights"] == "fp32" and case["observed"]["optimizer"] == "fp32+fp32", case
    trainable, frozen = case["parameters"]["trainable"], case["parameters"]["frozen"]
    assert 0 < trainable < frozen / 4, case["parameters"]
