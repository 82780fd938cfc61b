"""Will FP8 pay? The time of a Linear's three GEMMs (forward, input gradient, weight gradient) in bf16 and in each FP8
recipe fp8dist runs, plus the casts and scale computations the recipe adds, from each GPU's datasheet peaks
(fp8dist/facts/hardware.py) and a few efficiency figures, all in the block below. Torch-free: pure arithmetic.

The method is torchao's roofline (pytorch/ao benchmarks/float8/float8_roofline.py, torchao/testing/training/
roofline_utils.py): a GEMM takes max(FLOPs / achievable peak, bytes / achievable bandwidth); each cast is a
memory-bound pass over a tensor, counted in bytes read and written per element. What it adds:

- a fixed cost per GEMM and per memory-bound pass (launch, tail, the small scale kernels that come with a pass),
  which is what makes FP8 lose on small shapes;
- what torch.compile fuses and what it cannot. A cast whose tensor is made by an elementwise op (the SiLU x up
  product before down_proj, the activation gradients in backward) is fused into that op's kernel: the row-scaled
  float8 copy and the column amax are written by it, only the column-scaled cast is a pass of its own. A cast of a
  norm's output (q/k/v, gate/up) or of an opaque kernel's (attention, the residual stream's gradient, which a norm's
  backward makes) is not: compile does not fold a second reduction (the amax) into a norm's, so every pass runs
  alone. Weights are parameters, cast by passes of their own. Without compile every op of a cast is its own eager
  kernel through fp32 (torchao float8 `hp_tensor_and_scale_to_float8`: to fp32, multiply, clamp, cast);
- a cast pass moves more bytes than the roofline counts (column reductions, transposed writes, the scale
  arithmetic): CAST_BYTES_FACTOR, calibrated on compile's passes and applied to the libraries' hand-written
  quantizers too (Transformer Engine's, torchao's MXFP8 column cast), for want of a table that measures them. Eager
  ops are counted one by one at the plain achievable bandwidth, as are the elementwise ops around a Linear.

Calibrated against torchao's published H100 rowwise table (LayerNorm -> Linear -> Sigmoid, forward + backward,
compiled; pytorch/ao docs/static/fp8-rowwise-perf.png), by least squares on log speedup over its 216 shapes: three
parameters, GEMM_FIXED_S, PASS_FIXED_S and CAST_BYTES_FACTOR; everything else is a datasheet figure or torchao's own.
The table is not in the model: tests/unit/estimate/test_speed.py holds it and computes the error docs/speed.md
states. Figures for GPUs and recipes no table covers (H200, B200, L40S; tensorwise, MXFP8, Transformer Engine) are
the same physics with the same constants: predictions, not fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fp8dist.errors import Fp8distError
from fp8dist.facts.hardware import GPUS, GpuSpec
from fp8dist.facts.torchao import TORCHAO_MX_BLOCK, TORCHAO_RECIPE_MIN_CAPABILITY
from fp8dist.facts.transformer_engine import TE_RECIPES

# ---- Every constant of the speed model (hardware figures: fp8dist/facts/hardware.py) ----
# torchao roofline_utils.py, "NVIDIA H100": "pct_achievable_gemm_tops": 0.78 ("based on experimental observation
# with sample large inputs") and "pct_achievable_mem_bw": 0.92 (pointwise Triton kernels with large inputs); torchao
# uses both for B200 too ("for now, copy over from H100"), and so does fp8dist for every GPU.
GEMM_EFFICIENCY = 0.78
MEMORY_EFFICIENCY = 0.92
# Calibrated on torchao's rowwise H100 table (module docstring; median / worst error in docs/speed.md):
GEMM_FIXED_S = 1.6e-6  # per GEMM kernel: the efficiency curve FLOPs / (FLOPs + peak x 0.78 x this)
PASS_FIXED_S = 18.4e-6  # per memory-bound pass that is a kernel (or several small ones) of its own
CAST_BYTES_FACTOR = 3.27  # bytes torch.compile's cast passes move per byte the roofline counts
# FlashAttention-2, which torch's SDPA runs, "achieving only 35% utilization on H100" (FlashAttention-3, Shah et al.
# 2024, arXiv:2407.08608, abstract); used for forward and backward on every GPU. Backward: 2.5x the forward's FLOPs
# (FlashAttention-2, Dao 2023, arXiv:2307.08691, section 3.1: five matmuls against two, one recomputed).
ATTENTION_EFFICIENCY = 0.35
ATTENTION_BACKWARD_FLOPS = 2.5
# Share of a link's bandwidth a ring collective moves (NCCL's bus bandwidth on H100 NVLink and on 400 Gb/s
# InfiniBand is in this range: NVIDIA/nccl-tests doc/PERFORMANCE.md defines busBw); an assumption, not calibrated.
COMM_EFFICIENCY = 0.8
# Bytes per element a Llama-shaped block's elementwise work moves outside the GEMMs, forward + backward, compiled
# (fused: one read and one write per tensor and pass) and eager (HF's ops one by one, through fp32 where they upcast),
# and the passes each takes: per hidden element and norm (RMSNorm with its residual add; eager: to fp32, pow, mean,
# rsqrt, mul, to bf16, weight mul and their backward), per q/k element (RoPE), per intermediate element (SiLU x up),
# per logit (the loss: upcast, log-softmax, its gradient). Counted from transformers 5's Llama modeling code.
ELEMENTWISE = {  # kind -> ((compiled bytes, passes), (eager bytes, passes))
    "norm": ((14, 2), (112, 16)),
    "rope": ((8, 2), (36, 8)),
    "mlp_activation": ((16, 2), (24, 5)),
    "loss": ((12, 3), (32, 6)),
}
# AdamW reads and writes its master weight and both moments and reads the gradient (torch's fused / foreach kernels).
OPTIMIZER_PASSES = 4
# --------------------------------------------------------------------------------------------------------------

Format = Literal["bf16", "fp8", "fp4"]
Producer = Literal["norm", "elementwise", "opaque"]
Kind = Literal["cast", "kernel", "eager", "plain"]
# Bytes an element of each GEMM operand format occupies (FP4: two per byte).
ELEMENT_BYTES: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
TE_ONLY = ("current", "delayed", "block", "nvfp4")
RECIPES = TORCHAO_RECIPES + TE_ONLY
GPU_NAMES = tuple(GPUS)


@dataclass(frozen=True)
class Pass:
    """A memory-bound pass over one tensor: `nbytes` read + written per element, who runs it (`cast`: a kernel
    torch.compile generates, `kernel`: a library's hand-written quantizer, both at CAST_BYTES_FACTOR; `eager`: one ATen
    op of a cast, `plain`: an elementwise op that is not a cast), and whether it is folded into the kernel that makes
    the tensor (no kernel of its own, no fixed cost)."""
    nbytes: float
    kind: Kind
    fused: bool = False


def _p(*spec: float, kind: Kind = "cast") -> tuple[Pass, ...]:
    return tuple(Pass(b, kind) for b in spec)


_F = Pass  # a pass folded into the producer: _F(bytes, "cast", True)
_MX = 1 / TORCHAO_MX_BLOCK  # one e8m0 scale byte per block of 32
# torchao float8 eager: amax (abs r2 w2, max r2), then to fp32 (r2 w4), multiply (r4 w4), clamp (r4 w4), to float8
# (r4 w1); one cast per scaling axis; a transposed copy for the column-major operand (r1 w1).
_EAGER_CAST = (4, 2, 6, 8, 8, 5)
# (backend, recipe) -> tensor role -> passes, for: an unfused producer (norm, opaque, a parameter), an elementwise
# producer (fused), eager. torchao's passes follow roofline_utils.get_tensor_memory_traffic_ovhd_s.
_TORCHAO: dict[str, dict[str, tuple[tuple[Pass, ...], tuple[Pass, ...], tuple[Pass, ...]]]] = {
    "tensorwise": {  # amax, then one kernel writes the float8 copy row- and column-major (r2 w1 w1)
        "activation": (_p(2, 4), (_F(0, "cast", True), Pass(4, "cast")), _p(*_EAGER_CAST, 2, kind="eager")),
        "weight": (_p(2, 3, 3), _p(2, 3, 3), _p(*_EAGER_CAST, 2, kind="eager")),
    },
    "rowwise": {  # row amax + row-scaled cast (r2 w1), column amax (r2), column-scaled cast (r2 w1)
        "activation": (_p(3, 2, 3), (_F(1, "cast", True), Pass(3, "cast")),
                       _p(*_EAGER_CAST, *_EAGER_CAST, 2, kind="eager")),
        "weight": (_p(3, 2, 3), _p(3, 2, 3), _p(*_EAGER_CAST, *_EAGER_CAST, 2, kind="eager")),
    },
    "rowwise_with_gw_hp": {  # the weight gradient in bf16: activations row-scaled only; the weight both ways
        "activation": (_p(3), (_F(1, "cast", True),), _p(*_EAGER_CAST, kind="eager")),
        "weight": (_p(3, 3), _p(3, 3), _p(*_EAGER_CAST, *_EAGER_CAST, 2, kind="eager")),
    },
    "mxfp8": {  # row blocks by compile (r2 w1 + scales), column blocks by torchao's CUDA kernel
        "activation": ((Pass(3 + _MX, "cast"), Pass(3 + _MX, "kernel")),
                       (_F(1 + _MX, "cast", True), Pass(3 + _MX, "kernel")),
                       _p(*_EAGER_CAST, *_EAGER_CAST, kind="eager")),
        "weight": ((Pass(3 + _MX, "cast"), Pass(3 + _MX, "kernel")), (Pass(3 + _MX, "cast"), Pass(3 + _MX, "kernel")),
                   _p(*_EAGER_CAST, *_EAGER_CAST, kind="eager")),
    },
}
# Transformer Engine's quantizers are its own kernels (te.Linear is not compiled): per tensor, current scaling an
# amax (r2) and a cast-transpose (r2 w1 w1); delayed scaling the cast-transpose alone (its amax from the history);
# Float8BlockScaling, MXFP8 and NVFP4 quantize both layouts in one kernel with block scales (NVFP4: 4-bit values
# and an FP8 scale per 16, the random Hadamard transform of the weight-gradient operands in the same kernel).
_TE: dict[str, tuple[Pass, ...]] = {
    "current": _p(2, 4, kind="kernel"), "delayed": _p(4, kind="kernel"), "block": _p(4 + 2 / 128, kind="kernel"),
    "mxfp8": _p(4 + 2 * _MX, kind="kernel"), "nvfp4": _p(3 + 2 / 16, kind="kernel"),
}
_GEMMS: dict[str, tuple[Format, Format, Format]] = {
    "rowwise_with_gw_hp": ("fp8", "fp8", "bf16"), "nvfp4": ("fp4", "fp4", "fp4")}
_SCALE_BYTES = {"mxfp8": _MX, "block": 1 / 128, "nvfp4": 1 / 16}  # per operand element, read by the GEMM


def gpu_spec(gpu: str) -> GpuSpec:
    if gpu not in GPUS:
        raise Fp8distError(f"unknown GPU {gpu!r}: the speed model knows {', '.join(GPUS)}")
    return GPUS[gpu]


def recipe_backend(recipe: str, backend: str | None = None) -> str:
    """The backend a recipe name belongs to: torchao's four, Transformer Engine's; `mxfp8` is torchao's unless
    `backend` says te; MS-AMP is counted as per-tensor delayed scaling (its ScalingMeta) with kernels of its own."""
    if backend in ("te", "msamp") or (backend is None and recipe in TE_ONLY):
        if recipe not in _TE:
            raise Fp8distError(f"unknown Transformer Engine recipe {recipe!r}: one of {', '.join(_TE)}")
        return "te"
    if recipe not in _TORCHAO:
        raise Fp8distError(f"unknown FP8 recipe {recipe!r}: one of {', '.join(RECIPES)}")
    return "torchao"


def check_supported(recipe: str, gpu: str, backend: str | None = None) -> None:
    """Refuse a recipe the GPU has no tensor cores or kernels for (the libraries' own capability gates)."""
    spec, backend = gpu_spec(gpu), recipe_backend(recipe, backend)
    if backend == "torchao":
        low, high, what = TORCHAO_RECIPE_MIN_CAPABILITY[recipe], None, f"torchao {recipe}"
    else:
        record = TE_RECIPES[recipe]
        low, high, what = record.min_capability, record.max_capability, f"Transformer Engine {recipe} ({record.cls})"
    cap = spec.capability
    if cap < low or (high is not None and cap >= high):
        need = f">= {low[0]}.{low[1]}" + (f" and < {high[0]}.{high[1]}" if high else "")
        blackwell = " (Blackwell's MX / NVFP4 tensor cores)" if low >= (10, 0) else ""
        able = [name for name in GPU_NAMES if low <= gpu_spec(name).capability and (
            high is None or gpu_spec(name).capability < high)]
        raise Fp8distError(f"{what} does not run on {gpu}: it needs compute capability {need}{blackwell}, and {gpu} "
                           f"is SM {cap[0]}.{cap[1]}\n  fix: predict for a GPU that has it ({', '.join(able) or 'none'}"
                           f" of {', '.join(GPU_NAMES)}), or choose a recipe {gpu} runs")


def gemm_seconds(m: float, k: float, n: float, fmt: Format, gpu: str, scale_bytes: float = 0.0,
                 count: int = 1) -> float:
    """One GEMM (m x k) @ (k x n) in `fmt` (bf16 output), or `count` of that shape in one grouped kernel: compute-
    or memory-bound at the achievable fractions of peak, plus GEMM_FIXED_S."""
    spec = gpu_spec(gpu)
    peak = {"bf16": spec.bf16_flops, "fp8": spec.fp8_flops, "fp4": spec.fp4_flops}[fmt]
    if peak is None:
        raise Fp8distError(f"{gpu} has no {fmt} tensor cores")
    compute = 2 * m * k * n * count / (peak * GEMM_EFFICIENCY)
    operand = ELEMENT_BYTES[fmt] + scale_bytes
    memory = count * (operand * (m * k + k * n) + 2 * m * n) / (spec.memory_bandwidth * MEMORY_EFFICIENCY)
    return max(compute, memory) + GEMM_FIXED_S


def pass_seconds(numel: float, p: Pass, gpu: str) -> float:
    """One memory-bound pass over `numel` elements."""
    factor = CAST_BYTES_FACTOR if p.kind in ("cast", "kernel") else 1.0
    moved = numel * p.nbytes * factor / (gpu_spec(gpu).memory_bandwidth * MEMORY_EFFICIENCY)
    return moved + (0.0 if p.fused else PASS_FIXED_S)


def gemm_formats(recipe: str) -> tuple[Format, Format, Format]:
    """The formats of the forward, input-gradient and weight-gradient GEMMs of a recipe."""
    return _GEMMS.get(recipe, ("fp8", "fp8", "fp8"))


def cast_passes(recipe: str, role: Literal["activation", "weight"], producer: Producer | Literal["parameter"],
                compiled: bool, backend: str | None = None) -> tuple[Pass, ...]:
    """The passes a recipe spends on one tensor: an activation (the Linear's input, or its output gradient) made by
    `producer`, or the weight."""
    if recipe_backend(recipe, backend) == "te":
        return _TE[recipe]
    unfused, fused, eager = _TORCHAO[recipe][role]
    if not compiled:
        return eager
    return fused if producer == "elementwise" else unfused


@dataclass(frozen=True)
class LinearTimes:
    """Seconds of one Linear's forward + backward: its three GEMMs in bf16, in the recipe, and the recipe's casts."""
    bf16: float
    gemms: float
    casts: float

    @property
    def fp8(self) -> float:
        return self.gemms + self.casts

    @property
    def speedup(self) -> float:
        return self.bf16 / self.fp8


def linear_times(m: int, k: int, n: int, recipe: str, gpu: str, *, backend: str | None = None, compiled: bool = True,
                 input_from: Producer = "norm", grad_from: Producer = "elementwise", cast_input: bool = True,
                 weight_share: float = 1.0) -> LinearTimes:
    """A Linear of forward shape (M tokens, K in, N out). `input_from` / `grad_from`: what makes its input and its
    output's gradient (what compile can fuse the casts into); `cast_input` False: a sibling Linear's cast of the same
    input is reused (q/k/v, gate/up under compile); `weight_share`: the part of the weight this rank casts (float8
    all-gather casts each rank's shard before gathering; the gathered weight's transposed copy is then one pass)."""
    check_supported(recipe, gpu, backend)
    shapes = ((m, k, n), (m, n, k), (k, m, n))  # forward, input gradient, weight gradient
    bf16 = sum(gemm_seconds(*shape, "bf16", gpu) for shape in shapes)
    scale = _SCALE_BYTES.get(recipe, 0.0)
    gemms = sum(gemm_seconds(*shape, fmt, gpu, scale if fmt != "bf16" else 0.0)
                for shape, fmt in zip(shapes, gemm_formats(recipe)))
    casts = sum(pass_seconds(m * k, p, gpu) for p in cast_passes(recipe, "activation", input_from, compiled, backend)
                ) if cast_input else 0.0
    casts += sum(pass_seconds(m * n, p, gpu) for p in cast_passes(recipe, "activation", grad_from, compiled, backend))
    weight = cast_passes(recipe, "weight", "parameter", compiled, backend)
    if weight_share < 1.0:  # cast on the shard (amax and cast), then one transposed copy of the gathered float8
        casts += sum(pass_seconds(k * n * weight_share, p, gpu) for p in weight[:2])
        casts += pass_seconds(k * n, Pass(2, "cast" if compiled else "eager"), gpu)
    else:
        casts += sum(pass_seconds(k * n, p, gpu) for p in weight)
    return LinearTimes(bf16, gemms, casts)


def linear_speedup(m: int, k: int, n: int, recipe: str, gpu: str) -> float:
    """bf16 time / FP8 time of a Linear of forward shape (M tokens, K in, N out) in a compiled block, its input made
    by a norm and its output's gradient by elementwise ops (q/k/v, gate/up of a transformer block): its three GEMMs
    and the recipe's casts. Raises Fp8distError for a recipe the GPU lacks (MXFP8 and NVFP4 need Blackwell)."""
    return linear_times(m, k, n, recipe, gpu).speedup


def layernorm_linear_sigmoid_speedup(m: int, k: int, n: int, recipe: str = "rowwise", gpu: str = "h100") -> float:
    """The speedup torchao's table measures: LayerNorm -> Linear -> Sigmoid, forward + backward, compiled (pytorch/ao
    benchmarks/float8/float8_roofline.py LNLinearSigmoid). The norm (forward r2 w2, backward r4 w2) and the sigmoid
    (the same on the output) run in both; the sigmoid's backward makes the Linear's output gradient."""
    times = linear_times(m, k, n, recipe, gpu, input_from="norm", grad_from="elementwise")
    around = sum(pass_seconds(numel, Pass(b, "plain"), gpu) for numel in (m * k, m * n) for b in (4, 6))
    return (times.bf16 + around) / (times.fp8 + around)
