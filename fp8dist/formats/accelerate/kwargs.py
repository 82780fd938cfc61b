"""`accelerator_kwargs(config)`: everything to build an `accelerate.Accelerator` equivalent to an fp8dist config.

    from accelerate import Accelerator
    from fp8dist.integrations import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs("fp8dist.yaml"))

Returns `mixed_precision`, the plugin (`fsdp_plugin`: FullyShardedDataParallelPlugin with fsdp_version 2 and a
MixedPrecisionPolicy; or `deepspeed_plugin`: DeepSpeedPlugin around fp8dist's DeepSpeed translation), the FP8
kwargs handler (AORecipeKwargs with a full Float8LinearConfig and fp8dist's module filter; TERecipeKwargs, or the
deprecated FP8RecipeKwargs under DeepSpeed, the one class Accelerate 1.15's DeepSpeed path reads), a
TorchDynamoPlugin for `compile`, and a ParallelismConfig for hybrid sharding, tensor and context parallel (the
script then loads the model split, from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh),
and runs each step in accelerator.maybe_context_parallel; DeepSpeed's AutoTP rides in its config). Python can say
more than a config file (reduce dtype, any torchao recipe, emulation, fp8dist's module filter, the mesh sizes from
WORLD_SIZE, FP8 under DeepSpeed); what Accelerate still cannot do is refused as in `translate --to accelerate`
(docs/accelerate.md).
accelerate and torch are imported when this is called, not when fp8dist.integrations is imported.
"""
from __future__ import annotations

import dataclasses
import os
from fnmatch import fnmatchcase
from typing import Any

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.errors import Fp8distError
import fp8dist.dtypes as dtypes
from fp8dist.facts.peft import is_lora_module, peft_base_name
from fp8dist.formats.accelerate.translate import accelerate_plan



def as_spec(config) -> Spec:
    """A path, a dict (or omegaconf DictConfig) or a Spec, as fp8dist.audit.watch takes its config."""
    return config if isinstance(config, Spec) else load_config(config)


def resolve_world_size(given: int | None, key: str) -> int:
    """`given`, else WORLD_SIZE; `key`: the config key that needs it, for the message."""
    if given is not None:
        return int(given)
    value = os.environ.get("WORLD_SIZE")
    if not value:
        raise Fp8distError(f"{key}: Accelerate's ParallelismConfig needs the world size (its sizes multiply to it), "
                           "and WORLD_SIZE is not set\n  fix: call it inside the launched script (accelerate launch / "
                           "torchrun set WORLD_SIZE) or pass world_size=N")
    return int(value)


def parallelism_config(spec: Spec, world_size: int | None):
    """Accelerate's ParallelismConfig for the FSDP2 mesh of `spec` on `world_size` ranks (else WORLD_SIZE): the sizes
    of fp8dist's own mesh axes (fp8dist.config.parallel.ParallelDims.of), which refuses what does not divide."""
    from accelerate import ParallelismConfig

    par = spec.parallel
    key = ("parallel.shard_size" if par.sharding == "hybrid" else
           "parallel.tensor_size" if par.tensor_size > 1 else "parallel.context_size")
    dims = ParallelDims.of(spec, resolve_world_size(world_size, key), "accelerate launch --num_processes")
    return ParallelismConfig(dp_replicate_size=dims.dp_replicate, dp_shard_size=dims.dp_shard, tp_size=dims.tp,
                             cp_size=dims.cp)


class LinearFilter:
    """torchao module_filter_fn with fp8dist's rules (fp8dist/backends/module_filter.py): a Linear matching an
    exclude glob (full name or last component) stays high precision, as one whose dims are not multiples of
    `dims_multiple_of` (None: pad_inner_dim pads them), and a LoRA adapter's own Linear (the script applied PEFT
    before accelerator.prepare)."""

    def __init__(self, exclude, dims_multiple_of: int | None):
        self.exclude, self.dims_multiple_of = list(exclude), dims_multiple_of

    def __call__(self, module, fqn: str) -> bool:
        if is_lora_module(fqn):
            return False
        fqn = peft_base_name(fqn)  # exclusions name the base model's modules
        if any(fnmatchcase(fqn, p) or fnmatchcase(fqn.rsplit(".", 1)[-1], p) for p in self.exclude):
            return False
        dim = self.dims_multiple_of
        shape = (getattr(module, "in_features", 0), getattr(module, "out_features", 0))
        return not (dim and any(size % dim for size in shape))


