"""The NVIDIA compute capabilities FP8 GEMMs need, shared by the libraries' own gates (torchao, Transformer Engine),
and the datasheet figures of the GPUs fp8dist's speed model knows (fp8dist/speed.py).

FP8 tensor-core GEMMs: SM 8.9 (Ada) and 9.0 (Hopper) (TransformerEngine 2.20 transformer_engine/pytorch/quantization.py
check_fp8_support); rowwise/axiswise scaling needs 9.0 (pytorch/ao v0.18.0 test/float8/test_base.py
test_axiswise_gemm); MXFP8/NVFP4 need SM 10.x (the same TE file, check_mxfp8_support, check_nvfp4_support).
"""
from __future__ import annotations

from dataclasses import dataclass

Capability = tuple[int, int]

FP8_MIN_CAPABILITY: Capability = (8, 9)
ROWWISE_MIN_CAPABILITY: Capability = (9, 0)
BLOCKWISE_MIN_CAPABILITY: Capability = (10, 0)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's vendor figures: dense tensor-core peaks (NVIDIA lists sparse figures with a footnote, "with
    sparsity"; the dense peak is half of it), memory bandwidth, the link between GPUs of one node, and the source."""

    name: str
    capability: Capability
    bf16_flops: float  # dense BF16 tensor-core FLOP/s
    fp8_flops: float  # dense FP8 tensor-core FLOP/s
    fp4_flops: float | None  # dense FP4 (NVFP4) tensor-core FLOP/s; None: no FP4 tensor cores
    memory_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per direction between two GPUs of a node (NVLink, else PCIe)
    intra_node_link: str
    source: str


# Across nodes, fp8dist assumes one 400 Gb/s NIC per GPU (50 GB/s per direction): the DGX/HGX H100, H200 and B200
# systems' eight ConnectX-7 400 Gb/s ports (DGX H100 datasheet, https://resources.nvidia.com/en-us-dgx-systems/
# ai-enterprise-dgx; DGX B200, https://www.nvidia.com/en-us/data-center/dgx-b200/), and the network torchtitan's
# published runs used ("400 Gb/s per GPU", pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md).
INTER_NODE_BANDWIDTH = 400e9 / 8

GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # H100 SXM: BF16 1,979 / FP8 3,958 TFLOPS "with sparsity", 3.35 TB/s, NVLink 900 GB/s (both directions)
    GpuSpec("h100", (9, 0), 989.5e12, 1979e12, None, 3.35e12, 450e9, "NVLink 4",
            "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column)"),
    # H200 SXM: the H100's tensor cores (BF16 1,979 / FP8 3,958 TFLOPS with sparsity), 4.8 TB/s, NVLink 900 GB/s
    GpuSpec("h200", (9, 0), 989.5e12, 1979e12, None, 4.8e12, 450e9, "NVLink 4",
            "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column)"),
    # HGX B200, per GPU: FP4 18 / FP8 9 / BF16 4.5 PFLOPS with sparsity, 7.7 TB/s, NVLink 5 1.8 TB/s
    GpuSpec("b200", (10, 0), 2.25e15, 4.5e15, 9e15, 7.7e12, 900e9, "NVLink 5",
            "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, individual GPU specifications)"),
    # L40S (Ada, SM 8.9): BF16 362.05 / FP8 733 TFLOPS dense (733 / 1,466 with sparsity), 864 GB/s, no NVLink:
    # PCIe Gen4 x16, 64 GB/s both directions
    GpuSpec("l40s", (8, 9), 362.05e12, 733e12, None, 864e9, 32e9, "PCIe Gen4 x16",
            "https://www.nvidia.com/en-us/data-center/l40s/ (datasheet)"),
)}

# The names the CUDA driver reports (torch.cuda.get_device_name) contain the product's model: "NVIDIA H100 80GB HBM3",
# "NVIDIA H200", "NVIDIA B200", "NVIDIA L40S". An H100 PCIe or NVL reports "H100 PCIe" / "H100 NVL": a different
# card (fewer FLOPs, HBM2e), which the speed model does not know.
_DEVICE_NAMES = (("h100", "H100", ("PCIE", "NVL")), ("h200", "H200", ("NVL",)), ("b200", "B200", ()),
                 ("l40s", "L40S", ()))


def gpu_from_device_name(name: str | None) -> str | None:
    """The speed model's name (GPUS) of a device by the name the driver reports, None for one it does not know."""
    upper = (name or "").upper()
    for key, model, other_cards in _DEVICE_NAMES:
        if model in upper and not any(other in upper for other in other_cards):
            return key
    return None


def run_gpu(setting: str, device_name: str | None) -> str | None:
    """hardware.gpu resolved: a named GPU as written, `auto` the device's (gpu_from_device_name), None for none."""
    return setting if setting != "auto" else gpu_from_device_name(device_name)
