"""Integration overhead: step time of a model prepared by fp8dist vs the same model prepared by hand.

    python benchmarks/overhead.py [--pairs 20] [--rounds 4]   # launches itself under torchrun (2 gloo ranks)
    python benchmarks/overhead.py --smoke                     # every figure once, on tiny-llama: not a measurement

For each case two copies of small-llama (same seed) live in the same two processes: one prepared with
fp8dist (`engines.fsdp2.prepare` + `train_step`, or `engines.deepspeed.initialize` + `train_step`), one
prepared by hand the way the torchao README, torchtitan and the DeepSpeed docs show it, with the identical
policy (checked below: same Float8LinearConfig, same DeepSpeed JSON, same losses step by step). Timed steps
alternate A B, B A, ... so that drift hits both alike; the ratio is the median over pairs of
fp8dist / hand (robust to a slow step on the shared 2-core machine).
Goal: <= 1.01 (fp8dist adds hooks and a context manager, nothing per GEMM). A last row compares two
hand-prepared models (A/A): how far from 1.0 this machine's noise alone puts a ratio.
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

MICRO_BATCH, SEQ_LEN = 2, 128
FSDP2_CASES = {"fsdp2 bf16": "configs/fsdp2-bf16.yaml", "fsdp2 torchao float8": "configs/fsdp2-torchao-float8.yaml"}
DEEPSPEED_CASES = {"deepspeed zero2 bf16": "configs/deepspeed-bf16-zero2.yaml",
                   "deepspeed zero2 torchao float8": "configs/deepspeed-torchao-float8.yaml"}
# What a DeepSpeed user writes by hand for both DeepSpeed cases (the float8 conversion is separate).
HAND_DEEPSPEED_CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                         "gradient_clipping": 1.0, "steps_per_print": 100, "bf16": {"enabled": True},
                         "communication_data_type": "fp32", "zero_optimization": {"stage": 2}}


def hand_float8_config():
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                               enable_fsdp_float8_all_gather=True)


def hand_adamw(params, spec):
    import torch

    o = spec.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def hand_fsdp2(model, spec, float8: bool):
    """FSDP2 by hand: upcast, convert, fully_shard per decoder layer then the root, AdamW, precompute hook."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model.float()
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=hand_float8_config(), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if float8:  # gloo cannot send float8 dtypes; on NCCL this block is not needed
        from fp8dist.engines.fsdp2.collectives import ByteViewAllGather

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ByteViewAllGather(None))
    optimizer = hand_adamw(model.parameters(), spec)
    if float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def fp8dist_fsdp2(model, spec):
    from fp8dist.engines.fsdp2 import prepare, train_step

    run = prepare(model, spec)
    return run, (lambda batch: train_step(run, [batch], spec.train.gradient_clipping))


