"""End-to-end runs of the real Transformer Engine and MS-AMP. They need an NVIDIA GPU and the library;
elsewhere they are skipped with the reason. Written against TE 2.1-2.20.2 and MS-AMP 0.4.0 (deepspeed 0.13.1).
docs/gpu_paths.md says what the CPU tests verify instead; the rows after the audits check each finding of
issue 25 on the real library (RAM-efficient loading, activation checkpointing, FP8 attention keys, token
multiples, power-of-2 scales, per-release fields, NVFP4 element counts, MS-AMP's TE)."""
import importlib.util
import json
import math
import re

import pytest

from fp8dist.facts.hardware import FP8_MIN_CAPABILITY
from fp8dist.facts.msamp import MSAMP_MAX_TE
from fp8dist.facts.transformer_engine import TE_RECIPES, te_field_kept, te_recipe_available, te_supported
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.gpu


def _cuda_capability():
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


CAP = _cuda_capability()
needs_fp8_gpu = pytest.mark.skipif(CAP is None or CAP < FP8_MIN_CAPABILITY,
                                   reason="needs an NVIDIA GPU with compute capability >= 8.9")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="Transformer Engine not installed (needs CUDA to build)")
needs_msamp = pytest.mark.skipif(importlib.util.find_spec("msamp") is None, reason="MS-AMP not installed (not on PyPI)")


def audit(config, nproc=1, *overrides):
    # tiny-llama's Linears are far too small for FP8 to pay: precision.fp8.min_speedup's `auto` would keep every one in
    # bf16 on a GPU the speed model knows, and these tests are about the FP8 GEMMs themselves
    result = run_cli("audit", "tiny-llama", "--config", ROOT / "configs" / f"{config}.yaml", "--nproc", nproc,
                     "--format", "json", "precision.fp8.min_speedup=off", *overrides, timeout=900)
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
    docs) casts weights to e4m3 with fp16 masters under DeepSpeed at every level (Azure/MS-AMP v0.4.0
    msamp/deepspeed/runtime/engine.py, zero/fp8_stage_1_and_2.py): a
    failing O1/O2 'weights' row here is that finding, reported, not hidden."""
    data, by_phase = audit(f"msamp-{level}")
    assert by_phase["gemm"]["observed"] == "fp8", by_phase["gemm"]
    optimizer = "fp8+fp16" if level != "o1" else "fp32+fp32"
    assert by_phase["optimizer"]["ok"] and by_phase["optimizer"]["expected"] == optimizer, by_phase["optimizer"]
    if level == "o3":
        assert data["passed"], by_phase


# --- issue 25: each finding of reading TE and MS-AMP, on the real library ----------------------------------

def _installed_te():
    from fp8dist.backends.transformer_engine import installed_te_version

    return installed_te_version()


def _te_spec(**te):
    from fp8dist.config.load import load_config

    return load_config({"precision": {"preset": "te", "fp8": {"te": te}}})


@needs_fp8_gpu
@needs_te
def test_te_with_ram_efficient_loading():
    """te.Linear built on meta (device="meta"), the weights read into the shards afterwards."""
    data, by_phase = audit("te", 2, "parallel.cpu_ram_efficient_loading=true")
    assert data["passed"], by_phase
    assert by_phase["gemm"]["observed"] == "fp8"


@needs_fp8_gpu
@needs_te
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_te_with_activation_checkpointing(mode):
    """The recompute in backward runs in TE's autocast again: its GEMMs are FP8 too."""
    data, by_phase = audit("te", 1, f"parallel.activation_checkpointing={mode}")
    assert data["passed"], by_phase
    assert by_phase["gemm"]["observed"] == "fp8", by_phase["gemm"]


@needs_te
def test_installed_te_raises_where_fp8dist_refuses_first():
    """fp8dist's config rules quote TE's own message; the installed TE still raises it (fp8_dpa with block, ...)."""
    from transformer_engine.common import recipe as te_recipe

    version = _installed_te()
    for record in TE_RECIPES.values():
        for rejection in record.rejects:
            if rejection.since <= version and (rejection.until is None or version <= rejection.until):
                value = te_recipe.Format[rejection.value] if rejection.field == "fp8_format" else rejection.value
                with pytest.raises((AssertionError, ValueError), match=re.escape(rejection.message)):
                    getattr(te_recipe, record.cls)(**{rejection.field: value})


@needs_fp8_gpu
@needs_te
def test_te_gemms_need_tokens_a_multiple_of_8():
    """facts.transformer_engine.TE_TOKEN_MULTIPLE: te.Linear refuses 12 tokens under autocast
    (assert_dim_for_fp8_exec)."""
    import torch
    import transformer_engine.pytorch as te

    linear = te.Linear(64, 64, params_dtype=torch.bfloat16)
    autocast = te.autocast if hasattr(te, "autocast") else te.fp8_autocast
    with autocast(enabled=True):
        linear(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
        with pytest.raises((AssertionError, ValueError), match="divisible by 8"):
            linear(torch.randn(12, 64, device="cuda", dtype=torch.bfloat16))


@needs_fp8_gpu
@needs_te
@pytest.mark.skipif(_installed_te() is not None and _installed_te() < (2, 8, 0),
                    reason="use_power_2_scales is a field from TE 2.8")
def test_te_power_2_scales_reach_te_linear():
    """te.Linear's input and weight quantizers follow the recipe fp8dist built, not the environment."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    from fp8dist.backends.transformer_engine import build_recipe

    recipe = build_recipe(te_recipe, _te_spec(recipe="current", use_power_2_scales=True), _installed_te())
    linear = te.Linear(64, 64, params_dtype=torch.bfloat16)
    autocast = te.autocast(enabled=True, recipe=recipe) if hasattr(te, "autocast") else \
        te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    with autocast:
        linear(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
    assert all(q.force_pow_2_scales for q in linear.quantizers["scaling_fwd"][:2])  # GEMM1 input, weight


@needs_te
def test_installed_te_keeps_every_field_fp8dist_writes():
    """The recipe contract (tests/unit/backends/test_te_recipe_contract.py) on the installed TE itself."""
    from transformer_engine.common import recipe as te_recipe

    from fp8dist.backends.transformer_engine import build_recipe
    from tests.unit.backends.test_te_recipe_contract import VALUES, plain

    version = _installed_te()
    assert te_supported(version)[0]
    for name, values in VALUES.items():
        fields = {f: v for f, v in values.items() if te_field_kept(name, f, version)[0]}
        if te_recipe_available(name, version)[0]:
            built = build_recipe(te_recipe, _te_spec(recipe=name, **fields), version)
            assert {f: plain(getattr(built, f)) for f in fields} == fields, name


@pytest.mark.skipif(CAP is None or CAP < (10, 0), reason="NVFP4 needs compute capability 10.x")
@needs_te
def test_nvfp4_storage_counts_logical_elements():
    import torch
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    from fp8dist.backends.storage import storage

    quantizer = NVFP4Quantizer()
    quantizer.internal = True  # the *Storage object the audit meets in TE's saved tensors
    held = storage(quantizer(torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)))
    assert held.format == "fp4_e2m1" and held.numel == 128 * 256


@needs_msamp
def test_msamp_lives_with_te_at_most_1_7():
    """facts.msamp.msamp_install_hint: `import msamp` loads transformer_engine_extensions, gone from TE 1.8."""
    from fp8dist.backends.transformer_engine import installed_te_version

    version = installed_te_version()
    assert version is None or version[:2] <= MSAMP_MAX_TE[:2]
