"""FSDP2 x tensor parallel on 4 gloo ranks (dp_shard 2 x tp 2): what crosses the tp axis, and fp8dist's step time
against the same mesh built by hand.

    python benchmarks/tensor_parallel.py [--layers 8] [--pairs 12]   # launches itself under torchrun (4 ranks)
    python benchmarks/tensor_parallel.py --smoke                     # 2 layers, 2 pairs: not a measurement

1. Bytes on the tp axis per step (fp8dist.audit.wire, the audit's recorder, attributed by process group): the
   activation all-gathers of sequence parallel, float8 tensorwise vs bf16. torchao's float8 styles gather each block's
   attention / MLP input in float8 (forward, e4m3) and the row-wise Linears' output gradients in float8 (backward,
   e5m2): 1 byte where bf16 moves 2, so the physical limit is 0.5 (goal <= 0.55). Per block: the difference between
   a model of 2 x --layers and one of --layers layers, so the LM head's gathers (its input and the logits, bf16 in
   both: the head is not converted) drop out. The whole model's ratio (info) nears the per-block one as layers are
   added. The reductions on the tp axis (row-wise outputs, column-wise input gradients) stay in bf16 in both.
2. Step time, fp8dist (`engines.fsdp2.prepare` + `train_step`) over the same Llama prepared by hand (torchao's
   convert_to_float8_training, parallelize_module with torchao's float8 styles, fully_shard on the data axis) with
   the identical policy, alternating A B / B A; the median of the pair ratios. Goal <= 1.02. A last row times two
   hand-built copies (A/A): the noise floor of this machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, median, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

NPROC, TP, MICRO_BATCH, SEQ_LEN = 4, 2, 2, 128
FLOAT8 = {"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}},
          "parallel": {"tensor_size": TP}, "train": {"gradient_clipping": 0, "seq_len": SEQ_LEN,
                                                     "micro_batch_size": MICRO_BATCH},
          "audit": {"first_step": "off"}}
BF16 = {**FLOAT8, "precision": {"preset": "bf16"}}


def llama(layers: int):
    from fp8dist.runtime.models import _from_hf_config
    from fp8dist.config.models import _llama_config

    return _from_hf_config(_llama_config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                         num_attention_heads=8, num_key_value_heads=4), "bf16", seed=0)


def batches(rank: int, step: int):
    from fp8dist.runtime.models import causal_lm_batch

    return [causal_lm_batch(256)(MICRO_BATCH, SEQ_LEN, seed=1000 * step + rank // TP)]


def fp8dist_run(config: dict, layers: int):
    from fp8dist import load_config
    from fp8dist.engines.fsdp2 import prepare

    return prepare(llama(layers), load_config(config))


def tp_axis_bytes(config: dict, layers: int) -> dict[str, dict[str, int]]:
    """{kind: {dtype: bytes}} on the tp axis in the second step (the first builds the float8 scales)."""
    import torch.distributed as dist

    from fp8dist.audit.wire import WireRecorder
    from fp8dist.engines.fsdp2 import train_step

    run = fp8dist_run(config, layers)
    train_step(run, batches(dist.get_rank(), 0))
    recorder = WireRecorder(run.inspector().mesh_axes())
    with recorder:
        train_step(run, batches(dist.get_rank(), 1))
    return {kind: {dtype: entry["bytes"] for dtype, entry in by_dtype.items()}
            for kind, by_dtype in recorder.by_axis().get("tp", {}).items()}


def hand_built(layers: int):
    """What a torchao / torchtitan user writes for the same run: convert, parallelize with torchao's float8 styles
    (sequence parallel as fp8dist applies it), fully_shard on dp_shard, AdamW with the config's settings."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    from fp8dist import load_config
    from fp8dist.engines.fsdp2.collectives import ByteViewAllGather, carry_float8_tensor_parallel_over_gloo

    spec = load_config(FLOAT8)
    model = llama(layers).float()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                                 enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "lm_head")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    carry_float8_tensor_parallel_over_gloo()  # gloo has no float8 dtype (NCCL needs nothing here)
    for index, layer in enumerate(model.model.layers):
        parallelize_module(layer, mesh["tp"], {
            "": PrepareModuleInput(input_layouts=(Replicate() if index == 0 else Shard(1),),
                                   desired_input_layouts=(Shard(1),), use_local_output=True),
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareFloat8ModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                  desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"self_attn.{n}_proj": Float8ColwiseParallel() for n in "qkv"},
            "self_attn.o_proj": Float8RowwiseParallel(output_layouts=Shard(1)),
            "mlp.gate_proj": Float8ColwiseParallel(), "mlp.up_proj": Float8ColwiseParallel(),
            "mlp.down_proj": Float8RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=policy)
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(ByteViewAllGather())
    o = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay)
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))

    def step(batch_list):
        loss = model(**batch_list[0]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().float().item()

    return step


def timed(step, rank: int, index: int) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = step(batches(rank, index))
    dist.barrier()
    return time.perf_counter() - start, loss


def step_time_ratios(layers: int, pairs: int) -> tuple[float, float, list[float], list[float]]:
    """Median of fp8dist / hand and of hand / hand over `pairs` alternating pairs; the first 3 losses of each."""
    import torch.distributed as dist

    from fp8dist.engines.fsdp2 import train_step

    run = fp8dist_run(FLOAT8, layers)
    ours = lambda batch_list: train_step(run, batch_list)  # noqa: E731
    hand, other_hand = hand_built(layers), hand_built(layers)
    rank = dist.get_rank()
    losses_ours, losses_hand, ratios, noise = [], [], [], []
    for index in range(2):  # warm-up: scales, allocator
        losses_ours.append(timed(ours, rank, index)[1])
        losses_hand.append(timed(hand, rank, index)[1])
        timed(other_hand, rank, index)
    for index in range(2, 2 + pairs):
        order = [("ours", ours), ("hand", hand), ("other", other_hand)]
        if index % 2:
            order.reverse()
        times = {}
        for name, step in order:
            times[name], loss = timed(step, rank, index)
            if name == "ours" and len(losses_ours) < 3:
                losses_ours.append(loss)
            if name == "hand" and len(losses_hand) < 3:
                losses_hand.append(loss)
        ratios.append(times["ours"] / times["hand"])
        noise.append(times["other"] / times["hand"])
    return median(ratios), median(noise), losses_ours, losses_hand


def worker(layers: int, pairs: int) -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()
    measured = {(name, depth): tp_axis_bytes(config, depth) for name, config in (("fp8", FLOAT8), ("bf16", BF16))
                for depth in (layers, 2 * layers)}
    ratio, noise, ours, hand = step_time_ratios(layers, pairs)
    if dist.get_rank() != 0:
        leave(0)

    def gathered(name: str, depth: int) -> int:
        return sum(measured[(name, depth)].get("all_gather", {}).values())

    def total(name: str) -> int:
        return sum(v for by_dtype in measured[(name, layers)].values() for v in by_dtype.values())

    per_block = {name: (gathered(name, 2 * layers) - gathered(name, layers)) / layers for name in ("fp8", "bf16")}
    print(f"tp axis, bytes per rank per step ({NPROC} ranks = dp_shard 2 x tp 2):")
    for (name, depth), by_kind in measured.items():
        print(f"  {name:5s} {depth:3d} layers  {by_kind}")
    print(f"activation all-gathers per block: float8 {per_block['fp8']:.0f}, bf16 {per_block['bf16']:.0f} bytes")
    print(f"losses, first 3 steps: fp8dist {[round(x, 5) for x in ours]}, by hand {[round(x, 5) for x in hand]}")
    result("tp_allgather_bytes_fp8_vs_bf16_per_block", per_block["fp8"] / per_block["bf16"], "<=0.55",
           "activation all-gathers on the tp axis per decoder block, float8 tensorwise / bf16")
    result("tp_allgather_bytes_fp8_vs_bf16_whole_model", gathered("fp8", layers) / gathered("bf16", layers), "info",
           f"all-gathers on the tp axis, {layers} layers (the LM head's input and logits stay bf16)")
    result("tp_axis_bytes_fp8_vs_bf16", total("fp8") / total("bf16"), "info",
           f"everything on the tp axis, {layers} layers (the reductions stay bf16)")
    result("tp_step_time_fp8dist_vs_hand", ratio, "<=1.02", "FSDP2 x TP float8 step, fp8dist / by hand")
    result("tp_step_time_noise_floor_hand_vs_hand", noise, "info", "two hand-built copies: this machine's noise")
    leave(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the Llama (default 8)")
    parser.add_argument("--pairs", type=int, default=12, help="timed pairs (default 12)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.pairs = 1, 2
    if not under_torchrun():
        argv = ["--layers", str(args.layers), "--pairs", str(args.pairs)]
        raise SystemExit(relaunch(os.path.abspath(__file__), nproc=NPROC, args=argv))
    worker(args.layers, args.pairs)
