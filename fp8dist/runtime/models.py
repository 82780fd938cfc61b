"""The models a run trains, built or loaded (fp8dist.config.models names them: built in, a local Hugging Face
directory, a Hub id, or `package.module:factory`), each with a function that makes an input batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fp8dist.config.models import BUILTIN, check_model_name, config_values, factory_module, model_kind
from fp8dist.config.parallel import RANKS_LAUNCHED, ParallelDims
from fp8dist.dtypes import torch_dtype
from fp8dist.errors import Fp8distError
from fp8dist.runtime.data import BatchMaker

@dataclass
class LoadedModel:
    model: Any
    make_batch: BatchMaker  # (batch, seq_len, seed) -> forward kwargs incl. labels
    name: str
    make_optimizer: Callable | None = None  # params -> optimizer; None: the one the config names
    materialize: Any = None  # a meta-built model's loader, run after sharding (engines.loading.ShardOnRead)
    keepalive: Any = None  # what must live as long as the model (DeepSpeed ZeRO-3: the HfDeepSpeedConfig)


def causal_lm_batch(vocab_size: int) -> BatchMaker:
    def make(batch: int, seq_len: int, seed: int) -> dict:
        import torch

        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}

    return make


def _from_hf_config(config, dtype: str, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))


def check_mesh_fits(spec, name: str, world: int, world_flag: str = RANKS_LAUNCHED) -> ParallelDims:
    """The layout of `spec` on `world` ranks (ParallelDims.of), refusing before any weight is loaded a mesh `world`
    ranks do not fill, or a tensor / context / expert parallel mesh MODEL does not split on
    (ParallelDims.check_model); a factory model is checked when the engine sees it. `world_flag`: the option that
    set `world`, for the fix."""
    dims = ParallelDims.of(spec, world, world_flag)
    if dims.tp_enabled or dims.cp_enabled or dims.ep_enabled:
        values = config_values(name)
        if values is not None:
            dims.check_model(values, spec.train.seq_len, source=name)
    return dims


def load_model(name: str, dtype: str, seed: int = 0) -> LoadedModel:
    """Build or load MODEL in the load dtype. Only a Hub id may reach the network (transformers resolves it)."""
    check_model_name(name)
    kind = model_kind(name)
    if kind == "builtin":
        config = BUILTIN[name]()
        return LoadedModel(_from_hf_config(config, dtype, seed), causal_lm_batch(config.vocab_size), name)
    if kind == "factory":
        return _load_factory(name, dtype, seed)
    return _load_hf(name, dtype, local=kind == "directory")


def _load_hf(name: str, dtype: str, local: bool) -> LoadedModel:
    """A local Hugging Face directory (`local`: never the network), or a Hub id as transformers resolves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = f"in {name}" if local else name
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local, dtype=torch_dtype(dtype))
    except Exception as exc:  # transformers and safetensors raise many kinds; each says its cause in one line
        raise Fp8distError(f"cannot load the Hugging Face model {where}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return LoadedModel(model, causal_lm_batch(config.vocab_size), name)


def _load_factory(target: str, dtype: str, seed: int) -> LoadedModel:
    """`package.module:factory`. The factory returns an nn.Module (cast to the load dtype), or a dict with
    `model` and optionally `make_batch(batch, seq_len, seed)` and `make_optimizer(params)`. Without
    `make_batch`, the input is inferred (`infer_batch`)."""
    import torch

    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(factory_module(target), attr)
    except Fp8distError:
        raise
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raises on import
        raise Fp8distError(f"cannot import MODEL factory {target!r}: {type(exc).__name__}: {exc}") from None
    torch.manual_seed(seed)
    try:
        made = factory()
    except Exception as exc:
        raise Fp8distError(f"MODEL factory {target!r} raised {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    made = made if isinstance(made, dict) else {"model": made}
    model, make_batch = made.get("model"), made.get("make_batch")
    if not isinstance(model, torch.nn.Module):
        raise Fp8distError(f"MODEL factory {target!r} returned {type(model).__name__}, not an nn.Module")
    model = model.to(torch_dtype(dtype))
    if make_batch is None:
        make_batch = infer_batch(model)
        if make_batch is None:
            raise Fp8distError(f"MODEL factory {target!r}: cannot tell the input of {type(model).__name__} (its "
                               "first module is neither an nn.Embedding nor an nn.Linear); return "
                               "{'model': ..., 'make_batch': (batch, seq_len, seed) -> forward kwargs}")
    return LoadedModel(model, make_batch, target, made.get("make_optimizer"))


def infer_batch(model) -> BatchMaker | None:
    """An input for a model that came without one: token-id batches for a Hugging Face model
    (`config.vocab_size`) or a model whose first module is an nn.Embedding; a float tensor
    (batch, seq_len, in_features) in the weights' dtype when it is an nn.Linear; else None.
    The tensor goes to the forward's first parameter, and `labels` too when the forward takes them."""
    import inspect

    import torch

    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None:
        return causal_lm_batch(vocab)
    first = next((m for m in model.modules() if m is not model and not list(m.children())), None)
    params = list(inspect.signature(model.forward).parameters)
    if first is None or not params:
        return None
    name, takes_labels = params[0], "labels" in params

    def make(batch: int, seq_len: int, seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        if isinstance(first, torch.nn.Embedding):
            x = torch.randint(0, first.num_embeddings, (batch, seq_len), generator=gen)
            return {name: x, **({"labels": x.clone()} if takes_labels else {})}
        x = torch.randn(batch, seq_len, first.in_features, generator=gen).to(first.weight.dtype)
        return {name: x}

    return make if isinstance(first, (torch.nn.Embedding, torch.nn.Linear)) else None
