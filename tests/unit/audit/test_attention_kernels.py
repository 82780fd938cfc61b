"""A library attention kernel's own precision is not the run's (issue 46 item 14): GPT-2 with its own attention
dropout (0.1) trains through torch's SDPA, which on a CPU with dropout runs its math path and computes the bf16 run's
attention in fp32. The audit attributes those matmuls to the kernel (said, with the reason) and judges the run's
compute dtype on its own GEMMs; a run that hands the kernel fp32 itself is still caught. Real FSDP2 on a one-rank
gloo group, GPT-2 from transformers with its own config."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8dist.audit import watch
from fp8dist.audit.report import table
from fp8dist.config.load import load_config
from fp8dist.engines import fsdp2
from tests.conftest import ROOT

BF16 = str(ROOT / "configs" / "fsdp2-bf16.yaml")


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _row(report, phase):
    return next(c for c in report["checks"] if c["phase"] == phase)


def _gpt2_report(attention: str = "sdpa") -> dict:
    from transformers import AutoModelForCausalLM

    from fp8dist.runtime.models import causal_lm_batch
    from fp8dist.config.models import tiny_config

    config = tiny_config("gpt2")  # GPT-2's own dropout: attn_pdrop = resid_pdrop = embd_pdrop = 0.1
    assert config.attn_pdrop == 0.1
    config._attn_implementation = attention
    torch.manual_seed(0)
    spec = load_config(BF16)
    run = fsdp2.prepare(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), spec, audit="off")
    assert run.model.training  # the engine trains: dropout acts
    with watch(run.model, run.optimizer, spec, on_mismatch="ignore") as audit:
        fsdp2.train_step(run, [causal_lm_batch(config.vocab_size)(2, 16, 0)], spec.train.gradient_clipping)
    return audit.report


def test_gpt2_with_its_own_dropout_passes_and_the_kernels_fp32_is_said(one_rank):
    report = _gpt2_report()
    training = _row(report, "training")
    assert report["passed"] is True and training["observed"] == "bf16" and training["status"] == "ok", training
    # 2 layers: forward q.k and p.v, backward two matmuls for each: 12, all inside the 2 SDPA calls
    assert report["kernel_matmuls"] == {
        "kernel": "F.scaled_dot_product_attention", "calls": 2, "inputs": {"bf16": 2}, "matmuls": {"fp32": 12},
        "reason": report["kernel_matmuls"]["reason"]}
    assert "math path" in report["kernel_matmuls"]["reason"] and "check_for_dropout" in report["kernel_matmuls"]["reason"]
    assert "scaled_dot_product_attention calls ({'fp32': 12}, from {'bf16': 2} inputs)" in training["detail"]
    line = next(x for x in table(report).splitlines() if x.startswith("  - F.scaled_dot_product_attention"))
    assert "12 matmuls in fp32 inside 2 calls given bf16 inputs, not counted in the training row" in line


def test_without_a_kernel_of_its_own_nothing_is_set_aside(one_rank):
    """GPT-2's eager attention is the model's own code: its matmuls are the run's (bf16) and no kernel is said."""
    report = _gpt2_report("eager")
    assert report["passed"] is True and report["kernel_matmuls"] is None
    assert "not counted" not in _row(report, "training")["detail"]


class UpcastsAttention(torch.nn.Module):
    """A model that hands SDPA fp32 query, key and value itself: the fp32 is the run's, not the kernel's."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2).float() for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2).to(x.dtype))


def test_fp32_handed_to_the_kernel_by_the_model_still_fails(one_rank):
    spec = load_config(BF16)
    torch.manual_seed(0)
    run = fsdp2.prepare(UpcastsAttention().to(torch.bfloat16), spec, audit="off")
    with watch(run.model, run.optimizer, spec, on_mismatch="ignore") as audit:
        run.model(torch.randn(2, 16, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        run.optimizer.step()
    training = _row(audit.report, "training")
    assert training["observed"] == "bf16+fp32" and training["status"] == "MISMATCH", training
    assert "fp32: 1" in training["detail"]  # the one SDPA call, on the fp32 inputs the model gave it
    assert audit.report["kernel_matmuls"] is None  # the kernel computed in the precision it was given


def test_under_autocast_the_kernel_gets_autocasts_dtype():
    """Llama's RoPE multiplies q and k by fp32 cos / sin, so under fp16 autocast they reach
    F.scaled_dot_product_attention in fp32; autocast casts them to fp16 before the kernel (SDPA is in its
    lower-precision list), and the call counts in fp16, as it runs (the option matrix's ds-fp16-amp-autocast)."""
    from collections import Counter

    from fp8dist.audit.probes import AttentionKernels

    calls: Counter = Counter()
    q, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), AttentionKernels(calls):
        out = F.scaled_dot_product_attention(q, q, v)
    assert out.dtype == torch.float16 and calls == Counter({(AttentionKernels.NAME, ("fp16", "fp16", "fp16")): 1})
    with AttentionKernels(calls):  # without autocast: the inputs as given
        F.scaled_dot_product_attention(q, q, q)
    assert calls[(AttentionKernels.NAME, ("fp32", "fp32", "fp32"))] == 1
