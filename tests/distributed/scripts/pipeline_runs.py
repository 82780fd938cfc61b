"""Pipeline-parallel cases in one job (one launch, one process group), on small-llama (4 decoder layers):

    torchrun --nproc_per_node 1 tests/distributed/scripts/pipeline_runs.py baseline
    torchrun --nproc_per_node 2 tests/distributed/scripts/pipeline_runs.py schedules
    torchrun --nproc_per_node 4 tests/distributed/scripts/pipeline_runs.py mesh

`baseline`: fp32 without pipeline parallel on one process. `schedules`: the same fp32 run at pipeline_size 2 (one
data rank) under each schedule; each case's losses and its first step's gradient norm (clipping across stages) come
back. `mesh`: pipeline_size 2 x dp_shard 2 with torchao float8 tensorwise (float8 all-gather): step 1 inside
`fp8dist.audit.watch`, the bubble each rank measured, and a checkpoint round trip (saved at step 2, resumed on a fresh
run, exported and read back whole by transformers). Rank 0 prints a `case` line per case
(fp8dist.runtime.ranks.emit).
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases

MODEL = "small-llama"
STEPS = 4
COMMON = ["train.seq_len=32", "train.micro_batch_size=4", f"train.steps={STEPS}", "audit.first_step=off",
          "train.gradient_clipping=1.0"]
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # zero_bubble is refused on FSDP2 (config/rules/common.py)


def fp32(pipeline_size: int, schedule: str = "1f1b"):
    return load_config({"precision": {"preset": "fp32"}}, overrides=[
        *COMMON, f"parallel.pipeline_size={pipeline_size}", f"parallel.pipeline_schedule={schedule}"])


def float8():
    return load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml",
                       overrides=[*COMMON, "parallel.pipeline_size=2"])


def train(spec) -> dict:
    session = loop.start(spec, load_for_run(MODEL, spec))
    losses = [session.step(index)[0] for index in range(STEPS)]
    return {"losses": losses}


def audited(spec) -> dict:
    """Step 1 under the watch, the rest plain: the audit's verdict and rows, and the bubble of the plain steps."""
    session = loop.start(spec, load_for_run(MODEL, spec))
    engine = session.engine
    with watch(engine.model, engine.optimizer, spec, on_mismatch="ignore") as audit:
        losses = [session.step(0)[0]]
    losses += [session.step(index)[0] for index in range(1, STEPS)]
    idle: list = [None] * dist.get_world_size()
    dist.all_gather_object(idle, statistics.median(engine.pipeline.idle[1:]))
    report = audit.report
    return {"losses": losses, "passed": audit.passed,
            "failing": [c["phase"] for c in report["checks"] if not c["ok"]],
            "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "by_axis": report["communication_bytes_by_axis"], "fp8_share": report["gemm_flops"]["fp8_share"],
            "high_precision": [row["module"] for row in report["gemm_flops"]["high_precision"]],
            "bubble_theory": engine.pipeline.plan.bubble_theory, "idle": idle,
            "stages": engine.pipeline.plan.summary()}


def checkpoint(spec) -> dict:
    """Train 4 steps saving at 2 and 4; a fresh run resumes from a copy of step 2 (losses and weights bitwise those
    of the first run); step 4 exported and read back by transformers on rank 0, every stage's weights in it."""
    shared = [tempfile.mkdtemp(prefix="fp8dist-pp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    first, second = Path(shared[0]) / "first", Path(shared[0]) / "second"
    quiet = lambda *_: None  # noqa: E731 - the loop's progress lines are not the test's business
    lost: list[float] = []
    session = loop.start(spec, load_for_run(MODEL, spec))
    loop.train(session, loop.TrainOptions(steps=4, checkpoint_dir=str(first), save_every=2, model_name=MODEL),
               on_step=lambda index, loss, note: lost.append(loss), say=quiet)
    mine = {name: p.full_tensor().detach().clone() for name, p in session.engine.model.named_parameters()}
    if dist.get_rank() == 0:
        second.mkdir()
        shutil.copytree(first / "step-00000002", second / "step-00000002")
    dist.barrier()
    resumed: list[float] = []
    session = loop.start(spec, load_for_run(MODEL, spec))
    loop.train(session, loop.TrainOptions(steps=4, checkpoint_dir=str(second), resume=True, model_name=MODEL),
               on_step=lambda index, loss, note: resumed.append(loss), say=quiet)
    again = {name: p.full_tensor() for name, p in session.engine.model.named_parameters()}
    same = torch.tensor(float(all(torch.equal(mine[name], again[name]) for name in mine)))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: tensor.to(torch.bfloat16) for name, tensor in mine.items()})
    out: dict = {"losses": lost, "resumed": resumed, "weights_bitwise": bool(same.item()),
                 "names_by_rank": [sorted(names) for names in everyone]}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        whole = {name: tensor for names in everyone for name, tensor in names.items()}
        exported = Path(shared[0]) / "export"
        loop.export(first / "step-00000004", False, str(exported), say=quiet)
        model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
        read = dict(model.named_parameters())
        out["exported"] = {"names_match": sorted(read) == sorted(whole),
                           "equal": all(torch.equal(read[name].detach(), whole[name]) for name in whole)}
        shutil.rmtree(shared[0], ignore_errors=True)
    return out


def main(mode: str, only: list[str]) -> int:
    process_group.init(240)
    if mode == "baseline":
        cases = {"fp32": lambda: train(fp32(1))}
    elif mode == "schedules":
        cases = {name: (lambda name=name: train(fp32(2, name))) for name in SCHEDULES}
    else:
        cases = {"float8": lambda: audited(float8()), "checkpoint": lambda: checkpoint(float8())}
    run_cases(cases, only)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2:]))
