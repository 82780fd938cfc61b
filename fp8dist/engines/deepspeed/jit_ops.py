"""DeepSpeed's C++ ops that a run builds on this machine before its first step, said before the build starts.

DeepSpeed JIT-builds an op the first time a process needs it, through torch.utils.cpp_extension.load into torch's
extensions folder (deepspeed 0.19 ops/op_builder/builder.py OpBuilder.jit_load): on the CPU accelerator its
shared-memory collectives (`deepspeed_shm_comm`, built when the communication backend starts: comm/torch.py
build_shm_op) and, with the optimizer offloaded, DeepSpeedCPUAdam's op (`cpu_adam`). A build takes one to two
minutes on 2 cores and prints nothing; the built op stays in that folder and later runs load it in a second.
torch guards a build with a `lock` file in the op's folder (torch/utils/cpp_extension.py _jit_compile, FileBaton):
a build killed halfway leaves it behind, and every later run waits on it forever without a word. Both are said
here, once per process, on rank 0 (a stale lock on every rank: each would wait on it).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fp8dist.errors import UnsupportedEnvironment

# A lock older than this is taken for one a killed build left (a build of these ops takes 1-4 minutes here).
STALE_LOCK_S = 600
SHM_COMM = "ShareMemCommBuilder"  # the CPU accelerator's collectives (deepspeed/ops/op_builder/cpu/comm.py)
CPU_ADAM = "CPUAdamBuilder"  # DeepSpeedCPUAdam (deepspeed/ops/op_builder/cpu/cpu_adam.py on CPU)
_said: set[str] = set()


def build_folder(op_name: str) -> Path:
    """Where torch builds and keeps the op (TORCH_EXTENSIONS_DIR, else its cache folder per Python and CUDA)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op_name, verbose=False))


def say_builds(builder_names: tuple[str, ...]) -> None:
    """Before DeepSpeed loads these ops: say which it will build first (and where it keeps them), or refuse a
    stale build lock, naming the file and the fix."""
    from deepspeed.accelerator import get_accelerator

    for class_name in builder_names:
        builder = get_accelerator().create_op_builder(class_name)
        if builder is None or builder.name in _said or not builder.is_compatible(verbose=False):
            continue  # this accelerator does not build it, or DeepSpeed falls back without it
        folder = build_folder(builder.name)
        lock = folder / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            minutes = (time.time() - lock.stat().st_mtime) / 60
            raise UnsupportedEnvironment(
                f"DeepSpeed's {builder.name} op cannot be built: {lock} is a build lock left {minutes:.0f} minutes "
                "ago by a build that was stopped (torch waits for it to go away, so this run would hang without "
                "a word)",
                f"make sure no other run is building it, then delete {lock} (rm {lock})")
        _said.add(builder.name)
        if not (folder / f"{builder.name}.so").exists() and os.environ.get("RANK", "0") == "0":
            print(f"fp8dist: DeepSpeed builds its {builder.name} C++ op for this machine first (once: 1-2 minutes "
                  f"on 2 CPU cores, nothing printed meanwhile); later runs load it from {folder}",
                  file=sys.stderr, flush=True)
