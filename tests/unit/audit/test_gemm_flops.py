"""Weight GEMMs by FLOPs (fp8dist.audit.gemm_flops): every matmul on a parameter is found, attributed to its
module with the FLOPs its shapes say, in the format its operands' values have."""
import pytest
import torch

from fp8dist.audit.gemm_flops import WeightGemmLedger, combine, gemm_flops, summarize
from fp8dist.audit.probes import MatmulRecorder
from fp8dist.backends.base import get_backend
from fp8dist.config.load import load_config
from fp8dist.runtime.models import _from_hf_config, causal_lm_batch
from fp8dist.config.models import tiny_config

TOKENS = 2 * 32


def _step(model, tokens=(2, 32)):
    recorder = MatmulRecorder()
    batch = causal_lm_batch(model.config.vocab_size)(*tokens, 0)
    with recorder.ledger.owners(model), recorder:
        model(**batch).loss.backward()
    return recorder.ledger


def _per_module(ledger):
    flops = {}
    for (module, _), n in ledger.flops.items():
        flops[module] = flops.get(module, 0) + n
    return flops


def test_flops_from_shapes():
    a, b = torch.empty(8, 16), torch.empty(16, 4)
    assert gemm_flops("mm", (a, b), torch.empty(8, 4)) == 2 * 8 * 16 * 4
    assert gemm_flops("addmm", (torch.empty(4), a, b), torch.empty(8, 4)) == 2 * 8 * 16 * 4
    assert gemm_flops("linear", (torch.empty(3, 8, 16), torch.empty(4, 16)), None) == 2 * 24 * 16 * 4
    assert gemm_flops("bmm", (torch.empty(5, 8, 16), torch.empty(5, 16, 4)), torch.empty(5, 8, 4)) == 2 * 5 * 8 * 16 * 4
    offs = torch.tensor([3, 10, 12], dtype=torch.int32)  # 12 of the 20 rows are routed
    assert gemm_flops("_grouped_mm", (torch.empty(20, 16), torch.empty(3, 16, 4), offs), None) == 2 * 12 * 16 * 4
    # weight gradient: (N, rows) x (rows, K) per expert
    assert gemm_flops("_grouped_mm", (torch.empty(4, 20), torch.empty(20, 16), offs), None) == 2 * 4 * 12 * 16


def test_formats_of_values_built_from_low_precision_ones():
    assert combine({"fp8_e4m3", "fp8_e8m0"}) == "mxfp8"
    assert combine({"fp8_e4m3"}) == "fp8_e4m3"


def test_every_linear_counts_forward_input_gradient_and_weight_gradient():
    model = _from_hf_config(tiny_config("llama"), "fp32", 0)
    flops = _per_module(_step(model))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert flops.pop(name) == 3 * 2 * TOKENS * module.in_features * module.out_features, name
    assert flops == {}


def test_activation_checkpoint_recompute_keeps_weight_gradients_attributed():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _from_hf_config(tiny_config("llama"), "fp32", 0)
    model.config.use_cache = False
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    ledger = _step(model)
    q = model.model.layers[0]._checkpoint_wrapped_module.self_attn.q_proj
    # forward twice (the recompute), input gradient, weight gradient
    assert _per_module(ledger)["model.layers.0.self_attn.q_proj"] == 4 * 2 * TOKENS * q.in_features * q.out_features
    assert ledger.activation_flops == 0


def test_conv1d_and_experts_are_weight_gemms_too():
    gpt2 = _from_hf_config(tiny_config("gpt2"), "fp32", 0)  # Conv1D: addmm on the parameter
    flops = _per_module(_step(gpt2))
    assert flops["transformer.h.0.attn.c_attn"] == 3 * 2 * TOKENS * 64 * 192
    mixtral = _from_hf_config(tiny_config("mixtral"), "fp32", 0)
    ledger = _step(mixtral)
    experts = 3 * 2 * TOKENS * 2 * (64 * 128 + 64 * 64)  # top-2 rows through gate_up (64->128) and down (64->64)
    assert _per_module(ledger)["model.layers.0.mlp.experts"] == experts
    assert ledger.activation_flops == 0 and "model.layers.0.mlp.gate" in ledger.routers


