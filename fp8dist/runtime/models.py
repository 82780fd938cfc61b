"""Models for the audit, the demos and the tests: built in (no download), a local Hugging Face
directory, a Hugging Face Hub id (resolved by transformers: its cache, or the Hub where there is a network), or
`package.module:factory`. Each comes with a function that makes an input batch. `model_kind` is the one reading of a
MODEL argument that every command uses (estimate adds its shapes)."""
from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import socket
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Literal

from fp8dist.config.parallel import RANKS_LAUNCHED
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


def _llama_config(**overrides):
    from transformers import LlamaConfig

    # Every Linear dim is a multiple of 16 (FP8 GEMMs) and of 2 (float8 all-gather on 2 ranks).
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    base.update(overrides)
    return LlamaConfig(**base)


def tiny_llama_config():
    return _llama_config()


def small_llama_config():
    """~3.7M parameters: big enough that a CPU step is dominated by GEMMs, not Python (benchmarks)."""
    return _llama_config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)


def tiny_config(arch: str):
    """Small configs for the architectures the tests exercise (built offline)."""
    if arch == "llama":
        return _llama_config()
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=False)
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    if arch in MOE_CONFIGS:
        return tiny_moe_config(arch)
    raise ValueError(f"no tiny config for {arch!r}")


# Mixture-of-Experts shapes: 8 experts, top-2, every expert size a multiple of 32 (MXFP8 blocks).
MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=2, decoder_sparse_step=1, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
}


def tiny_moe_config(arch: str, **sizes):
    import transformers

    class_name, experts = MOE_CONFIGS[arch]
    shape = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    shape.update(sizes)
    return getattr(transformers, class_name)(max_position_embeddings=256, tie_word_embeddings=False,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=0, **{**experts, **shape})


def small_mixtral_config():
    """~9M parameters, 8 experts of 256 x 256, top-2 (benchmarks: the experts hold most GEMM FLOPs, as in
    public MoE models)."""
    return tiny_moe_config("mixtral", vocab_size=1024, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4)


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


BUILTIN = {"tiny-llama": tiny_llama_config, "small-llama": small_llama_config, "tiny-qwen2": lambda: tiny_config("qwen2"),
           "tiny-mixtral": lambda: tiny_moe_config("mixtral"), "small-mixtral": small_mixtral_config}


def model_forms(shapes: Collection[str] = ()) -> str:
    """What a MODEL argument may be, for every --help and refusal that names the forms; `shapes`: the names of model
    shapes a command also takes (estimate: the config.json of public checkpoints, without weights), which then takes
    a config.json too and no factory (it builds the model from its config alone)."""
    hub = "a Hugging Face Hub id (org/name, from the Hub cache or downloaded where there is a network)"
    if shapes:
        return (f"a built-in name or shape ({', '.join([*BUILTIN, *shapes])}), a local Hugging Face model directory "
                f"or its config.json, or {hub}")
    return (f"a built-in name ({', '.join(BUILTIN)}), a local Hugging Face model directory, {hub}, or "
            "package.module:factory")


MODEL_FORMS = model_forms()
# A Hugging Face Hub model id, `org/name` (huggingface_hub validate_repo_id: letters, digits, - _ .). A bare word is
# not taken for one (the Hub's once org-less models have org/name ids, e.g. openai-community/gpt2): a misspelt
# built-in name is said here, not asked of the network.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
ModelKind = Literal["shape", "builtin", "directory", "config_file", "factory", "hub"]


def model_kind(name: str, shapes: Collection[str] = ()) -> ModelKind:
    """What MODEL names, the one reading of a MODEL argument for every command: one of `shapes` (a command's own
    names: estimate's), a built-in name, a model directory, a config.json file (which only a command taking `shapes`
    reads), package.module:factory, or a Hub id (not resolved here). Anything else is refused, with the closest
    name where it looks misspelt. No torch import, no network."""
    if name in shapes:
        return "shape"
    if name in BUILTIN:
        return "builtin"
    if ":" in name:
        return "factory"
    path = Path(name)
    if path.is_dir():
        return "directory"
    if path.exists():
        if shapes and path.suffix == ".json":
            return "config_file"
        raise Fp8distError(f"MODEL {name!r} is a file\n  fix: name the directory that holds the model's config.json")
    if not HUB_ID.fullmatch(name) or ".." in name or "--" in name:
        close = difflib.get_close_matches(name, [*BUILTIN, *shapes], n=1, cutoff=0.8)
        why = f"did you mean {close[0]}?" if close else "no such directory, and not a Hugging Face Hub id (org/name)"
        raise Fp8distError(f"unknown MODEL {name!r}: {why}\n  fix: use {model_forms(shapes)}")
    return "hub"


def check_model_name(name: str) -> None:
    """Refuse a MODEL that names nothing fp8dist can build or load. No torch import, except for a Hub id, which
    transformers resolves (hub_config)."""
    kind = model_kind(name)
    if kind == "directory":
        config = Path(name) / "config.json"
        if not config.exists():
            raise Fp8distError(f"{name} has no config.json: not a Hugging Face model directory")
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Fp8distError(f"{config}: not JSON ({exc})") from None
        _check_safetensors(Path(name))
    elif kind == "hub":
        hub_config(name)
    elif kind == "factory":
        _factory_module(name, find_only=True)


