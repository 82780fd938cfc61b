"""`fp8dist calibrate`'s measuring process, one per rank (launched under torchrun by fp8dist.commands.calibrate):
loads the model as a run of the config would, and runs precision.fp8.policy auto's calibration pass on the run's
first batches (fp8dist.audit.calibration); rank 0 writes the decision.

    python -m torch.distributed.run --nproc_per_node N -m fp8dist.commands.calibrate_worker
        MODEL CONFIG OVERRIDES OUT.json

OVERRIDES: the KEY=VALUE config overrides, one per line. The process group is up so that the ranks' measurements
are summed (each rank measures its own batches, as each rank of the run would train on them).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from fp8dist.audit.calibration import calibrate
from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.errors import Fp8distError
from fp8dist.facts.hardware import run_gpu
from fp8dist.machine import device_info
from fp8dist.runtime import loop, process_group
from fp8dist.runtime.data import SYNTHETIC_BATCHES
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.ranks import finish


def main(model_name: str, config: str, overrides: list[str], out_path: str) -> dict[str, Any]:
    try:
        import torch

        spec = load_config(config or None, overrides=overrides)
        process_group.init(spec.train.process_group_timeout_s)
        dims = ParallelDims.of(spec, process_group.world_size())  # this rank's layout, built once
        loaded = load_for_run(model_name, spec, dims=dims)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        loaded.model.to(device)
        steps = loop.calibration_steps(spec, loaded.make_batch, dims, SYNTHETIC_BATCHES, device)
        info = device_info()
        gpu = run_gpu(spec.hardware.gpu, info.get("name"))
        result = calibrate(spec, loaded.model, steps, gpu)
        return {"overrides": result.overrides, "report": result.report(), "summary": result.summary(),
                "decisions": [dataclasses.asdict(d) for d in result.decisions], "gpu": gpu,
                "device": info.get("name") or "cpu"}
    except Fp8distError as exc:
        return {"_error": str(exc)}


if __name__ == "__main__":
    model, config, overrides, out = sys.argv[1:5]
    finish(main(model, config, [o for o in overrides.split("\n") if o], out), out)
