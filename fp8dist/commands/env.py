"""`fp8dist env`: versions, device, compute capability, and which backends can run here (and why not)."""
from __future__ import annotations

import platform
from typing import Any

from fp8dist.commands.output import dump_json
from fp8dist.errors import ExitCode
from fp8dist.facts.msamp import MSAMP_DISTRIBUTION, msamp_install_hint, msamp_native_fp8, msamp_supports_deepspeed
from fp8dist.facts.torch import fsdp2_supported
from fp8dist.facts.torchao import torchao_fp8_hardware
from fp8dist.facts.transformer_engine import te_recipe_hardware, te_supported
import fp8dist.facts.versions
from fp8dist.facts.versions import parse_version
from fp8dist.machine import device_info
PACKAGES = {"torch": "torch", "deepspeed": "deepspeed", "torchao": "torchao", "transformers": "transformers",
            "transformer_engine": "transformer-engine", "msamp": MSAMP_DISTRIBUTION, "omegaconf": "omegaconf",
            "jsonschema": "jsonschema"}


def _importable(module: str) -> tuple[bool, str]:
    import importlib

    try:
        importlib.import_module(module)
        return True, "imports"
    except Exception as exc:  # TE raises RuntimeError/OSError without CUDA, not only ImportError
        return False, f"`import {module}` fails: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def backend_status(versions: dict[str, str | None], device: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cap = tuple(device["capability"]) if device["capability"] else None
    cuda = parse_version(device["cuda"]) if device["cuda"] else None
    out: dict[str, dict[str, Any]] = {}

    torch_v, deepspeed_v = versions.get("torch"), versions.get("deepspeed")
    te_v, msamp_v = versions.get("transformer_engine"), versions.get("msamp")
    ok, why = fsdp2_supported(parse_version(torch_v)) if torch_v else (False, "torch is not installed")
    out["fsdp2"] = {"usable": ok, "reason": why}
    out["deepspeed"] = ({"usable": True, "reason": f"deepspeed {deepspeed_v} installed"}
                        if deepspeed_v else {"usable": False, "reason": "pip install deepspeed"})

    if versions.get("torchao"):
        hw, hw_why = torchao_fp8_hardware("tensorwise", cap)
        out["torchao_float8"] = {"usable": True, "native_fp8": hw,
                                 "reason": hw_why if hw else f"{hw_why}; runs here only with "
                                 "precision.fp8.torchao.emulate=true (emulated float8, for tests)"}
    else:
        out["torchao_float8"] = {"usable": False, "reason": "pip install torchao"}

    if not te_v:
        out["transformer_engine"] = {"usable": False, "reason": "not installed: Transformer Engine needs CUDA to build "
                                     "and run (pip install transformer-engine[pytorch] on a CUDA machine)"}
    else:
        ok, why = te_supported(parse_version(te_v))
        if ok:
            ok, why = _importable("transformer_engine.pytorch")
        if ok:
            ok, why = te_recipe_hardware("delayed", cap, cuda)
        out["transformer_engine"] = {"usable": ok, "reason": why}

    if not msamp_v:
        why = f"not installed, and {msamp_install_hint()}"
        if deepspeed_v:
            fits, window = msamp_supports_deepspeed(parse_version(deepspeed_v))
            why += "" if fits else f"; and {window}"
        out["msamp"] = {"usable": False, "reason": why}
    else:
        ok, why = _importable("msamp")
        if ok and deepspeed_v:
            ok, why = msamp_supports_deepspeed(parse_version(deepspeed_v), parse_version(msamp_v))
        status = {"usable": ok, "reason": why}
        if ok:
            native, native_why = msamp_native_fp8(device["name"])
            status = {"usable": True, "native_fp8": native, "reason": why if native else f"{why}; {native_why}"}
        out["msamp"] = status
    return out


def verdict(status: dict[str, Any]) -> str:
    """`yes`, `no`, or `emulation only` for an FP8 backend that runs here without FP8 GEMM kernels (its formats and
    rounding, high-precision matmuls)."""
    if not status["usable"]:
        return "no"
    return "emulation only" if status.get("native_fp8") is False else "yes"


def report() -> dict[str, Any]:
    versions = {name: fp8dist.facts.versions.installed_version(dist) for name, dist in PACKAGES.items()}
    device = device_info()
    return {"python": platform.python_version(), "platform": platform.platform(), "versions": versions,
            "device": device, "backends": backend_status(versions, device)}


def render(info: dict[str, Any]) -> str:
    lines = [f"python      {info['python']}  ({info['platform']})"]
    for name, version in info["versions"].items():
        lines.append(f"{name:20s}{version or 'not installed'}")
    dev = info["device"]
    if dev["cuda_available"]:
        cap = ".".join(map(str, dev["capability"]))
        lines.append(f"device      {dev['name']} (compute capability {cap}, CUDA {dev['cuda']})")
    else:
        lines.append("device      CPU only (no CUDA GPU visible)")
    lines.append("")
    marks = {name: verdict(status) for name, status in info["backends"].items()}
    width = max(map(len, marks.values()))
    for name, status in info["backends"].items():
        lines.append(f"{marks[name]:{width}s}  {name:20s}{status['reason']}")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import sys

    info = report()
    sys.stdout.write(dump_json(info) if args.format == "json" else render(info))
    return ExitCode.OK
