"""The audit's measuring process, one per rank (launched by `fp8dist audit` under torchrun): a thin driver over
`fp8dist.audit.watch` and the run loop (fp8dist.runtime.loop). A command's rank side: the audit observes a run and
the runtime runs it, so the one that drives both sits above them. It loads the model, prepares it with fp8dist's
engine and runs step 1 inside the watch, then the remaining steps; rank 0 writes the watch's report.

    python -m torch.distributed.run --nproc_per_node N -m fp8dist.commands.audit_worker
        MODEL CONFIG STEPS OVERRIDES NUMERICS OUT.json

NUMERICS: `numerics` to watch with numerics=True (fp8dist.audit.numerics), empty otherwise.
"""
from __future__ import annotations

import sys
from typing import Any, cast

import fp8dist.audit.probes as probes
from fp8dist.audit.watching import watch
from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Fp8distError
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.ranks import finish


NUMERICS = "numerics"  # the NUMERICS argument that turns the numerics check on


def loading_cell(loaded) -> dict[str, Any]:
    """The `loading` phase, as the parameters came out of loading (or the files a meta-built model reads)."""
    if loaded.materialize is not None:  # built on meta in the master dtype; the files are read after sharding
        value, counts = probes.summarize_counts(loaded.materialize.file_formats())
        return {"observed": value, "detail": f"RAM-efficient loading: read shard by shard from the safetensors "
                f"files, which hold {counts}", "measured": True}
    frozen = [p for p in loaded.model.parameters() if not p.requires_grad]
    if frozen:  # adapter runs: the adapters are made, not loaded
        from fp8dist.backends.nf4 import is_nf4
        from fp8dist.backends.storage import short

        # an NF4 base read tensor by tensor (fp8dist.runtime.loading.load_nf4_base) holds weights read in the load
        # dtype and quantized as they were read: the dtype they were read in (an NF4Tensor's own) is loading's;
        # what they hold, the frozen_weights row's
        read_as: dict[str, int] = {}
        for param in frozen:
            fmt = short(param.dtype) if is_nf4(param) else probes.storage(param).format
            read_as[fmt] = read_as.get(fmt, 0) + param.numel()
        value, counts = probes.summarize_counts(read_as)
        quantized = sum(param.numel() for param in frozen if is_nf4(param))
        read = f"; {quantized} values quantized to NF4 as they were read" if quantized else ""
        return {"observed": value, "detail": f"the frozen base after loading (the adapters are new): {counts}{read}",
                "measured": True}
    value, counts = probes.summarize(probes.trainable(loaded.model))
    return {"observed": value, "detail": f"parameters after loading: {counts}", "measured": True}


def observe(spec, loaded, steps: int, numerics: bool = False, dims: ParallelDims | None = None) -> dict[str, Any]:
    """The audit report of step 1 of `loaded` under `spec`, after `steps` real steps (process group up). The
    engine's own first-step audit is off: the watch here is the audit. `dims`: the run's layout (default: `spec`'s
    on this world)."""
    loading = loading_cell(loaded)
    session = loop.start(spec, loaded, audit="off", dims=dims)
    engine, spec = session.engine, session.spec  # policy auto: the spec with the calibrated overrides
    with watch(engine.model, engine.optimizer, spec, on_mismatch="ignore", name=loaded.name, loading=loading,
               numerics=numerics) as audit:
        session.step(0)
    for index in range(1, steps):
        session.step(index)
    report = cast(dict[str, Any], audit.report)  # the block ended without an error: its __exit__ built the report
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is not None:
        report["pipeline"] = pipeline_bubble(pipeline)
    return report


def pipeline_bubble(pipeline) -> dict[str, Any]:
    """The bubble of a pipeline run, measured beside the schedule's theory: each rank's idle fraction (time waiting
    for a neighbour stage over the schedule's time; the median over the steps after the audited one, which ran
    under the watch's dispatch modes, or that one alone)."""
    import statistics

    import torch.distributed as dist

    plan = pipeline.plan
    steps = pipeline.idle[1:] or pipeline.idle
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, statistics.median(steps) if steps else None)
    return {"schedule": plan.schedule, "stages": plan.stages, "microbatches": plan.microbatches,
            "bubble_theory": round(plan.bubble_theory, 4),
            "bubble_measured_by_rank": {rank: None if idle is None else round(idle, 4)
                                        for rank, idle in enumerate(everyone)}}


def main(model_name: str, config: str, steps: int, overrides: list[str], out_path: str,
         numerics: bool = False) -> dict[str, Any]:
    try:
        spec = load_config(config or None, overrides=overrides)
        process_group.init(spec.train.process_group_timeout_s, deepspeed=profile_for(spec).deepspeed_process_group)
        dims = ParallelDims.of(spec, process_group.world_size())  # this rank's layout, built once
        return observe(spec, load_for_run(model_name, spec, dims=dims), steps, numerics, dims)
    except Fp8distError as exc:
        return {"_error": str(exc)}


if __name__ == "__main__":
    model, config, steps, overrides, numerics, out = sys.argv[1:7]
    finish(main(model, config, int(steps), [o for o in overrides.split("\n") if o], out, numerics == NUMERICS), out)
