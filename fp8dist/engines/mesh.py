"""The run's DeviceMesh, built once from its fp8dist.config.parallel.ParallelDims after the process group starts
(the runtime loop builds it and hands it to the engine; an engine set up alone builds it here too)."""
from __future__ import annotations

from fp8dist.config.parallel import ParallelDims


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_device_mesh(dims: ParallelDims):
    """A DeviceMesh over the default process group with the dims of `dims` (ParallelDims.mesh_shape). Named dims,
    so a later axis (cp, tp) is sliced by name: mesh["dp_shard"]."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = dims.mesh_shape()
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)
