"""HF Trainer with DeepSpeed ZeRO-2 (the config fp8dist translates) audited by `AuditCallback`, 2 ranks:

    torchrun --nproc_per_node 2 tests/distributed/scripts/watch_frontends.py trainer-deepspeed

Rank 0 prints `CASE <name> <json>` with the verdict, failing phases and observed cells. (Accelerate's loop is
examples/accelerate_watch.py, run as users run it.)
"""
from __future__ import annotations

import sys

import torch

from fp8dist.models import load_model
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases


def summary(report: dict) -> dict:
    return {"passed": report["passed"], "engine": report["engine"],
            "failing": sorted({p for ps in report.get("failing_by_rank", {}).values() for p in ps}),
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "details": {c["phase"]: c["detail"] for c in report["checks"]}}


def trainer_deepspeed() -> dict:
    from transformers import Trainer, TrainingArguments

    from fp8dist.config.load import load_config
    from fp8dist.integrations import AuditCallback
    from fp8dist.translate.deepspeed import to_deepspeed

    spec = load_config(ROOT / "configs" / "deepspeed-bf16-zero2.yaml")
    ds_config = to_deepspeed(spec)
    model = load_model("tiny-llama", "fp32").model
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (16, 32),
                                                                        generator=torch.Generator().manual_seed(0))]
    args = TrainingArguments(output_dir="/tmp/fp8dist-trainer-test", per_device_train_batch_size=ds_config[
        "train_micro_batch_size_per_gpu"], gradient_accumulation_steps=ds_config["gradient_accumulation_steps"],
        max_steps=2, bf16=True, deepspeed=ds_config, report_to=[], save_strategy="no", logging_steps=1000,
        max_grad_norm=ds_config["gradient_clipping"], learning_rate=spec.optimizer.lr, use_cpu=not torch.cuda.is_available())
    callback = AuditCallback(spec, on_mismatch="ignore")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    return summary(callback.report)


def main(name: str) -> int:
    import torch.distributed as dist

    run_cases({"trainer-deepspeed": trainer_deepspeed}, [name])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
