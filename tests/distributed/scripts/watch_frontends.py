"""HF Trainer with DeepSpeed ZeRO-2, and a PEFT LoRA model on ZeRO-3 (TrainingArguments from
fp8dist.integrations.training_arguments_kwargs) audited by `AuditCallback`, 2 ranks:

    torchrun --nproc_per_node 2 tests/distributed/scripts/watch_frontends.py trainer-deepspeed | trainer-deepspeed-lora

Rank 0 prints a `case` result line with the verdict, failing phases and observed cells. (Accelerate's loop is
examples/accelerate_watch.py, run as users run it.)
"""
from __future__ import annotations

import sys

import torch

from fp8dist.runtime.models import load_model
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases


def summary(report: dict) -> dict:
    return {"passed": report["passed"], "engine": report["engine"],
            "failing": sorted({p for ps in report.get("failing_by_rank", {}).values() for p in ps}),
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "details": {c["phase"]: c["detail"] for c in report["checks"]}}


def train_with_the_trainer(config_name: str, with_adapter: bool = False) -> dict:
    """tiny-llama trained 2 steps by the HF Trainer with TrainingArguments from `training_arguments_kwargs(config)`,
    step 1 audited by `AuditCallback`. `with_adapter`: the model wrapped with PEFT by the script, as that function's
    docstring says for `adapter.kind=lora` (`lora_config(spec.adapter)`, `autocast_adapter_dtype=False`)."""
    from transformers import Trainer, TrainingArguments

    from fp8dist.config.load import load_config
    from fp8dist.integrations import AuditCallback, training_arguments_kwargs

    config = ROOT / "configs" / f"{config_name}.yaml"
    spec = load_config(config)
    model = load_model("tiny-llama", spec.precision.load_dtype).model
    if with_adapter:
        from peft import get_peft_model

        from fp8dist.backends.adapters import lora_config

        model = get_peft_model(model, lora_config(spec.adapter), autocast_adapter_dtype=False)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (16, 32),
                                                                        generator=torch.Generator().manual_seed(0))]
    # use_cpu: TrainingArguments refuses bf16 on a CPU-only node without it (transformers 5 training_args.py)
    args = TrainingArguments(output_dir="/tmp/fp8dist-trainer-test", max_steps=2, report_to=[], save_strategy="no",
                             logging_steps=1000, use_cpu=not torch.cuda.is_available(),
                             **training_arguments_kwargs(config))
    callback = AuditCallback(spec, on_mismatch="ignore")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    return {**summary(callback.report), "parameters": callback.report.get("parameters")}


CASES = {
    # bf16, the DeepSpeed dict, batch, clipping, AdamW
    "trainer-deepspeed": lambda: train_with_the_trainer("deepspeed-bf16-zero2"),
    # a PEFT LoRA model on ZeRO-3: frozen bf16 base, fp32 adapter masters
    "trainer-deepspeed-lora": lambda: train_with_the_trainer("deepspeed-lora-zero3", with_adapter=True),
}


def main(name: str) -> int:
    run_cases(CASES, [name])
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1]))
