"""The audit's measured bytes per parameter for every CPU-runnable example config, tiny-llama and small-llama,
in one 2-rank job: a `case` result line `<config>/<model>` with the bytes per parameter, on rank 0 (tests/distributed/test_estimate_vs_audit.py)."""
from __future__ import annotations

import json
import sys

import torch.distributed as dist

from fp8dist.runtime import process_group
from fp8dist.runtime.process_group import leave
from fp8dist.runtime.ranks import emit

from fp8dist.commands.audit_worker import observe
from fp8dist.config.load import load_config
from fp8dist.runtime.models import load_model
from tests.conftest import ROOT


def main(configs: list[str], models: list[str]) -> int:
    process_group.init(180, deepspeed=True)  # gloo; serves the FSDP2 configs too
    for config in configs:
        spec = load_config(ROOT / "configs" / f"{config}.yaml")
        for model in models:
            loaded = load_model(model, spec.precision.load_dtype, seed=spec.train.seed)
            report = observe(spec, loaded, 1)
            if dist.get_rank() == 0:
                emit("case", f"{config}/{model}", report["bytes_per_param"])
            dist.barrier()
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1].split(","), sys.argv[2].split(",")))
