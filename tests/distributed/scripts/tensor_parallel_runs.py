"""Tensor-parallel cases in one job (one launch, one process group), on a Qwen2 shape no other test uses
(tests/tp_models.py):

    torchrun --nproc_per_node 4 tests/distributed/scripts/tensor_parallel_runs.py tp [CASE ...]
    torchrun --nproc_per_node 2 tests/distributed/scripts/tensor_parallel_runs.py baseline [CASE ...]

`tp` runs each config at parallel.tensor_size 2 (4 ranks: dp_shard 2 x tp 2); `baseline` the same configs without
tensor parallel on 2 ranks, as many data-parallel ranks, so both read the same batches. Each case trains STEPS steps
through fp8dist's run loop, the first inside `fp8dist.audit.watch`, and rank 0 prints a `case` result line
(fp8dist.runtime.ranks.emit): the losses, the first step's gradient norm (measured before training, by the engine's
clipping across meshes), the audit's verdict and rows, the bytes per mesh axis, and the bytes each
rank holds. `checkpoint` (tp only) saves at step 2, resumes a fresh run from it and exports a Hugging Face model.
"""
from __future__ import annotations

import sys

import torch

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.engines.fsdp2.clipping import clip_grad_norm_
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases
from tests.distributed.mesh_cases import checkpoint_round_trip, local_bytes

MODEL = "tests.tp_models:unseen_qwen2"
STEPS = 4
CONFIGS = {
    "fp32": {"precision": {"preset": "fp32"}},
    "bf16": {"precision": {"preset": "bf16"}},
    "tensorwise": ROOT / "configs" / "fsdp2-torchao-float8.yaml",
    "rowwise": ROOT / "configs" / "fsdp2-torchao-rowwise.yaml",
}
COMMON = ["train.seq_len=32", "train.steps=4", "audit.first_step=off"]


def spec_for(name: str, tensor_size: int):
    return load_config(CONFIGS[name], overrides=[*COMMON, f"parallel.tensor_size={tensor_size}"])


def train(name: str, tensor_size: int) -> dict:
    spec = spec_for(name, tensor_size)
    session = loop.start(spec, load_for_run(MODEL, spec))
    engine, losses = session.engine, []
    engine.accumulate(session.batches(0))  # the first step's gradients, from the weights both runs start from
    norm = float(clip_grad_norm_([p for p in engine.model.parameters() if p.requires_grad], float("inf")))
    engine.optimizer.zero_grad(set_to_none=True)
    with watch(engine.model, engine.optimizer, spec, on_mismatch="ignore") as audit:
        losses.append(session.step(0)[0])
    losses += [session.step(index)[0] for index in range(1, STEPS)]
    states = [t for state in engine.optimizer.state.values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    report = audit.report
    return {"losses": losses, "passed": audit.passed, "grad_norm": norm,
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "failing": [c["phase"] for c in report["checks"] if not c["ok"]],
            "by_axis": report["communication_bytes_by_axis"], "fp8_share": report["gemm_flops"]["fp8_share"],
            "fp8_emulated": report["fp8_emulated"],
            "weight_bytes": local_bytes(engine.model.parameters()), "state_bytes": local_bytes(states),
            "tensor_parallel": engine.tensor_parallel.summary() if engine.tensor_parallel else None}


def checkpoint() -> dict:
    """tensorwise FP8 on dp_shard 2 x tp 2: resumed bitwise, exported whole (layer 0's attention shapes)."""
    return checkpoint_round_trip(spec_for("tensorwise", 2), MODEL, lambda name: "layers.0.self_attn" in name)


def main(mode: str, only: list[str]) -> int:
    process_group.init(240)
    tensor_size = 2 if mode == "tp" else 1
    cases = {name: (lambda name=name: train(name, tensor_size)) for name in CONFIGS}
    if mode == "tp":
        cases["checkpoint"] = checkpoint
    run_cases(cases, only)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2:]))