def _factory_module(target: str, *, find_only: bool = False):
    """The module of `package.module:factory`, from the Python path or else, as `python -m` reads a module name,
    from the current directory (a rank under torchrun has its script's folder on the path, not the directory it was
    launched from). `find_only`: whether it can be found, without running it (the check before any rank starts)."""
    import importlib.util

    module_name = target.partition(":")[0]
    here = os.getcwd()

    def found() -> bool:
        try:
            return importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False

    if not found() and here not in sys.path:
        sys.path.insert(0, here)
        if not found():
            sys.path.remove(here)
    if not found():
        top = module_name.split(".")[0]
        if top != module_name and importlib.util.find_spec(top) is not None:
            raise Fp8distError(f"cannot import MODEL factory {target!r}: package {top!r} is found, but it has no "
                               f"module {module_name!r}\n  fix: check the module path (package.module:function)")
        raise Fp8distError(f"cannot import MODEL factory {target!r}: no module {module_name!r} on the Python path or "
                           f"in the current directory ({here})\n  fix: run from the directory that holds {top}/ (or "
                           f"{top}.py), or add that directory to PYTHONPATH")
    return None if find_only else importlib.import_module(module_name)


def hub_config(name: str):
    """The config of the Hub model `name`, as transformers resolves it: from its cache, or the Hub where there is a
    network (HF_HUB_OFFLINE=1: the cache only; set here when the Hub cannot be reached). Refused with transformers'
    own reason when it cannot."""
    from transformers import AutoConfig

    unreachable = offline_unless_reachable()
    try:
        return AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - OSError (not found, offline, gated), ValueError (unknown model type)...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        where = (f" ({unreachable} cannot be reached from this machine, so only the Hub cache was looked in: "
                 "HF_HUB_OFFLINE=1)" if unreachable else "")
        raise Fp8distError(f"unknown MODEL {name!r}: not a built-in name or a local directory, and transformers cannot "
                           f"resolve it as a Hugging Face Hub id{where}: {reason[:600]}\n  fix: check the id; where "
                           "this machine has no network, put the model in its Hub cache (`hf download ID` where there "
                           "is one, then copy HF_HUB_CACHE) or name its local directory") from None


def offline_unless_reachable(timeout_s: float = 3.0) -> str | None:
    """Turn on the Hub's offline mode (HF_HUB_OFFLINE=1: the Hub cache only) when the Hub's host cannot be reached,
    so that an id the cache lacks is refused at once instead of after huggingface_hub's retries (5 of them, about
    28 s, for each file asked for). Set in os.environ, so the ranks started later inherit it, and in
    huggingface_hub's constants when it is already imported (it reads the variable at import). Returns the host
    when it was unreachable; None when it answered, when offline mode is set already, or when a proxy is configured
    (the connection goes through it: huggingface_hub decides)."""
    if any(os.environ.get(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy",
                                             "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    try:
        socket.create_connection((host, endpoint.port or (80 if endpoint.scheme == "http" else 443)),
                                 timeout=timeout_s).close()
        return None
    except OSError:  # no route, no name resolution, refused or timed out
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:
            setattr(constants, "HF_HUB_OFFLINE", True)
        return host


def _check_safetensors(directory: Path) -> None:
    """Open every safetensors file's header, as loading will (no tensor is read): a truncated or garbage file
    is said here, with safetensors' own error line, before any rank starts."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as exc:
            raise Fp8distError(f"{path}: cannot be loaded: {str(exc).splitlines()[0]} (a truncated or corrupt "
                               "safetensors file; save the model again or copy it completely)") from None


def config_values(name: str) -> dict | None:
    """MODEL's config.json values without building it (None for a factory, whose model only prepare sees)."""
    kind = model_kind(name)
    if kind == "builtin":
        return BUILTIN[name]().to_dict()
    if kind == "factory":
        return None
    path = Path(name) / "config.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return hub_config(name).to_dict()


def check_mesh_fits(spec, name: str, world: int, world_flag: str = RANKS_LAUNCHED) -> None:
    """Refuse, before any weight is loaded, a mesh `world` ranks do not fill, or a tensor / context / expert parallel
    mesh MODEL does not split on (fp8dist.config.parallel.check_model_fits); a factory model is checked when the
    engine sees it. `world_flag`: the option that set `world`, for the fix (parallel_dims)."""
    from fp8dist.config.parallel import check_model_fits, parallel_dims, sequence_parallel

    dims = parallel_dims(spec, world, world_flag)
    if dims.tp == 1 and dims.cp == 1 and dims.ep == 1:
        return
    values = config_values(name)
    if values is not None:
        check_model_fits(dims, values, spec.train.seq_len, sequence_split=sequence_parallel(spec), source=name)


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
        factory = getattr(_factory_module(target), attr)
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
