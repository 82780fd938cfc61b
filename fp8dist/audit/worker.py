"""The audit's measuring process, one per rank (launched by fp8dist.audit.run under torchrun).

    python -m torch.distributed.run --nproc_per_node N -m fp8dist.audit.worker MODEL CONFIG STEPS OUT.json
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fp8dist.audit import probes
from fp8dist.audit.formats import is_scaling_tensor, is_tensor_like
from fp8dist.audit.wire import REDUCTIONS, WireRecorder
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.models import forward_loss, load_model
from fp8dist.ranks import finish

DS_MASTER = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
             "fp32_groups_flat", "fp32_groups")
DS_GRADS = ("averaged_gradients", "fp32_groups_gradients_flat", "grad_partitions_flat_buffer")


def _tensors(obj) -> list:
    if is_tensor_like(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _first_attr(obj, names) -> tuple[str | None, list[torch.Tensor]]:
    for name in names:
        found = [t for t in _tensors(getattr(obj, name, None)) if t.numel() > 0]
        if found:
            return name, found
    return None, []


def _msamp_scope(params) -> tuple[list, str]:
    """Table A's MS-AMP cells describe the Linear weights MS-AMP converted (ScalingParameters); embeddings,
    norms and biases follow the engine's own precision and are named in the detail only."""
    scope = [p for p in params if is_scaling_tensor(p)]
    rest, counts = probes.summarize(p for p in params if not is_scaling_tensor(p))
    return scope, f" converted by MS-AMP ({len(scope)}; the other parameters: {rest} {counts})"


def _obs(value: str, detail: str = "", measured: bool = True) -> dict[str, Any]:
    return {"observed": value, "detail": detail, "measured": measured}


def run_fsdp2(spec, loaded, steps, nproc, out):
    from fp8dist.engines.fsdp2 import accumulate_gradients, apply_gradients, prepare, train_step

    run = prepare(loaded.model, spec, record_comm=nproc > 1, optimizer=loaded.make_optimizer)
    model = run.model
    local = [p.to_local() if hasattr(p, "to_local") else p for p in probes.trainable(model)]
    prep, counts = probes.summarize(local)
    out["preparation"] = _obs(prep, f"local shards: {counts}")
    out["weights"] = _obs(prep, "FSDP2 sharded parameters")
    out["master_weights"] = _obs("n/a" if spec.precision.master_weights == "none" else prep,
                                 "the optimizer steps on the local shards")
    batches = [loaded.make_batch(spec.train.micro_batch_size, spec.train.seq_len, seed=dist.get_rank())]
    recorder = probes.MatmulRecorder()
    with recorder:  # the engine's own step (loss scaling, clipping): what the run does, not a stand-in
        accumulate_gradients(run, batches)
    grads = [p.grad for p in probes.trainable(model) if p.grad is not None]
    grad_dtype, grad_counts = probes.summarize(grads)
    out["weight_gradients"] = _obs(grad_dtype, f"sharded gradients: {grad_counts}")
    covered = sum(t.numel() for t in local)
    out["_bytes"] = {"weights": probes.nbytes(local) / covered, "gradients": probes.nbytes(grads) / covered}
    apply_gradients(run, spec.train.gradient_clipping)
    for _ in range(max(steps - 1, 0)):
        train_step(run, batches, spec.train.gradient_clipping)
    if run.comm is not None:
        record = run.comm.as_dict()
        gathered = set(record["all_gather"])
        fp8_params = sum(1 for p in model.parameters() if "Float8" in type(getattr(p, "_local_tensor", p)).__name__)
        ag = "fp8" if fp8_params and gathered & {"uint8", "float8_e4m3fn", "float8_e5m2"} else \
            "+".join(sorted(probes.short(getattr(torch, k)) for k in gathered)) or "none"
        out["weight_all_gather"] = _obs(ag, f"flat buffers {record['all_gather']}; {fp8_params} float8 weights")
        rs = "+".join(sorted(probes.short(getattr(torch, k)) for k in record["reduce_scatter"])) or "none"
        out["communication"] = _obs(rs, f"reduce-scatter {record['reduce_scatter']}")
        out["_comm"] = record
    return recorder, run.optimizer, run.decisions, covered


