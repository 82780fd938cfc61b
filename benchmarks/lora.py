"""LoRA: peak memory per rank of an adapter run, fp8dist against Accelerate + PEFT doing the same run.

    python benchmarks/lora.py [--steps N] [--model NAME]
    python benchmarks/lora.py --smoke            # 1 step of tiny-llama per side: not a measurement

configs/deepspeed-lora-zero3.yaml (LoRA r=16 on q/k/v/o, bf16 base, fp32 adapter masters, DeepSpeed ZeRO-3) on
`small-llama` (built in, 3.7M parameters), 2 gloo ranks, N training steps (default 3), each side in its own
torchrun launch so that each process's high-water mark is its own:
- fp8dist: `fp8dist.load_model` (PEFT applied at loading) and `fp8dist.engines.deepspeed.initialize`;
- Accelerate + PEFT: the script a user writes for the same config: the model loaded in bf16,
  `peft.get_peft_model`, an AdamW over the trainable parameters, `Accelerator(**accelerator_kwargs(CONFIG))`
  (DeepSpeed ZeRO-3 from the same config), `accelerator.prepare`, `accelerator.backward`;
- fp8dist, full fine-tune: the same config without its `adapter` section (for scale).

Peak bytes per rank: the process's resident high-water mark (VmHWM) minus its resident size after every library
is imported and the process group is up, before the model is built; the larger of the two ranks. Goal: fp8dist /
Accelerate+PEFT <= 1.0 (within the 1% the table allows). Also measured on the fp8dist side: bytes per frozen
parameter as stored in its ZeRO-3 partitions (goal: 2, the bf16 load dtype) and the elements of the fp32 partitions
the ZeRO optimizer keeps per trainable element (1: no fp32 copy of the frozen base).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ROOT, SMOKE_HELP, measure_side, quiet_libraries, reset_peak_resident, result,  # noqa: E402
                     status_kib, under_torchrun)

CONFIG = str(ROOT / "configs" / "deepspeed-lora-zero3.yaml")
SIDES = ("fp8dist", "accelerate", "fp8dist-full")


def run_side(side: str, model_name: str, steps: int) -> None:
    """One side on this rank (under torchrun): build, train `steps` steps, print the peak and the facts."""
    quiet_libraries()
    import accelerate  # noqa: F401  every side imports the same libraries before the baseline
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed as dist

    from fp8dist import load_config
    from fp8dist.runtime import process_group
    from fp8dist.runtime.data import batches_for
    from fp8dist.runtime.ranks import emit

    process_group.init(deepspeed=True)
    document = yaml.safe_load(Path(CONFIG).read_text())
    if side == "fp8dist-full":
        document.pop("adapter")
    spec = load_config(document)
    rank = dist.get_rank()
    dist.barrier()
    baseline = status_kib("VmRSS") * 1024
    reset_peak_resident()
    facts = {}
    if side == "accelerate":
        from accelerate import Accelerator
        from peft import get_peft_model

        from fp8dist.engines.optim import build_optimizer
        from fp8dist.integrations import accelerator_kwargs
        from fp8dist.backends.adapters import lora_config
        from fp8dist.runtime.models import load_model

        loaded = load_model(model_name, spec.precision.load_dtype, seed=spec.train.seed)
        model = get_peft_model(loaded.model, lora_config(spec.adapter), autocast_adapter_dtype=False)  # as the header says
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], spec)
        accelerator = Accelerator(**accelerator_kwargs(spec))
        model, optimizer = accelerator.prepare(model, optimizer)
        for step in range(steps):
            for batch in batches_for(loaded.make_batch, spec, step, rank):
                accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    else:
        from fp8dist import load_model
        from fp8dist.engines.deepspeed import initialize, train_step

        loaded = load_model(model_name, spec)
        engine = initialize(loaded.model, spec, audit="off")[0]
        for step in range(steps):
            train_step(engine, batches_for(loaded.make_batch, spec, step, rank))
        frozen = [p.ds_tensor for p in engine.module.parameters() if not p.requires_grad]
        trainable = sum(p.ds_tensor.numel() for p in engine.module.parameters() if p.requires_grad)
        fp32 = sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat)
        facts = {"frozen_bytes_per_param": sum(t.numel() * t.element_size() for t in frozen) /
                 max(sum(t.numel() for t in frozen), 1), "fp32_partition_per_trainable": fp32 / max(trainable, 1)}
    peak = status_kib("VmHWM") * 1024 - baseline
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peak)
    if rank == 0:
        emit("side", side, {"peak": max(gathered), **facts})
    process_group.leave(0)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, under torchrun
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.model = 1, "tiny-llama"
    if args.side:
        assert under_torchrun(), "--side runs under torchrun (python benchmarks/lora.py launches it)"
        return run_side(args.side, args.model, args.steps)
    sides = {side: measure_side(__file__, side, "--model", args.model, "--steps", str(args.steps)) for side in SIDES}
    mib = {side: facts["peak"] / 2 ** 20 for side, facts in sides.items()}
    print(f"peak resident bytes per rank above the imported baseline, {args.model}, {args.steps} steps, 2 ranks: "
          + ", ".join(f"{side} {value:.1f} MiB" for side, value in mib.items()))
    ours = sides["fp8dist"]
    print(f"fp8dist side: {ours['frozen_bytes_per_param']:g} bytes per frozen parameter, "
          f"{ours['fp32_partition_per_trainable']:g} fp32 partition elements per trainable element")
    result("lora_peak_fp8dist_over_accelerate_peft", sides["fp8dist"]["peak"] / sides["accelerate"]["peak"], "<=1.0",
           "peak resident bytes per rank, fp8dist / Accelerate + PEFT, same config")
    result("lora_peak_over_full_finetune", sides["fp8dist"]["peak"] / sides["fp8dist-full"]["peak"], "info",
           "peak resident bytes per rank, LoRA / full fine-tune (fp8dist, same model)")
    result("lora_bytes_per_frozen_param", ours["frozen_bytes_per_param"], "=2", "ZeRO-3 partitions of the frozen base")
    result("lora_fp32_partition_per_trainable", ours["fp32_partition_per_trainable"], "=1",
           "ZeRO optimizer fp32 partition elements per trainable element (frozen base: none)")


if __name__ == "__main__":
    main()
