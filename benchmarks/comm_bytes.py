"""FSDP2 all-gather bytes: bf16 all-gather vs torchao float8 all-gather, tiny-llama on 2 gloo ranks.

    python benchmarks/comm_bytes.py          # launches itself under torchrun --nproc_per_node 2

Bytes are counted at FSDP2's all-gather (fp8dist's custom collective) for one training step, per rank.
"linear weights" = the decoder-layer groups minus their RMSNorm vectors (all-gathered in bf16 in both
runs: numel x 2 bytes). Last line: allgather_bytes_ratio_fp8_vs_bf16=<linear weights>; the limit is 0.5.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFIGS = {"bf16": {"precision": {"preset": "bf16"}},
           "float8": {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}}}


def measure(name: str) -> tuple[int, int]:
    """(whole-model bytes, linear-weight bytes) all-gathered by this rank in one step."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fp8dist import load_config
    from fp8dist.engines.collectives import ByteViewAllGather, CommRecord
    from fp8dist.engines.fsdp2 import prepare, train_step
    from fp8dist.models import load_model

    spec = load_config(CONFIGS[name])
    loaded = load_model("tiny-llama", spec.precision.load_dtype)
    run = prepare(loaded.model, spec)
    records = {}
    for fqn, module in run.model.named_modules():
        if isinstance(module, FSDPModule):
            records[fqn] = CommRecord()
            module.set_custom_all_gather(ByteViewAllGather(records[fqn]))
    batch = [loaded.make_batch(2, 64, 0)]
    train_step(run, batch, 1.0)
    for record in records.values():
        record.all_gather.clear()
    train_step(run, batch, 1.0)
    world = torch.distributed.get_world_size()
    total = sum(v[1] for r in records.values() for v in r.all_gather.values())
    linear = 0
    for fqn, record in records.items():
        if not fqn.startswith("model.layers."):
            continue
        module = run.model.get_submodule(fqn)
        norm_numel = sum(p.numel() for n, p in module.named_parameters() if "norm" in n)
        linear += sum(v[1] for v in record.all_gather.values()) - norm_numel * 2 // world
    return total, linear


def worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {name: measure(name) for name in CONFIGS}
    if dist.get_rank() == 0:
        (bf16_total, bf16_linear), (fp8_total, fp8_linear) = results["bf16"], results["float8"]
        print(f"{'all-gather bytes per step per rank':40s}{'bf16':>12s}{'float8':>12s}{'ratio':>8s}")
        print(f"{'linear weights (decoder layers)':40s}{bf16_linear:12d}{fp8_linear:12d}{fp8_linear / bf16_linear:8.3f}")
        print(f"{'whole model':40s}{bf16_total:12d}{fp8_total:12d}{fp8_total / bf16_total:8.3f}")
        print(f"allgather_bytes_ratio_fp8_vs_bf16={fp8_linear / bf16_linear:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("LOCAL_RANK") is None:
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc_per_node", "2", __file__], env=env))
    worker()
