"""Expert-parallel cases in one job (one launch, one process group):

    torchrun --nproc_per_node 2 tests/distributed/scripts/expert_parallel_runs.py 2 [CASE ...]
    torchrun --nproc_per_node 4 tests/distributed/scripts/expert_parallel_runs.py 4 [CASE ...]

Each case trains one MoE model with one precision (and overrides) at parallel.expert_size 1 and at the EP sizes of the
world, on the same ranks from the same weights and batches, STEPS steps through fp8dist's run loop (the first inside
`fp8dist.audit.watch`), after one forward and backward of the first step's batches whose gradient norm it measures.
Rank 0 prints a `case` result line (fp8dist.runtime.ranks.emit) with, per EP size: the losses, the audit's verdict
and rows, the bytes per mesh axis, every rank's weight-GEMM FLOPs and FP8 share, the expert bytes each rank holds
(sharded, and gathered while an experts module runs), the gradient norms and, for MXFP8 experts, rank 0's expert GEMM
SQNRs (`watch(..., numerics=True)`).
`checkpoint` (2 ranks) saves at step 2 under EP 2, resumes a fresh run from it and exports a Hugging Face model.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.backends.experts import experts_modules
from fp8dist.config.load import load_config
from fp8dist.engines.fsdp2.clipping import clip_grad_norm_
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases
from tests.distributed.mesh_cases import checkpoint_round_trip, local_bytes

STEPS = 4
MODELS = {"mixtral": "tiny-mixtral", "qwen3_moe": "tests.tp_models:unseen_qwen3_moe",
          "gpt_oss": "tests.tp_models:unseen_gpt_oss"}
PRECISIONS = {
    "fp32": {"precision": {"preset": "fp32"}},
    "bf16": {"precision": {"preset": "bf16"}},
    "mxfp8": ROOT / "configs" / "fsdp2-moe-mxfp8.yaml",
}
COMMON = ["train.seq_len=32", f"train.steps={STEPS}", "audit.first_step=off"]
# More of the run around the dispatch: activation checkpointing recomputes it (both all-to-alls again), two
# micro-batches accumulate before the experts' reduce-scatter, grad_op keeps the gathered experts between forward
# and backward.
AROUND = ["parallel.activation_checkpointing=full", "train.gradient_accumulation_steps=2", "parallel.sharding=grad_op"]


@dataclass(frozen=True)
class Case:
    model: str
    precision: str
    sizes: tuple[int, ...]  # the EP sizes run besides 1
    overrides: tuple[str, ...] = ()
    skewed: bool = False  # every token routed to the first ep rank's experts: the others receive no rows


CASES = {2: {"mixtral-fp32": Case("mixtral", "fp32", (2,)), "mixtral-bf16": Case("mixtral", "bf16", (2,)),
             "mixtral-mxfp8": Case("mixtral", "mxfp8", (2,)), "qwen3_moe-fp32": Case("qwen3_moe", "fp32", (2,)),
             "qwen3_moe-mxfp8": Case("qwen3_moe", "mxfp8", (2,)), "gpt_oss-fp32": Case("gpt_oss", "fp32", (2,)),
             "mixtral-fp32-around": Case("mixtral", "fp32", (2,), tuple(AROUND)),
             "mixtral-fp32-skewed": Case("mixtral", "fp32", (2,), skewed=True)},
         4: {"qwen3_moe-fp32": Case("qwen3_moe", "fp32", (2, 4)), "mixtral-mxfp8": Case("mixtral", "mxfp8", (2, 4))}}


def spec_for(precision: str, expert_size: int, overrides=()):
    return load_config(PRECISIONS[precision], overrides=[*COMMON, *overrides, f"parallel.expert_size={expert_size}"])


def skew(model) -> None:
    """Route every token to the experts of the first ep rank of 2 (the router's choice modulo half the experts; its
    weights stay in the graph): the other rank's experts receive no rows."""
    for _, experts in experts_modules(model):
        half = experts.num_experts // 2
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(lambda m, args, out: (*out[:-1], out[-1] % half))
        return


def every_rank(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def train(case: Case, expert_size: int) -> dict:
    spec = spec_for(case.precision, expert_size, case.overrides)
    loaded = load_for_run(MODELS[case.model], spec)
    if case.skewed:
        skew(loaded.model)
    session = loop.start(spec, loaded)
    engine, losses = session.engine, []
    gathered: list[int] = []  # the expert bytes one experts module holds while it runs (FSDP2 has gathered them)
    hooks = [module.register_forward_pre_hook(lambda m, args: gathered.append(local_bytes(m.parameters())))
             for _, module in experts_modules(engine.model)]
    engine.accumulate(session.batches(0))  # the first step's gradients, from the weights both runs start from
    expert_ids = {id(p) for _, module in experts_modules(engine.model) for p in module.parameters()}
    norm = float(clip_grad_norm_([p for p in engine.model.parameters() if p.requires_grad], float("inf")))
    expert_norm = float(clip_grad_norm_([p for p in engine.model.parameters() if id(p) in expert_ids], float("inf")))
    engine.optimizer.zero_grad(set_to_none=True)
    with watch(engine.model, engine.optimizer, spec, on_mismatch="ignore", numerics=case.precision == "mxfp8") as audit:
        losses.append(session.step(0)[0])
    losses += [session.step(index)[0] for index in range(1, STEPS)]
    for hook in hooks:
        hook.remove()
    report = audit.report
    flops = report["gemm_flops"]
    expert_params = [p for _, module in experts_modules(engine.model) for p in module.parameters()]
    return {"losses": losses, "passed": audit.passed, "grad_norm": norm, "expert_grad_norm": expert_norm,
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "expected": {c["phase"]: c["expected"] for c in report["checks"]},
            "failing": [c["phase"] for c in report["checks"] if not c["ok"]],
            "by_axis": report["communication_bytes_by_axis"],
            "flops": every_rank((flops["fp8_share"], flops["weight_gemm_flops"])),
            "expert_bytes": every_rank(local_bytes(expert_params)), "gathered_expert_bytes": max(gathered),
            "weight_bytes": local_bytes(engine.model.parameters()),
            "expert_parallel": engine.expert_parallel.summary() if engine.expert_parallel else None,
            "expert_sqnr_db": {f"{g['module']}:{g['gemm']}": g["sqnr_db"] for g in report.get("numerics", {}).get(
                "gemms", []) if ".experts." in g["module"]}}


def compare(case: Case) -> dict:
    return {str(size): train(case, size) for size in (1, *case.sizes)}


def checkpoint() -> dict:
    """MXFP8 experts under EP 2: resumed bitwise, exported with every expert gathered (layer 0's experts' shape)."""
    return checkpoint_round_trip(spec_for("mxfp8", 2), MODELS["mixtral"],
                                 lambda name: name == "model.layers.0.mlp.experts.gate_up_proj")


def main(world: int, only: list[str]) -> int:
    process_group.init(240)
    cases = {name: (lambda case=case: compare(case)) for name, case in CASES[world].items()}
    if world == 2:
        cases["checkpoint"] = checkpoint
    run_cases(cases, only)
    return 0


if __name__ == "__main__":
    leave(main(int(sys.argv[1]), sys.argv[2:]))
