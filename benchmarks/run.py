"""Run every benchmark in one go and print one table of what was measured against its goal.

    python benchmarks/run.py                 # all of them (CPU: ~15 minutes on 2 cores)
    python benchmarks/run.py --only overhead numerics
    python benchmarks/run.py --quick         # fewer repetitions: noisier ratios
    python benchmarks/run.py --smoke         # every script at its smallest size: shows they run, measures nothing

Each script runs as its own process (so that their torchrun jobs never share a machine with each other) and
prints `result name=value goal=...` lines (benchmarks/_common.py); this collects them. The GPU throughput
script refuses on a machine without an FP8 GPU; that is listed, not counted as a miss. Exit code: 0 when every
figure with a goal meets it, 1 when one misses, 2 when a benchmark itself failed (tests/distributed/test_benchmarks_run.py
runs every script with --smoke, so that a change that breaks one turns the test suite red).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, cpu_env, parse_results  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    """One script: its `--quick` arguments, and the `result` names it promises at every size, `--smoke`
    included (the test holds each script to them; a `*` stands for a size or config name, as fnmatch reads it)."""

    script: str
    quick: tuple[str, ...]
    promises: tuple[str, ...]


BENCHMARKS = {
    "overhead": Benchmark("overhead.py", ("--pairs", "6", "--rounds", "2"), (
        "overhead_fsdp2_bf16", "overhead_fsdp2_torchao_float8", "overhead_deepspeed_zero2_bf16",
        "overhead_deepspeed_zero2_torchao_float8", "overhead_noise_floor_hand_vs_hand")),
    "watch_overhead": Benchmark("watch_overhead.py", ("--pairs", "4", "--rounds", "2"), (
        "watch_observed_step_fsdp2_bf16", "watch_after_fsdp2_bf16", "watch_observed_step_deepspeed_zero2_bf16",
        "watch_after_deepspeed_zero2_bf16", "watch_after_noise_floor_fsdp2_bf16")),
    "numerics_overhead": Benchmark("numerics_overhead.py", ("--pairs", "3"), tuple(
        f"{figure}_{case}" for case in ("float8_tensorwise", "float8_rowwise", "moe_mxfp8_experts")
        for figure in ("numerics_watched_step", "watched_step"))),
    "comm_bytes": Benchmark("comm_bytes.py", (), (
        "allgather_bytes_fp8_vs_bf16_linear_weights", "allgather_bytes_fp8_vs_bf16_linear_on_the_wire",
        "allgather_bytes_fp8_vs_bf16_whole_model")),
    "memory": Benchmark("memory.py", ("--only", "fsdp2-bf16", "deepspeed-bf16-zero2"), (
        "bytes_per_param_*", "msamp_o2_optimizer_saving_by_table")),
    "loading_memory": Benchmark("loading_memory.py", ("--sizes", "200M", "--ranks", "2"), (
        "loading_peak_efficient_vs_naive_*_2ranks_rank0", "loading_peak_efficient_vs_naive_*_2ranks_rank1",
        "activation_bytes_full_vs_none", "activation_bytes_selective_vs_none")),
    "checkpoint_io": Benchmark("checkpoint_io.py", ("--quick",), tuple(
        f"{name}_{engine}_{figure}" for engine in ("fsdp2", "deepspeed") for name, figure in (
            ("checkpoint", "bytes_per_param"), ("checkpoint", "save_s"), ("checkpoint", "load_s"),
            ("export", "bf16_over_fp32_bytes")))),
    "cli_latency": Benchmark("cli_latency.py", ("--runs", "3"), (
        "cli_translate_vs_import_torch", "cli_validate_vs_import_torch")),
    "numerics": Benchmark("numerics.py", ("--steps", "10"), (
        "loss_gap_float8_tensorwise_vs_bf16", "loss_gap_float8_rowwise_vs_bf16")),
    "moe": Benchmark("moe.py", ("--steps", "10"), (
        "moe_fp8_share_experts_mxfp8", "moe_fp8_share_linears_only", "moe_same_weights_loss_gap_mxfp8_vs_bf16",
        "moe_expert_output_sqnr_db_min", "moe_trajectory_gap_mxfp8_vs_bf16_fixed_routing",
        "moe_trajectory_gap_mxfp8_vs_bf16_free_routing", "moe_trajectory_gap_fp32_vs_bf16_fixed_routing")),
    "lora": Benchmark("lora.py", ("--steps", "2"), (
        "lora_peak_fp8dist_over_accelerate_peft", "lora_peak_over_full_finetune", "lora_bytes_per_frozen_param",
        "lora_fp32_partition_per_trainable")),
    "qlora": Benchmark("qlora.py", ("--steps", "2"), (
        "qlora_frozen_bytes_over_bf16_base", "qlora_peak_over_accelerate_bnb", "qlora_peak_over_bf16_base_lora",
        "qlora_after_steps_over_bf16_base_lora")),
    "tensor_parallel": Benchmark("tensor_parallel.py", ("--layers", "4", "--pairs", "6"), (
        "tp_allgather_bytes_fp8_vs_bf16_per_block", "tp_allgather_bytes_fp8_vs_bf16_whole_model",
        "tp_axis_bytes_fp8_vs_bf16", "tp_step_time_fp8dist_vs_hand", "tp_step_time_noise_floor_hand_vs_hand")),
    "pipeline_parallel": Benchmark("pipeline_parallel.py", ("--pairs", "6", "--steps", "4"), (
        *(f"{figure}_{schedule}" for schedule in ("1f1b", "gpipe", "interleaved_1f1b") for figure in (
            "pp_bubble", "pp_bubble_theory", "pp_p2p_bytes", "pp_p2p_bytes_theory", "pp_step_ms")),
        "pp_step_time_fp8dist_vs_hand", "pp_step_time_noise_floor_hand_vs_hand", "pp_loss_gap_fp8dist_vs_hand")),
    "expert_parallel": Benchmark("expert_parallel.py", ("--pairs", "4"), (
        "ep_gathered_expert_bytes_ep2_vs_ep1", "ep_expert_bytes_at_rest_ep2_vs_ep1", "ep_all_to_all_bytes_per_step",
        "ep_gather_and_reduce_bytes_ep2_vs_ep1", "ep_step_time_ep2_vs_ep1", "ep_step_time_noise_floor")),
    "gpu_throughput": Benchmark("gpu_throughput.py", ("--steps", "5", "--warmup", "2"), (
        "gpu_tokens_per_s_float8_tensorwise_vs_bf16", "gpu_tokens_per_s_float8_rowwise_vs_bf16",
        "gpu_tokens_per_s_te_Float8CurrentScaling_vs_bf16", "gpu_tokens_per_s_float8_tensorwise_filter_off_vs_bf16",
        "gpu_tokens_per_s_float8_rowwise_filter_off_vs_bf16", "gpu_tokens_per_s_hand_tensorwise_vs_bf16",
        "gpu_tokens_per_s_hand_rowwise_vs_bf16", "gpu_tokens_per_s_*_vs_bf16_m*", "gpu_fp8dist_over_hand_tensorwise_m*",
        "gpu_fp8dist_over_hand_rowwise_m*")),
}
GPU_REFUSED = 2  # gpu_throughput.py's exit code without an FP8 GPU
SIZES = ("full", "quick", "smoke")


def command(name: str, size: str) -> list[str]:
    """The command line of one benchmark at `size` (one of SIZES)."""
    bench = BENCHMARKS[name]
    extra = {"full": [], "quick": list(bench.quick), "smoke": ["--smoke"]}[size]
    return [sys.executable, str(ROOT / "benchmarks" / bench.script), *extra]


def run(name: str, size: str) -> tuple[int, str]:
    argv = command(name, size)
    print(f"\n=== {name}: python benchmarks/{' '.join([BENCHMARKS[name].script, *argv[2:]])}", flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cpu_env(), cwd=ROOT)
    lines = []
    for line in proc.stdout:  # stream: these take minutes
        lines.append(line)
        print(line, end="", flush=True)
    return proc.wait(), "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repetitions (ratios are noisier)")
    size.add_argument("--smoke", action="store_true", help="every script at its smallest size: shows they run, "
                                                           "measures nothing")
    args = parser.parse_args()
    chosen = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows, failed, refused = [], [], []
    for name in args.only:
        code, output = run(name, chosen)
        if name == "gpu_throughput" and code == GPU_REFUSED:
            refused.append(output.strip().splitlines()[0] if output.strip() else "refused")
        elif code != 0:
            failed.append(f"{name} (exit {code})")
        rows += [(name, r) for r in parse_results(output)]
    print("\n=== summary" + {"full": "", "quick": " (--quick: fewer repetitions, noisier)",
                             "smoke": " (--smoke: smallest sizes, not a measurement)"}[chosen])
    width = max([len(r.name) for _, r in rows] + [10])
    print(f"{'benchmark':16s}{'figure':{width + 2}s}{'value':>10s}  {'goal':8s}{'verdict':9s}what")
    for bench, r in rows:
        print(f"{bench:16s}{r.name:{width + 2}s}{r.value:10.4f}  {r.goal:8s}{r.verdict():9s}{r.label}")
    for line in refused:
        print(f"{'gpu_throughput':16s}{line}")
    for name in failed:
        print(f"FAILED: {name}")
    if failed:
        return 2
    return 1 if any(r.verdict() == "MISSES" for _, r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
