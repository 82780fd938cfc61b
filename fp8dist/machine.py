"""What this machine is: the visible accelerator (name, compute capability, CUDA version). torch is imported only
when asked; installed package versions come from facts.versions.installed_version (metadata, no import)."""
from __future__ import annotations

from typing import Any


def device_info() -> dict[str, Any]:
    """The visible accelerator: name, compute capability and CUDA version (None on a CPU machine)."""
    info: dict[str, Any] = {"cuda_available": False, "name": None, "capability": None, "cuda": None}
    try:
        import torch
    except ImportError:
        return info
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info.update(cuda_available=True, name=torch.cuda.get_device_name(0),
                    capability=list(torch.cuda.get_device_capability(0)), count=torch.cuda.device_count())
    return info
