"""RAM-efficient loading of a local Hugging Face model directory (`parallel.cpu_ram_efficient_loading`):
no rank ever holds the full model.

FSDP2 (research/scaling.md 1.5, verified on gloo): build on the meta device in the master dtype, with the
buffers real (accelerate.init_empty_weights(include_buffers=False): RoPE's inv_freq is computed, not
stored); `fsdp2.prepare` converts, wraps, compiles and shards it; then `ShardOnRead.materialize`
allocates the local shards (`to_empty`), puts the buffers back and reads each rank's slices straight from
the safetensors files (torch.distributed.checkpoint's HuggingFaceStorageReader). It copies into the
sharded parameters: they keep the master dtype and torchao's float8 all-gather wrapper. The other load
path, `load_state_dict(assign=True)` on meta parameters, silently turns fp32 masters into the file's bf16
and drops the wrapper (scaling.md 1.5), which is why it is not used.

DeepSpeed: ZeRO-3 builds the model inside `deepspeed.zero.Init` (transformers does so while an
HfDeepSpeedConfig is alive, transformers 5.23 modeling_utils get_init_context) and loads each parameter
through GatheredParameters from rank 0's read; the config object is kept alive with the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8dist.errors import Fp8distError
from fp8dist.models import LoadedModel, causal_lm_batch, check_model_name, torch_dtype


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclass
class ShardOnRead:
    """Materialises a meta-built, sharded model from a Hugging Face directory, each rank reading its shards."""

    path: Path
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def file_formats(self) -> dict[str, int]:
        """Elements per storage format in the safetensors files (read from their headers, no tensor loaded)."""
        from safetensors import safe_open

        from fp8dist.audit.formats import short

        counts: dict[str, int] = {}
        for path in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    numel = 1
                    for dim in piece.get_shape():
                        numel *= dim
                    dtype = short(getattr(torch, _SAFETENSORS_DTYPES.get(piece.get_dtype(), "float32")))
                    counts[dtype] = counts.get(dtype, 0) + numel
        return counts

    def keep_buffers(self, model: torch.nn.Module) -> None:
        """The real buffers of the meta-built model (to_empty would leave them uninitialised)."""
        self.buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}

    def materialize(self, model: torch.nn.Module, device: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader

        self.keep_buffers(model)
        tied = _tie_groups(model)
        model.to_empty(device=device)
        _retie(model, tied)
        for name, saved in self.buffers.items():
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[attr] = saved.to(device)
        state = model.state_dict()
        try:  # tied weights (lm_head = embeddings) are not in the files: a partial load, then the tie holds
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(self.path)),
                     planner=DefaultLoadPlanner(allow_partial_load=True))
        except Exception as exc:  # dcp raises CheckpointException with every rank's cause
            raise Fp8distError(f"cannot read the weights of {self.path} shard by shard: "
                               f"{str(exc).strip().splitlines()[-1]}") from None
        model.load_state_dict(state)


def _tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), first the one FSDP2 registered it under."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """`to_empty` gives every module its own new parameter, which unties them; point the others back at the
    first, the one FSDP2's parameter tracks (torch 2.13 _fsdp_param.py reset_sharded_param reads the module
    it was first found on)."""
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            (model.get_submodule(owner) if owner else model).register_parameter(attr, shared)


def _hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_empty(path: Path, master_dtype: str) -> LoadedModel:
    """FSDP2: the model built on meta in the master dtype (buffers real), with the loader to call after
    sharding (`LoadedModel.materialize`)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = _hf_config(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(master_dtype))
    # init_empty_weights re-creates every parameter it sees registered, which undoes the tie transformers made
    # while building (accelerate 1.15 big_modeling.py register_empty_parameter): tie again, outside it.
    model.tie_weights()
    return LoadedModel(model, causal_lm_batch(config.vocab_size), str(path), materialize=ShardOnRead(path))


def load_zero3(path: Path, spec, ds_config: dict[str, Any]) -> LoadedModel:
    """DeepSpeed ZeRO-3: built partitioned inside zero.Init and loaded through GatheredParameters."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keepalive = HfDeepSpeedConfig(ds_config)  # while alive, from_pretrained builds under zero.Init
    config = _hf_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch_dtype(spec.precision.load_dtype))
    except Exception as exc:
        raise Fp8distError(f"cannot load the Hugging Face model in {path} under zero.Init: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return LoadedModel(model, causal_lm_batch(config.vocab_size), str(path), keepalive=keepalive)


def check_efficient_loading(name: str, spec) -> None:
    """RAM-efficient loading reads files: MODEL must be a local Hugging Face directory (said before launch)."""
    check_model_name(name)
    if spec.parallel.cpu_ram_efficient_loading and not Path(name).is_dir():
        raise Fp8distError(f"parallel.cpu_ram_efficient_loading reads a local Hugging Face model directory; MODEL "
                           f"{name!r} is built in memory\n  fix: save it first (model.save_pretrained(DIR)) and "
                           "pass --model DIR, or set parallel.cpu_ram_efficient_loading=false")


def load_for_run(name: str, spec) -> LoadedModel:
    """MODEL as the run needs it: RAM-efficiently where `parallel.cpu_ram_efficient_loading` says so (a local
    Hugging Face directory only), else fully on every rank (fp8dist.models.load_model)."""
    from fp8dist.config.rules import weight_dtype
    from fp8dist.models import load_model

    if not spec.parallel.cpu_ram_efficient_loading:
        return load_model(name, spec.precision.load_dtype, seed=spec.train.seed)
    check_efficient_loading(name, spec)
    if spec.engine == "deepspeed":
        from fp8dist.translate.deepspeed import to_deepspeed

        return load_zero3(Path(name), spec, to_deepspeed(spec))
    return load_empty(Path(name), weight_dtype(spec.to_dict()))
