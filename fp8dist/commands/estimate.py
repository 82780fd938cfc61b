"""`fp8dist estimate MODEL --config X --world-size N`: per-rank memory of a run before it starts.

The model is built on the meta device (no weights read, no memory), so an 8B or 70B estimate takes
seconds. Per-parameter bytes of each store come from the audit's expected dtypes for the config
(audit/expected.py `implied_bytes_per_param`, the same rules the audit checks a real run against), then
divided by the ranks each engine shards that store over. Activations are measured on the meta device: one
forward of a `micro_batch_size x seq_len` batch in the compute dtype, summing the tensors autograd saves for
backward (parameters excluded; attention as flash attention keeps it), attributed to the transformer blocks,
so the config's `parallel.activation_checkpointing` can be counted: `full` (every block keeps its input) and
`selective` (its input and the op outputs the engines' selective policy saves), each plus one block recomputed
in backward. The transient peaks of backward (gathered weights in flight, the logits' gradient) and, from step 2
on, the optimizer's states give the phase where a rank peaks: its bytes are the one total the estimate gives.
Sizes print in binary units (KiB, MiB, GiB: powers of 1024).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fp8dist.compat as compat
from fp8dist.commands.output import dump_json
from fp8dist.config.load import load_config
from fp8dist.config.spec import Spec
from fp8dist.engines.registry import facts_for
from fp8dist.errors import ExitCode, Fp8distError

# Shapes only (config.json of the public checkpoints; no weights): what users name most.
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False},
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": False},
    # mistralai/Mixtral-8x7B-v0.1 config.json (46.70B parameters, 12.88B active per token)
    "mixtral-8x7b": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # Qwen/Qwen3-30B-A3B config.json (30.53B parameters)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    # google-bert/bert-base-cased config.json (the base model, as Accelerate's estimate-memory counts it)
    "bert-base-cased": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 28996, "hidden_size": 768, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
                        "type_vocab_size": 2},
}
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2"}
STORES = ("weights", "master_weights", "gradients", "optimizer", "buffers", "fp8_extras", "activations")
# The phases of a step, each with every store alive in it (not an increment over the one before). The first four
# are the training columns of the Model Memory Usage tool (huggingface.co/spaces/hf-accelerate/model-memory-usage),
# counted for the first step, before the optimizer's states exist; from step 2 on the states are there during every
# backward pass, which is where a run peaks (what published peaks measure).
PHASES = {"model": "Model", "gradients": "Gradients", "backward_pass": "Backward pass",
          "optimizer_step": "Optimizer step", "later_backward_pass": "Backward, step 2+"}


@dataclass
class MetaModel:
    model: Any
    shape_only: bool  # a built-in shape: parameter count and sizes are real, no weights exist
    causal_lm: bool


def _hf_config(name: str):
    from transformers import AutoConfig

    if name in SHAPES:
        values = dict(SHAPES[name])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    from fp8dist.runtime.models import BUILTIN

    if name in BUILTIN:
        return BUILTIN[name]()
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise Fp8distError(f"unknown MODEL {name!r}: use a built-in name or shape ({', '.join([*BUILTIN, *SHAPES])}), "
                           "a local Hugging Face model directory, or a config.json")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8distError(f"{path}: not a JSON config ({exc})") from None
    except OSError as exc:
        raise Fp8distError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(document, dict) or "model_type" not in document:
        raise Fp8distError(f"{path}: a Hugging Face config.json needs a `model_type` key")
    model_type = document.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **document)
    except (ValueError, KeyError, TypeError) as exc:
        raise Fp8distError(f"{path}: transformers cannot build model_type {model_type!r}: "
                           f"{str(exc).splitlines()[0]}") from None


def build_meta_model(name: str, dtype: str) -> MetaModel:
    """The model on the meta device in `dtype`: real shapes, no storage."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from fp8dist.dtypes import torch_dtype

    config = _hf_config(name)
    architectures = getattr(config, "architectures", None) or []
    # A causal LM is trained as one; anything else (BERT's masked LM) is counted as its base model, as
    # Accelerate's estimate-memory does.
    causal = any(a.endswith("ForCausalLM") for a in architectures) or (
        not architectures and not getattr(config, "is_encoder_decoder", False)
        and config.model_type not in ENCODER_TYPES)
    with torch.device("meta"):
        try:
            auto = AutoModelForCausalLM if causal else AutoModel
            model = auto.from_config(config, dtype=torch_dtype(dtype))
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises for a config it cannot build
            raise Fp8distError(f"transformers cannot build {name!r} ({config.model_type}): "
                               f"{str(exc).splitlines()[0]}") from None
    return MetaModel(model, name in SHAPES, causal)


