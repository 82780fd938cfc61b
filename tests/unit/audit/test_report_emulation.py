"""The audit says when its FP8 GEMMs were emulated (dequantized values multiplied in high precision, as torchao's
`emulate` and MX emulation run on a CPU): `(emulated)` in the gemm row, `fp8_emulated` in the JSON."""
import pytest
import torch

from fp8dist.audit.expected import expected
from fp8dist.audit.gemm_flops import WeightGemmLedger
from fp8dist.audit.probes import emulates
from fp8dist.audit.report import build, markdown, table
from fp8dist.config.load import load_config

FLOAT8 = {"engine": "fsdp2", "precision": {"preset": "torchao-float8"}}


def _report(spec, **extra):
    observed = {phase: {"observed": value, "detail": "", "measured": True}
                for phase, (value, _) in {**expected(spec, nproc=2), "engine": (spec.engine, "")}.items()}
    observed["gemm"]["observed"] = "fp8"
    return build(spec, "tiny-llama", {**observed, **extra}, nproc=2)


def _gemm_line(text):
    return next(line for line in text.splitlines() if line.startswith("gemm ") or line.startswith("| gemm |"))


def test_an_emulated_gemm_row_says_so_and_still_matches():
    result = _report(load_config(FLOAT8), _fp8_emulated=True)
    assert result["fp8_emulated"] is True and result["passed"] is True
    gemm = next(c for c in result["checks"] if c["phase"] == "gemm")
    assert gemm["observed"] == "fp8" and gemm["status"] == "ok"  # the JSON cell stays the format
    assert "fp8 (emulated)" in _gemm_line(table(result)) and _gemm_line(table(result)).endswith("ok")
    assert "| fp8 (emulated) | yes |" in _gemm_line(markdown(result))


def test_a_native_gemm_row_says_fp8_only():
    result = _report(load_config(FLOAT8), _fp8_emulated=False)
    assert result["fp8_emulated"] is False
    assert "emulated" not in table(result) and "emulated" not in markdown(result)
    assert _report(load_config(FLOAT8))["fp8_emulated"] is False  # nothing observed: not emulated


def test_the_operand_says_which_kernel_runs():
    """torchao 0.18 decides per operand: a Float8TrainingTensor's ScaledMMConfig.emulate, an MXTensor's
    kernel_preference; a plain tensor holding dequantized FP8 values is emulated by what it is."""
    from torchao.float8.float8_training_tensor import (GemmInputRole, LinearMMConfig, ScaledMMConfig,
                                                       hp_tensor_and_scale_to_float8)

    ledger = WeightGemmLedger()
    weight = torch.randn(8, 16)

    def float8(emulate):
        config = LinearMMConfig(*(ScaledMMConfig(emulate=emulate),) * 3)
        return hp_tensor_and_scale_to_float8(weight, torch.tensor(1.0), torch.float8_e4m3fn, config,
                                             GemmInputRole.WEIGHT)

    assert emulates(float8(True), ledger) and not emulates(float8(False), ledger)
    payload = weight.to(torch.float8_e4m3fn)
    dequantized = payload.float()
    ledger.observe("_to_copy", (payload,), {"dtype": torch.float32}, dequantized)  # as the audit's dispatch mode
    assert emulates(dequantized, ledger) and not emulates(weight, ledger)


def test_a_watched_step_on_emulated_float8_reports_it():
    from fp8dist.audit import watch
    from fp8dist.backends.base import get_backend
    from fp8dist.engines.base import forward_loss
    from fp8dist.runtime.models import _from_hf_config, causal_lm_batch
    from fp8dist.config.models import tiny_config

    spec = load_config({**FLOAT8, "precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    model = _from_hf_config(tiny_config("llama"), "bf16", 0)
    backend.convert_module(model)
    optimizer = torch.optim.AdamW(model.parameters())
    with watch(model, optimizer, spec, on_mismatch="ignore") as audit:
        forward_loss(model, causal_lm_batch(model.config.vocab_size)(2, 16, 0)).backward()
        optimizer.step()
    gemm = next(c for c in audit.report["checks"] if c["phase"] == "gemm")
    assert audit.report["fp8_emulated"] is True and gemm["observed"] == "fp8" and gemm["status"] == "ok"
    assert "emulated: 42 of 42 low-precision GEMMs" in gemm["detail"]  # 14 Linears x forward, dgrad, wgrad


@pytest.fixture
def gloo_tp1():
    """A 1-rank gloo tp mesh: the tensor-parallel styles and DTensors are real, no second process is needed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["plain", "tensor-parallel"])
@pytest.mark.parametrize("emulate", [True, False], ids=["emulate", "scaled-mm"])
def test_the_flag_is_what_ran_through_dtensor_and_the_float8_styles(gloo_tp1, tensor_parallel, emulate):
    """Issue 46 item 1: under tensor parallel torchao's float8 styles hand the GEMM a DTensor over a
    Float8TrainingTensor, and the audit said `fp8_emulated: false` for an emulated run. The flag is read from the GEMM
    that ran below the subclasses: torch.mm of dequantized values when emulated, torch._scaled_mm of float8 values
    otherwise (torch runs that one on a CPU too), with and without tensor parallel."""
    import dataclasses

    from torch.distributed.tensor import DTensor
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fp8dist.audit import watch
    from fp8dist.engines.base import forward_loss
    from fp8dist.engines.fsdp2.tensor_parallel import apply
    from fp8dist.runtime.models import _from_hf_config, causal_lm_batch
    from fp8dist.config.models import tiny_config

    spec = load_config({**FLOAT8, "precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": emulate}}}})
    model = _from_hf_config(tiny_config("llama"), "bf16", 0)
    convert_to_float8_training(model.model.layers, config=dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"), emulate=emulate))
    if tensor_parallel:
        plan = apply(model, gloo_tp1, sequence_parallel=True)
        assert len(plan.float8_styles) == 14 and isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)
    optimizer = torch.optim.AdamW(model.parameters())
    with watch(model, optimizer, spec, on_mismatch="ignore") as audit:
        forward_loss(model, causal_lm_batch(model.config.vocab_size)(2, 16, 0)).backward()
        optimizer.step()
    gemm = next(c for c in audit.report["checks"] if c["phase"] == "gemm")
    assert gemm["observed"] == "fp8" and "e4m3xe4m3: 14, e5m2xe4m3: 28" in gemm["detail"], gemm
    assert audit.report["fp8_emulated"] is emulate
    assert ("emulated: 42 of 42 low-precision GEMMs" in gemm["detail"]) is emulate
    assert ("fp8 (emulated)" in _gemm_line(table(audit.report))) is emulate
