"""The audit's measured bytes per parameter for every CPU-runnable example config, tiny-llama and small-llama,
in one 2-rank job: `CASE <config> <model> <json bytes_per_param>` on rank 0 (tests/distributed/test_estimate_vs_audit.py)."""
from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

from fp8dist.audit.worker import observe
from fp8dist.config.load import load_config
from fp8dist.models import load_model
from tests.conftest import ROOT


def main(configs: list[str], models: list[str]) -> int:
    import deepspeed

    deepspeed.init_distributed(timeout=timedelta(seconds=180))  # gloo; serves the FSDP2 configs too
    for config in configs:
        spec = load_config(ROOT / "configs" / f"{config}.yaml")
        for model in models:
            loaded = load_model(model, spec.precision.load_dtype, seed=spec.train.seed)
            report = observe(spec, loaded, 1)
            if dist.get_rank() == 0:
                print(f"CASE {config} {model} {json.dumps(report['bytes_per_param'])}", flush=True)
            dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1].split(","), sys.argv[2].split(",")))