def offloaded(spec: Spec) -> set[str]:
    """The stores that live in host memory instead of the accelerator's (the engine's facts)."""
    return facts_for(spec).offloaded(spec)


def shard_counts(spec: Spec, world: int) -> dict[str, int]:
    """Over how many ranks each store is divided (1: every rank holds all of it; the engine's facts)."""
    return facts_for(spec).shard_counts(spec, world)


def adapted_counts(meta: MetaModel, spec: Spec) -> tuple[int, int]:
    """(trainable, frozen) parameters: with `adapter`, PEFT's LoRA applied to the meta model (its adapters built on
    meta too: no storage), as the run's loading applies it."""
    import torch

    from fp8dist.runtime.adapters import apply_adapter, split_parameters

    with torch.device("meta"):
        model = apply_adapter(meta.model, spec.adapter, spec.precision.weight_dtype, spec.train.seed)
    return split_parameters(model)


def masters_note(spec: Spec, per_param: dict[str, float]) -> str | None:
    """Why the master-weights store holds no bytes of its own (None when it does): no master copy at all, or the
    engine's weights are the masters (FSDP2 shards the parameters in the master dtype: engines/fsdp2/facts.py)."""
    from fp8dist.audit.expected import expected

    if per_param["master_weights"]:
        return None
    cell = expected(spec, nproc=2)["master_weights"][0]
    if cell == "n/a":
        return "none: the optimizer steps the weights themselves (precision.master_weights)"
    return f"the sharded {cell} parameters are the master weights (counted under weights; no copy beside them)"


def bytes_per_param(spec: Spec) -> dict[str, float]:
    from fp8dist.audit.expected import implied_bytes_per_param

    implied = implied_bytes_per_param(spec)
    return {"weights": implied["weights"], "master_weights": implied["master"], "gradients": implied["gradients"],
            "optimizer": implied["optimizer"]}


def _blocks(model, spec: Spec) -> list:
    """The transformer blocks, found as FSDP2 finds its wrap units (HF `_no_split_modules`, else the first
    ModuleList)."""
    from fp8dist.engines.blocks import wrap_units

    return [module for _, module in wrap_units(model, spec)]


