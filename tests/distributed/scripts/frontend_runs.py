"""One fp8dist config through other frontends, step 1 audited with `fp8dist.audit.watch`, on 2 gloo ranks:

    accelerate launch --config_file FILE --num_processes 2 frontend_runs.py launched CONFIG
    torchrun --nproc_per_node 2 frontend_runs.py kwargs CONFIG [CONFIG ...]

`launched`: the Accelerator built from what `accelerate launch --config_file` (the file of `fp8dist translate
--to accelerate`) exported. `kwargs`: for each CONFIG, `Accelerator(**accelerator_kwargs(CONFIG))`, then the
same config run by fp8dist's own engine in the same processes, for reference. The script is what a user
writes: load the model, build the optimizer the config names, `accelerator.prepare`, `accelerator.backward`,
`optimizer.step()`. Rank 0 prints a `case` result line `<frontend>:<config>` with the observed cells.

Accelerate 1.15 applies an FSDP plugin only on GPU-like devices (state.py AcceleratorState.__init__: the FSDP
branch is under `distributed_type in [MULTI_GPU, ...]`); on CPU the same Accelerator silently runs DDP. So in
`kwargs` mode on CPU the script does what that branch does on a GPU: distributed_type FSDP, the plugin on the
state, the plugin's mixed precision. That is the one thing done here that a GPU run does not need.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.runtime.data import batches_for
from fp8dist.engines.optim import build_optimizer, trainable_parameters
from fp8dist.runtime import process_group
from fp8dist.backends.adapters import lora_config
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.models import load_model
from fp8dist.runtime.process_group import leave
from fp8dist.runtime.ranks import emit
from tests.distributed.case_runner import run_cases


def observed(report: dict) -> dict:
    return {"passed": report["passed"], "observed": {c["phase"]: c["observed"] for c in report["checks"]},
            "failing": sorted({p for ps in report.get("failing_by_rank", {}).values() for p in ps})}


def accelerator_for(config: str, launched: bool):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from fp8dist.integrations import accelerator_kwargs

    if launched:
        return Accelerator()
    kwargs = accelerator_kwargs(config)
    plugin = kwargs.get("fsdp_plugin")
    forced = plugin is not None and not torch.cuda.is_available()
    parallelism = kwargs.pop("parallelism_config", None) if forced else None  # refused on MULTI_CPU at __init__
    ddp_on_cpu = plugin is None and "deepspeed_plugin" not in kwargs and not torch.cuda.is_available()
    accelerator = Accelerator(cpu=forced or ddp_on_cpu, **kwargs)  # cpu=True: Accelerate's DDP over gloo (MULTI_CPU)
    if forced:
        state = accelerator.state  # what AcceleratorState.__init__'s FSDP branch does on a GPU (accelerate 1.15)
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        if kwargs.get("mixed_precision", "no") != "no":
            plugin.set_mixed_precision(kwargs["mixed_precision"])
        if parallelism is not None:  # and what Accelerator.__init__ does with a ParallelismConfig
            state.parallelism_config = parallelism
            state.device_mesh = parallelism.build_device_mesh("cpu")
    return accelerator


def through_accelerate(config: str, launched: bool) -> dict:
    import torch.distributed as dist

    spec = load_config(config)
    try:
        accelerator = accelerator_for(config, launched)
        loaded = load_model("tiny-llama", spec.precision.load_dtype)
        model = loaded.model
        if spec.adapter.enabled:  # what the translated file's header tells the script to do
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(spec.adapter), autocast_adapter_dtype=False)
        optimizer = build_optimizer(trainable_parameters(model), spec)
        model, optimizer = accelerator.prepare(model, optimizer)
        batch = batches_for(loaded.make_batch, spec, 0, dist.get_rank())[0]
        with watch(model, optimizer, spec, on_mismatch="ignore") as audit:
            loss = model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return {**observed(audit.report), "distributed_type": str(accelerator.state.distributed_type)}
    finally:
        _forget_accelerate()


def through_fp8dist(config: str) -> dict:
    import torch.distributed as dist

    spec = load_config(config)
    loaded = load_for_run("tiny-llama", spec)
    batches = batches_for(loaded.make_batch, spec, 0, dist.get_rank())
    if spec.engine == "deepspeed":
        from fp8dist.engines.deepspeed import initialize, train_step

        engine = initialize(loaded.model, spec, audit="warn")[0]
        train_step(engine, batches)
        return observed(engine.fp8dist_run.audit_report)
    from fp8dist.engines.fsdp2 import prepare, train_step

    run = prepare(loaded.model, spec, audit="warn")
    train_step(run, batches, spec.train.gradient_clipping)
    return observed(run.audit_report)


def _forget_accelerate() -> None:
    """The next case builds a new Accelerator in the same processes: drop the singleton state and the
    DeepSpeed ZeRO-3 config transformers keeps (it would build the next model inside zero.Init)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        del os.environ[key]


def main(mode: str, configs: list[str]) -> int:
    if mode == "launched":  # as a user script: the Accelerator sets up (or not) the process group
        out = through_accelerate(configs[0], True)
        if os.environ.get("RANK", "0") == "0":
            emit("case", f"launched:{Path(configs[0]).stem}", out)
    else:
        cases = {}
        for config in configs:
            cases[f"kwargs:{Path(config).stem}"] = lambda config=config: through_accelerate(config, False)
            cases[f"fp8dist:{Path(config).stem}"] = lambda config=config: through_fp8dist(config)
        process_group.init(deepspeed=True)  # gloo on the CPU accelerator; serves every case
        run_cases(cases)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2:]))
