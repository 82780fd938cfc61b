"""`fp8dist audit` on real models with real FSDP2 / DeepSpeed on gloo: the documented rows reproduce,
float8 shows up where it should, and the audit fails when a model or optimizer lies."""
import importlib.util
import json

import pytest

from tests.conftest import ROOT, run_cli
from tests.distributed.launch import cli_in_world

pytestmark = pytest.mark.distributed


def audit(model, config=None, nproc=2, fmt="json", overrides=()):
    args = ["audit", model, "--nproc", nproc, "--format", fmt]
    if config:
        args += ["--config", ROOT / "configs" / f"{config}.yaml"]
    return cli_in_world(*args, *overrides, timeout=400)


def checks(result):
    data = json.loads(result.stdout)
    return data, {c["phase"]: c for c in data["checks"]}


@pytest.mark.parametrize("config,row", [
    ("fsdp2-bf16-pure", {"loading": "bf16", "preparation": "bf16", "training": "bf16", "optimizer": "bf16+bf16"}),
    ("fsdp2-bf16", {"loading": "bf16", "preparation": "fp32", "training": "bf16", "optimizer": "fp32+fp32"}),
    ("deepspeed-bf16-zero2", {"loading": "bf16", "preparation": "fp32", "training": "bf16", "optimizer": "fp32+fp32"}),
])
def test_table_b_rows_reproduce(config, row):
    result = audit("tiny-llama", config)
    assert result.returncode == 0, result.stderr[-3000:]
    data, by_phase = checks(result)
    assert data["passed"] is True
    for phase, value in row.items():
        assert by_phase[phase]["observed"] == value and by_phase[phase]["ok"], by_phase[phase]
    assert all(c["measured"] and c["status"] == "ok" for c in data["checks"]), data["checks"]
    if config.startswith("deepspeed"):  # captured on the wire, not read from engine.communication_data_type
        assert data["communication_bytes"]["all_reduce"]["fp32"]["bytes"] > 100_000, data["communication_bytes"]


