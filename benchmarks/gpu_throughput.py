"""GPU throughput: training tokens/s of bf16 vs torchao float8 (tensorwise + float8 all-gather, rowwise) vs
Transformer Engine, on a Llama-3-shaped model with FSDP2, all GPUs of one node, every case in one run, each beside
the speed model's prediction and beside torchao's recipe prepared by hand as torchtitan does it.

    python benchmarks/gpu_throughput.py [--tokens 4096 8192 16384] [--layers N] [--micro-batch 1] [--steps 20]
                                        [--warmup 5] [--profile-steps 2]

Launches itself under torchrun with one process per visible GPU. Needs NVIDIA GPUs with compute capability
>= 8.9 (rowwise: 9.0); elsewhere it refuses with exit 2 and says why. The fp8dist cases are fp8dist configs run by
`fp8dist.engines.fsdp2.prepare` + `train_step`, the FP8 ones with precision.fp8.min_speedup auto (the default: the
speed model's filter) and off: bf16 and torchao with torch.compile (torchao's speedups need it); Transformer Engine
(Float8CurrentScaling) without it (TE modules run their own fused kernels). The anchors: torchao tensorwise and
rowwise by hand (convert_to_float8_training with torchao's `_auto_filter_for_recipe`, per-block compile,
fully_shard), so that fp8dist is judged against them on the same GPU in the same run.
The model is Llama 3 8B per layer (hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocab 128256) with as many
layers as fp8dist's estimate fits in 80% of the GPU's memory (or --layers), at each tokens-per-micro-batch size.
Prints, per size, tokens/s per GPU, peak memory and each case's ratio to bf16, each as `measured (predicted)`
(fp8dist/estimate/step.py on the device's GPU; the anchors predicted as fp8dist's config with the filter off),
then a torch.profiler breakdown per case in ms per step: FP8 GEMMs, bf16 GEMMs, casts, attention, optimizer,
communication, and `other` (kernels whose names do not say: `kernel_part`), beside the predicted parts.

Published numbers to compare with (torchao torchao/float8/README.md, torchtitan docs/float8.md, Axolotl
docs/mixed_precision), on 8xH100 with FSDP2 + compile:
  torchao, Llama 3 8B: tensorwise + float8 all-gather +25% tokens/s over bf16, rowwise +10%;
  torchtitan, Llama 3.1 8B: +28%; 70B with float8 all-gather 1.5x overall;
  Axolotl: ~10% over bf16 for a 3B model with FP8 + float8 all-gather.
Fewer layers and fewer GPUs than those runs mean less all-gather traffic to save: expect the ratios lower.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

TRAIN = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
TOKENS = (4096, 8192, 16384)  # tokens per micro-batch (--tokens)
HEADROOM = 0.8  # share of the GPU's memory the estimated peak may take when --layers is not given
MOST_LAYERS = 32  # Llama 3 8B's own count


@dataclass(frozen=True)
class Case:
    """One side: an fp8dist config (prepared by fp8dist) or, with `hand`, torchao's recipe prepared by hand as
    torchtitan does it; `slug` names its result lines; `predict_as`: the config the speed model predicts it as."""
    slug: str
    config: dict | None
    compile: bool = True
    hand: str | None = None
    published: str = ""
    predict_as: dict | None = None


_TENSORWISE = {"preset": "torchao-float8"}  # precision.fp8.min_speedup: auto (the preset's default)
_ROWWISE = {"preset": "torchao-float8-rowwise"}
_OFF = {"fp8": {"min_speedup": "off"}}
CASES = {
    "bf16": Case("bf16", {"precision": {"preset": "bf16"}}),
    "float8 tensorwise + float8 all-gather": Case("float8_tensorwise", {"precision": _TENSORWISE},
                                                  published="torchao 8B/8xH100: 1.25"),
    "float8 tensorwise, min_speedup off": Case("float8_tensorwise_filter_off",
                                               {"precision": {**_TENSORWISE, **_OFF}}),
    "torchao tensorwise by hand (torchtitan)": Case("hand_tensorwise", None, hand="tensorwise",
                                                    predict_as={"precision": {**_TENSORWISE, **_OFF}}),
    "float8 rowwise": Case("float8_rowwise", {"precision": _ROWWISE}, published="torchao 8B/8xH100: 1.10"),
    "float8 rowwise, min_speedup off": Case("float8_rowwise_filter_off", {"precision": {**_ROWWISE, **_OFF}}),
    "torchao rowwise by hand (torchtitan)": Case("hand_rowwise", None, hand="rowwise",
                                                 predict_as={"precision": {**_ROWWISE, **_OFF}}),
    "te Float8CurrentScaling": Case("te_Float8CurrentScaling", {"precision": {
        "load_dtype": "bf16", "mixed_precision": "bf16", "master_weights": "fp32", "reduce_dtype": "fp32",
        "fp8": {"backend": "te", "te": {"recipe": "current"}}}}, compile=False, published="no published figure"),
}
HAND_OF = {"hand_tensorwise": "float8_tensorwise", "hand_rowwise": "float8_rowwise"}  # anchor -> fp8dist side
# The profiler's parts (--profile-steps), and the speed model's parts (fp8dist/estimate/step.py PARTS) they hold.
PROFILE_PARTS = ("fp8_gemms", "bf16_gemms", "casts", "attention", "optimizer", "communication", "other")
PREDICTED_PARTS = {"fp8_gemms": ("fp8_gemms",), "bf16_gemms": ("high_precision_gemms",), "casts": ("casts",),
                   "attention": ("attention",), "optimizer": ("optimizer",),
                   "communication": ("communication_exposed",), "other": ("norms_elementwise", "recompute")}


def gpu_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (this benchmark measures real FP8 GEMMs: H100/H200, SM 8.9+)"
    from fp8dist.facts.torchao import torchao_fp8_hardware
    capability = torch.cuda.get_device_capability(0)
    ok, why = torchao_fp8_hardware("tensorwise", capability)
    if not ok:
        return f"{torch.cuda.get_device_name(0)}: {why}"
    return None


def skip_reason(name: str, capability) -> str | None:
    from fp8dist.facts.torchao import torchao_fp8_hardware
    if "rowwise" in CASES[name].slug:
        ok, why = torchao_fp8_hardware("rowwise", capability)
        if not ok:
            return why
    if CASES[name].slug.startswith("te_") and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    return None


# ---- Pure: no torch, unit-tested (tests/unit/test_gpu_throughput_parts.py) ----
_COMMUNICATION = ("nccl",)
_ATTENTION = ("flash_fwd", "flash_bwd", "flash::", "fmha", "efficient_attention", "attention_kernel")
_CASTS = ("amax", "cast_transpose", "quantize", "to_float8", "to_mx", "float8_cast")
_GEMM = ("gemm", "xmma", "nvjet", "cutlass", "s16816", "_scaled_mm")
_FP8 = ("e4m3", "e5m2", "f8f8", "fp8", "float8")
_BF16 = ("bf16", "s16816", "h16816")
_OPTIMIZER = ("adam", "multi_tensor_apply")


def kernel_part(name: str) -> str:
    """The part of the step a GPU kernel belongs to, by its name, conservatively: a GEMM counts as FP8 or bf16 only
    when its name says its input type (cuBLAS `nvjet_*` kernels often do not: then `other`), a cast only when its
    name says amax / quantize / cast-transpose; the optimizer is AdamW's and clipping's foreach kernels."""
    low = name.lower()
    if any(m in low for m in _COMMUNICATION):
        return "communication"
    if any(m in low for m in _ATTENTION):
        return "attention"
    if any(m in low for m in _CASTS):
        return "casts"
    if any(m in low for m in _GEMM):
        if any(m in low for m in _FP8):
            return "fp8_gemms"
        if any(m in low for m in _BF16):
            return "bf16_gemms"
        return "other"
    if any(m in low for m in _OPTIMIZER):
        return "optimizer"
    return "other"


def parts_of(kernels, steps: int = 1) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(milliseconds per step of each of PROFILE_PARTS, the `other` kernels by time, largest first) from (kernel
    name, total device microseconds) pairs measured over `steps` steps."""
    parts = dict.fromkeys(PROFILE_PARTS, 0.0)
    other: dict[str, float] = {}
    for name, micros in kernels:
        part = kernel_part(name)
        parts[part] += micros / 1000 / steps
        if part == "other":
            other[name] = other.get(name, 0.0) + micros / 1000 / steps
    return parts, sorted(other.items(), key=lambda kv: -kv[1])


