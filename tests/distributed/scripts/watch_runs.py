"""Hand-written training loops audited with `fp8dist.audit.watch`, one 2-rank job for all cases:

    torchrun --nproc_per_node 2 tests/distributed/scripts/watch_runs.py [NAME ...]

Each case prepares tiny-llama by hand (fully_shard, deepspeed.initialize or DDP, no fp8dist engine), runs one
step inside `watch` and prints on rank 0 a `case` result line (fp8dist.runtime.ranks.emit): the verdict, the failing phases of every rank,
the observed cells and the bytes on the wire (tests/distributed/test_watch.py checks them). Some loops are
correct; others carry a deliberate precision bug that users have shipped.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from fp8dist.runtime import process_group
from fp8dist.runtime.process_group import leave

from fp8dist.audit import AuditMismatch, watch
from fp8dist.config.load import load_config
from fp8dist.engines.base import forward_loss
from fp8dist.runtime.models import load_model
from tests.audit_factories import AdamWithBf16States
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases

CONFIG = {name: load_config(ROOT / "configs" / f"{name}.yaml") for name in ("fsdp2-bf16", "fsdp2-torchao-float8")}


def batch() -> dict:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    return {"input_ids": ids, "labels": ids}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def fsdp2_by_hand(*, upcast=True, float8=None, mixed_precision=True):
    """What the torchao README and torchtitan show: upcast, (convert), fully_shard per block then the root."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = load_model("tiny-llama", "bf16").model
    if upcast:
        model.float()
    if float8 is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                                     enable_fsdp_float8_all_gather=float8 == "float8 all-gather")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "lm_head")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if float8 == "float8 all-gather":  # gloo has no float8 dtype: send the same bytes as uint8
        from fp8dist.engines.fsdp2.collectives import ByteViewAllGather

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ByteViewAllGather())
    return model


def one_step(model, optimizer, config, step=None, **kwargs):
    with watch(model, optimizer, config, **kwargs) as audit:
        forward_loss(model, batch()).backward()
        (step or optimizer.step)()
        optimizer.zero_grad()
    return audit


# -- FSDP2 by hand -----------------------------------------------------------------------------------------
def fsdp2_correct():
    model = fsdp2_by_hand()
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="ignore")


def fsdp2_float8_correct():
    model = fsdp2_by_hand(float8="float8 all-gather")
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-torchao-float8"], on_mismatch="ignore")


def fsdp2_upcast_is_a_no_op():
    """(a) accelerate #3979: the fp32 upcast never happened, so the optimizer steps bf16 shards."""
    model = fsdp2_by_hand(upcast=False)
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="ignore")


def fsdp2_optimizer_before_upcast():
    """(a) the optimizer is built on the bf16 parameters, then the model is upcast by new parameters: it
    steps stale bf16 tensors the model no longer uses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = load_model("tiny-llama", "bf16").model
    optimizer = adamw(model.parameters())
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().float()))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return one_step(model, optimizer, CONFIG["fsdp2-bf16"], on_mismatch="ignore")


def fsdp2_float8_not_converted():
    """(b) float8 asked for, the model never converted."""
    model = fsdp2_by_hand()
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-torchao-float8"], on_mismatch="ignore")


def fsdp2_float8_gather_not_wrapped():
    """(c) float8 all-gather asked for, the weights converted without it (torchtitan #3123)."""
    model = fsdp2_by_hand(float8="no float8 all-gather")
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-torchao-float8"], on_mismatch="ignore")


def fsdp2_computes_in_fp32():
    """(d) a bf16 mixed-precision config; the FSDP2 policy was left out, so every matmul runs in fp32."""
    model = fsdp2_by_hand(mixed_precision=False)
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="ignore")


def fsdp2_bf16_adam_states():
    """(e) AdamW moments kept in bf16 where the config says fp32."""
    model = fsdp2_by_hand()
    return one_step(model, AdamWithBf16States(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="ignore")


LORA_CONFIG = {"precision": {"preset": "bf16"}, "adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"]}}


def fsdp2_lora_by_hand(*, upcast_base: bool):
    """A PEFT LoRA model sharded by hand: the adapters upcast to fp32 masters; with `upcast_base` the whole model
    is upcast (`model.float()`, the usual full fine-tune recipe), keeping an fp32 copy of the frozen base."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = get_peft_model(load_model("tiny-llama", "bf16").model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                           autocast_adapter_dtype=False)
    if upcast_base:
        model.float()
    else:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp2_lora_correct():
    model = fsdp2_lora_by_hand(upcast_base=False)
    return one_step(model, adamw([p for p in model.parameters() if p.requires_grad]), LORA_CONFIG,
                    on_mismatch="ignore")


def fsdp2_lora_base_upcast():
    """An fp32 copy of the frozen base: 4 bytes per frozen parameter where the config keeps the load dtype's 2."""
    model = fsdp2_lora_by_hand(upcast_base=True)
    return one_step(model, adamw([p for p in model.parameters() if p.requires_grad]), LORA_CONFIG,
                    on_mismatch="ignore")