def run_deepspeed(spec, loaded, steps, nproc, out):
    from fp8dist.engines.deepspeed import initialize, train_step

    optimizer = loaded.make_optimizer(loaded.model.parameters()) if loaded.make_optimizer else None
    engine, optimizer, _, _ = initialize(loaded.model, spec, optimizer=optimizer)
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters() if p.requires_grad]
    scope, scope_note = _msamp_scope(params) if spec.fp8.backend == "msamp" else (params, "")
    weights, counts = probes.summarize(scope)
    out["weights"] = _obs(weights, f"module parameters (ZeRO-3: partitions){scope_note}: {counts}")
    inner = engine.optimizer
    attr, master = _first_attr(inner, DS_MASTER)
    linked = [m for m in (getattr(p, "_link_hp_param", None) for p in scope) if m is not None]
    if linked:  # MS-AMP's FP8 ZeRO optimizer: a 16-bit master per FP8 weight it owns (fp8_stage_1_and_2.py)
        attr, master = "_link_hp_param of the FP8 weights", linked
    if master:
        value, counts = probes.summarize(master)
        out["preparation"] = _obs(value, f"optimizer.{attr}: {counts}")
        out["master_weights"] = _obs(value, f"optimizer.{attr}")
    else:
        out["preparation"] = _obs(weights, "no wrapper: the optimizer steps on the module parameters")
        out["master_weights"] = _obs("n/a", "no separate master copy")
    batch = {k: v.to(engine.device) for k, v in
             loaded.make_batch(spec.train.micro_batch_size, spec.train.seq_len, seed=dist.get_rank()).items()}
    recorder, wire = probes.MatmulRecorder(), WireRecorder()
    with wire:
        with recorder:
            with engine.fp8dist_backend.forward_context():
                loss = forward_loss(engine, batch)
            engine.backward(loss)
        attr, grads = _first_attr(inner, DS_GRADS)
        if spec.fp8.backend == "msamp":
            attr, grads = "FP8 weights' .grad", [p.grad for p in scope if p.grad is not None]
        if not grads:
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            attr = "param.grad"
        if grads:
            value, counts = probes.summarize(grads)
            out["weight_gradients"] = _obs(value, f"{attr}: {counts}")
        else:
            out["weight_gradients"] = _obs(probes.short(engine.get_data_types()[1]), "engine.get_data_types()", False)
        engine.step()
    if nproc > 1:
        # MS-AMP sends its FP8 gradients as uint8 (ScalingTensor bytes): name them by what they carry.
        reduced = sorted({"fp8" if d == "uint8" and spec.fp8.backend == "msamp" else d for d in wire.dtypes(REDUCTIONS)})
        out["communication"] = _obs("+".join(reduced) or "none",
                                    f"gradient reductions captured on the wire (scalars left out): {wire.as_dict()}")
        out["_comm"] = wire.as_dict()
    for _ in range(max(steps - 1, 0)):
        train_step(engine, [batch])
    covered = sum(t.numel() for t in (master or params))
    out["_bytes"] = {"weights": probes.nbytes(params) / sum(t.numel() for t in params)}
    if master:
        out["_bytes"]["master"] = probes.nbytes(master) / covered
    if grads:
        out["_bytes"]["gradients"] = probes.nbytes(grads) / sum(t.numel() for t in grads)
    return recorder, getattr(inner, "optimizer", inner), engine.fp8dist_decisions, covered


def observe(spec, loaded, steps: int, nproc: int) -> dict[str, Any]:
    """Every phase of `steps` real steps of `loaded` under `spec` (the process group is initialised)."""
    out: dict[str, Any] = {}
    value, counts = probes.summarize(probes.trainable(loaded.model))
    out["loading"] = _obs(value, f"parameters after loading: {counts}")
    runner = run_deepspeed if spec.engine == "deepspeed" else run_fsdp2
    recorder, optimizer, decisions, covered = runner(spec, loaded, steps, nproc, out)
    fp8, other = recorder.split()
    compute, detail = probes.compute_dtype(other)
    out["training"] = _obs(compute, f"non-FP8 matmul operands: {detail}")
    notes = "".join(f"; {note}" for note in recorder.notes)
    out["gemm"] = (_obs(probes.low_precision_format(fp8), probes.describe_fp8(fp8) + notes) if fp8
                   else _obs(compute, "no FP8/FP4 operands seen" + notes))
    state, per_key = probes.optimizer_states(optimizer)
    out["optimizer"] = _obs(state, f"state storage: {per_key}")
    out["_bytes"]["optimizer"] = probes.nbytes(probes.state_tensors(optimizer)) / covered
    out["_decisions"] = [d.__dict__ for d in decisions]
    return out


def main(model_name: str, config: str, steps: int, out_path: str) -> int:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        spec = load_config(config or None)
        loaded = load_model(model_name, spec.precision.load_dtype, seed=spec.train.seed)
        if cuda:
            loaded.model.to("cuda")
        out = observe(spec, loaded, steps, dist.get_world_size())
    except Fp8distError as exc:
        out = {"_error": str(exc)}
    return finish(out, out_path)

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
