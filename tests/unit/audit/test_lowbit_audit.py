"""The audit names what low-bit tensors hold, in one process: torchao's low-bit AdamW states after a real step (the
optimizer row's detail and `layouts`), and a bitsandbytes 4-bit base beside torchao's NF4Tensor base (the
frozen_weights row and the frozen bytes)."""
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torchao.optim import AdamW8bit, AdamWFp8

from fp8dist.audit import watch
from fp8dist.audit.report import table
from fp8dist.backends.nf4 import nf4_linears, quantize_frozen_base
from fp8dist.engines.optim import full_precision_by_design


def _mlp():
    torch.manual_seed(0)  # 64x128 and 128x64 weights: 8192 values each, states quantized; the biases stay fp32
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))


def _optimizer_cell(model, optimizer, state_dtype):
    """One real step inside the watch (torchao's compiled step runs eagerly there): the optimizer row."""
    with watch(model, optimizer, {"optimizer": {"state_dtype": state_dtype}}, on_mismatch="ignore") as audit:
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    json.dumps(audit.report)  # the layouts are plain JSON
    assert table(audit.report)
    return next(c for c in audit.report["checks"] if c["phase"] == "optimizer")


def test_adamw8bit_states_are_named_by_codes_block_and_scale_read_from_the_tensors():
    model = _mlp()
    optimizer = AdamW8bit(model.parameters(), block_size=128)  # not torchao's default 256: read, not assumed
    cell = _optimizer_cell(model, optimizer, "int8")
    assert cell["observed"] == "int8+int8" and cell["status"] == "ok"
    assert "exp_avg: int8 codes (uint8), block 128, fp32 scale per block" in cell["detail"]
    assert "exp_avg_sq: int8 codes (uint8), block 128, fp32 scale per block" in cell["detail"]
    layout = {"format": "int8", "codes": "uint8", "per_code": 1, "block_size": 128, "scale": "fp32"}
    assert cell["layouts"] == {"exp_avg": [layout], "exp_avg_sq": [layout]}
    # the states' appearance dtype is fp32: it shows nowhere but as the scales' dtype
    state = optimizer.state[model[0].weight]["exp_avg"]
    assert state.dtype == torch.float32 and "'fp32'" not in cell["detail"]
    assert len(full_precision_by_design(optimizer)) == 2 * 3  # the biases' exp_avg, exp_avg_sq, step
    assert "6 states of small tensors left out" in cell["detail"]


def test_adamw_fp8_states_are_float8_codes():
    model = _mlp()
    cell = _optimizer_cell(model, AdamWFp8(model.parameters()), "fp8")
    assert cell["observed"] == "fp8_e4m3+fp8_e4m3" and cell["status"] == "ok"
    assert "exp_avg: fp8_e4m3 codes, block 256, fp32 scale per block" in cell["detail"]
    assert cell["layouts"]["exp_avg_sq"] == [{"format": "fp8_e4m3", "codes": "fp8_e4m3", "per_code": 1,
                                             "block_size": 256, "scale": "fp32"}]


def test_full_precision_states_have_no_layouts():
    model = _mlp()
    cell = _optimizer_cell(model, torch.optim.AdamW(model.parameters()), "fp32")
    assert cell["observed"] == "fp32+fp32" and "layouts" not in cell and "codes" not in cell["detail"]


# ---- a 4-bit frozen base ----

ADAPTER = {"precision": {"preset": "bf16"},
           "adapter": {"kind": "lora", "target_modules": ["proj"], "base_dtype": "nf4"}}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 256)
        self.proj = torch.nn.Linear(256, 256, bias=False)  # 4 NF4 scaler blocks (64 x 256 values each)
        self.head = torch.nn.Linear(256, 64, bias=False)

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


def _adapted():
    torch.manual_seed(0)
    return get_peft_model(Tiny().to(torch.bfloat16), LoraConfig(r=4, target_modules=["proj"]))


def _bnb_base(model, quant_storage):
    """The Linears fp8dist's NF4 base would quantize, as bitsandbytes 4-bit Linears (QLoRA's double quantization)."""
    bnb = pytest.importorskip("bitsandbytes")
    chosen, _ = nf4_linears(model, shards=1)
    for name in chosen:
        linear = model.get_submodule(name)
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4", quant_storage=quant_storage)
        layer.weight = bnb.nn.Params4bit(linear.weight.detach(), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", quant_storage=quant_storage, module=layer)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.to("cpu"))  # quantized on this first move
    return chosen


def _frozen_figures(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with watch(model, optimizer, ADAPTER, on_mismatch="ignore") as audit:
        model(torch.randint(0, 32, (2, 8))).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    row = next(c for c in audit.report["checks"] if c["phase"] == "frozen_weights")
    return row, audit.report["frozen_bytes_by_format"], audit.report["frozen_bytes_per_param"]


@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16])
def test_a_bnb_4bit_base_reads_as_nf4_exactly_as_torchaos_nf4tensor(quant_storage):
    torchao_model = _adapted()
    chosen, _ = quantize_frozen_base(torchao_model, shards=1)
    bnb_model = _adapted()
    assert _bnb_base(bnb_model, quant_storage) == chosen == ["base_model.model.proj.base_layer",
                                                            "base_model.model.head"]
    assert type(bnb_model.get_submodule(chosen[0]).weight).__name__ == "Params4bit"
    ao_row, ao_formats, ao_bytes = _frozen_figures(torchao_model)
    bnb_row, bnb_formats, bnb_bytes = _frozen_figures(bnb_model)
    assert ao_row["observed"] == bnb_row["observed"] == "bf16+nf4" and bnb_row["status"] == "ok"
    assert bnb_row["detail"] == ao_row["detail"]  # the same elements per format: {'bf16': 8192, 'nf4': 81920}
    assert bnb_formats.keys() == ao_formats.keys() == {"bf16", "nf4"} and bnb_formats["bf16"] == 2
    # codes (0.5 byte) + a uint8 absmax per 64 + its fp32 absmax per 256 absmax and the code tables
    assert 0.5 < bnb_formats["nf4"] < 0.6 and 0.5 < ao_formats["nf4"] < 0.6
    # per frozen parameter: both by logical elements, not the packed storage's count
    assert abs(bnb_bytes - ao_bytes) < 0.05
