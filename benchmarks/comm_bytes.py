"""FSDP2 all-gather bytes: bf16 all-gather vs torchao float8 all-gather, tiny-llama on 2 gloo ranks.

    python benchmarks/comm_bytes.py          # launches itself under torchrun --nproc_per_node 2
    python benchmarks/comm_bytes.py --smoke  # the same (it is its smallest size: bytes, not times)

Per rank:
- linear weights: what FSDP2 all-gathers for each decoder-layer Linear weight, read from its per-parameter
  all-gather inputs (`FSDPParam.all_gather_inputs`, torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param.py;
  for float8 weights torchao's fsdp_pre_all_gather returns the float8 shard). Goal <= 0.5: 1 byte vs 2.
- on the wire: the flat buffers fp8dist's custom all-gather sent in one training step, forward and the
  backward re-gather (reshard_after_forward), decoder layers minus their RMSNorm vectors (bf16 in both
  runs). Slightly above 0.5: where float8 weights and bf16 norm vectors share
  one flat buffer it is uint8, and FSDP2 pads each parameter's bytes in it (info).
- whole model: embeddings, norms and the excluded lm_head stay bf16 (info).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

CONFIGS = {"bf16": {"precision": {"preset": "bf16"}},
           "float8": {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}}}


def measure(name: str) -> dict[str, int]:
    """Bytes all-gathered by this rank in one step: whole model, linear weights on the wire, linear weights'
    per-parameter all-gather inputs."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fp8dist import load_config
    from fp8dist.engines.fsdp2.collectives import ByteViewAllGather, CommRecord
    from fp8dist.engines.fsdp2 import prepare, train_step
    from fp8dist.runtime.models import load_model

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
    wire, inputs = 0, 0
    for fqn, record in records.items():
        if not fqn.startswith("model.layers."):
            continue
        module = run.model.get_submodule(fqn)
        norm_numel = sum(p.numel() for n, p in module.named_parameters() if "norm" in n)
        wire += sum(v[1] for v in record.all_gather.values()) - norm_numel * 2 // world
        for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
            info = fsdp_param._module_info
            if isinstance(info.module, torch.nn.Linear) and info.param_name == "weight":
                inputs += sum(t.numel() * t.element_size() for t in fsdp_param.all_gather_inputs)
    return {"total": total, "wire": wire, "inputs": inputs}


def worker() -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()
    results = {name: measure(name) for name in CONFIGS}
    if dist.get_rank() == 0:
        bf16, fp8 = results["bf16"], results["float8"]
        rows = {"inputs": "linear weights, inputs of one gather", "wire": "linear weights, flat buffers per step",
                "total": "whole model, flat buffers per step"}
        print(f"{'all-gather bytes per rank':40s}{'bf16':>12s}{'float8':>12s}{'ratio':>8s}")
        for key, label in rows.items():
            print(f"{label:40s}{bf16[key]:12d}{fp8[key]:12d}{fp8[key] / bf16[key]:8.3f}")
        result("allgather_bytes_fp8_vs_bf16_linear_weights", fp8["inputs"] / bf16["inputs"], "<=0.5",
               "FSDP2 float8 / bf16 all-gather, decoder Linear weights")
        result("allgather_bytes_fp8_vs_bf16_linear_on_the_wire", fp8["wire"] / bf16["wire"], "info",
               "same, flat buffers incl. FSDP2 copy-in padding")
        result("allgather_bytes_fp8_vs_bf16_whole_model", fp8["total"] / bf16["total"], "info",
               "embeddings, norms and the excluded lm_head stay bf16")
    leave(0)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the same run: its smallest size)")
    parser.parse_args()
    if not under_torchrun():
        raise SystemExit(relaunch(os.path.abspath(__file__), args=sys.argv[1:]))
    worker()
