"""Mixture-of-Experts: where the FLOPs run, and what converting the experts costs in loss.

    python benchmarks/moe.py [--steps N]
    python benchmarks/moe.py --smoke           # 2 steps of tiny-mixtral: not a measurement

On `small-mixtral` (built in: 4 layers, 8 experts of 256 x 256, top-2), FSDP2 on 2 gloo ranks:
- the FP8 share of weight-GEMM FLOPs that `fp8dist audit` measures (gemm_flops.fp8_share) with the experts in
  MXFP8 (configs/fsdp2-moe-mxfp8.yaml, emulated on CPU) and with Linears only (`experts=none`, what a Linear-only
  FP8 conversion gives). Goal: >= 0.85 with the experts converted.
- the loss of that config against bf16 (configs/fsdp2-bf16.yaml) over the same steps, seed and batches, through
  the real launcher (`torchrun launch/train.py`): the largest relative gap. Goal: <= 0.02. Beside it, the same
  measure for fp32 vs bf16 (info): routing flips make a small MoE's curves part further than a dense model's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, cpu_env, launcher_losses, result  # noqa: E402

MODEL = "small-mixtral"
MOE_CONFIG = str(ROOT / "configs" / "fsdp2-moe-mxfp8.yaml")


def fp8_share(model: str, *overrides: str) -> float:
    command = [sys.executable, "-m", "fp8dist", "audit", model, "--config", MOE_CONFIG, *overrides, "--nproc", "2",
               "--format", "json"]
    done = subprocess.run(command, capture_output=True, text=True, env=cpu_env(), cwd=ROOT)
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
    fp8 = launcher_losses(MOE_CONFIG, steps, model)
    bf16 = launcher_losses(str(ROOT / "configs" / "fsdp2-bf16.yaml"), steps, model)
    gaps = [abs(a - b) / abs(b) for a, b in zip(fp8, bf16)]
    worst = max(range(steps), key=gaps.__getitem__)
    print(f"loss over {steps} steps: largest relative gap {gaps[worst]:.5f} at step {worst + 1}; final "
          f"{fp8[-1]:.4f} (experts MXFP8) vs {bf16[-1]:.4f} (bf16)")
    result("moe_loss_gap_experts_mxfp8_vs_bf16", gaps[worst], "<=0.02",
           f"max over {steps} steps of |loss_fp8 - loss_bf16| / loss_bf16")
    fp32 = launcher_losses(str(ROOT / "configs" / "fp32.yaml"), steps, model)
    floor = max(abs(a - b) / abs(b) for a, b in zip(fp32, bf16))
    print(f"the same measure for fp32 vs bf16 (how far two precisions part on this MoE at all): {floor:.5f}")
    result("moe_loss_gap_fp32_vs_bf16", floor, "info", "the same max relative gap, fp32 vs bf16: the floor of "
           "this measure on a small MoE, whose top-2 routing amplifies any rounding difference")


if __name__ == "__main__":
    main()
