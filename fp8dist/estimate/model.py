"""The model an estimate counts, built on the meta device (real shapes, no storage, no weights read), and the bytes
one micro-batch's forward keeps for backward, measured on it. torch and transformers are imported only when a meta
model is built."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, cast

from fp8dist.config.spec import Spec
from fp8dist.dtypes import torch_dtype
from fp8dist.engines.base import forward_loss
from fp8dist.errors import Fp8distError
from fp8dist.estimate.expert_parallel import ExpertSplit, expert_split
from fp8dist.estimate.result import CheckpointingMode
from fp8dist.estimate.shapes import HUB_IDS, SHAPES
from fp8dist.estimate.tensor_parallel import TensorSplit, local_linears, tensor_split
from fp8dist.backends.adapters import apply_adapter, split_parameters
from fp8dist.config.models import BUILTIN, hub_config, model_kind

if TYPE_CHECKING:
    import torch

ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2"}


@dataclass
class MetaModel:
    model: torch.nn.Module
    config: Any  # the transformers PretrainedConfig it was built from
    shape_only: bool  # a built-in shape: parameter count and sizes are real, no weights exist
    causal_lm: bool


@dataclass(frozen=True)
class MeasuredActivations:
    """What `activation_bytes` measured: the bytes kept until backward per checkpointing mode, and the largest
    block's own bytes (`none`), which checkpointing recomputes in backward one block at a time. Under expert parallel:
    of the `none` bytes, those the dispatch keeps (`dispatch_kept`: recomputed with their block under
    checkpointing), and the largest MoE layer's all-to-all buffers, in flight one layer at a time (`all_to_all`)."""
    kept: Mapping[CheckpointingMode, int]
    recomputed_block: int
    dispatch_kept: int = 0
    all_to_all: int = 0
    # Per block, in the order `blocks` lists them: what it keeps per mode (pipeline parallel sums a stage's blocks).
    per_block: tuple[Mapping[CheckpointingMode, int], ...] = ()
    before_blocks: int = 0  # kept outside the blocks before the first (the embeddings' input)
    after_blocks: int = 0  # kept after the last block (the final norm, the LM head's input, the loss)

    def per_rank(self, mode: CheckpointingMode) -> int:
        """The bytes a rank holds at once in `mode`: what is kept, plus one block recomputed when checkpointing."""
        return self.kept[mode] + (self.recomputed_block if mode != "none" else 0)

    def stage(self, blocks: range, first: bool, last: bool, mode: CheckpointingMode) -> int:
        """What one pipeline stage keeps in `mode` (the blocks `blocks`, what comes before them on the first stage,
        after them on the last), without the block recomputed in backward."""
        return (sum(self.per_block[i][mode] for i in blocks) + (self.before_blocks if first else 0)
                + (self.after_blocks if last else 0))

    def recomputed(self, blocks: tuple[int, ...]) -> int:
        """The largest of `blocks`' own bytes: what checkpointing recomputes in backward, one block at a time."""
        return max((self.per_block[i]["none"] for i in blocks), default=0)


_SHAPE_OF_HUB_ID = {hub_id: shape for shape, hub_id in HUB_IDS.items()}


def _hf_config(name: str) -> Any:
    """The transformers config `name` stands for, read as every command reads MODEL (fp8dist.config.models.model_kind)
    with the shapes added: a built-in shape (or the Hub id it is the config.json of: no network), a built-in model, a
    model directory or a config.json, a Hub id (as transformers resolves it). A factory is refused: its model exists
    only when it runs."""
    name = _SHAPE_OF_HUB_ID.get(name, name)
    kind = model_kind(name, SHAPES)
    from transformers import AutoConfig

    if kind == "shape":
        values = dict(SHAPES[name])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if kind == "builtin":
        return BUILTIN[name]()
    if kind == "hub":
        return hub_config(name)
    if kind == "factory":
        raise Fp8distError(f"MODEL {name!r} is a factory, whose model exists only when it runs; the estimate "
                           "builds the model from its config on the meta device\n  fix: save the model "
                           "(model.save_pretrained(DIR)) and name DIR or DIR/config.json")
    path = Path(name) / "config.json" if kind == "directory" else Path(name)
    if not path.is_file():
        raise Fp8distError(f"{name} has no config.json: not a Hugging Face model directory")
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
    config = _hf_config(name)  # a name that names nothing is refused before torch is imported
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

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
    return MetaModel(model, config, _SHAPE_OF_HUB_ID.get(name, name) in SHAPES, causal)