def hand_deepspeed(model, spec, float8: bool):
    import deepspeed

    if float8:
        from torchao.float8 import convert_to_float8_training

        config = dataclasses.replace(hand_float8_config(), enable_fsdp_float8_all_gather=False)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    engine, *_ = deepspeed.initialize(model=model, optimizer=hand_adamw(model.parameters(), spec),
                                      config=HAND_DEEPSPEED_CONFIG)

    def step(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def fp8dist_deepspeed(model, spec):
    from fp8dist.engines.deepspeed import initialize, train_step

    engine, *_ = initialize(model, spec)
    if engine.fp8dist_run.config != HAND_DEEPSPEED_CONFIG:
        raise SystemExit(f"not a like-for-like comparison: fp8dist wrote {engine.fp8dist_run.config}")
    return engine, (lambda batch: train_step(engine, [batch]))


def timed(step, batch) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step(batch)
    return time.perf_counter() - start, loss


def prepared_pair(model_name: str, spec, hand_first: bool, control: bool):
    """Two identical models, one prepared by fp8dist, one by hand; returns their step functions and a batch.
    `control`: prepare both by hand (the A/A noise floor of this machine)."""
    from fp8dist.runtime.models import load_model

    float8 = spec.fp8.backend == "torchao"
    steps = {}
    for who in (("hand", "fp8dist") if hand_first else ("fp8dist", "hand")):
        loaded = load_model(model_name, spec.precision.load_dtype, seed=0)
        if who == "hand" or control:
            steps[who] = (hand_fsdp2 if spec.engine == "fsdp2" else hand_deepspeed)(loaded.model, spec, float8)
        elif spec.engine == "fsdp2":
            run, steps[who] = fp8dist_fsdp2(loaded.model, spec)
            if float8 and run.backend.float8_linear_config() != hand_float8_config():
                raise SystemExit("not a like-for-like comparison: the Float8LinearConfigs differ")
        else:
            _, steps[who] = fp8dist_deepspeed(loaded.model, spec)
    return steps, loaded.make_batch


def compare(name: str, config: str, args, control: bool = False) -> float:
    """Median over all timed pairs of (fp8dist step time / hand step time), over `rounds` fresh pairs of
    models. Rounds alternate which model is built first: on the 2-core machine the build order alone
    moved an A/A comparison by up to 4%."""
    import torch.distributed as dist

    from fp8dist import load_config

    spec = load_config(config)
    pair_ratios, times, loss_gap = [], {"fp8dist": [], "hand": []}, 0.0
    for round_index in range(args.rounds):
        steps, make_batch = prepared_pair(args.model, spec, round_index % 2 == 1, control)
        batch = make_batch(MICRO_BATCH, SEQ_LEN, dist.get_rank())
        for i in range(args.warmup + args.pairs):
            order = ("fp8dist", "hand") if i % 2 == 0 else ("hand", "fp8dist")
            seconds, losses = {}, {}
            for who in order:
                seconds[who], losses[who] = timed(steps[who], batch)
            loss_gap = max(loss_gap, abs(losses["fp8dist"] - losses["hand"]))
            if i >= args.warmup:
                pair_ratios.append(seconds["fp8dist"] / seconds["hand"])
                for who in seconds:
                    times[who].append(seconds[who])
    ratio = median(pair_ratios)
    if dist.get_rank() == 0:
        print(f"{name:32s}{median(times['hand']) * 1e3:10.1f}{median(times['fp8dist']) * 1e3:10.1f}"
              f"{ratio:8.3f}{loss_gap:12.2e}", flush=True)
    return ratio


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="timed step pairs per round")
    parser.add_argument("--rounds", type=int, default=4, help="fresh pairs of models (build order alternates)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed step pairs first, per round")
    parser.add_argument("--model", default="small-llama", help="built-in model")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.rounds, args.warmup, args.model = 1, 1, 1, "tiny-llama"
    return args


def worker(args) -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()
    if dist.get_rank() == 0:
        print(f"{args.model}, micro-batch {MICRO_BATCH} x {SEQ_LEN} tokens, 2 gloo ranks, {args.rounds} rounds x "
              f"{args.pairs} interleaved step pairs")
        print(f"{'case':32s}{'hand ms':>10s}{'ours ms':>10s}{'ratio':>8s}{'loss diff':>12s}", flush=True)
    ratios = {name: compare(name, config, args) for name, config in {**FSDP2_CASES, **DEEPSPEED_CASES}.items()}
    noise = compare("A/A control: hand vs hand", FSDP2_CASES["fsdp2 bf16"], args, control=True)
    if dist.get_rank() == 0:
        for name, ratio in ratios.items():
            result("overhead_" + name.replace(" ", "_"), ratio, "<=1.01", "median step time fp8dist / by hand")
        result("overhead_noise_floor_hand_vs_hand", noise, "info", "A/A: two hand-prepared models")
    leave(0)


if __name__ == "__main__":
    arguments = parse_args()
    if not under_torchrun():
        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        raise SystemExit(relaunch(os.path.abspath(__file__), args=sys.argv[1:]))
    worker(arguments)