def predicted_parts(step_parts) -> dict[str, float]:
    """The speed model's seconds per step (fp8dist/estimate/step.py PARTS) as milliseconds in PROFILE_PARTS."""
    return {part: 1000 * sum(step_parts.get(p, 0.0) for p in PREDICTED_PARTS[part]) for part in PROFILE_PARTS}


def beside(measured: float | None, predicted: float | None, spec: str = ".3f") -> str:
    """`measured (predicted)`, a dash for a figure that is missing."""
    m = "-" if measured is None else format(measured, spec)
    return f"{m} ({'-' if predicted is None else format(predicted, spec)})"


def throughput_row(name: str, measured: tuple[float, float, float], predicted: tuple[float, float, float] | None,
                   published: str = "") -> str:
    """One line of the throughput table: tokens/s/GPU, peak GiB and the ratio to bf16, each measured with the
    speed model's prediction in parentheses."""
    tokens, peak, ratio = measured
    p = predicted or (None, None, None)
    return (f"{name:42s}{beside(tokens, p[0], '.0f'):>18s}{beside(peak, p[1], '.1f'):>14s}"
            f"{beside(ratio, p[2]):>16s}   {published}")


def parts_row(name: str, measured: dict[str, float], predicted: dict[str, float] | None) -> str:
    """One line of the profile table: milliseconds per step of each part, measured (predicted)."""
    cells = "".join(f"{beside(measured[p], predicted[p] if predicted else None, '.1f'):>16s}" for p in PROFILE_PARTS)
    return f"{name:42s}{cells}"


