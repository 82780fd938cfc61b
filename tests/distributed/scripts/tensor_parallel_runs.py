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

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.engines.fsdp2.clipping import clip_grad_norm_
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases

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


def local_bytes(tensors) -> int:
    """What this rank holds of these tensors (a DTensor's local shard)."""
    held = 0
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        held += local.numel() * local.element_size()
    return held


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
            "weight_bytes": local_bytes(engine.model.parameters()), "state_bytes": local_bytes(states),
            "tensor_parallel": engine.tensor_parallel.summary() if engine.tensor_parallel else None}


def checkpoint() -> dict:
    """Save at steps 2 and 4 while training; a fresh run resumes from step 2 and must step 3 and 4 bitwise the same;
    the step-4 checkpoint exports a plain Hugging Face model whose tensors are the gathered weights."""
    spec = spec_for("tensorwise", 2)
    shared = [tempfile.mkdtemp(prefix="fp8dist-tp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    first, second = Path(shared[0]) / "first", Path(shared[0]) / "second"
    quiet = lambda *_: None  # noqa: E731 - the loop's progress lines are not this test's business
    lost: list[float] = []
    session = loop.start(spec, load_for_run(MODEL, spec))
    loop.train(session, loop.Plan(steps=4, checkpoint_dir=str(first), save_every=2, model_name=MODEL),
               on_step=lambda index, loss, note: lost.append(loss), say=quiet)
    full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(torch.bfloat16)
            for name, p in session.engine.model.named_parameters()}
    if dist.get_rank() == 0:
        second.mkdir()
        shutil.copytree(first / "step-00000002", second / "step-00000002")
    dist.barrier()
    resumed: list[float] = []
    session = loop.start(spec, load_for_run(MODEL, spec))
    loop.train(session, loop.Plan(steps=4, checkpoint_dir=str(second), resume=True, model_name=MODEL),
               on_step=lambda index, loss, note: resumed.append(loss), say=quiet)
    out: dict = {"losses": lost, "resumed": resumed}
    dist.barrier()
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        exported = Path(shared[0]) / "export"
        loop.export(first / "step-00000004", False, str(exported), say=quiet)
        model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
        mine = dict(model.named_parameters())
        out["exported"] = {"names_match": sorted(mine) == sorted(full),
                           "equal": all(torch.equal(mine[name].detach(), full[name]) for name in full if name in mine),
                           "shapes": {name: list(t.shape) for name, t in mine.items() if "layers.0.self_attn" in name}}
        shutil.rmtree(shared[0], ignore_errors=True)
    return out


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
