"""Hugging Face Accelerate, as fp8dist's Accelerate translation drives it (a config file for `accelerate launch`, or
the objects fp8dist.integrations builds): the release it follows, and what Accelerate does with the FP8 and mixed
precision settings it is given. Paths are relative to the accelerate 1.15 wheel's accelerate/."""
from __future__ import annotations

from fp8dist.facts.versions import Version, fmt

# The Accelerate release whose config-file keys, launcher environment and recipe kwargs
# fp8dist/formats/accelerate/ (translate.py, importer.py, sections.py) follows (the installed one, PyPI).
ACCELERATE_KNOWN = (1, 15, 0)
# fp8_config.backend must hold FP8BackendType's value (utils/dataclasses.py): the launcher exports it as
# ACCELERATE_FP8_BACKEND and Accelerator.fp8_backend builds FP8BackendType(value) from it.
ACCELERATE_FP8_BACKEND = {"torchao": "AO", "te": "TE", "msamp": "MSAMP"}
# MSAMPRecipeKwargs / DeepSpeedPlugin.msamp_opt_level accept O1 and O2 only (utils/dataclasses.py OptLevel).
ACCELERATE_MSAMP_OPT_LEVELS = ("O1", "O2")
# torchao's module filter when a config file (not Python) sets up FP8: every nn.Linear except the first and the
# last one and those with a dim not divisible by 16 (utils/ao.py convert_model_to_fp8_ao, filter_linear_layers).
ACCELERATE_AO_DIM_MULTIPLE = 16
# The FSDP2 MixedPrecisionPolicy a config file can give: `mixed_precision` sets param_dtype, reduce_dtype and
# output_dtype to one dtype, fp8 meaning bf16 (utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision);
# and with any mixed precision fsdp2_prepare_model upcasts trainable parameters to fp32 (utils/fsdp_utils.py).
ACCELERATE_FP8_COMPUTE_DTYPE = "bf16"


def accelerate_matches(version: Version | None) -> tuple[bool, str]:
    """Is `version` the Accelerate release whose key names and behaviour the translation follows?"""
    if version is None:
        return False, (f"Accelerate is not installed here; the file follows Accelerate "
                       f"{fmt(ACCELERATE_KNOWN[:2])}.x (pip install 'accelerate>=1.15')")
    if version[:2] == ACCELERATE_KNOWN[:2]:
        return True, f"Accelerate {fmt(version)} is the {fmt(ACCELERATE_KNOWN[:2])}.x release the file follows"
    return False, (f"Accelerate {fmt(version)} is installed, the file follows {fmt(ACCELERATE_KNOWN[:2])}.x; check it "
                   "with `accelerate launch --config_file`")
