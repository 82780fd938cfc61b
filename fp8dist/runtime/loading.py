"""RAM-efficient loading of a local Hugging Face model directory (`parallel.cpu_ram_efficient_loading`):
no rank ever holds the full model.

FSDP2 (as Accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model does it; verified on gloo): build on the meta device
in the master dtype, with the buffers real (accelerate.init_empty_weights(include_buffers=False): RoPE's inv_freq is
computed, not stored); `fsdp2.prepare` converts, wraps, compiles and shards it; then `ShardOnRead.materialize` allocates
the local shards (`to_empty`), puts the buffers back and reads each rank's rows straight from the safetensors files with
positional reads (`read_local_shards`). torch.distributed.checkpoint's HuggingFaceStorageReader reads the same slices
but through safetensors' mmap, and measured here it doubled the peak host memory of a rank
(benchmarks/loading_memory.py). It copies into the sharded parameters: they keep the master dtype and torchao's float8
all-gather wrapper. The other load path, `load_state_dict(assign=True)` on meta parameters, silently turns fp32 masters
into the file's bf16 and drops the wrapper (scaling.md 1.5), which is why it is not used.

DeepSpeed: ZeRO-3 builds the model inside `deepspeed.zero.Init` (transformers does so while an
HfDeepSpeedConfig is alive, transformers 5.23 modeling_utils get_init_context) and loads each parameter
through GatheredParameters from rank 0's read; the config object is kept alive with the model.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from fp8dist.config.parallel import ParallelDims, expert_count
from fp8dist.errors import Fp8distError
from fp8dist.facts.transformers import HF_MOE_CHECKPOINT_LAYOUT
import fp8dist.dtypes as dtypes
from fp8dist.dtypes import torch_dtype
from fp8dist.engines.advice import say
from fp8dist.backends.adapters import apply_adapter
from fp8dist.runtime.models import LoadedModel, causal_lm_batch, load_model
from fp8dist.config.models import BUILTIN, check_model_name
from fp8dist.engines.registry import profile_for
from fp8dist.translate import EnginePlan


def _torch_dtype(code: str, file: Path, tensor: str):
    """The torch dtype of a safetensors header's dtype code (fp8dist.dtypes)."""
    entry = dtypes.from_safetensors(code)
    if entry is None or not hasattr(torch, entry.torch):
        raise Fp8distError(f"{file}: {tensor} is stored as {code}, which fp8dist cannot read shard by shard "
                           f"(known: {', '.join(dtypes.safetensors_codes())}); set "
                           "parallel.cpu_ram_efficient_loading=false")
    return getattr(torch, entry.torch)


@dataclass
class ShardOnRead:
    """Materialises a meta-built, sharded model from a Hugging Face directory, each rank reading its shards."""

    path: Path
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def file_formats(self) -> dict[str, int]:
        """Elements per storage format in the safetensors files (read from their headers, no tensor loaded)."""
        from safetensors import safe_open

        from fp8dist.backends.storage import short

        counts: dict[str, int] = {}
        for path in model_files(self.path):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    numel = 1
                    for dim in piece.get_shape():
                        numel *= dim
                    dtype = short(_torch_dtype(piece.get_dtype(), path, key))
                    counts[dtype] = counts.get(dtype, 0) + numel
        return counts

    def keep_buffers(self, model: torch.nn.Module) -> None:
        """The real buffers of the meta-built model (to_empty would leave them uninitialised)."""
        self.buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}

    def materialize(self, model: torch.nn.Module, device: str) -> None:
        self.keep_buffers(model)
        tied = _tie_groups(model)
        model.to_empty(device=device)
        _retie(model, tied)
        for name, saved in self.buffers.items():
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[attr] = saved.to(device)
        read_local_shards(model, self.path)


