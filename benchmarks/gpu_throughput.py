"""GPU throughput: training tokens/s of bf16 vs torchao float8 (tensorwise + float8 all-gather, rowwise) vs
Transformer Engine, on a Llama-3-shaped model with FSDP2, all GPUs of one node, every case in one run.

    python benchmarks/gpu_throughput.py [--layers 8] [--seq-len 4096] [--micro-batch 1] [--steps 20] [--warmup 5]

Launches itself under torchrun with one process per visible GPU. Needs NVIDIA GPUs with compute capability
>= 8.9 (rowwise: 9.0); elsewhere it refuses with exit 2 and says why. Each case is an fp8dist config run by
`fp8dist.engines.fsdp2.prepare` + `train_step`: bf16 and torchao with torch.compile (torchao's speedups
need it); Transformer Engine (Float8CurrentScaling) without it (TE modules run their own fused kernels).
The model is Llama 3 8B per layer (hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocab 128256) with fewer
layers so that one GPU holds it. Prints tokens/s per GPU, peak memory, and each case's ratio to bf16.

Published numbers to compare with (torchao torchao/float8/README.md, torchtitan docs/float8.md, Axolotl
docs/mixed_precision), on 8xH100 with FSDP2 + compile:
  torchao, Llama 3 8B: tensorwise + float8 all-gather +25% tokens/s over bf16, rowwise +10%;
  torchtitan, Llama 3.1 8B: +28%; 70B with float8 all-gather 1.5x overall;
  Axolotl: ~10% over bf16 for a 3B model with FP8 + float8 all-gather.
Fewer layers and fewer GPUs than those runs mean less all-gather traffic to save: expect the ratios lower.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

TRAIN = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
CASES = {
    "bf16": {"precision": {"preset": "bf16"}, "compile": True},
    "float8 tensorwise + float8 all-gather": {"precision": {"preset": "torchao-float8"}, "compile": True},
    "float8 rowwise": {"precision": {"preset": "torchao-float8-rowwise"}, "compile": True},
    "te Float8CurrentScaling": {"precision": {"load_dtype": "bf16", "mixed_precision": "bf16", "master_weights": "fp32",
                                              "reduce_dtype": "fp32",
                                              "fp8": {"backend": "te", "te": {"recipe": "current"}}},
                                "compile": False},
}
PUBLISHED = {"float8 tensorwise + float8 all-gather": "torchao 8B/8xH100: 1.25",
             "float8 rowwise": "torchao 8B/8xH100: 1.10",
             "te Float8CurrentScaling": "no published figure"}


def gpu_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (this benchmark measures real FP8 GEMMs: H100/H200, SM 8.9+)"
    from fp8dist.facts.torchao import torchao_fp8_hardware
    capability = torch.cuda.get_device_capability(0)
    ok, why = torchao_fp8_hardware("tensorwise", capability)
    if not ok:
        return f"{torch.cuda.get_device_name(0)}: {why}"
    return None


def skip_reason(name: str, capability) -> str | None:
    from fp8dist.facts.torchao import torchao_fp8_hardware
    if name == "float8 rowwise":
        ok, why = torchao_fp8_hardware("rowwise", capability)
        if not ok:
            return why
    if name.startswith("te ") and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    return None


def llama_config(layers: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=seq_len,
                       tie_word_embeddings=False)


def run_case(name: str, args) -> tuple[float, float]:
    """(tokens/s per GPU, peak GiB) of one case; every rank returns the same figures."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fp8dist import load_config
    from fp8dist.engines.fsdp2 import prepare, train_step
    from fp8dist.runtime.models import causal_lm_batch

    # Each case compiles its own blocks: a cache shared with the previous case's Linear types recompiles every
    # block until dynamo's recompile limit (8) and then runs eager (seen on an H100: float8 0.64x, rowwise 0.49x)
    torch._dynamo.reset()
    spec = load_config({**CASES[name], "engine": "fsdp2",
                        "train": {**TRAIN, "micro_batch_size": args.micro_batch, "seq_len": args.seq_len}})
    config = llama_config(args.layers, args.seq_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    run = prepare(model, spec)
    make = causal_lm_batch(config.vocab_size)
    batch = {k: v.cuda() for k, v in make(args.micro_batch, args.seq_len, dist.get_rank()).items()}
    for _ in range(args.warmup):
        train_step(run, [batch], spec.train.gradient_clipping)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(run, [batch], spec.train.gradient_clipping)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    del run, model
    torch.cuda.empty_cache()
    tokens_per_gpu = args.micro_batch * args.seq_len * args.steps / seconds
    figures = torch.tensor([tokens_per_gpu, peak], device="cuda")
    dist.all_reduce(figures, op=dist.ReduceOp.MIN)  # the slowest rank sets the pace
    return float(figures[0]), float(figures[1])


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()  # NCCL, the device of LOCAL_RANK
    capability = torch.cuda.get_device_capability()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{torch.cuda.get_device_name()} x {dist.get_world_size()}, Llama-3-shaped, {args.layers} layers, "
              f"micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.steps} timed steps after {args.warmup}")
        print(f"{'case':40s}{'tokens/s/GPU':>14s}{'peak GiB':>10s}{'vs bf16':>9s}   published", flush=True)
    figures = {}
    for name in CASES:
        reason = skip_reason(name, capability)
        if reason:
            if rank0:
                print(f"{name:40s}  skipped: {reason}", flush=True)
            continue
        figures[name] = run_case(name, args)
        if rank0:
            tokens, peak = figures[name]
            ratio = tokens / figures["bf16"][0]
            print(f"{name:40s}{tokens:14.0f}{peak:10.1f}{ratio:9.3f}   {PUBLISHED.get(name, '')}", flush=True)
            if name != "bf16":
                result(f"gpu_tokens_per_s_{name.split()[0]}_{name.split()[1]}_vs_bf16", ratio, "info",
                       f"{name}; published: {PUBLISHED[name]}")
    leave(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (torch.compile happens here)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; without an FP8 GPU it refuses, exit 2")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.seq_len, args.steps, args.warmup = 1, 512, 2, 1
    if under_torchrun():
        worker(args)
        return 0
    problem = gpu_problem()
    if problem:
        print(f"gpu_throughput.py: refusing: {problem}.\n  fix: run it on an H100/H200 node "
              "(python benchmarks/gpu_throughput.py); the CPU benchmarks are in benchmarks/run.py", file=sys.stderr)
        return 2
    import torch

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return relaunch(os.path.abspath(__file__), torch.cuda.device_count(), sys.argv[1:], env)


if __name__ == "__main__":
    raise SystemExit(main())