def adapted_counts(meta: MetaModel, spec: Spec) -> tuple[int, int]:
    """(trainable, frozen) parameters: with `adapter`, PEFT's LoRA applied to the meta model (its adapters built on
    meta too: no storage), as the run's loading applies it."""
    import torch

    with torch.device("meta"):
        model = apply_adapter(meta.model, spec.adapter, spec.precision.weight_dtype, spec.train.seed)
    return split_parameters(model)


def blocks(model: torch.nn.Module, spec: Spec) -> list[tuple[str, torch.nn.Module]]:
    """(fqn, module) of the transformer blocks, found as FSDP2 finds its wrap units (HF `_no_split_modules`, else
    the first ModuleList)."""
    from fp8dist.engines.blocks import wrap_units

    return wrap_units(model, spec)


def activation_bytes(meta: MetaModel, spec: Spec, split: TensorSplit | None = None,
                     experts: ExpertSplit | None = None) -> MeasuredActivations:
    """Bytes one rank keeps for backward in one micro-batch forward, per activation-checkpointing mode, measured on
    the meta device in the compute dtype. `none`: what autograd saves; a tensor saved by several ops (the input of
    q/k/v_proj) or through several views counts once, at the size of its base; attention is counted as flash
    attention keeps it (no S x S tensors). `full`: every block keeps its input. `selective`: every block keeps its
    input and the op outputs the engines' selective policy saves (engines/activation_checkpointing.py SavePolicy).
    Under either, one block at a time is recomputed in backward (its `none` bytes: `recomputed_block`).

    The mesh (`split`: what tensor parallel splits, default the config's): context parallel gives a rank
    `seq_len / cp` tokens everywhere, so the forward runs on those. Tensor parallel: the forward runs with each split
    Linear holding one tp rank's shard (tensor_parallel.local_linears), so attention and MLP keep their rank's heads
    and columns and their input whole. Sequence parallel also splits what the blocks keep outside attention and
    MLP (norms, block inputs) and the final norm along the sequence, by tp (Korthikanti et al. 2022,
    arXiv:2205.05198, Table 2: per layer sbh(10/t + 24/t + 5as/ht) with sequence parallel against
    sbh(10 + 24/t + 5as/ht) without); a region's input is gathered whole (torch's PrepareModuleInput) and counted
    whole. The LM head's input, the logits and the loss stay whole: the logits are gathered on every rank. Expert
    parallel (`experts`: what it splits, default the config's): each experts module's dispatch keeps its regroup
    indices in its block (expert_parallel.ExpertSplit.kept_bytes, from the rows the module is called with; not ops
    the selective policy keeps, so recomputed with the block under checkpointing); its all-to-all buffers are in
    flight, not kept, and only the largest layer's are returned."""
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8dist.engines.activation_checkpointing import SavePolicy

    model, t = meta.model, spec.train
    split = split or tensor_split(model, spec)
    experts = experts or expert_split(model, spec)
    # what is kept while `on_sequence_shard` is a rank's sequence shard: divided by tp under sequence parallel
    sequence_shards = split.tp if split.sequence_parallel else 1
    units = [module for _, module in blocks(model, spec)]
    current: list[int | None] = [None]
    on_sequence_shard = [False]  # in a block outside its regions, or in a sequence-parallel module outside blocks
    per_block = [0] * len(units)
    block_inputs = [0] * len(units)
    outside = [0]
    entered = [False]  # a block has run: what is kept outside the blocks from then on comes after them
    # id of each saved base -> (a weak reference to it, a rank's bytes of it, its block or None, after the blocks):
    # counted once the forward is done, if still alive (held by the loss's graph); a tensor saved for a graph the loss
    # does not reach dies with it (DoRA's update of each adapted Linear, built over an in x in identity and detached:
    # estimate/dora.py)
    seen: dict[int, tuple[weakref.ref, int, int | None, bool]] = {}
    after = [0]
    selective = [0] * len(units)
    policies: dict[int, SavePolicy] = {}

    class SelectiveKeeps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            index = current[0]
            if index is not None and policies.setdefault(index, SavePolicy()).keeps(func):
                for tensor in [o for o in (out if isinstance(out, (tuple, list)) else [out])
                               if isinstance(o, torch.Tensor)]:
                    selective[index] += rank_bytes(tensor.numel() * tensor.element_size())
            return out

    class MetaGroupedMm(TorchDispatchMode):
        """The experts' grouped GEMMs in any dtype: torch 2.13's meta kernel of aten._grouped_mm takes bf16 only
        ("Expected inputs of BF16 type", the CUDA kernel's rule), while the CPU and the run's dtype may be fp32. The
        output's shape is all a meta forward needs: tokens (rows, K) x experts (E, K, N) -> (rows, N)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16 and args[0].dim() == 2 \
                    and args[1].dim() == 3:
                return args[0].new_empty(args[0].shape[0], args[1].shape[-1])
            return func(*args, **(kwargs or {}))

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

    def rank_bytes(size: int) -> int:
        """A rank's bytes of a tensor kept now."""
        return size // sequence_shards if on_sequence_shard[0] else size

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        known = seen.get(id(base))
        if id(base) not in params and (known is None or known[0]() is not base):  # an id freed and reused: new
            seen[id(base)] = (weakref.ref(base), rank_bytes(base.numel() * base.element_size()), current[0],
                              entered[0])
        return tensor

    def enter(index):
        def hook(_module, args, kwargs):
            current[0], on_sequence_shard[0], entered[0] = index, True, True
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(hidden, torch.Tensor):
                block_inputs[index] = hidden.numel() * hidden.element_size() // sequence_shards
        return hook

    def leave(*_):
        current[0], on_sequence_shard[0] = None, False

    def sequence_shard(value: bool):
        return lambda *_: on_sequence_shard.__setitem__(0, value)

    dispatch_kept, all_to_all = [0], [0]

    def dispatch(_module, args, kwargs, _output):
        """An experts module's dispatch: its (tokens, hidden) input sent as tokens x top_k rows."""
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rows = kwargs.get("top_k_index", args[1] if len(args) > 1 else None).numel()
        size = experts.kept_bytes(rows)
        dispatch_kept[0] += size
        if current[0] is None:
            outside[0] += size
            after[0] += size if entered[0] else 0
        else:
            per_block[current[0]] += size
        all_to_all[0] = max(all_to_all[0], experts.in_flight_bytes(rows, hidden.shape[-1], hidden.element_size()))

    handles = [unit.register_forward_pre_hook(enter(i), with_kwargs=True) for i, unit in enumerate(units)]
    handles += [unit.register_forward_hook(leave) for unit in units]
    for fqn in split.regions:  # attention and MLP hold the whole sequence, gathered
        handles += [model.get_submodule(fqn).register_forward_pre_hook(sequence_shard(False)),
                    model.get_submodule(fqn).register_forward_hook(sequence_shard(True))]
    if experts.ep > 1:
        handles += [model.get_submodule(fqn).register_forward_hook(dispatch, with_kwargs=True)
                    for fqn in experts.modules]
    if split.final_norm is not None:
        final_norm = model.get_submodule(split.final_norm)
        handles += [final_norm.register_forward_pre_hook(sequence_shard(True)),
                    final_norm.register_forward_hook(sequence_shard(False))]
    ids = torch.zeros(t.micro_batch_size, t.seq_len // spec.parallel.context_size, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, **({"labels": ids} if meta.causal_lm else {})}
    try:
        with local_linears(model, split), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                FlashAttention(), MetaGroupedMm(), SelectiveKeeps():
            params = {id(p) for p in model.parameters()}  # the rank's shards, in place while measuring
            loss = forward_loss(model, batch)  # held: its graph keeps what backward needs alive
    except Exception as exc:  # noqa: BLE001 - an op without a meta kernel, a model that needs other inputs
        raise Fp8distError(f"cannot run {type(model).__name__} on the meta device to measure activations: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        for handle in handles:
            handle.remove()
    for reference, size, index, past in seen.values():
        if reference() is None:
            continue
        if index is None:
            outside[0] += size
            after[0] += size if past else 0
        else:
            per_block[index] += size
    del loss
    kept: dict[CheckpointingMode, int] = {
        "none": outside[0] + sum(per_block), "full": outside[0] + sum(block_inputs),
        "selective": outside[0] + sum(block_inputs) + sum(selective)}
    each = tuple({"none": per_block[i], "full": block_inputs[i], "selective": block_inputs[i] + selective[i]}
                 for i in range(len(units)))
    return MeasuredActivations(kept, max(per_block) if per_block else 0, dispatch_kept[0], all_to_all[0],
                               cast("tuple[Mapping[CheckpointingMode, int], ...]", each), outside[0] - after[0],
                               after[0])
