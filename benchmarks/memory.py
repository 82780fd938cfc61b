"""Memory per parameter: bytes per parameter held for weights, master weights, gradients and optimizer
states, measured by the audit (`fp8dist audit tiny-llama --config X --nproc 2`) for each example config,
next to what the documented dtype tables imply for that config (fp8dist.audit.expected.implied_bytes_per_param).

    python benchmarks/memory.py [--only CONFIG ...]
    python benchmarks/memory.py --smoke          # fsdp2-bf16 only: every kind of figure once, not a measurement

Bytes are per element of each store as held on a rank (ZeRO / FSDP2 partitions divide the count of
elements, not the bytes per element), from the storage of each tensor, so float8 and low-bit states count
1 byte. Transient copies (FSDP2's unsharded bf16 parameters during forward, activations) are not counted.
FSDP2's sharded weights are the master copy, so its `master` column is 0. Goal per config: measured total =
implied total (within 1%). Configs that need a GPU library (Transformer Engine, MS-AMP, DeepSpeed fp16)
show the implied figures only. Also printed: the optimizer memory MS-AMP O2 saves over O1 by the table
(the "up to 62.5%" of the MS-AMP docs).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, SMOKE_HELP, cpu_env, quiet_libraries, result  # noqa: E402

PARTS = ("weights", "master", "gradients", "optimizer")
# Need CUDA or a GPU-only library: implied figures only.
GPU_ONLY = {"deepspeed-fp16": "DeepSpeed's CPU accelerator has no fp16", "deepspeed-te": "needs Transformer Engine",
            "te": "needs Transformer Engine", "msamp-o1": "needs MS-AMP", "msamp-o2": "needs MS-AMP",
            "msamp-o3": "needs MS-AMP"}


def configs(only: list[str]) -> list[str]:
    names = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    return [n for n in names if not only or n in only]


def measured(config: str) -> dict[str, float]:
    from fp8dist.commands.audit import measure

    os.environ.update({k: v for k, v in cpu_env().items() if k in ("OMP_NUM_THREADS", "DS_ACCELERATOR")})
    report = measure("tiny-llama", str(ROOT / "configs" / f"{config}.yaml"), nproc=2, steps=1)
    return {part: report["bytes_per_param"].get(part, 0.0) for part in PARTS}


def fmt(parts: dict[str, float] | None) -> list[str]:
    return [f"{parts[p]:g}" for p in PARTS] + [f"{sum(parts.values()):g}"] if parts else ["-"] * 5


def main() -> None:
    from fp8dist import load_config
    from fp8dist.audit.expected import implied_bytes_per_param

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="config names (stems in configs/)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    only = ["fsdp2-bf16"] if args.smoke else args.only
    quiet_libraries()
    header = ["config", *(f"{p}" for p in PARTS), "total"]
    print("bytes per parameter: measured (audit, tiny-llama, 2 ranks) / implied by the documented tables")
    print(f"{header[0]:24s}" + "".join(f"{h:>16s}" for h in header[1:]))
    for name in configs(only):
        implied = implied_bytes_per_param(load_config(str(ROOT / "configs" / f"{name}.yaml")))
        seen = None if name in GPU_ONLY else measured(name)
        cells = [f"{m}/{i}" for m, i in zip(fmt(seen), fmt(implied))]
        print(f"{name:24s}" + "".join(f"{c:>16s}" for c in cells) + (f"   (not here: {GPU_ONLY[name]})" if name in
                                                                         GPU_ONLY else ""), flush=True)
        if seen is not None:
            result(f"bytes_per_param_{name}", sum(seen.values()) / sum(implied.values()), "=1",
                   f"measured {sum(seen.values()):g} / implied {sum(implied.values()):g} bytes per parameter")
    o1, o2 = (implied_bytes_per_param(load_config({"precision": {"preset": p}}))["optimizer"]
              for p in ("msamp-o1", "msamp-o2"))
    print(f"MS-AMP optimizer states by table A: O1 {o1:g} bytes/param, O2 {o2:g} -> {1 - o2 / o1:.1%} less "
          "(MS-AMP docs: 'up to 62.5%'); not measurable here (MS-AMP needs CUDA)")
    result("msamp_o2_optimizer_saving_by_table", 1 - o2 / o1, "=0.625", "implied by table A, not measured here")


if __name__ == "__main__":
    main()