def test_the_main_job_through_the_real_launcher():
    """`fp8dist audit` as the README runs it: a fresh process and its own torchrun launch of 2 ranks (the other
    audits here run their rank job in the kept world)."""
    result = run_cli("audit", "tiny-llama", "--config", ROOT / "configs" / "fsdp2-bf16.yaml", "--nproc", "2",
                     "--format", "json", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    data, by_phase = checks(result)
    assert data["passed"] is True and data["nproc"] == 2 and by_phase["communication"]["observed"] == "fp32"
    assert data["not_observed"] == {} and "ChildFailedError" not in result.stderr


def test_torchao_float8_gemm_and_float8_all_gather():
    result = audit("tiny-llama", "fsdp2-torchao-float8")
    assert result.returncode == 0, result.stderr[-3000:]
    data, by_phase = checks(result)
    gemm = by_phase["gemm"]
    assert gemm["observed"] == "fp8" and data["fp8_emulated"] is True  # emulate: true, as on every CPU
    assert "e4m3xe4m3" in gemm["detail"] and "e5m2xe4m3" in gemm["detail"]  # forward, backward (grad in e5m2)
    assert by_phase["weight_all_gather"]["observed"] == "fp8"
    assert by_phase["training"]["observed"] == "bf16"  # lm_head and attention stay bf16


def test_audit_fails_on_a_model_that_computes_in_fp32():
    result = audit("tests.audit_factories:secretly_fp32", "fsdp2-bf16", nproc=1)
    assert result.returncode == 1, result.stderr[-3000:]
    data, by_phase = checks(result)
    assert data["passed"] is False and by_phase["training"]["ok"] is False
    assert by_phase["training"]["observed"] == "fp32"


def test_audit_fails_on_an_optimizer_with_other_state_dtypes():
    result = audit("tests.audit_factories:tiny_llama_bf16_states", "fsdp2-bf16", nproc=1, fmt="table")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "optimizer" in result.stdout and "MISMATCH" in result.stdout and "bf16+bf16" in result.stdout


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gpt2"])
def test_audit_of_local_hf_directories(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import tiny_config

    config = tiny_config(arch)  # each architecture's own dropout: GPT-2's 0.1, 0.0 for the others
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / arch)
    result = audit(str(tmp_path / arch), "fsdp2-bf16", nproc=1, fmt="markdown")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "**PASS**" in result.stdout
    # GPT-2's dropout acts in training, and torch's CPU attention then takes its math SDPA path, which computes the
    # bf16 run's attention in fp32: said as the kernel's own, not the run's (issue 46 item 14: it read bf16+fp32 FAIL)
    said = "not counted: 12 matmuls inside 2 F.scaled_dot_product_attention calls ({'fp32': 12}, from {'bf16': 2}"
    assert (said in result.stdout) is (arch == "gpt2"), result.stdout


@pytest.mark.skipif(any(importlib.util.find_spec(m) for m in ("transformer_engine", "msamp")),
                    reason="Transformer Engine or MS-AMP is installed here")
def test_audit_environment_errors_exit_2():
    result = audit("tiny-llama", "te", nproc=1, fmt="table")
    assert result.returncode == 2 and "Transformer Engine is not installed" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    result = audit("tiny-llama", "msamp-o2", nproc=1, fmt="json")
    assert result.returncode == 2 and "MS-AMP is not installed" in result.stderr and "needs a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    result = run_cli("audit", "no-such-model")
    assert result.returncode == 2 and "unknown MODEL" in result.stderr and "Traceback" not in result.stderr


def test_overrides_reach_the_ranks():
    """`KEY=VALUE` after the config changes the run the ranks make, not only the expected row: bf16 gradient
    reduction is expected and observed on the wire, with half the bytes of the fp32 default."""
    fp32, bf16 = audit("tiny-llama", "fsdp2-bf16"), audit("tiny-llama", "fsdp2-bf16",
                                                           overrides=["precision.reduce_dtype=bf16"])
    assert fp32.returncode == 0 and bf16.returncode == 0, fp32.stderr[-2000:] + bf16.stderr[-2000:]
    (_, fp32_rows), (data, bf16_rows) = checks(fp32), checks(bf16)
    assert fp32_rows["communication"]["observed"] == "fp32"
    assert bf16_rows["communication"]["expected"] == bf16_rows["communication"]["observed"] == "bf16", bf16_rows
    sent = {name: checks(r)[0]["communication_bytes"]["reduce_scatter"] for name, r in (("fp32", fp32), ("bf16", bf16))}
    assert sent["bf16"]["bf16"]["bytes"] * 2 == sent["fp32"]["fp32"]["bytes"], sent


@pytest.mark.parametrize("model", ["tiny-mixtral", "tests.audit_factories:tiny_qwen3_moe",
                                   "tests.audit_factories:tiny_olmoe"])
def test_moe_experts_in_fp8_pass_and_a_linear_only_conversion_fails_naming_them(model):
    """The gemm row counts FLOPs: with the experts' grouped GEMMs in MXFP8 (emulated) the audit passes on 2 ranks
    with most weight-GEMM FLOPs in FP8; converting the Linears only leaves the experts in bf16, and it fails."""
    converted = audit(model, "fsdp2-moe-mxfp8")
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    data, _ = checks(converted)
    assert data["gemm_flops"]["fp8_share"] >= 0.75 and data["gemm_flops"]["by_format"]["mxfp8"] > 0.5
    assert data["fp8_emulated"] is True
    linears_only = audit(model, "fsdp2-moe-mxfp8", overrides=["precision.fp8.torchao.experts=none"])
    assert linears_only.returncode == 1
    data, by_phase = checks(linears_only)
    assert not by_phase["gemm"]["ok"] and "model.layers.0.mlp.experts" in by_phase["gemm"]["detail"]
    stray = [row["module"] for row in data["gemm_flops"]["high_precision"] if not row["allowed"]]
    assert stray == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
