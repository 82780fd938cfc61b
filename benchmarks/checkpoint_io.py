"""Checkpoint save / load time and size per parameter, and the Hugging Face export: fp32 vs bf16.

    python benchmarks/checkpoint_io.py [--size 50M] [--repeats 3]
    python benchmarks/checkpoint_io.py --smoke      # a ~0.4M-parameter model, once: not a measurement

A Llama-shaped model (~58M parameters at 50M) trains one step under the bf16 preset (fp32 masters, fp32
AdamW states) on 2 gloo ranks, with FSDP2 and with DeepSpeed ZeRO-2; then fp8dist.engines.checkpoint saves
it `--repeats` times (median seconds, bytes on disk per parameter) and resumes from it as many times; rank 0
then exports the newest checkpoint to Hugging Face format in fp32 and in bf16 (fp8dist.runtime.export). Goal: the
bf16 export takes half the bytes of the fp32 one (the "fp32 checkpoints from bf16 training" pain,
instructlab#477); the resumable checkpoint (masters + Adam moments, ~12 bytes per parameter) is info.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, median, quiet_libraries, result, torchrun, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402
from fp8dist.runtime.ranks import emit, results  # noqa: E402
from loading_memory import SIZES  # noqa: E402


def _bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def worker(size: str, repeats: int, root: str) -> None:
    quiet_libraries()
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fp8dist import load_config
    from fp8dist.runtime.data import batches_for
    import fp8dist.engines.checkpoint as checkpoint
    from fp8dist.runtime.models import causal_lm_batch
    from fp8dist.config.models import _llama_config

    process_group.init(deepspeed=True)  # gloo on the CPU accelerator; serves FSDP2 too
    rank = dist.get_rank()
    figures = {}
    for engine in ("fsdp2", "deepspeed"):
        spec = load_config({"engine": engine, "precision": {"preset": "bf16"}, "audit": {"first_step": "off"},
                            "checkpoint": {"keep_last": repeats}, "deepspeed": {"zero_stage": 2},
                            "train": {"micro_batch_size": 1, "seq_len": 32}})
        torch.manual_seed(0)
        config = _llama_config(**SIZES[size])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        if engine == "fsdp2":
            from fp8dist.engines.fsdp2 import prepare, train_step

            target = prepare(model, spec)
            train_step(target, batches_for(causal_lm_batch(config.vocab_size), spec, 0, rank), 1.0)
        else:
            from fp8dist.engines.deepspeed import initialize, train_step

            target = initialize(model, spec)[0]
            train_step(target, batches_for(causal_lm_batch(config.vocab_size), spec, 0, rank))
        directory = os.path.join(root, engine)
        saves, loads = [], []
        for step in range(1, repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            checkpoint.save(target, directory, step, spec=spec)
            saves.append(time.perf_counter() - started)
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            checkpoint.resume(target, directory)
            loads.append(time.perf_counter() - started)
        if rank == 0:
            from fp8dist.runtime.export import export_hf

            newest = checkpoint.find_latest(directory)
            exports = {}
            for dtype in ("fp32", "bf16"):
                started = time.perf_counter()
                done = export_hf(newest, os.path.join(root, f"{engine}-{dtype}"), dtype)
                exports[dtype] = (done.bytes, time.perf_counter() - started)
            figures[engine] = {"params": params, "save_s": median(saves), "load_s": median(loads),
                               "checkpoint_bytes": _bytes(newest), "exports": exports}
        dist.barrier()
    if rank == 0:
        emit("figures", "checkpoint_io", figures)
    leave(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="50M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", nargs=2, metavar=("SIZE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeats = 1 if args.quick or args.smoke else args.repeats
    if args.smoke:
        args.size = "smoke"
    if under_torchrun():
        worker(args.worker[0], repeats, args.worker[1])
        return 0
    with tempfile.TemporaryDirectory() as root:
        out = torchrun(os.path.abspath(__file__), ["--repeats", str(repeats), "--worker", args.size, root])
    lines = results(out.stdout, "figures")
    if out.returncode != 0 or not lines:
        print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
        return 2
    figures = lines[0][1]
    for engine, f in figures.items():
        params = f["params"]
        (fp32_bytes, fp32_s), (bf16_bytes, bf16_s) = f["exports"]["fp32"], f["exports"]["bf16"]
        print(f"{engine}: {params / 1e6:.1f}M params; checkpoint {f['checkpoint_bytes'] / params:.2f} B/param, "
              f"save {f['save_s']:.2f} s ({f['save_s'] / params * 1e9:.1f} ns/param), load {f['load_s']:.2f} s; "
              f"export fp32 {fp32_bytes / params:.2f} B/param in {fp32_s:.2f} s, bf16 {bf16_bytes / params:.2f} "
              f"B/param in {bf16_s:.2f} s")
        result(f"checkpoint_{engine}_bytes_per_param", f["checkpoint_bytes"] / params, "info",
               "masters + Adam moments + per-rank state")
        result(f"checkpoint_{engine}_save_s", f["save_s"], "info", f"{params / 1e6:.0f}M params, 2 ranks")
        result(f"checkpoint_{engine}_load_s", f["load_s"], "info")
        result(f"export_{engine}_bf16_over_fp32_bytes", bf16_bytes / fp32_bytes, "<=0.51")
    return 0


if __name__ == "__main__":
    sys.exit(main())
