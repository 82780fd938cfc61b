"""Host memory of preparing a model for FSDP2: RAM-efficient loading vs every rank loading the whole model,
and activation bytes with full / selective / no activation checkpointing.

    python benchmarks/loading_memory.py [--sizes 50M 200M] [--ranks 2 4]
    python benchmarks/loading_memory.py --smoke     # a ~0.4M-parameter model on 2 ranks: not a measurement

Loading: Llama-shaped models of ~50M and ~200M parameters are saved in bf16 (safetensors), then prepared
by fp8dist's FSDP2 engine (bf16 preset: fp32 masters) on N gloo ranks, once naively (every rank loads the
whole model, upcasts, shards) and once with `parallel.cpu_ram_efficient_loading` (meta build, shard, each
rank reads its shards). Each rank reports its peak resident memory (VmHWM) counted above the same process
with the libraries imported (transformers' Llama code and accelerate included), the process group up and
no model (the peak is reset there through /proc/self/clear_refs). Goal: rank 1 (a rank that is not rank 0) <= 0.4 of naive at ~200M on 2 ranks.

Activations: bytes kept for backward after one forward of small-llama (micro-batch 2 x 128), each storage
once: what autograd saves plus what selective checkpointing caches. Info, ratios to no checkpointing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ROOT, SMOKE_HELP, quiet_libraries, reset_peak_resident, result, status_kib, torchrun,  # noqa: E402
                     under_torchrun)
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

SIZES = {  # ~parameters -> Llama config overrides (vocab 32000: the embeddings are a real share, as in Llama)
    "smoke": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4),  # --smoke only
    "50M": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=8),
    "200M": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=16),
}


def worker(model_dir: str, mode: str, out: str) -> None:
    """One rank: baseline (libraries imported, process group up), reset the peak, prepare, report the peak."""
    quiet_libraries()
    import torch.distributed as dist

    from fp8dist import load_config
    from fp8dist.engines import fsdp2
    from fp8dist.runtime.loading import load_for_run

    process_group.init()
    # the libraries both paths use, imported before the baseline (transformers loads model code lazily)
    import accelerate.big_modeling  # noqa: F401
    import safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    spec = load_config({"precision": {"preset": "bf16"}, "audit": {"first_step": "off"},
                        "parallel": {"cpu_ram_efficient_loading": mode == "efficient"}})
    dist.barrier()
    baseline = status_kib("VmRSS")
    reset_peak_resident()
    loaded = load_for_run(model_dir, spec)
    run = fsdp2.prepare(loaded.model, spec, materialize=loaded.materialize)
    peak = status_kib("VmHWM")
    params = sum(p.numel() for p in run.model.parameters())
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, {"rank": dist.get_rank(), "peak_above_baseline_kib": peak - baseline,
                                     "params": params})
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(reports, handle)
    leave(0)


def save_model(size: str, directory: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import _llama_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama_config(**SIZES[size]), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def measure(model_dir: str, mode: str, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peaks.json")
        done = torchrun(os.path.abspath(__file__), ["--worker", model_dir, mode, out], nproc=nproc)
        if done.returncode != 0:
            raise SystemExit(f"{mode} on {nproc} ranks: exit {done.returncode}\n{done.stderr[-3000:]}")
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def activation_bytes() -> dict[str, int]:
    """Bytes kept for backward in one forward of small-llama, per checkpointing mode (one process)."""
    from fp8dist import load_config
    import fp8dist.engines.activation_checkpointing as activation_checkpointing
    from fp8dist.engines.blocks import wrap_units
    from fp8dist.engines.base import forward_loss
    from fp8dist.runtime.models import load_model

    out = {}
    for mode in ("none", "full", "selective"):
        loaded = load_model("small-llama", "fp32", seed=0)
        spec = load_config({"parallel": {"activation_checkpointing": mode}})
        activation_checkpointing.apply(loaded.model, wrap_units(loaded.model, spec), mode)
        with activation_checkpointing.kept_for_backward() as kept:
            loss = forward_loss(loaded.model, loaded.make_batch(2, 128, 0))
        out[mode] = kept()
        loss.backward()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["50M", "200M"], choices=list(SIZES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.ranks = ["smoke"], [2]
    if args.worker and under_torchrun():
        worker(*args.worker)
        return 0
    sys.path.insert(0, str(ROOT))
    print(f"{'model':8s}{'ranks':>6s}{'rank':>6s}{'naive MiB':>12s}{'efficient MiB':>15s}{'ratio':>8s}")
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix=f"fp8dist-{size}-") as directory:
            params = save_model(size, directory)
            for nproc in args.ranks:
                naive, efficient = measure(directory, "naive", nproc), measure(directory, "efficient", nproc)
                for a, b in zip(naive, efficient):
                    ratio = b["peak_above_baseline_kib"] / a["peak_above_baseline_kib"]
                    print(f"{size:8s}{nproc:6d}{a['rank']:6d}{a['peak_above_baseline_kib'] / 1024:12.1f}"
                          f"{b['peak_above_baseline_kib'] / 1024:15.1f}{ratio:8.3f}   ({params / 1e6:.0f}M parameters)",
                          flush=True)
                    goal = "<=0.4" if (size, nproc) == ("200M", 2) and a["rank"] == 1 else "info"
                    result(f"loading_peak_efficient_vs_naive_{size}_{nproc}ranks_rank{a['rank']}", ratio, goal,
                           f"VmHWM above baseline, {params / 1e6:.0f}M params, {nproc} ranks, rank {a['rank']}")
    acts = activation_bytes()
    print("activation bytes kept for backward, small-llama, 2 x 128 tokens: " +
          ", ".join(f"{mode} {value / 2**20:.1f} MiB" for mode, value in acts.items()))
    for mode in ("full", "selective"):
        result(f"activation_bytes_{mode}_vs_none", acts[mode] / acts["none"], "info",
               f"{mode} activation checkpointing / none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
