"""Mixture-of-Experts: where the FLOPs run, and what converting the experts costs in loss.

    python benchmarks/moe.py [--steps N]
    python benchmarks/moe.py --smoke           # 2 steps of tiny-mixtral: not a measurement

On `small-mixtral` (built in: 4 layers, 8 experts of 256 x 256, top-2), FSDP2 on 2 gloo ranks:
- the FP8 share of weight-GEMM FLOPs that `fp8dist audit` measures (gemm_flops.fp8_share) with the experts in
  MXFP8 (configs/fsdp2-moe-mxfp8.yaml, emulated on CPU) and with Linears only (`experts=none`, what a Linear-only
  FP8 conversion gives). Goal: >= 0.85 with the experts converted.
- what the experts in MXFP8 cost in loss against bf16 (configs/fsdp2-bf16.yaml), through `fp8dist compare
  --fixed-routing --layer-steps` (the baseline's expert choices replayed; at the first, middle and last step both
  precisions on the baseline's weights and batch). Goal: the loss gap on the same weights <= 0.02 at every one of
  those steps: a measure of the numerics alone. Beside it (info): the smallest expert-output SQNR of the layer
  report, the gap of the two trajectories with routing fixed and free, and the same trajectory gap for fp32 vs
  bf16 with routing fixed: how far two trajectories part without any FP8 (batch-to-batch swings of a small MoE's
  loss turn any drift of the weights into a gap, which is why trajectories cannot judge the goal).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, fp8dist_cli, result  # noqa: E402

MODEL = "small-mixtral"
MOE_CONFIG = str(ROOT / "configs" / "fsdp2-moe-mxfp8.yaml")


def fp8_share(model: str, *overrides: str) -> float:
    done = fp8dist_cli("audit", model, "--config", MOE_CONFIG, *overrides, "--nproc", "2", "--format", "json")
    if done.returncode not in (0, 1):  # 1: the audit failed (expected with experts=none)
        raise SystemExit(f"audit {overrides}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["gemm_flops"]["fp8_share"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    steps, model = (2, "tiny-mixtral") if args.smoke else (args.steps, MODEL)
    converted, linear_only = fp8_share(model), fp8_share(model, "precision.fp8.torchao.experts=none")
    print(f"FP8 share of weight-GEMM FLOPs on {model}: experts in MXFP8 {converted:.3f}, Linears only "
          f"{linear_only:.3f}")
    result("moe_fp8_share_experts_mxfp8", converted, ">=0.85", "audit gemm_flops.fp8_share, experts converted")
    result("moe_fp8_share_linears_only", linear_only, "info", "audit gemm_flops.fp8_share, experts=none")
    chosen = ",".join(str(step) for step in sorted({1, max(steps // 2, 1), steps}))
    bf16 = str(ROOT / "configs" / "fsdp2-bf16.yaml")
    fixed = compare(MOE_CONFIG, bf16, model, steps, "--fixed-routing", "--layer-steps", chosen)
    gaps = [step["loss"]["relative_gap"] for step in fixed["layers"]]
    same_weights = math.inf if None in gaps else max(gaps)  # a non-finite probe loss is an unbounded gap
    measured = [row.get("expert_output_sqnr_db") for step in fixed["layers"] for row in step["layers"]]
    sqnr = min((v for v in measured if isinstance(v, float)), default=math.nan)
    print(f"experts MXFP8 vs bf16, routing fixed, on the baseline's weights and batch at steps {chosen}: largest "
          f"loss gap {same_weights:.5f}, smallest expert-output SQNR {sqnr:.2f} dB")
    result("moe_same_weights_loss_gap_mxfp8_vs_bf16", same_weights, "<=0.02",
           f"fp8dist compare --fixed-routing --layer-steps {chosen}: max of the steps' loss gaps on equal weights")
    result("moe_expert_output_sqnr_db_min", sqnr, "info", "the layer report's smallest expert-output SQNR")
    free = compare(MOE_CONFIG, bf16, model, steps)
    floor = compare(str(ROOT / "configs" / "fp32.yaml"), bf16, model, steps, "--fixed-routing")
    for name, report, label in (("moe_trajectory_gap_mxfp8_vs_bf16_fixed_routing", fixed, "MXFP8 vs bf16, fixed"),
                                ("moe_trajectory_gap_mxfp8_vs_bf16_free_routing", free, "MXFP8 vs bf16, free"),
                                ("moe_trajectory_gap_fp32_vs_bf16_fixed_routing", floor, "fp32 vs bf16, fixed")):
        gap = math.inf if report["max_relative_gap"] is None else report["max_relative_gap"]
        print(f"trajectories over {steps} steps, {label} routing: largest relative gap {gap:.5f}")
        result(name, gap, "info", f"max over {steps} steps of |loss - loss_bf16| / loss_bf16")


def compare(config: str, baseline: str, model: str, steps: int, *flags: str) -> dict:
    done = fp8dist_cli("compare", "--config", config, "--baseline", baseline, "--model", model, "--steps", str(steps),
                       "--nproc", "2", "--format", "json", "--tolerance", "1", *flags)
    if done.returncode != 0:
        raise SystemExit(f"compare {config} {flags}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)

if __name__ == "__main__":
    main()
