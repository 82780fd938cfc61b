"""`watch` on a user's own PEFT model: the frozen base is audited apart from the adapters."""
import torch
from peft import LoraConfig, get_peft_model

from fp8dist.audit import watch
from fp8dist.engines.base import forward_loss
from fp8dist.runtime.models import load_model

CONFIG = {"precision": {"preset": "bf16"}, "adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"]}}


def _peft_model():
    loaded = load_model("tiny-llama", "bf16")
    model = get_peft_model(loaded.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model, loaded.make_batch(2, 16, 0)


def _cells(model, optimizer, batch):
    with watch(model, optimizer, CONFIG, on_mismatch="ignore") as audit:
        forward_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {c["phase"]: c for c in audit.report["checks"]}, audit.report


def test_a_loop_that_steps_only_the_adapters_keeps_the_base_as_loaded():
    model, batch = _peft_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    cells, report = _cells(model, optimizer, batch)
    assert cells["frozen_weights"]["observed"] == "bf16" and cells["frozen_weights"]["status"] == "ok"
    assert cells["frozen_state"]["observed"] == "none" and cells["frozen_state"]["status"] == "ok"
    assert cells["weights"]["observed"] == "fp32"  # the adapters (PEFT's autocast_adapter_dtype)
    # r=4 on q_proj (64 -> 64) and v_proj (64 -> 32) of 2 blocks: A is r x in, B is out x r
    trainable = 2 * 4 * ((64 + 64) + (64 + 32))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert report["parameters"] == {"trainable": trainable, "frozen": frozen}
    assert report["frozen_bytes_per_param"] == 2.0


def test_a_loop_that_upcasts_and_trains_the_base_fails_naming_it():
    model, batch = _peft_model()
    model.float()  # an fp32 copy of the frozen base
    for name, param in model.named_parameters():
        param.requires_grad = True  # and the base trained with it
    optimizer = torch.optim.AdamW(model.parameters())
    cells, report = _cells(model, optimizer, batch)
    assert cells["frozen_weights"]["observed"] == "fp32" and cells["frozen_weights"]["status"] == "MISMATCH"
    state = cells["frozen_state"]
    assert state["observed"] == "gradients+optimizer" and state["status"] == "MISMATCH"
    assert "base_model.model.model.embed_tokens.weight" in state["detail"]
    assert report["passed"] is False