def layers_that_fit(peak_one: float, peak_two: float, capacity: float, headroom: float = HEADROOM,
                    most: int = MOST_LAYERS) -> int:
    """The most layers (1 to `most`) whose peak, extrapolated from the estimated peaks at one and two layers, stays
    within `headroom` of `capacity` (bytes)."""
    per_layer = max(peak_two - peak_one, 1.0)
    fit = int((capacity * headroom - (peak_one - per_layer)) // per_layer)
    return max(1, min(most, fit))


def result_names(slug: str, tokens: int, first: bool) -> list[str]:
    """The result names of one case's ratio to bf16 at `tokens` per micro-batch: the size's own, and for the first
    size the name run.py has always promised."""
    return [f"gpu_tokens_per_s_{slug}_vs_bf16_m{tokens}"] + ([f"gpu_tokens_per_s_{slug}_vs_bf16"] if first else [])


# ---- GPU only: behind gpu_problem's refusal ----
def llama_config(layers: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=seq_len,
                       tie_word_embeddings=False)


def case_spec(case: Case, args, seq_len: int, predict: bool = False):
    from fp8dist import load_config

    config = case.predict_as if predict and case.predict_as else case.config
    return load_config({**config, "compile": case.compile, "engine": "fsdp2",
                        "train": {**TRAIN, "micro_batch_size": args.micro_batch, "seq_len": seq_len}})


def shape_folder(layers: int, seq_len: int) -> str:
    """A folder with the benchmark model's config.json (for the estimate)."""
    folder = Path(tempfile.mkdtemp(prefix="gpu_throughput_"))
    config = llama_config(layers, seq_len).to_dict()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def estimated(case: Case, args, layers: int, seq_len: int, world: int, gpu: str | None):
    """fp8dist's estimate of the case on `gpu` (its `speed`: the step prediction), None without a known GPU."""
    from fp8dist.estimate.memory import estimate

    if gpu is None:
        return None
    return estimate(shape_folder(layers, seq_len), case_spec(case, args, seq_len, predict=True), world, gpu)


def fitting_layers(args, seq_len: int, world: int, gpu: str | None) -> int:
    import torch

    if args.layers:
        return args.layers
    if gpu is None:
        return 8
    peaks = [max(estimated(CASES["bf16"], args, n, seq_len, world, gpu).phases_bytes.values()) for n in (1, 2)]
    return layers_that_fit(*peaks, torch.cuda.get_device_properties(0).total_memory)


def fp8dist_side(case: Case, model, args, seq_len: int):
    """fp8dist's own preparation (engines.fsdp2.prepare + train_step): a step function."""
    from fp8dist.engines.fsdp2 import prepare, train_step

    spec = case_spec(case, args, seq_len)
    run = prepare(model, spec)
    return lambda batch: train_step(run, [batch], spec.train.gradient_clipping)


def hand_side(case: Case, model, args, seq_len: int):
    """torchao's recipe by hand as torchtitan applies it (torchtitan components/quantization/float8.py,
    models/llama3/infra/parallelize.py): fp32 masters, convert_to_float8_training with torchao's own auto filter
    (`_auto_filter_for_recipe`, lm_head kept out), each block compiled, fully_shard per block (the last block not
    resharded after forward) then the root in bf16 / fp32 reduce, AdamW as the config's, the scale precompute."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import (Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)

    spec = case_spec(case, args, seq_len, predict=True)  # the optimizer settings fp8dist's side uses
    model.float()
    gather = case.hand == "tensorwise"
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(case.hand), enable_fsdp_float8_all_gather=gather)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=_auto_filter_for_recipe(case.hand, filter_fqns=["lm_head"]))
    layers = model.model.layers
    for block in layers:
        block.compile()  # in place, as torchtitan's apply_compile
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index, block in enumerate(layers):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    o = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay)

    def step(batch):
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gather:
            precompute_float8_dynamic_scale_for_fsdp(model)

    return step


def profiled_parts(step, batch, steps: int):
    """torch.profiler over `steps` steps: milliseconds per step by part, and the largest `other` kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(batch)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total) for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return parts_of(kernels, steps)


