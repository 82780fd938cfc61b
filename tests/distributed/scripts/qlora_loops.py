"""QLoRA loops people write with Accelerate + PEFT + bitsandbytes on FSDP2, audited with `fp8dist.audit.watch`
against configs/fsdp2-qlora.yaml, one 2-rank job for all cases:

    torchrun --nproc_per_node 2 tests/distributed/scripts/qlora_loops.py MODEL_DIR [NAME ...]

MODEL_DIR: a bf16 Hugging Face directory whose Linears split into whole 4-bit blocks. Each case loads it with
`BitsAndBytesConfig(load_in_4bit, nf4)`, adds LoRA with PEFT, prepares it with Accelerate's FSDP2 plugin (forced
on the CPU as Accelerate's own __init__ sets it on a GPU: accelerate 1.15 state.py applies none without one),
runs one step inside `watch` and prints rank 0's verdict, failing phases and frozen-weights cell
(tests/distributed/test_qlora.py checks them):
- bf16-storage: the recipe (bf16 quant storage, the dtype of the other weights): FSDP2 shards the 4-bit base;
- uint8-storage: bitsandbytes' default storage: Accelerate leaves the base out of FSDP2, whole on every rank;
- peft-upcast: `prepare_model_for_kbit_training`, which casts every parameter that is not 4-bit to fp32.
"""
from __future__ import annotations

import sys

import torch
import yaml

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.integrations import accelerator_kwargs
from fp8dist.runtime import process_group
from fp8dist.backends.adapters import lora_config
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases

QLORA = ROOT / "configs" / "fsdp2-qlora.yaml"


def loop(model_dir: str, storage: torch.dtype, upcast: bool = False) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = load_config(QLORA)
    document = yaml.safe_load(QLORA.read_text())
    document["adapter"].pop("base_dtype")  # Accelerate takes the FSDP2 plugin of the same file; bitsandbytes quantizes
    kwargs = accelerator_kwargs(load_config(document))
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=storage)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    if upcast:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, lora_config(spec.adapter))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    accelerator = Accelerator(cpu=True, **kwargs)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = kwargs["fsdp_plugin"]
    kwargs["fsdp_plugin"].set_mixed_precision(kwargs["mixed_precision"])
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(64).reshape(1, 64) % model.config.vocab_size
    with watch(model, optimizer, spec, on_mismatch="ignore") as audit:
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    report = audit.report
    rows = {check["phase"]: check for check in report["checks"]}
    return {"passed": report["passed"], "failing": sorted(p for p, c in rows.items() if not c["ok"]),
            "frozen_weights": rows["frozen_weights"]["observed"], "detail": rows["frozen_weights"]["detail"],
            "frozen_bytes_by_format": report.get("frozen_bytes_by_format"), "parameters": report["parameters"]}


if __name__ == "__main__":
    process_group.init()
    directory = sys.argv[1]
    run_cases({"bf16-storage": lambda: loop(directory, torch.bfloat16),
               "uint8-storage": lambda: loop(directory, torch.uint8),
               "peft-upcast": lambda: loop(directory, torch.bfloat16, upcast=True)}, sys.argv[2:])
    leave(0)
