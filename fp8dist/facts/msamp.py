"""MS-AMP (Azure/MS-AMP): the DeepSpeed, Transformer Engine and torch releases each MS-AMP release works with, where it
runs FP8 GEMMs natively, and what its optimizer wrapper refuses. Paths are relative to the Azure/MS-AMP repository at
tag v0.4.0, its last release (2024-02-26), unless another is named."""
from __future__ import annotations

from fp8dist.facts import versions
from fp8dist.facts.torch import TORCH_FLOOR
from fp8dist.facts.versions import Version, fmt, parse_version

# MS-AMP <= 0.3 pins deepspeed==0.9.2 and passes `cpu_offload`, removed in DeepSpeed 0.10.1.
# MS-AMP 0.4 pins deepspeed==0.13.1; it needs use_multi_rank_bucket_allreduce (0.12.4) and breaks from
# 0.17.5, where DeepSpeedZeroOptimizer.__init__ gained the positional `optimizer_params`
# (pyproject.toml, msamp/deepspeed/runtime/engine.py).
# Each window: (label, first MS-AMP release it covers, last one, lowest DeepSpeed, highest DeepSpeed).
MSAMP_DEEPSPEED_WINDOWS = (
    ("MS-AMP <= 0.3 (pins deepspeed 0.9.2)", (0, 2, 0), (0, 3, 99), (0, 9, 2), (0, 10, 0)),
    ("MS-AMP 0.4 (pins deepspeed 0.13.1)", (0, 4, 0), (0, 4, 99), (0, 12, 4), (0, 17, 4)),
)
MSAMP_TESTED_DEEPSPEED = ((0, 9, 2), (0, 13, 1))
MSAMP_DISTRIBUTION = "ms-amp"  # pyproject name "MS-AMP"; set only by a source install (not on PyPI)
# The last release, the DeepSpeed it pins, and its image (pyproject.toml, docs/user-tutorial/container-images.mdx).
MSAMP_RELEASE, MSAMP_RELEASE_DEEPSPEED = (0, 4, 0), (0, 13, 1)
MSAMP_IMAGE = "ghcr.io/azure/msamp:v0.4.0-cuda12.2"
# `import msamp` imports msamp.te, which loads TE's `transformer_engine_extensions` (msamp/te/extension.py); TE
# renamed that module transformer_engine_torch in 1.8 (NVIDIA/TransformerEngine#877), and MS-AMP 0.4.0 pins TE v1.1
# (pyproject.toml). MS-AMP tests torch 1.14 and 2.1 only (.github/workflows/unit-tests.yaml: NGC 22.12 and 23.10).
# So MS-AMP lives in an environment of its own, below fp8dist's torch floor (TORCH_FLOOR).
MSAMP_MAX_TE, MSAMP_PINNED_TE, MSAMP_TESTED_TORCH = (1, 7, 0), (1, 1, 0), (2, 1, 0)


def msamp_install_hint() -> str:
    """Where MS-AMP runs, for messages: its own environment, and what fp8dist can and cannot do for it."""
    return (f"not on PyPI, and it needs an environment of its own: Transformer Engine <= {fmt(MSAMP_MAX_TE[:2])} "
            f"(`import msamp` loads TE's transformer_engine_extensions, renamed in TE 1.8; MS-AMP "
            f"{fmt(MSAMP_RELEASE)} pins TE {fmt(MSAMP_PINNED_TE[:2])}), torch {fmt(MSAMP_TESTED_TORCH[:2])} (below "
            f"fp8dist's torch floor {fmt(TORCH_FLOOR[:2])}) and deepspeed {fmt(MSAMP_RELEASE_DEEPSPEED)}: install it "
            f"from source (github.com/Azure/MS-AMP v{fmt(MSAMP_RELEASE)}) or use the {MSAMP_IMAGE} image, on a CUDA "
            f"GPU. fp8dist translates O1, O2 and O3 for it (`fp8dist translate --to deepspeed --deepspeed-version "
            f"{fmt(MSAMP_RELEASE_DEEPSPEED)}`, whose JSON msamp.deepspeed.initialize reads in that environment), but "
            f"fp8dist's own runtime, engines and audit cannot run there")


def installed_msamp() -> Version | None:
    version = versions.installed_version(MSAMP_DISTRIBUTION)
    return parse_version(version) if version else None


def msamp_supports_deepspeed(ds: Version, msamp: Version | None = None) -> tuple[bool, str]:
    """Can MS-AMP `msamp` (None: whichever release the user installs) drive DeepSpeed `ds`?"""
    windows = [w for w in MSAMP_DEEPSPEED_WINDOWS if msamp is None or w[1] <= msamp <= w[2]]
    if msamp is not None and not windows:
        return False, (f"MS-AMP {fmt(msamp)} is not a release fp8dist knows (newest known: "
                       f"{fmt(MSAMP_RELEASE)}, 2024-02-26); its DeepSpeed range is unknown")
    for label, _, _, low, high in windows:
        if low <= ds <= high:
            tested = " (the pinned, tested version)" if ds in MSAMP_TESTED_DEEPSPEED else \
                " (API-compatible by code reading; MS-AMP tested only its pin)"
            return True, f"DeepSpeed {fmt(ds)} is inside {label}: {fmt(low)}-{fmt(high)}{tested}"
    ranges = "; ".join(f"{label}: {fmt(lo)}-{fmt(hi)}" for label, _, _, lo, hi in windows)
    who = f"installed MS-AMP {fmt(msamp)}" if msamp else "every MS-AMP window"
    return False, f"DeepSpeed {fmt(ds)} is outside {who} ({ranges})"


# msamp.initialize (msamp/__init__.py) tests isinstance(optimizer, torch.optim.Adam) before AdamW and builds its
# low-bit optimizer from optimizer.defaults minus foreach/capturable/differentiable/fused. Since torch's "Refactor
# AdamW into Adam" (pytorch/pytorch#143710) AdamW subclasses Adam, so an AdamW becomes LBAdam, whose `use_adam=True`
# applies L2 weight decay instead of decoupled decay (msamp/optim/adamw_base.py), and both classes carry defaults
# LBAdamW.__init__ does not accept (TypeError).
MSAMP_REJECTED_OPTIMIZER_DEFAULTS = ("decoupled_weight_decay",)


# Real FP8 GEMMs in MS-AMP only when the GPU name contains "h100"; elsewhere emulated in 16-bit
# (msamp/common/utils/device.py Device.is_fp8_supported).
def msamp_native_fp8(gpu_name: str | None) -> tuple[bool, str]:
    if gpu_name and "h100" in gpu_name.lower():
        return True, f"'{gpu_name}' runs MS-AMP FP8 GEMMs natively"
    return False, (f"MS-AMP runs FP8 GEMMs natively only on GPUs named 'H100'; on "
                   f"'{gpu_name or 'no GPU'}' they are emulated in 16-bit (memory savings only)")