def accelerator_kwargs(config, *, world_size: int | None = None, deepspeed_version: str | None = None,
                       torchao_version: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `accelerate.Accelerator` equivalent to `config` (path, dict or Spec). With
    `adapter.kind=lora` the script applies the adapters itself before `accelerator.prepare`:
    `peft.get_peft_model(model, fp8dist.backends.adapters.lora_config(spec.adapter), autocast_adapter_dtype=False)`
    and an optimizer over the trainable parameters (tests/distributed/scripts/frontend_runs.py does)."""
    spec = as_spec(config)
    plan = accelerate_plan(spec, "python", deepspeed_version=deepspeed_version, torchao_version=torchao_version)
    kwargs: dict[str, Any] = {}
    handlers: list[Any] = []
    if plan["ddp"]:
        kwargs["mixed_precision"] = plan["mixed_precision"]  # DDP: no plugin (accelerate's MULTI_GPU)
    elif plan["fsdp"]:
        kwargs["mixed_precision"] = plan["mixed_precision"]
        kwargs["fsdp_plugin"] = fsdp_plugin(plan)
        if plan["fsdp"]["parallelism"]:
            kwargs["parallelism_config"] = parallelism_config(spec, world_size)
    else:
        # DeepSpeed's own sections decide the precision; Accelerate's fp8 mode is the only one to name
        # (accelerate 1.15 state.py: DeepSpeed's mixed_precision is read back from the config).
        from accelerate.utils import DeepSpeedPlugin

        kwargs["mixed_precision"] = "fp8" if plan["fp8"] else "no"
        ds = plan["deepspeed"]
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds["config"], zero3_init_flag=ds["zero3_init_flag"],
                                                     enable_msamp=bool(plan["fp8"]
                                                                       and plan["fp8"]["backend"] == "msamp"))
    if plan["fp8"] and plan["fp8"]["backend"] != "msamp":
        handlers.append(fp8_handler(plan))
    if plan["compile"]:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor",
                                                    use_regional_compilation=plan["compile"]["regional"])
    if handlers:
        kwargs["kwargs_handlers"] = handlers
    return kwargs


def fsdp_plugin(plan: dict[str, Any]):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    fs = plan["fsdp"]
    policy = fs["policy"]
    dtype = {name: dtypes.torch_dtype(value) if value else None
             for name, value in policy.items() if name != "cast_forward_inputs"}
    if (plan["mixed_precision"] == "no" and policy["reduce_dtype"] == plan["load_dtype"]
            and policy["cast_forward_inputs"]):
        mp_policy = None  # FSDP2's default: everything in the parameters' dtype
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype["param_dtype"], reduce_dtype=dtype["reduce_dtype"],
                                         output_dtype=dtype["output_dtype"],
                                         cast_forward_inputs=policy["cast_forward_inputs"])
    # Accelerate's own offload policy pins host memory, which needs an accelerator (torch 2.13 _fsdp_param.py
    # pin_memory: "Cannot access accelerator device" on a CPU-only node); pinned only where CUDA exists, as in
    # fp8dist's runtime.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fs["offload_params"] else False
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=fs["reshard_after_forward"], cpu_offload=offload,
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=fs["wrap"],
        activation_checkpointing=fs["activation_checkpointing"],
        cpu_ram_efficient_loading=fs["cpu_ram_efficient_loading"], mixed_precision_policy=mp_policy)


def fp8_handler(plan: dict[str, Any]):
    fp8 = plan["fp8"]
    if fp8["backend"] == "torchao":
        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig

        knobs = dict(fp8["float8_linear_config"])
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(knobs.pop("recipe_name")), **knobs)
        rules = fp8["module_filter"]
        # skip_first_last: Accelerate's own filter (it alone sees the whole model); else fp8dist's.
        module_filter = (None if rules["accelerate_default"]
                         else LinearFilter(rules["exclude"], rules["dims_multiple_of"]))
        return AORecipeKwargs(config=config, module_filter_func=module_filter)
    recipe = dict(fp8["recipe"], use_mxfp8_block_scaling=fp8["use_mxfp8_block_scaling"])
    if plan["deepspeed"] is not None:
        # accelerate 1.15 accelerator.py _prepare_deepspeed wraps the forward with self.fp8_recipe_handler only,
        # so a TERecipeKwargs would be ignored there; FP8RecipeKwargs (deprecated) is the class it reads.
        from accelerate.utils import FP8RecipeKwargs

        return FP8RecipeKwargs(backend="TE", **recipe)
    from accelerate.utils import TERecipeKwargs

    return TERecipeKwargs(**recipe)
