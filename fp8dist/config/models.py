"""The models a MODEL argument can name, read without building them: the built-in ones (no download), a local Hugging
Face directory, a Hugging Face Hub id (resolved by transformers: its cache, or the Hub where there is a network), or
`package.module:factory`. `model_kind` is the one reading of a MODEL argument that every command uses (estimate adds
its shapes); `config_values` a model's config.json values. No torch import; transformers only inside the functions
that build a config. Building and loading the models is the runtime's (fp8dist.runtime.models)."""
from __future__ import annotations

import difflib
import json
import os
import re
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Collection, Literal

from fp8dist.errors import Fp8distError


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


BUILTIN = {"tiny-llama": tiny_llama_config, "small-llama": small_llama_config,
           "tiny-qwen2": lambda: tiny_config("qwen2"), "tiny-mixtral": lambda: tiny_moe_config("mixtral"),
           "small-mixtral": small_mixtral_config}


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
        factory_module(name, find_only=True)


def factory_module(target: str, *, find_only: bool = False):
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
            vars(constants)["HF_HUB_OFFLINE"] = True  # the module huggingface_hub reads it from
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