def model_files(path: Path) -> list[Path]:
    """The model's safetensors files in a Hugging Face directory: those model.safetensors.index.json lists (a sharded
    checkpoint names its files; others beside them, e.g. a consolidated copy or an adapter, are not the model's),
    else every *.safetensors."""
    listed = path / "model.safetensors.index.json"
    if listed.is_file():
        return sorted({path / name for name in json.loads(listed.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def _header_index(path: Path) -> dict[str, tuple[Path, int, str, list[int]]]:
    """tensor name -> (file, absolute byte offset of its data, safetensors dtype, shape), from the headers of
    the model's safetensors files (those model.safetensors.index.json lists, else every *.safetensors): 8 bytes
    little-endian header length, the JSON header, then the data (the safetensors format, huggingface/safetensors
    README)."""
    import struct

    index = {}
    for file in model_files(path):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                index[name] = (file, 8 + length + entry["data_offsets"][0], entry["dtype"], entry["shape"])
    return index


def _read_bytes(file: Path, offset: int, size: int, name: str) -> torch.Tensor:
    """`size` bytes of `file` from `offset`, read with positional reads straight into a new uint8 tensor (no mmap:
    the pages of the file never count as the process's memory; no intermediate bytes object)."""
    import os

    out = torch.empty(size, dtype=torch.uint8)
    view, done = memoryview(out.numpy()).cast("B"), 0  # type: ignore[arg-type]  # numpy arrays are buffers
    with open(file, "rb") as handle:
        while done < size:
            count = os.preadv(handle.fileno(), [view[done:]], offset + done)
            if count == 0:
                raise Fp8distError(f"{file}: {name} ends past the end of the file (truncated?)")
            done += count
    return out


def read_local_shards(model: torch.nn.Module, path: Path) -> None:
    """Each rank reads, with plain positional reads (no mmap: no page of another rank's rows is touched), only
    the rows of its own shard of every parameter and persistent buffer, and copies them into the sharded
    tensors (casting to the master dtype; torchao's float8 wrapper is kept, `copy_` preserves it). FSDP2
    shards on dim 0 (Shard(0); Replicate on a hybrid mesh's other dim), so a shard is one contiguous byte
    range. Names missing from the files are tied weights, which share the loaded parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    index = _header_index(path)
    missing = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in index:
            missing.append(name)
            continue
        file, start, dtype_name, shape = index[name]
        _check_shape(file, name, shape, tensor)
        local, rows, first = tensor, shape[0] if shape else 1, 0
        if isinstance(tensor, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                        tensor.placements)
            if any(offset[1:]) or list(local_shape[1:]) != shape[1:]:
                raise Fp8distError(f"{name}: sharded on a dim other than 0 ({tensor.placements}); shard-on-read "
                                   "reads row blocks only")
            local, rows, first = tensor.to_local(), local_shape[0], offset[0]
        dtype = _torch_dtype(dtype_name, file, name)
        row_bytes = dtype.itemsize
        for dim in shape[1:]:
            row_bytes *= dim
        if local.numel():
            data = _read_bytes(file, start + first * row_bytes, rows * row_bytes, name)
            with torch.no_grad():
                local.copy_(data.view(dtype).view(local.shape))
    present = {n for n, _ in model.named_parameters()}
    unloaded = [n for n in missing if n in present and not _shares_a_loaded_parameter(model, n, index)]
    _refuse_unloaded(path, unloaded)


def _check_shape(file: Path, name: str, shape: list[int], tensor: torch.Tensor) -> None:
    if list(tensor.shape) != shape:
        raise Fp8distError(f"{file}: {name} has shape {shape} in the file and {list(tensor.shape)} in the model "
                           "built from config.json; the directory's files do not belong to its config")


def _refuse_unloaded(path: Path, unloaded: list[str]) -> None:
    """Parameters the files hold no weights for (tied ones excepted by the caller)."""
    if unloaded:
        raise Fp8distError(f"{path}: no weights for {', '.join(unloaded[:5])}{' ...' if len(unloaded) > 5 else ''}; "
                           "the files do not belong to this model")


def _shares_a_loaded_parameter(model: torch.nn.Module, name: str, index: dict) -> bool:
    param = model.get_parameter(name)
    return any(other in index for other, p in model.named_parameters(remove_duplicate=False) if p is param)


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
    model, config = _build_empty(path, master_dtype)
    return LoadedModel(model, causal_lm_batch(config.vocab_size), str(path), materialize=ShardOnRead(path))


def _build_empty(path: Path, dtype: str):
    """(the model of `path`'s config.json built on the meta device in `dtype`, buffers real; its config)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = _hf_config(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    # init_empty_weights re-creates every parameter it sees registered, which undoes the tie transformers made
    # while building (accelerate 1.15 big_modeling.py register_empty_parameter): tie again, outside it.
    model.tie_weights()
    return model, config


def load_nf4_base(path: Path, spec, shards: int) -> LoadedModel | str:
    """QLoRA's base from a local Hugging Face directory (`adapter.base_dtype: nf4`), read tensor by tensor: each
    Linear weight the NF4 base holds (fp8dist.backends.nf4.nf4_linears on `shards` shards, modules to save left out
    by name) is quantized as soon as it is read, so no rank ever holds the 16-bit base, only one 16-bit weight at a
    time beside the NF4 ones, as transformers does for a bitsandbytes 4-bit load. Everything else is read in the
    load dtype. The weights are the bytes quantizing after a full load gives (same values into the same to_nf4);
    FSDP2 then shards the NF4 weights (fsdp2.prepare), and the adapters go on as after any load.
    Returns why not, instead, where the files are not read as they are (a name the model lacks: transformers renames
    such keys as it loads, transformers 5 conversion_mapping.py) or the model keeps modules in fp32
    (`_keep_in_fp32_modules`, which from_pretrained honours): the caller loads those whole."""
    from fp8dist.backends.nf4 import nf4_linears, quantize_weight

    dtype = torch_dtype(spec.precision.load_dtype)
    model, config = _build_empty(path, spec.precision.load_dtype)
    index = _header_index(path)
    names = set(model.state_dict(keep_vars=True))
    ignored = {name for name, _ in model.named_buffers()}  # a non-persistent buffer an older file holds (inv_freq)
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    foreign = sorted(key for key in set(index) - names - ignored
                     if not any(re.search(pattern, key) for pattern in patterns))  # as from_pretrained ignores them
    if foreign:
        return (f"its files name tensors the model built from config.json does not have ({', '.join(foreign[:3])}"
                f"{' ...' if len(foreign) > 3 else ''}), which transformers renames as it loads")
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        return "the model keeps some modules in fp32 (_keep_in_fp32_modules), which transformers' loading does"
    chosen, _ = nf4_linears(model, shards, frozen_only=False, saved=spec.adapter.modules_to_save)
    quantized = {f"{name}.weight" for name in chosen}
    tied = _tie_groups(model)
    loaded = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in index:
            continue
        file, start, dtype_name, shape = index[name]
        _check_shape(file, name, shape, tensor)
        stored = _torch_dtype(dtype_name, file, name)
        numel = 1
        for dim in shape:
            numel *= dim
        value = _read_bytes(file, start, numel * stored.itemsize, name).view(stored).view(shape)
        if value.is_floating_point():  # as from_pretrained(dtype=...) casts; integer buffers keep theirs
            value = value.to(dtype)
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr in module._parameters:
            module._parameters[attr] = (quantize_weight(value, shards) if name in quantized else
                                        torch.nn.Parameter(value, requires_grad=tensor.requires_grad))
        else:
            module._buffers[attr] = value
        loaded.add(name)
    for group in tied:  # the names a tied weight is missing under share the one that was read
        read = [name for name in group if name in loaded]
        for name in group:
            if read and name != read[0]:
                owner, _, attr = name.rpartition(".")
                (model.get_submodule(owner) if owner else model).register_parameter(attr, model.get_parameter(read[0]))
    unloaded = [name for name, param in model.named_parameters() if param.is_meta]
    _refuse_unloaded(path, unloaded)
    model.eval()  # as from_pretrained leaves it (transformers 5 modeling_utils.py from_pretrained: model.eval())
    return LoadedModel(model, causal_lm_batch(config.vocab_size), str(path))


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
    """RAM-efficient loading reads files: MODEL must be a local Hugging Face directory, of a dense model (said
    before launch)."""
    check_model_name(name)
    if spec.parallel.cpu_ram_efficient_loading and not Path(name).is_dir():
        hub = name not in BUILTIN and ":" not in name
        what, get = (("a Hugging Face Hub id", f"download it first (`hf download {name} --local-dir DIR`)") if hub else
                     ("built in memory", "save it first (model.save_pretrained(DIR))"))
        raise Fp8distError(f"parallel.cpu_ram_efficient_loading reads a local Hugging Face model directory; MODEL "
                           f"{name!r} is {what}\n  fix: {get} and name DIR as the model where you named {name!r}, "
                           "or set parallel.cpu_ram_efficient_loading=false")
    if spec.parallel.cpu_ram_efficient_loading and (config := Path(name) / "config.json").is_file():
        experts = expert_count(json.loads(config.read_text()))
        if experts > 1:
            raise Fp8distError(f"parallel.cpu_ram_efficient_loading: {name} is a Mixture-of-Experts model ({experts} "
                               f"experts): {HF_MOE_CHECKPOINT_LAYOUT}, which shard-on-read does not read\n  fix: "
                               "parallel.cpu_ram_efficient_loading=false for this model (transformers loads and "
                               "converts the experts)")


def load_for_run(name: str, spec, plan: EnginePlan | None = None, dims: ParallelDims | None = None) -> LoadedModel:
    """MODEL as the run needs it (`fp8dist.load_model`): RAM-efficiently where `parallel.cpu_ram_efficient_loading`
    says so (a local Hugging Face directory only), else fully on every rank (fp8dist.runtime.models.load_model).
    `plan`: the run's translation, when the caller made it already (ZeRO-3 builds under zero.Init from it).
    With `adapter.kind=lora` the adapters are added here, before the engine converts and shards (the rules refuse
    them with RAM-efficient loading). `dims`: the run's layout (default: `spec`'s on this world)."""
    if not spec.parallel.cpu_ram_efficient_loading:
        read = (load_nf4_base(Path(name), spec, (dims or _this_world(spec)).fsdp_size)
                if _reads_nf4_base(name, spec) else None)
        if isinstance(read, str):
            say("nf4_base", f"adapter.base_dtype=nf4: {name} is loaded whole and quantized after, not tensor by "
                f"tensor as it is read: {read}")
        loaded = read if isinstance(read, LoadedModel) else load_model(name, spec.precision.load_dtype,
                                                                       seed=spec.train.seed)
        loaded.model = apply_adapter(loaded.model, spec.adapter, spec.precision.weight_dtype, spec.train.seed)
        return loaded
    check_efficient_loading(name, spec)
    profile = profile_for(spec)
    if profile.efficient_loading == "zero_init":
        # zero_init is DeepSpeed's loading, and a DeepSpeed engine's translation is its ds_config dict
        ds_config = plan if isinstance(plan, dict) else cast(dict[str, Any], profile.translate(spec))
        return load_zero3(Path(name), spec, ds_config)
    return load_empty(Path(name), spec.precision.weight_dtype)


def _reads_nf4_base(name: str, spec) -> bool:
    """An NF4 base (QLoRA) of a dense model in a local Hugging Face directory of safetensors files is read and
    quantized tensor by tensor (load_nf4_base). An MoE model's files hold its experts in another layout than the
    model (HF_MOE_CHECKPOINT_LAYOUT), and other files are not read by offset: transformers loads those, and the
    engine quantizes after (an MoE model's experts stay 16 bit)."""
    config = Path(name) / "config.json"
    return (spec.adapter.enabled and spec.adapter.base_dtype == "nf4" and config.is_file()
            and any(Path(name).glob("*.safetensors")) and expert_count(json.loads(config.read_text())) <= 1)


def _this_world(spec) -> ParallelDims:
    """The layout of `spec` on this process's world, for a caller that loads without one (the public
    `fp8dist.load_model`): NF4 weights must split into whole scaler blocks on the ranks FSDP2 shards them over
    (ParallelDims.fsdp_size; fp8dist.backends.nf4.nf4_unfit)."""
    import os

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return ParallelDims.of(spec, world)
