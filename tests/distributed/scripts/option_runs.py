"""Run option-matrix cases for real, one after the other in one 2-rank job (one launch, one process group):

    torchrun --nproc_per_node 2 tests/distributed/scripts/option_runs.py [CASE_ID ...]

Each case builds its model (tiny-llama unless it names another) fresh, prepares it with fp8dist's engine (FSDP2 or DeepSpeed) and trains
`train.steps` steps through the library's train steps. Rank 0 prints one line per case:
a `case` result line per case (fp8dist.runtime.ranks.emit; any rank whose case failed prints `{"error": ...}` too), the facts that tests/distributed/test_option_runs.py checks.
"""
from __future__ import annotations

import gc
import json
import math
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from fp8dist.runtime import process_group
from fp8dist.runtime.ranks import emit
from fp8dist.runtime.process_group import leave

import fp8dist.audit.probes as probes
from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.runtime.data import batches_for
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.preflight import preflight
from fp8dist.runtime.models import load_model
from tests.option_matrix import RUN_BASE, RUNS, merge

CASE_TIMEOUT = timedelta(seconds=180)  # a rank stuck in a collective fails the job instead of hanging


def float8_linears(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


def mx_linears(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ == "MXFP8Linear")


def _checksum(model) -> float:
    return float(sum(p.detach().float().sum() for p in probes.trainable(model)
                     for p in [p.to_local() if hasattr(p, "to_local") else p]))


def count_reduce_scatters(model) -> list[int]:
    """FSDP2's reduce-scatters, counted in its collective hook (a dispatch mode would stop torch.compile)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    count = [0]

    class Counting(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            count[0] += 1
            return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(Counting())
    return count


def data_rank(spec) -> int:
    """This rank's data-parallel index: tensor-parallel peers read the same batch (DeepSpeed AutoTP asserts it)."""
    return ParallelDims.of(spec, dist.get_world_size()).data_rank(dist.get_rank())


def run_fsdp2(case, spec, loaded) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from fp8dist.engines.fsdp2 import accumulate_gradients, apply_gradients, prepare

    run = prepare(loaded.model, spec, materialize=loaded.materialize)
    embeddings = run.model.model.embed_tokens  # None on a pipeline rank without the first stage
    loaded_from_files = embeddings is not None and matches_saved(loaded, embeddings.weight.full_tensor())
    reduce_scatters = count_reduce_scatters(run.model)
    losses, skipped, scales = [], [], []
    for step in range(spec.train.steps):
        # Step 1 under the config's first-step audit, as the engine's train_step runs it (this loop injects
        # faults between the halves of a step, so it calls them itself).
        with run.first_step():
            loss = accumulate_gradients(run, batches_for(loaded.make_batch, spec, step, data_rank(spec)))
            inject = case.inject_inf
            if inject and inject["step"] == step + 1 and inject["rank"] == dist.get_rank():
                grad = next(p.grad for p in run.model.parameters() if p.grad is not None)
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
            before = _checksum(run.model)
            if not apply_gradients(run, spec.train.gradient_clipping):
                skipped.append(step + 1)
                assert _checksum(run.model) == before, "a skipped step changed the weights"
        losses.append(loss)
        if run.scaler is not None:
            scales.append(run.scaler.scale)
    local, _ = probes.summarize(p.to_local() for p in probes.trainable(run.model))
    if run.pipeline is not None:  # a stage's modules are not a model to call: what the pipeline ran
        return {"losses": losses, "local_dtype": local, "optimizer": type(run.optimizer).__name__,
                "float8_linears": float8_linears(run.model), "pipeline": run.pipeline.plan.summary(),
                **audit_facts(run.audit_report)}
    with torch.no_grad():
        logits = run.model(**batches_for(loaded.make_batch, spec, 0, data_rank(spec))[0]).logits
    for module in run.model.modules():  # FSDP2 keeps the root (grad_op: every unit) unsharded after a forward
        if isinstance(module, FSDPModule):  # that no backward follows
            module.reshard()
    state = [v for s in run.optimizer.state.values() for k, v in s.items() if k == "exp_avg"]
    units = [m for m in run.model.modules() if isinstance(m, FSDPModule)]
    all_skipped = [None] * dist.get_world_size()
    dist.all_gather_object(all_skipped, skipped)
    return {
        "losses": losses, "local_dtype": local, "logits_dtype": probes.short(logits.dtype), "optimizer": type(run.optimizer).__name__,
        "state_dtype": probes.summarize(state)[0] if state else None,
        "compiled": all(getattr(m, "_compiled_call_impl", None) is not None
                        for name, m in run.model.named_modules() if name in run.wrapped) and bool(run.wrapped),
        "root_is_fsdp": isinstance(run.model, FSDPModule),
        "reduce_scatters_per_step": reduce_scatters[0] // spec.train.steps,
        "fsdp_units": len(units), "float8_linears": float8_linears(run.model),
        "mx_linears": mx_linears(run.model),
        "mesh": list(next(run.model.parameters()).device_mesh.shape), "checkpointed_blocks": checkpointed(run.model),
        "float8_all_gather_weights": sum(1 for p in run.model.parameters()
                                         if type(p.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"),
        "loaded_from_files": loaded_from_files, "experts": experts_implementation(run.model),
        "skipped_steps": skipped, "skipped_by_rank": all_skipped,
        "sequence_parallel": run.tensor_parallel.sequence_parallel if run.tensor_parallel else None, "loss_scales": scales, **audit_facts(run.audit_report),
        "expert_parallel": run.expert_parallel.size if run.expert_parallel else None,
        **adapter_facts(run.model, run.optimizer),
    }


def adapter_facts(module, optimizer, stepped: list | None = None) -> dict:
    """Trainable vs frozen parameter tensors: how many, which the optimizer steps (`stepped`: the module's
    parameters behind DeepSpeed's flat partitions) and holds state for, and the frozen ones' stored dtype (FSDP2:
    local shards; ZeRO-3: the partitions)."""
    params = list(module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    stepped = {id(p) for p in (stepped if stepped is not None else
                               [p for group in optimizer.param_groups for p in group["params"]])}
    stored = [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else getattr(p, "_local_tensor", p)
              for p in frozen]
    return {"trainable_tensors": len(params) - len(frozen), "frozen_tensors": len(frozen),
            "stepped_tensors": len(stepped), "frozen_dtype": probes.summarize(stored)[0] if frozen else None,
            "frozen_with_gradient": sum(1 for p in frozen if p.grad is not None),
            "frozen_with_state": sum(1 for p in frozen if id(p) in stepped or optimizer.state.get(p))}


def experts_implementation(model) -> str | None:
    """The transformers experts implementation a MoE model runs (None: not a MoE model)."""
    config = getattr(model, "config", None)
    return getattr(config, "_experts_implementation", None) if hasattr(config, "num_experts_per_tok") else None


def checkpointed(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("CheckpointWrapper"))  # FSDP2: FSDPCheckpointWrapper


def matches_saved(loaded, full_weight) -> bool | None:
    """RAM-efficient cases: the embedding as the run holds it equals the one in the saved files (None: the
    model was not loaded from files)."""
    if loaded.materialize is None and loaded.keepalive is None:
        return None
    from safetensors.torch import load_file

    saved = load_file(f"{loaded.name}/model.safetensors")["model.embed_tokens.weight"]
    return bool(torch.equal(full_weight.detach().float().cpu(), saved.float()))


def audit_facts(report) -> dict:
    """The verdict of the first-step audit (None: audit.first_step=off), and the phases any rank failed."""
    if report is None:
        return {"audit_passed": None, "audit_failing": []}
    return {"audit_passed": report["passed"], "fp8_share": (report.get("gemm_flops") or {}).get("fp8_share"),
            "audit_failing": sorted({p for phases in report.get("failing_by_rank", {}).values() for p in phases}),
            "audit_mismatches": {c["phase"]: f"expected {c['expected']}, observed {c['observed']}: {c['detail']}"
                                 for c in report["checks"] if not c["ok"]}}


def run_deepspeed(case, spec, loaded) -> dict:
    from fp8dist.engines.deepspeed import DeepSpeedInspector, initialize, train_step

    engine, _, _, _ = initialize(loaded.model, spec)
    weight = engine.module.model.embed_tokens.weight
    import deepspeed

    with deepspeed.zero.GatheredParameters([weight], enabled=hasattr(weight, "ds_id")):
        loaded_from_files = matches_saved(loaded, weight)
    losses = [train_step(engine, batches_for(loaded.make_batch, spec, step, data_rank(spec)))
              for step in range(spec.train.steps)]
    master, _, separate = DeepSpeedInspector(engine.module, engine.optimizer).masters()
    master = master if separate else None
    facts = {**audit_facts(engine.fp8dist_run.audit_report), "losses": losses, "zero_stage": engine.zero_optimization_stage(),
             "optimizer": type(engine.basic_optimizer).__name__, "compiled": engine.is_compiled,
             "master_dtype": probes.summarize(master)[0] if master else None,
             "float8_linears": float8_linears(engine.module), "mx_linears": mx_linears(engine.module),
             "tensor_parallel_linears": sum(type(m).__name__ in ("LinearLayer", "LinearAllreduce")
                                            for m in engine.module.modules()),
             "skipped_steps": engine.skipped_steps,
             "checkpointed_blocks": checkpointed(engine.module), "loaded_from_files": loaded_from_files,
             "experts": experts_implementation(engine.module),
             **adapter_facts(engine.module, engine.basic_optimizer, zero_stepped(engine))}
    engine.destroy()
    return facts


def zero_stepped(engine) -> list | None:
    """The module parameters DeepSpeed's ZeRO optimizer keeps fp32 partitions of (stage 1/2 `bit16_groups`,
    stage 3 `fp16_groups`, DeepSpeed 0.19.8); None below ZeRO-1 (the torch optimizer steps them directly)."""
    groups = getattr(engine.optimizer, "bit16_groups", None) or getattr(engine.optimizer, "fp16_groups", None)
    return None if groups is None else [p for group in groups for p in group]


_SAVED: list[str] = []


def saved_tiny_llama() -> str:
    """tiny-llama saved once as a Hugging Face directory (bf16 safetensors), for the RAM-efficient cases."""
    if not _SAVED:
        import tempfile

        path = [tempfile.mkdtemp(prefix="fp8dist-option-runs-") if dist.get_rank() == 0 else None]
        if dist.get_rank() == 0:
            load_model("tiny-llama", "bf16", seed=0).model.save_pretrained(path[0])
        dist.broadcast_object_list(path)
        _SAVED.append(path[0])
    return _SAVED[0]


def main(ids: list[str]) -> int:
    process_group.init(CASE_TIMEOUT.total_seconds(), deepspeed=True)  # gloo on the CPU accelerator; serves FSDP2 cases too
    for case in [c for c in RUNS if not ids or c.id in ids]:
        try:
            spec = load_config(merge(RUN_BASE, case.config))
            preflight(spec)
            loaded = (load_for_run(saved_tiny_llama(), spec) if spec.parallel.cpu_ram_efficient_loading
                      else load_for_run(case.model, spec))
            facts = (run_deepspeed if spec.engine == "deepspeed" else run_fsdp2)(case, spec, loaded)
            facts["finite"] = all(math.isfinite(v) for v in facts["losses"])
        except Exception as exc:  # report, then let the next case run (the peers raised the same or time out)
            facts = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        if dist.get_rank() == 0 or "error" in facts:
            emit("case", case.id, {**facts, "rank": dist.get_rank()})
        # A RAM-efficient ZeRO-3 case keeps an HfDeepSpeedConfig alive with its model; while it lives,
        # transformers builds every model under zero.Init. Let it go before the next case builds one.
        loaded = None
        gc.collect()
        dist.barrier()
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