def _converted_mixtral(experts, tokens=(2, 32)):
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "experts": experts}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    model = _from_hf_config(tiny_config("mixtral"), "bf16", 0)
    decisions = backend.convert_module(model)
    return summarize(_step(model, tokens), {d.fqn: d.reason for d in decisions if not d.convert}, True)


def test_a_linear_only_conversion_leaves_the_experts_in_bf16_and_says_so():
    result = _converted_mixtral("none")
    stray = [row for row in result["high_precision"] if not row["allowed"]]
    assert [row["module"] for row in stray] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "3-D parameters" in stray[0]["reason"]
    assert result["fp8_share"] < 0.3


def test_experts_in_mxfp8_put_most_flops_in_fp8():
    result = _converted_mixtral("mxfp8")
    assert result["fp8_share"] >= 0.75 and result["by_format"]["mxfp8"] > 0.5
    assert all(row["allowed"] for row in result["high_precision"])
    reasons = {row["module"]: row["reason"] for row in result["high_precision"]}
    assert "MoE router" in reasons["model.layers.0.mlp.gate"] and "excluded" in reasons["lm_head"]


def test_without_fp8_in_the_config_nothing_is_held_against_it():
    ledger = WeightGemmLedger()
    ledger.flops[("model.layers.0.mlp.experts", "bf16")] = 10
    result = summarize(ledger, {}, fp8_expected=False)
    assert result["fp8_share"] == 0.0 and result["high_precision"][0]["allowed"]


def test_dense_mxfp8_linears_count_as_mxfp8():
    """recipe_name=mxfp8: torchao's MXFP8Linear multiplies MXTensors (FP8 qdata, e8m0 block scales), in all three
    GEMMs of each converted Linear."""
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "recipe_name": "mxfp8"}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    model = _from_hf_config(tiny_config("llama"), "bf16", 0)
    decisions = backend.convert_module(model)
    assert sum(d.convert for d in decisions) == 14 and type(model.lm_head).__name__ == "Linear"
    result = summarize(_step(model), {d.fqn: d.reason for d in decisions if not d.convert}, True)
    assert set(result["by_format"]) == {"mxfp8", "bf16"} and result["fp8_share"] > 0.8
    assert [row["module"] for row in result["high_precision"]] == ["lm_head"]


def test_a_recipe_that_keeps_the_weight_gradient_in_high_precision_is_held_to_that_only():
    """rowwise_with_gw_hp runs each converted Linear's weight-gradient GEMM in bf16 by design
    (TORCHAO_HIGH_PRECISION_GEMMS): allowed there, and nowhere else."""
    from fp8dist.facts.torchao import TORCHAO_HIGH_PRECISION_GEMMS

    spec = load_config({"engine": "fsdp2", "precision": {"fp8": {"backend": "torchao", "torchao": {
        "emulate": True, "recipe_name": "rowwise_with_gw_hp"}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    model = _from_hf_config(tiny_config("llama"), "bf16", 0)
    kept = {d.fqn: d.reason for d in backend.convert_module(model) if not d.convert}
    ledger = _step(model)
    phases = {phase for (module, phase) in ledger.high_precision_phases if module != "lm_head"}
    assert phases == {"weight_gradient"}
    assert not all(row["allowed"] for row in summarize(ledger, kept, True)["high_precision"])
    by_design = TORCHAO_HIGH_PRECISION_GEMMS["rowwise_with_gw_hp"]
    assert all(row["allowed"] for row in summarize(ledger, kept, True, by_design)["high_precision"])


@pytest.mark.parametrize("experts", ["none", "mxfp8"])
def test_estimate_predicts_the_share_the_audit_measures(experts):
    """`fp8dist estimate`'s FP8 coverage (per token, from shapes; routers in high precision) against the share this
    ledger measures on the same tiny Mixtral: within a point. Enough tokens that MXFP8's padding of each expert's
    rows to a block of 32 (FLOPs the kernel really runs, which the ledger counts) is small: 8 x 256 tokens."""
    from fp8dist.estimate.coverage import fp8_coverage
    from fp8dist.estimate.model import build_meta_model

    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "experts": experts}}}})
    predicted = fp8_coverage(build_meta_model("tiny-mixtral", "bf16"), spec).fp8_share
    measured = _converted_mixtral(experts, tokens=(8, 256))["fp8_share"]
    assert abs(predicted - measured) < 0.01, (predicted, measured)
