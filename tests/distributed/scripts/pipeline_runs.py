"""Pipeline-parallel cases in one job (one launch, one process group), on small-llama (4 decoder layers):

    torchrun --nproc_per_node 1 tests/distributed/scripts/pipeline_runs.py baseline
    torchrun --nproc_per_node 2 tests/distributed/scripts/pipeline_runs.py schedules
    torchrun --nproc_per_node 4 tests/distributed/scripts/pipeline_runs.py mesh

`baseline`: fp32 without pipeline parallel on one process. `schedules`: the same fp32 run at pipeline_size 2 (one
data rank) under each schedule; each case's losses and its first step's gradient norm (clipping across stages) come
back. `mesh`: fp32 at pipeline_size 2 x tensor_size 2 (one data rank, sequence parallel off), and pipeline_size 2 x
dp_shard 2 with torchao float8 tensorwise (float8 all-gather): step 1 inside
`fp8dist.audit.watch`, the bubble each rank measured, and a checkpoint round trip (saved at step 2, resumed on a fresh
run, exported and read back whole by transformers). Rank 0 prints a `case` line per case
(fp8dist.runtime.ranks.emit).
"""
from __future__ import annotations

import statistics
import sys

import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.conftest import ROOT
from tests.distributed.case_runner import run_cases
from tests.distributed.mesh_cases import checkpoint_round_trip

MODEL = "small-llama"
STEPS = 4
COMMON = ["train.seq_len=32", "train.micro_batch_size=4", f"train.steps={STEPS}", "audit.first_step=off",
          "train.gradient_clipping=1.0"]
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # zero_bubble is refused on FSDP2 (config/rules/common.py)


def fp32(pipeline_size: int, schedule: str = "1f1b", tensor_size: int = 1):
    return load_config({"precision": {"preset": "fp32"}}, overrides=[
        *COMMON, f"parallel.pipeline_size={pipeline_size}", f"parallel.pipeline_schedule={schedule}",
        f"parallel.tensor_size={tensor_size}"])


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


def main(mode: str, only: list[str]) -> int:
    process_group.init(240)
    if mode == "baseline":
        cases = {"fp32": lambda: train(fp32(1))}
    elif mode == "schedules":
        cases = {name: (lambda name=name: train(fp32(2, name))) for name in SCHEDULES}
    else:
        cases = {"float8": lambda: audited(float8()), "tensor_parallel": lambda: train(fp32(2, tensor_size=2)),
                 "checkpoint": lambda: checkpoint_round_trip(float8(), MODEL, lambda name: False)}
    run_cases(cases, only)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2:]))
