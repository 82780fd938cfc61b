"""FSDP2 expert parallel on 2 gloo ranks: EP 2 against EP 1 on the same ranks, weights and batches.

    python benchmarks/expert_parallel.py [--pairs 8]   # launches itself under torchrun (2 ranks)
    python benchmarks/expert_parallel.py --smoke       # tiny-mixtral, 1 pair: not a measurement

On `small-mixtral` (built in: 4 layers, 8 experts of 256 x 256, top-2), bf16 compute with fp32 masters
(configs/fsdp2-bf16.yaml's precision), micro-batch 4 x 128 tokens:
1. Expert bytes a rank holds while an experts module runs (FSDP2 has gathered them): EP 1 gathers every expert, EP 2
   only its own over efsdp = 1. Goal: = 1/ep (0.5). The sharded bytes at rest are the same in both (info).
2. Bytes on the wire per step (fp8dist.audit.wire, the audit's recorder): the experts' all-gathers and
   reduce-scatters that EP removes against the all-to-alls it adds (info).
3. Step time EP 2 / EP 1, alternating A B / B A, the median of the pair ratios (info: on a 2-core CPU the all-to-all
   and its host-side split sizes weigh more than on GPUs, where torchtitan reports EP's gain), with an A/A row (two
   EP 1 copies): this machine's noise floor.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, median, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

NPROC, MICRO_BATCH, SEQ_LEN = 2, 4, 128
CONFIG = {"engine": "fsdp2", "precision": {"preset": "bf16"}, "audit": {"first_step": "off"},
          "train": {"gradient_clipping": 0, "seq_len": SEQ_LEN, "micro_batch_size": MICRO_BATCH}}


def model_config(size: str):
    from fp8dist.config import models

    return models.small_mixtral_config() if size == "full" else models.tiny_config("mixtral")


def prepared(expert_size: int, size: str):
    from fp8dist import load_config
    from fp8dist.engines.fsdp2 import prepare
    from fp8dist.runtime.models import _from_hf_config

    spec = load_config({**CONFIG, "parallel": {"expert_size": expert_size}})
    return prepare(_from_hf_config(model_config(size), "bf16", seed=0), spec)


def batches(rank: int, step: int):
    from fp8dist.runtime.models import causal_lm_batch

    return [causal_lm_batch(256)(MICRO_BATCH, SEQ_LEN, seed=1000 * step + rank)]


def expert_bytes(run) -> tuple[int, int]:
    """(held at rest, held while an experts module runs) of one experts module, on this rank."""
    from fp8dist.backends.experts import experts_modules
    from fp8dist.engines.fsdp2 import train_step

    def local(module) -> int:
        return sum(getattr(p, "_local_tensor", p).numel() * getattr(p, "_local_tensor", p).element_size()
                   for p in module.parameters())

    import torch.distributed as dist

    module = experts_modules(run.model)[0][1]
    gathered: list[int] = []
    hook = module.register_forward_pre_hook(lambda m, args: gathered.append(local(m)))
    train_step(run, batches(dist.get_rank(), 0))
    hook.remove()
    return local(module), max(gathered)


def wire(run) -> dict[str, int]:
    """Bytes this rank sends in one step (after `expert_bytes`'s), by collective kind."""
    import torch.distributed as dist

    from fp8dist.audit.wire import WireRecorder
    from fp8dist.engines.fsdp2 import train_step

    recorder = WireRecorder(run.inspector().mesh_axes())
    with recorder:
        train_step(run, batches(dist.get_rank(), 1))
    return {kind: sum(entry["bytes"] for entry in by_dtype.values()) for kind, by_dtype in recorder.as_dict().items()}


def timed(run, rank: int, index: int) -> float:
    import torch.distributed as dist

    from fp8dist.engines.fsdp2 import train_step

    dist.barrier()
    start = time.perf_counter()
    train_step(run, batches(rank, index))
    dist.barrier()
    return time.perf_counter() - start


def worker(pairs: int, size: str) -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()
    one, two, other = prepared(1, size), prepared(2, size), prepared(1, size)
    held = {size: expert_bytes(run) for size, run in ((1, one), (2, two))}
    sent = {size: wire(run) for size, run in ((1, one), (2, two))}
    timed(other, dist.get_rank(), 0)
    timed(other, dist.get_rank(), 1)
    ratios, noise = [], []
    for index in range(2, 2 + pairs):
        order = [("one", one), ("two", two), ("other", other)]
        if index % 2:
            order.reverse()
        times = {name: timed(run, dist.get_rank(), index) for name, run in order}
        ratios.append(times["two"] / times["one"])
        noise.append(times["other"] / times["one"])
    if dist.get_rank() != 0:
        leave(0)
    print(f"one experts module on rank 0 (bytes): at rest EP1 {held[1][0]}, EP2 {held[2][0]}; while it runs EP1 "
          f"{held[1][1]}, EP2 {held[2][1]}")
    for size in (1, 2):
        print(f"bytes sent by rank 0 in one step, EP {size}: {sent[size]}")
    result("ep_gathered_expert_bytes_ep2_vs_ep1", held[2][1] / held[1][1], "=0.5",
           "expert bytes held while an experts module runs, EP 2 / EP 1 (goal 1/ep)")
    result("ep_expert_bytes_at_rest_ep2_vs_ep1", held[2][0] / held[1][0], "info",
           "expert bytes held between steps (both shard over all dp_shard ranks)")
    result("ep_all_to_all_bytes_per_step", sent[2].get("all_to_all", 0), "info",
           "bytes rank 0 sends by all-to-all in one EP 2 step (tokens out and back, forward and backward)")
    result("ep_gather_and_reduce_bytes_ep2_vs_ep1",
           (sent[2].get("all_gather", 0) + sent[2].get("reduce_scatter", 0))
           / (sent[1].get("all_gather", 0) + sent[1].get("reduce_scatter", 0)), "info",
           "FSDP all-gather + reduce-scatter bytes, EP 2 / EP 1 (EP keeps the experts off them)")
    result("ep_step_time_ep2_vs_ep1", median(ratios), "info", "step time EP 2 / EP 1 on the same 2 ranks")
    result("ep_step_time_noise_floor", median(noise), "info", "two EP 1 copies: this machine's noise")
    leave(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="timed pairs (default 8)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.pairs = 1
    if not under_torchrun():
        argv = ["--pairs", str(args.pairs), *(["--smoke"] if args.smoke else [])]
        raise SystemExit(relaunch(os.path.abspath(__file__), nproc=NPROC, args=argv))
    worker(args.pairs, "smoke" if args.smoke else "full")