def activation_bytes(meta: MetaModel, spec: Spec) -> dict[str, int]:
    """Bytes kept for backward in one micro-batch forward, per activation-checkpointing mode, measured on the
    meta device in the compute dtype. `none`: what autograd saves; a tensor saved by several ops (the input of
    q/k/v_proj) or through several views counts once, at the size of its base; attention is counted as flash
    attention keeps it (no S x S tensors). `full`: every block keeps its input, and one block at a
    time is recomputed in backward (its `none` bytes). `selective`: every block keeps its input and the op
    outputs the engines' selective policy saves (engines/activation_checkpointing.py SavePolicy), plus one
    block recomputed."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8dist.engines.activation_checkpointing import SavePolicy
    from fp8dist.engines.base import forward_loss

    model, t = meta.model, spec.train
    params = {id(p) for p in model.parameters()}
    blocks = _blocks(model, spec)
    current: list[int | None] = [None]
    per_block = [0] * len(blocks)
    block_inputs = [0] * len(blocks)
    outside = [0]
    seen: dict[int, torch.Tensor] = {}  # keeps every counted base alive, so that ids are not reused
    selective = [0] * len(blocks)
    policies: dict[int, SavePolicy] = {}

    class SelectiveKeeps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            index = current[0]
            if index is not None and policies.setdefault(index, SavePolicy()).keeps(func):
                for tensor in [o for o in (out if isinstance(out, (tuple, list)) else [out])
                               if isinstance(o, torch.Tensor)]:
                    selective[index] += tensor.numel() * tensor.element_size()
            return out

    class FlashAttention(TorchFunctionMode):
        """Attention as flash attention keeps it for backward (q, k, v, output, logsumexp): the meta device runs
        the math SDPA, which saves fp32 copies and S x S scores no GPU run keeps. torch's CPU flash kernel has a
        meta implementation (and takes grouped k/v heads), so it stands in."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                query, key, value = args[:3]
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, key, value, 0.0, bool(kwargs.get("is_causal")), scale=kwargs.get("scale"))[0]
            return func(*args, **kwargs)

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in params and id(base) not in seen:
            seen[id(base)] = base
            size = base.numel() * base.element_size()
            if current[0] is None:
                outside[0] += size
            else:
                per_block[current[0]] += size
        return tensor

    def enter(index):
        def hook(_module, args, kwargs):
            current[0] = index
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(hidden, torch.Tensor):
                block_inputs[index] = hidden.numel() * hidden.element_size()
        return hook

    handles = [block.register_forward_pre_hook(enter(i), with_kwargs=True) for i, block in enumerate(blocks)]
    handles += [block.register_forward_hook(lambda *_: current.__setitem__(0, None)) for block in blocks]
    ids = torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, **({"labels": ids} if meta.causal_lm else {})}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), FlashAttention(), \
                SelectiveKeeps():
            forward_loss(model, batch)
    except Exception as exc:  # noqa: BLE001 - an op without a meta kernel, a model that needs other inputs
        raise Fp8distError(f"cannot run {type(model).__name__} on the meta device to measure activations: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        for handle in handles:
            handle.remove()
    recomputed = max(per_block) if per_block else 0
    kept = {"none": outside[0] + sum(per_block), "full": outside[0] + sum(block_inputs),
            "selective": outside[0] + sum(block_inputs) + sum(selective)}
    return {**{mode: n + (recomputed if mode != "none" else 0) for mode, n in kept.items()},
            "kept": kept, "recomputed_block": recomputed}


def transient_bytes(meta: MetaModel, spec: Spec, shards: dict[str, int]) -> dict[str, int]:
    """Bytes that exist only for a moment of the step, on top of the stores: the gathered weights of the wrap units
    in flight when weights are sharded (the unit computing and the one prefetched: FSDP2's default prefetch of
    one, torch 2.13 _fully_shard/_fsdp_state.py; ZeRO-3 prefetches likewise), and the gradient of the logits,
    which a causal LM's loss upcasts to fp32 (transformers 5 loss/loss_utils.py ForCausalLMLoss) and which
    reaches the bf16 lm_head output as a compute-dtype copy."""
    from fp8dist.dtypes import get as dtype_info

    compute = dtype_info(spec.precision.compute_dtype).bits // 8
    units = 0
    if shards["weights"] > 1:
        sizes = sorted((sum(p.numel() for p in block.parameters()) for block in _blocks(meta.model, spec)),
                       reverse=True)
        units = sum(sizes[:2]) * compute
    logits = 0
    vocab = getattr(meta.model.config, "vocab_size", 0)
    if meta.causal_lm and vocab:
        logits = spec.train.micro_batch_size * spec.train.seq_len * vocab * (4 + compute)
    return {"unsharded_units": units, "logits_gradient": logits}


def _decisions(meta: MetaModel, spec: Spec):
    """(Linear facts, the backend's module-filter decision for each), as the backend would decide."""
    from fp8dist.backends.module_filter import decide, linear_infos
    from fp8dist.translate.fsdp2 import torchao_dims_multiple

    fp8 = spec.fp8
    infos = linear_infos(meta.model)
    multiple = {"te": compat.TE_RECIPES[fp8.te.recipe].dim_multiple, "msamp": None,  # backends/msamp.py: no dims rule
                "torchao": torchao_dims_multiple(fp8.torchao)}.get(fp8.backend)
    return infos, decide(infos, fp8.modules.exclude, fp8.modules.skip_first_last, multiple)


def _experts(meta: MetaModel, spec: Spec) -> list[tuple[str, int, str | None]]:
    """(name, weight-GEMM FLOPs per token, why it stays in high precision or None) of each MoE experts module: a
    token meets `num_experts_per_tok` experts, each a GEMM per 3-D weight (backends/experts.py converts them)."""
    from fp8dist.backends.experts import experts_modules
    from fp8dist.backends.module_filter import matching_pattern

    fp8 = spec.fp8
    top_k = getattr(meta.model.config, "num_experts_per_tok", 1)
    mode = {"auto": "float8" if not fp8.torchao.emulate else "mxfp8"}.get(fp8.torchao.experts, fp8.torchao.experts)
    found = []
    for name, module in experts_modules(meta.model):
        weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        flops = top_k * sum(2 * w.shape[1] * w.shape[2] for w in weights)
        sizes = {size for w in weights for size in w.shape[1:]}
        if fp8.backend != "torchao":
            why = f"the {fp8.backend} backend converts nn.Linear only; experts are 3-D parameters"
        elif mode == "none":
            why = "precision.fp8.torchao.experts=none"
        elif pattern := matching_pattern(name, fp8.modules.exclude):
            why = f"excluded by pattern {pattern!r}"
        elif any(size % compat.TORCHAO_EXPERTS_DIM_MULTIPLE[mode] for size in sizes):
            why = f"expert sizes are not multiples of {compat.TORCHAO_EXPERTS_DIM_MULTIPLE[mode]} ({mode})"
        else:
            why = None
        found.append((name, flops, why))
    return found


def _routers(meta: MetaModel) -> list[tuple[str, int]]:
    """(name, FLOPs per token) of each MoE router that is not an nn.Linear (transformers 5 `*TopKRouter`: F.linear on
    its own 2-D weight; nn.Linear routers are among the Linears already). Every recipe keeps them in high precision,
    and the audit counts their GEMMs (backends/module_filter.is_router)."""
    import torch

    from fp8dist.backends.module_filter import is_router

    parents = {name: module for name, module in meta.model.named_modules()}
    found = []
    for name, module in meta.model.named_modules():
        parent = parents.get(name.rsplit(".", 1)[0]) if "." in name else meta.model
        if isinstance(module, torch.nn.Linear) or not is_router(name, module, parent):
            continue
        weights = [p for p in module.parameters(recurse=False) if p.dim() == 2]
        found.append((name, sum(2 * w.numel() for w in weights)))
    return found


def fp8_coverage(meta: MetaModel, spec: Spec) -> dict[str, Any]:
    """Share of the weight-GEMM FLOPs of one token that run in FP8 under the config's module filter (what the
    audit measures as gemm_flops.fp8_share), the modules left out and why, and the converted Linears below
    torchao's size heuristics. MoE experts count with the experts a token is routed to (top-k). Attention's own
    matmuls (QK^T, AV) multiply activations, not weights, and are not weight GEMMs."""
    fp8 = spec.fp8
    infos, decisions = _decisions(meta, spec)
    experts = _experts(meta, spec)
    if not fp8.enabled:
        return {"backend": "none", "fp8_share": 0.0, "linears": len(infos), "converted": 0, "left_out": [],
                "too_small_to_gain": [], "experts": len(experts)}
    by_fqn = {i.fqn: i for i in infos}
    flops = {i.fqn: 2 * i.in_features * i.out_features for i in infos}
    converted = [d.fqn for d in decisions if d.convert]
    small = []
    if fp8.backend == "torchao":
        small = [fqn for fqn in converted if compat.torchao_too_small_to_gain(
            fp8.torchao.recipe_name, by_fqn[fqn].out_features, by_fqn[fqn].in_features)]
    in_fp8 = sum(flops[f] for f in converted) + sum(n for _, n, why in experts if why is None)
    total = sum(flops.values()) + sum(n for _, n, _ in experts) + sum(n for _, n in _routers(meta))
    return {"backend": fp8.backend, "fp8_share": in_fp8 / total if total else 0.0, "linears": len(infos),
            "converted": len(converted),
            "left_out": [{"fqn": d.fqn, "reason": d.reason} for d in decisions if not d.convert]
                        + [{"fqn": name, "reason": why} for name, _, why in experts if why],
            "too_small_to_gain": small, "experts": len(experts)}


def fp8_extra_bytes(meta: MetaModel, spec: Spec) -> tuple[int, str]:
    """Per-rank bytes the FP8 recipe keeps beyond the stores above, and how they were counted."""
    if not spec.fp8.enabled:
        return 0, "no FP8 backend"
    infos, decisions = _decisions(meta, spec)
    sizes = [i.in_features * i.out_features for i, d in zip(infos, decisions) if d.convert]
    if spec.fp8.backend == "torchao":
        scales = 4 * 3 * len(sizes)  # input, weight and grad scales (fp32) per Float8Linear
        if spec.float8_all_gather:
            return sum(sizes) + scales, ("unsharded float8 weights of the converted Linears, saved for backward "
                                         "in eager mode (1 byte/param), plus their scales")
        return scales, "float8 scales only: weights are cast per GEMM and not kept"
    if spec.fp8.backend == "te":
        history = spec.fp8.te.amax_history_len or 1024  # TE's DelayedScaling default
        per_linear = 3 * 4 * (history + 1) if spec.fp8.te.recipe == "delayed" else 3 * 4
        return sum(sizes) + per_linear * len(sizes), ("the FP8 weight copy each te.Linear caches (1 byte/param), "
                                                      "plus amax history and scales (fp32)")
    return 0, "MS-AMP keeps its FP8 weights and scales inside the stores above (table A)"


def estimate(name: str, spec: Spec, world: int) -> dict[str, Any]:
    if world < 1:
        raise Fp8distError(f"--world-size must be at least 1, got {world}")
    compute = spec.precision.compute_dtype
    from fp8dist.audit.expected import frozen_bytes_per_param

    meta = build_meta_model(name, compute)
    trainable, frozen = adapted_counts(meta, spec)
    params = trainable + frozen
    per_param = bytes_per_param(spec)
    shards = shard_counts(spec, world)
    # the trainable parameters carry every store; the frozen ones (an adapter run's base) their weight only
    per_rank = {store: math.ceil(trainable * per_param[store] / shards[store]) for store in per_param}
    per_rank["weights"] += math.ceil(frozen * frozen_bytes_per_param(spec) / shards["weights"])
    activations = activation_bytes(meta, spec)
    coverage = fp8_coverage(meta, spec)
    extras, extras_how = fp8_extra_bytes(meta, spec)
    # Buffers (RoPE tables, BERT's position ids) stay whole on every rank, in their own dtype.
    per_rank["buffers"] = sum(b.numel() * b.element_size() for b in meta.model.buffers())
    per_rank["fp8_extras"] = extras
    per_rank["activations"] = activations[spec.parallel.activation_checkpointing]
    host = offloaded(spec)
    device = {store: 0 if store in host else per_rank[store] for store in STORES}
    model = device["weights"] + device["master_weights"] + device["buffers"]
    transient = transient_bytes(meta, spec, shards)
    backward = model + device["gradients"] + device["activations"] + extras + sum(transient.values())
    phases = {"model": model, "gradients": model + device["gradients"], "backward_pass": backward,
              "optimizer_step": model + device["gradients"] + device["optimizer"],
              "later_backward_pass": backward + device["optimizer"]}
    highest = max(phases, key=phases.get)
    return {
        "model": name, "shape_only": meta.shape_only, "parameters": params, "world_size": world,
        "trainable_parameters": trainable, "frozen_parameters": frozen,
        "frozen_bytes_per_param": frozen_bytes_per_param(spec),
        "engine": spec.engine, "config": spec.source, "preset": spec.precision.preset,
        "micro_batch_size": spec.train.micro_batch_size, "seq_len": spec.train.seq_len,
        "bytes_per_param": per_param, "master_weights_note": masters_note(spec, per_param), "shards": shards,
        "per_rank_bytes": per_rank, "offloaded_to_host": sorted(host),
        "host_bytes": sum(per_rank[store] for store in host),
        "activations_bytes": {"none": activations["none"], "full_checkpointing": activations["full"],
                              "selective_checkpointing": activations["selective"],
                              "mode": spec.parallel.activation_checkpointing},
        "phases_bytes": phases, "highest_phase": highest, "peak_bytes": phases[highest],
        "fp8_extras_counted": extras_how,
        "transient_bytes": transient,
        "fp8_coverage": coverage,
    }


def human(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"


def render_table(result: dict[str, Any], markdown: bool = False) -> str:
    r = result
    head = (f"fp8dist estimate: {r['model']}{' (shape only)' if r['shape_only'] else ''}, "
            f"{r['parameters'] / 1e6:,.2f}M parameters, {r['engine']} on {r['world_size']} rank(s), "
            f"micro batch {r['micro_batch_size']} x {r['seq_len']} tokens, config {r['config']}")
    pr, ph = r["per_rank_bytes"], r["phases_bytes"]
    host = set(r["offloaded_to_host"])
    store_rows = [(store.replace("_", " ") + (" (host)" if store in host else ""), human(pr[store]))
                  for store in STORES]
    if r["master_weights_note"]:
        store_rows[STORES.index("master_weights")] = ("master weights", r["master_weights_note"])
    stores_title = "Per rank, by store (KiB, MiB, GiB: powers of 1024)" + (
        f"; (host): in host memory, {human(r['host_bytes'])} in all, outside the phases below" if host else "")
    phases_title = "Per rank on the device, by phase of a step (cumulative: each column holds every store alive then)"
    cells = [human(ph[k]) for k in PHASES]
    peak = f"Peak per rank on the device: {human(r['peak_bytes'])}, in phase {PHASES[r['highest_phase']]}"
    cov = r["fp8_coverage"]
    experts = f", {cov['experts']} MoE experts modules" if cov.get("experts") else ""
    coverage = (f"FP8 coverage: {cov['fp8_share']:.1%} of weight-GEMM FLOPs ({cov['converted']} of {cov['linears']} "
                f"Linears converted{experts})" if cov["backend"] != "none" else "FP8 coverage: none (no FP8 backend)")
    left = "; ".join(f"{item['fqn']} ({item['reason']})" for item in cov["left_out"][:8])
    more = f" and {len(cov['left_out']) - 8} more" if len(cov["left_out"]) > 8 else ""
    if cov["too_small_to_gain"]:
        more += (f"; {len(cov['too_small_to_gain'])} converted Linears are below torchao's size heuristics "
                 "(too small to gain on H100)")
    act = r["activations_bytes"]
    notes = [coverage + (f"; left out: {left}" if left else "") + more,
             f"activations per micro batch: {human(act['none'])} without checkpointing, "
             f"{human(act['selective_checkpointing'])} selective, {human(act['full_checkpointing'])} full "
             f"(counted: {act['mode']})",
             f"transient in backward: {human(r['transient_bytes']['unsharded_units'])} of gathered weights, "
             f"{human(r['transient_bytes']['logits_gradient'])} of logits gradient",
             f"fp8 extras: {r['fp8_extras_counted']}"]
    if r["frozen_parameters"]:
        notes.insert(0, f"adapter: {r['trainable_parameters'] / 1e6:,.2f}M trainable parameters carry masters, "
                        f"gradients and optimizer states; {r['frozen_parameters'] / 1e6:,.2f}M frozen ones their "
                        f"weights only, at {r['frozen_bytes_per_param']:g} bytes per parameter")
    if markdown:
        lines = [f"**{head}**", "", f"{stores_title}:", "", "| store | per rank |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in store_rows]
        lines += ["", f"{phases_title}:", "", "| " + " | ".join(PHASES.values()) + " |",
                  "|" + "---|" * len(PHASES), "| " + " | ".join(cells) + " |", "", f"**{peak}**", ""]
        return "\n".join(lines + [f"- {note}" for note in notes]) + "\n"
    width = max(len(name) for name, _ in store_rows)
    lines = [head, "", stores_title + ":"] + [f"{name.ljust(width)}  {value}" for name, value in store_rows]
    widths = [max(len(h), len(c)) for h, c in zip(PHASES.values(), cells)]
    lines += ["", phases_title + ":", "  ".join(h.ljust(w) for h, w in zip(PHASES.values(), widths)).rstrip(),
              "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(), "", peak, ""] + notes
    return "\n".join(lines) + "\n"


def run(args) -> int:
    """The CLI command: the config is loaded (and refused) before torch is imported."""
    import sys

    spec = load_config(args.config, overrides=args.overrides)
    result = estimate(args.model, spec, args.world_size)
    sys.stdout.write(dump_json(result) if args.format == "json" else render_table(result, markdown=args.format == "markdown"))
    return ExitCode.OK
