"""Audit the first step of an Accelerate training loop with `fp8dist.audit.watch`.

    accelerate launch --num_processes 2 examples/accelerate_watch.py --config configs/fsdp2-bf16.yaml
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/accelerate_watch.py   # CPU: 2 gloo processes

(`accelerate launch --cpu` starts a single process unless MPI is set up: accelerate 1.15 commands/launch.py
uses its simple launcher for --cpu.)

The loop is the one Accelerate's docs show: build the model and optimizer, `accelerator.prepare`, then
`accelerator.backward` and `optimizer.step`. Only the first step is inside `watch`; every later step runs
with nothing of fp8dist installed. On a GPU node the FSDP2 plugin shards the model and the audit passes; on
CPU, Accelerate 1.15 does not shard: it falls back to DDP with bf16 weights and bf16 AdamW states,
without a warning, and the audit shows exactly that (engine ddp, weights / master / optimizer bf16).
Exit code: 0 when the audited step matches the config, 1 when it does not.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from fp8dist.audit import watch
from fp8dist.runtime.models import load_model
from fp8dist.runtime.process_group import leave


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/fsdp2-bf16.yaml", help="the fp8dist config the run follows")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--report", default=None, help="write the audit report (JSON) here, from rank 0")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = load_model("tiny-llama", "bf16").model  # any model; tiny-llama is built offline
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    for step in range(args.steps):
        ids = torch.randint(0, 256, (2, 64), device=accelerator.device)
        with watch(model, optimizer, args.config) if step == 0 else contextlib.nullcontext() as audit:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step == 0:
            report = audit.report
        accelerator.print(f"step {step + 1} loss {loss.item():.4f}")
    if args.report and accelerator.is_main_process:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump({**report, "distributed_type": str(accelerator.distributed_type)}, handle)
    accelerator.end_training()
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    # fp8dist's clean exit: no interpreter finalisation, where gloo's threads can abort a finished rank (pytorch
    # #179291); the exit code stays the audit's (1 when it failed).
    leave(main())