def timed(step, batch, args) -> tuple[float, float]:
    """(seconds of args.steps steps after args.warmup, peak GiB)."""
    import torch

    for _ in range(args.warmup):
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def run_case(case: Case, args, layers: int, seq_len: int):
    """(tokens/s per GPU, peak GiB) of one case, the slowest rank's, and its profile (parts, other kernels)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fp8dist.runtime.models import causal_lm_batch

    # Each case compiles its own blocks: a cache shared with the previous case's Linear types recompiles every
    # block until dynamo's recompile limit (8) and then runs eager (seen on an H100: float8 0.64x, rowwise 0.49x)
    torch._dynamo.reset()
    config = llama_config(layers, seq_len)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    step = (hand_side if case.hand else fp8dist_side)(case, model, args, seq_len)
    make = causal_lm_batch(config.vocab_size)
    batch = {k: v.cuda() for k, v in make(args.micro_batch, seq_len, dist.get_rank()).items()}
    seconds, peak = timed(step, batch, args)
    profile = profiled_parts(step, batch, args.profile_steps) if args.profile_steps else None
    del step, model
    torch.cuda.empty_cache()
    figures = torch.tensor([args.micro_batch * seq_len * args.steps / seconds, peak], device="cuda")
    dist.all_reduce(figures, op=dist.ReduceOp.MIN)  # the slowest rank sets the pace
    return (float(figures[0]), float(figures[1])), profile


def prediction(case: Case, args, layers: int, seq_len: int, gpu: str | None):
    """(tokens/s per GPU, peak GiB, FP8 / bf16) and the parts in ms per step that the speed model predicts."""
    import torch.distributed as dist

    result = estimated(case, args, layers, seq_len, dist.get_world_size(), gpu)
    if result is None or result.speed is None:
        return None, None
    ratio = 1.0 if case.slug == "bf16" else result.speed.fp8_over_bf16
    return ((result.speed.tokens_per_s, max(result.phases_bytes.values()) / 2**30, ratio),
            predicted_parts(result.speed.parts))


def report_size(tokens: int, first: bool, rows: dict, args) -> None:
    """Rank 0's tables and result lines of one size (rows: name -> (figures, profile, predicted, parts))."""
    bf16 = rows["bf16"][0][0]
    print(f"{'case':42s}{'tokens/s/GPU':>18s}{'peak GiB':>14s}{'vs bf16':>16s}   published   [measured (predicted)]")
    for name, (figures, _, predicted, _) in rows.items():
        case = CASES[name]
        print(throughput_row(name, (*figures, figures[0] / bf16), predicted, case.published), flush=True)
        if case.slug != "bf16":
            for key in result_names(case.slug, tokens, first):
                result(key, figures[0] / bf16, "info", f"{name}, {tokens} tokens/micro-batch; predicted "
                       f"{predicted[2]:.3f}" if predicted else f"{name}, {tokens} tokens/micro-batch")
    by_slug = {CASES[name].slug: figures[0] for name, (figures, *_) in rows.items()}
    for hand, ours in HAND_OF.items():
        if hand in by_slug and ours in by_slug:
            result(f"gpu_fp8dist_over_hand_{ours.split('_')[1]}_m{tokens}", by_slug[ours] / by_slug[hand], "info",
                   "fp8dist (min_speedup auto) tokens/s / torchao by hand as torchtitan does it")
    if args.profile_steps:
        print(f"\nms per step by part [measured (predicted); communication: kernel time measured, exposed time "
              f"predicted; other: norms, elementwise, unclassified kernels]")
        print(f"{'case':42s}" + "".join(f"{p:>16s}" for p in PROFILE_PARTS))
        for name, (_, profile, _, parts) in rows.items():
            print(parts_row(name, profile[0], parts))
        for name, (_, profile, _, _) in rows.items():
            print(f"  largest 'other' kernels of {name.strip()}: "
                  + "; ".join(f"{k[:60]} {ms:.1f}" for k, ms in profile[1][:3]))


