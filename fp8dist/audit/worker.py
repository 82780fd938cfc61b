"""The audit's measuring process, one per rank (launched by fp8dist.audit.run under torchrun): a thin driver
over `fp8dist.audit.watch`. It loads the model, prepares it with fp8dist's engine and runs step 1 inside the
watch, then the remaining steps; rank 0 writes the watch's report.

    python -m torch.distributed.run --nproc_per_node N -m fp8dist.audit.worker MODEL CONFIG STEPS OUT.json
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fp8dist.audit import probes
from fp8dist.audit.watching import watch
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.config.vocabulary import check_world_size
from fp8dist.engines.loading import load_for_run
from fp8dist.ranks import finish


def prepared(spec, loaded):
    """(model the loop calls, optimizer, one optimizer step over batches) from fp8dist's engine for `spec`.
    The engine's own first-step audit is off: the watch here is the audit."""
    if spec.engine == "deepspeed":
        from fp8dist.engines import deepspeed

        optimizer = loaded.make_optimizer(loaded.model.parameters()) if loaded.make_optimizer else None
        engine, _, _, _ = deepspeed.initialize(loaded.model, spec, optimizer=optimizer, audit="off")
        return engine, engine.optimizer, lambda batches: deepspeed.train_step(engine, batches)
    from fp8dist.engines import fsdp2

    run = fsdp2.prepare(loaded.model, spec, optimizer=loaded.make_optimizer, audit="off",
                        materialize=loaded.materialize)
    return run.model, run.optimizer, lambda batches: fsdp2.train_step(run, batches, spec.train.gradient_clipping)


def observe(spec, loaded, steps: int) -> dict[str, Any]:
    """The audit report of step 1 of `loaded` under `spec`, after `steps` real steps (process group up)."""
    value, counts = probes.summarize(probes.trainable(loaded.model))
    loading = {"observed": value, "detail": f"parameters after loading: {counts}", "measured": True}
    if loaded.materialize is not None:  # built on meta in the master dtype; the files are read after sharding
        value, counts = probes.summarize_counts(loaded.materialize.file_formats())
        loading = {"observed": value, "detail": f"RAM-efficient loading: read shard by shard from the safetensors "
                   f"files, which hold {counts}", "measured": True}
    model, optimizer, step = prepared(spec, loaded)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = loaded.make_batch(spec.train.micro_batch_size, spec.train.seq_len, seed=dist.get_rank())
    batches = [{k: v.to(device) for k, v in batch.items()}]
    with watch(model, optimizer, spec, on_mismatch="ignore", name=loaded.name, loading=loading) as audit:
        step(batches)
    for _ in range(max(steps - 1, 0)):
        step(batches)
    return audit.report


def main(model_name: str, config: str, steps: int, out_path: str) -> int:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        spec = load_config(config or None)
        check_world_size(spec, dist.get_world_size())
        loaded = load_for_run(model_name, spec)
        if cuda and loaded.materialize is None:  # a meta-built model is allocated on the device by prepare
            loaded.model.to("cuda")
        out = observe(spec, loaded, steps)
    except Fp8distError as exc:
        out = {"_error": str(exc)}
    return finish(out, out_path)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