def fsdp2_mismatch_raises():
    """on_mismatch=raise: AuditMismatch on every rank (one verdict for the job)."""
    model = fsdp2_by_hand()
    try:
        one_step(model, AdamWithBf16States(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="raise")
    except AuditMismatch as exc:
        raised = [None] * dist.get_world_size()
        dist.all_gather_object(raised, str(exc).splitlines()[0])
        return {"raised_on": raised}
    return {"raised_on": None}


# -- DDP by hand -----------------------------------------------------------------------------------------
def ddp_with_an_fsdp2_config():
    model = torch.nn.parallel.DistributedDataParallel(load_model("tiny-llama", "bf16").model.float())
    return one_step(model, adamw(model.parameters()), CONFIG["fsdp2-bf16"], on_mismatch="ignore")


# -- DeepSpeed by hand ---------------------------------------------------------------------------------------
def deepspeed_by_hand(stage: int, communication: str):
    """What the DeepSpeed docs show: a JSON config and deepspeed.initialize with a torch optimizer."""
    import deepspeed

    model = load_model("tiny-llama", "bf16").model
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "communication_data_type": communication, "zero_optimization": {"stage": stage},
              "steps_per_print": 1000}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    return engine, optimizer


def deepspeed_case(stage: int, communication: str = "fp32"):
    def run():
        engine, optimizer = deepspeed_by_hand(stage, communication)
        spec = load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": stage},
                            "precision": {"preset": "bf16", "reduce_dtype": communication}})
        with watch(engine, optimizer, spec, on_mismatch="ignore") as audit:
            engine.backward(forward_loss(engine, batch()))
            engine.step()
        engine.destroy()
        return audit

    return run


def deepspeed_autotp_float8():
    """Float8 conversion, then DeepSpeed AutoTP (`tensor_parallel.autotp_size`, what Axolotl's tensor_parallel_size
    writes): AutoTP replaces every nn.Linear subclass, Float8Linear included, so the GEMMs run in bf16. The config
    the user meant says FP8; the gemm row must fail."""
    import deepspeed
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = load_model("tiny-llama", "bf16").model
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "lm_head")
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 1000}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=ds_config)
    left = sum(type(m).__name__ == "Float8Linear" for m in engine.module.modules())
    spec = load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": 1}, "precision": {"preset": "torchao-float8"}})
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))  # tp peers: the same batch
    with watch(engine, optimizer, spec, on_mismatch="ignore") as audit:
        engine.backward(forward_loss(engine, {"input_ids": ids, "labels": ids}))
        engine.step()
    engine.destroy()
    return {**facts(audit), "float8_linears": [converted, left]}


CASES = {
    "fsdp2-correct": fsdp2_correct, "fsdp2-float8-correct": fsdp2_float8_correct,
    "fsdp2-upcast-is-a-no-op": fsdp2_upcast_is_a_no_op, "fsdp2-optimizer-before-upcast": fsdp2_optimizer_before_upcast,
    "fsdp2-float8-not-converted": fsdp2_float8_not_converted,
    "fsdp2-float8-gather-not-wrapped": fsdp2_float8_gather_not_wrapped,
    "fsdp2-computes-in-fp32": fsdp2_computes_in_fp32, "fsdp2-bf16-adam-states": fsdp2_bf16_adam_states,
    "fsdp2-mismatch-raises": fsdp2_mismatch_raises,
    "fsdp2-lora-correct": fsdp2_lora_correct, "fsdp2-lora-base-upcast": fsdp2_lora_base_upcast, "ddp-with-an-fsdp2-config": ddp_with_an_fsdp2_config,
    "deepspeed-zero1": deepspeed_case(1), "deepspeed-zero2": deepspeed_case(2), "deepspeed-zero3": deepspeed_case(3),
    "deepspeed-zero2-bf16-reduce": deepspeed_case(2, "bf16"), "deepspeed-autotp-float8": deepspeed_autotp_float8,
}


def facts(result) -> dict:
    if isinstance(result, dict):
        return result
    report = result.report
    return {"passed": result.passed, "failing": sorted({p for ps in report.get("failing_by_rank", {}).values() for p in ps}),
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "details": {c["phase"]: c["detail"] for c in report["checks"]},
            "wire": report["communication_bytes"], "wire_by_axis": report["communication_bytes_by_axis"]}


def main(ids: list[str]) -> int:
    process_group.init(180, deepspeed=True)  # gloo; serves the torch cases too
    run_cases({name: (lambda case=case: facts(case())) for name, case in CASES.items()}, ids)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
