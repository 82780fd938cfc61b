"""The NVIDIA compute capabilities FP8 GEMMs need, shared by the libraries' own gates (torchao, Transformer Engine).

FP8 tensor-core GEMMs: SM 8.9 (Ada) and 9.0 (Hopper) (TransformerEngine 2.20 transformer_engine/pytorch/quantization.py
check_fp8_support); rowwise/axiswise scaling needs 9.0 (pytorch/ao v0.18.0 test/float8/test_base.py
test_axiswise_gemm); MXFP8/NVFP4 need SM 10.x (the same TE file, check_mxfp8_support, check_nvfp4_support).
"""
from __future__ import annotations

Capability = tuple[int, int]

FP8_MIN_CAPABILITY: Capability = (8, 9)
ROWWISE_MIN_CAPABILITY: Capability = (9, 0)
BLOCKWISE_MIN_CAPABILITY: Capability = (10, 0)