def run_size(tokens: int, first: bool, args, capability, gpu: str | None) -> None:
    import torch
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    seq_len = tokens // args.micro_batch
    layers = fitting_layers(args, seq_len, dist.get_world_size(), gpu)
    if rank0:
        print(f"\n{torch.cuda.get_device_name()} x {dist.get_world_size()}, Llama-3-shaped, {layers} layers, "
              f"micro-batch {args.micro_batch} x {seq_len} tokens, {args.steps} timed steps after {args.warmup}; "
              f"predictions: {gpu or 'none (a GPU the speed model does not know)'}", flush=True)
    rows = {}
    for name, case in CASES.items():
        reason = skip_reason(name, capability)
        if reason:
            if rank0:
                print(f"{name:42s}  skipped: {reason}", flush=True)
            continue
        figures, profile = run_case(case, args, layers, seq_len)
        rows[name] = (figures, profile, *prediction(case, args, layers, seq_len, gpu))
    if rank0:
        report_size(tokens, first, rows, args)


def worker(args) -> None:
    import torch

    from fp8dist.facts.hardware import gpu_from_device_name

    quiet_libraries()
    process_group.init()  # NCCL, the device of LOCAL_RANK
    capability = torch.cuda.get_device_capability()
    gpu = gpu_from_device_name(torch.cuda.get_device_name())
    for index, tokens in enumerate(args.tokens):
        run_size(tokens, index == 0, args, capability, gpu)
    leave(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                        help="tokens per micro-batch, one run of every case each (default: 4096 8192 16384)")
    parser.add_argument("--layers", type=int, default=0,
                        help="decoder layers (default: as many as the estimate fits in 80%% of the GPU's memory)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (torch.compile happens here)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler per case (0: none)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; without an FP8 GPU it refuses, exit 2")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.tokens, args.steps, args.warmup, args.profile_steps = 1, [512], 2, 1, 1
    if under_torchrun():
        worker(args)
        return 0
    problem = gpu_problem()
    if problem:
        print(f"gpu_throughput.py: refusing: {problem}.\n  fix: run it on an H100/H200 node "
              "(python benchmarks/gpu_throughput.py); the CPU benchmarks are in benchmarks/run.py", file=sys.stderr)
        return 2
    import torch

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return relaunch(os.path.abspath(__file__), torch.cuda.device_count(), sys.argv[1:], env)


if __name__ == "__main__":
    raise SystemExit(main())
