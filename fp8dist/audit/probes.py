"""Probes that observe a real prepared model without changing its numerics.

Every tensor is read by what it stores, not its logical `.dtype` (fp8dist.backends.storage); GEMMs are seen
as aten matmuls (TorchDispatchMode) and, for Transformer Engine and MS-AMP, at their own GEMM entry points
(fp8dist.audit.library_gemms).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import AbstractSet, Any, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fp8dist.backends.storage import BlockLayout, Storage, is_tensor_like, short, storage
from fp8dist.dtypes import name_of
from fp8dist.facts.torch import sdpa_kernel_reason
from fp8dist.audit.gemm_flops import GROUPED, LOW_PRECISION, WeightGemmLedger, is_low_precision
from fp8dist.audit.library_gemms import LibraryGemmRecorder

__all__ = ["short", "summarize", "trainable", "MatmulRecorder", "KernelProbe", "emulates", "describe_fp8",
           "low_precision_format", "compute_dtype", "optimizer_states", "state_layouts", "describe_layouts",
           "state_tensors", "nbytes", "numel", "summarize_counts", "bytes_per_param_by_format"]


def summarize(tensors: Iterable) -> tuple[str, dict[str, int]]:
    """Dominant storage format over the tensors, and elements per format."""
    counts: Counter = Counter()
    for t in tensors:
        s = storage(t)
        counts[s.format] += s.numel
    return summarize_counts(counts)


def summarize_counts(counts: dict[str, int]) -> tuple[str, dict[str, int]]:
    """The formats of elements counted per format: one name, or `a+b` when mixed."""
    if not counts:
        return "none", {}
    return ("+".join(sorted(counts)) if len(counts) > 1 else next(iter(counts))), dict(counts)


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


FLOAT_FORMATS = ("fp", "bf")  # fp32/fp16/fp8_*/fp4_*, bf16: not integer index tensors
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", *GROUPED,
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}


class AttentionKernels(TorchFunctionMode):
    """The matmuls a library attention kernel runs inside itself, told apart from the run's own.

    `F.scaled_dot_product_attention` takes query, key and value from the run and picks its own kernel, whose
    precision is its own: on a CPU with dropout it runs its math path, which upcasts bf16 inputs to fp32
    (fp8dist.facts.torch.SDPA_MATH_UPCAST). Each call is counted as one attention op on the operands the run gave it
    (`calls`), as its fused kernel would be; what runs inside it is the kernel's: its forward while the call runs
    (`inside`), its backward on the autograd nodes the call created (read from the output's graph down to its inputs,
    matched by sequence number with the node the autograd engine runs: torch._C._current_autograd_node). Sequence
    numbers are counted per thread; the forward runs on one."""

    NAME = "scaled_dot_product_attention"

    def __init__(self, calls: Counter):
        super().__init__()
        self.depth = 0
        self.nodes: set[int] = set()  # sequence numbers of the autograd nodes inside the calls
        self.calls = calls  # the recorder's: (NAME, the input formats) -> calls
        self.dropout_on_cpu = 0  # calls that took dropout on a CPU tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch._C._nn.scaled_dot_product_attention:
            return func(*args, **kwargs)
        inputs = [t for t in (*args[:3], kwargs.get("query"), kwargs.get("key"), kwargs.get("value"))
                  if isinstance(t, torch.Tensor)][:3]
        self.calls[(self.NAME, _formats_the_kernel_gets(inputs))] += 1
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if dropout and inputs and inputs[0].device.type == "cpu":
            self.dropout_on_cpu += 1
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        outside = {id(t.grad_fn) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                   and t.grad_fn is not None}
        self.nodes |= _nodes_between(getattr(out, "grad_fn", None), outside)
        return out

    def inside(self) -> bool:
        """Whether the op being dispatched now runs inside an attention call: in its forward, or in the backward
        of a node it created."""
        if self.depth:
            return True
        node = torch._C._current_autograd_node() if self.nodes else None
        return node is not None and node._sequence_nr() in self.nodes


def _formats_the_kernel_gets(inputs: list[torch.Tensor]) -> tuple[str, ...]:
    """The formats of the attention inputs as the kernel takes them: under autocast, cast to autocast's dtype first
    (scaled_dot_product_attention is in autocast's lower-precision list on CPU and CUDA: torch 2.13
    aten/src/ATen/autocast_mode.cpp), whatever the run computed them in (RoPE's fp32 cos/sin promote q and k)."""
    device = inputs[0].device.type if inputs else "cpu"
    if inputs and torch.is_autocast_enabled(device):
        cast = name_of(torch.get_autocast_dtype(device))
        return tuple(cast if t.is_floating_point() else storage(t).format for t in inputs)
    return tuple(storage(t).format for t in inputs)


def _nodes_between(start, outside: set[int]) -> set[int]:
    """Sequence numbers of the autograd nodes from `start` down to (not into) the nodes of `outside` (ids of the
    inputs' grad_fns) and the leaves."""
    found: set[int] = set()
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in outside or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        found.add(node._sequence_nr())
        todo += [next_node for next_node, _ in node.next_functions]
    return found


class MatmulRecorder(TorchDispatchMode):
    """Records the operand formats of every matmul-like op (forward and backward), and of the GEMMs Transformer
    Engine and MS-AMP run outside aten; `ledger` counts the weight GEMMs' FLOPs per module and format
    (fp8dist.audit.gemm_flops), and gives an operand the format of the values it holds (an emulated MXFP8
    GEMM's dequantized operands are MXFP8 values). `emulated`: the low-precision GEMMs among `calls` that ran
    emulated, read from the GEMM that ran (`_run_low_precision`), not from a setting. `notes`: what the libraries said
    about their GEMMs."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.emulated: Counter = Counter()
        self.kernel_calls: Counter = Counter()  # matmuls inside library attention kernels (AttentionKernels)
        self.ledger = WeightGemmLedger()
        self.library = LibraryGemmRecorder(self.calls, self.ledger)
        self.attention = AttentionKernels(self.calls)

    @property
    def notes(self) -> list[str]:
        return self.library.notes

    def __enter__(self):
        self.library.__enter__()
        try:
            self.attention.__enter__()
            try:
                return super().__enter__()
            except BaseException:
                self.attention.__exit__(None, None, None)
                raise
        except BaseException:
            self.library.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            try:
                self.attention.__exit__(*exc)
            finally:
                self.library.__exit__(*exc)

    def kernels(self) -> dict[str, Any] | None:
        """The attention kernels' own matmuls, when their precision is not that of the inputs the run gave them:
        {kernel, calls, inputs (format -> calls), matmuls (format -> matmuls), reason}; None otherwise. They are left
        out of the training row (not the run's GEMMs) and said beside it."""
        inputs: Counter = Counter()
        for (name, operands), n in self.calls.items():
            if name == AttentionKernels.NAME:
                for fmt in set(operands):
                    inputs[fmt] += n
        matmuls: Counter = Counter()
        for (_, operands), n in self.kernel_calls.items():
            for fmt in set(operands):
                matmuls[fmt] += n
        if not matmuls or set(matmuls) <= set(inputs):
            return None
        return {"kernel": f"F.{AttentionKernels.NAME}", "calls": sum(inputs.values()), "inputs": dict(inputs),
                "matmuls": dict(matmuls), "reason": sdpa_kernel_reason(self.attention.dropout_on_cpu > 0)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        out = None
        if name in MATMULS and not _outer_product(name, args):
            tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
            formats = (self.ledger.format_of(a) for a in tensors)
            operands = tuple(f for f in formats if f.startswith(FLOAT_FORMATS) or is_low_precision(f))
            if self.attention.inside():  # the attention kernel's own (its call counts once, on the run's inputs)
                self.kernel_calls[(name, operands)] += 1
            else:
                self.calls[(name, operands)] += 1
            if any(map(is_low_precision, operands)):
                out, emulated = self._run_low_precision(func, args, kwargs, tensors)
                if emulated:
                    self.emulated[(name, operands)] += 1
        if out is None:
            out = func(*args, **kwargs)
        self.ledger.observe(name, args, kwargs, out)
        return out

    def _run_low_precision(self, func, args, kwargs, tensors) -> tuple[Any, bool]:
        """Run a GEMM with a low-precision operand; (its output, whether it ran emulated), read from the GEMM that
        really ran. On plain tensors this op is that GEMM. On a tensor subclass (torchao's Float8TrainingTensor,
        MXTensor, a DTensor over one under tensor parallel) the kernel is chosen inside the subclass, out of this
        mode's sight: the op runs under a KernelProbe, which sees the plain GEMMs it comes down to. A subclass
        whose GEMM goes where aten does not (no plain GEMM seen) is judged by what its operands declare."""
        if all(type(t) in PLAIN_TYPES for t in tensors):
            return func(*args, **kwargs), not any(native_operands(tensors))
        probe = KernelProbe()
        with probe:
            out = func(*args, **kwargs)
        if probe.kernels:
            return out, not any(probe.kernels)
        return out, any(emulates(t, self.ledger) for t in tensors)

    def split(self) -> tuple[Counter, Counter]:
        """(GEMMs with an FP8/FP4 operand, the others)."""
        fp8: Counter = Counter()
        other: Counter = Counter()
        for (name, operands), n in self.calls.items():
            (fp8 if any(is_low_precision(o) for o in operands) else other)[(name, operands)] += n
        return fp8, other


def _outer_product(name: str, args) -> bool:
    """A matmul whose inner dimension is 1: an outer product, no GEMM. transformers before 5.2x computed the
    rotary embedding's frequencies that way, in fp32 by design (transformers 5.17 models/llama/modeling_llama.py
    LlamaRotaryEmbedding.forward: `inv_freq_expanded.float() @ position_ids_expanded.float()`, autocast off;
    5.24 multiplies by broadcasting): it is not the training's compute dtype."""
    first = args[1] if name in ("addmm", "baddbmm") else args[0] if args else None
    return (name in ("mm", "addmm", "bmm", "baddbmm", "matmul") and isinstance(first, torch.Tensor)
            and first.dim() >= 2 and first.shape[-1] == 1)


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


# Op namespaces below a GEMM on tensor subclasses that are never a GEMM themselves: aten's own (its matmuls are
# told by name), and the collectives DTensor runs inside a tensor-parallel mm (they move float8 bytes, multiply none).
NOT_GEMMS = ("aten", "prims", "_c10d_functional", "c10d", "_dtensor")
# A block-scaled format's scales (MX's E8M0) are fp8-typed but values of no GEMM operand.
SCALE_FORMATS = ("fp8_e8m0",)


def native_operands(tensors: Iterable[torch.Tensor]) -> Iterator[bool]:
    """Per plain operand of a GEMM that ran: whether it holds low-precision values itself (`torch._scaled_mm` of
    float8 tensors), as a native FP8/FP4 kernel takes them; dequantized values in fp32/bf16 do not, nor do scales."""
    return (storage(t).format.startswith(LOW_PRECISION) and not storage(t).format.startswith(SCALE_FORMATS)
            for t in tensors)


class KernelProbe(TorchDispatchMode):
    """Below one GEMM on tensor subclasses: each plain GEMM it comes down to, as `kernels` (True where that GEMM took
    low-precision operands: a native kernel; False where it multiplied high-precision values: emulation). An op on a
    subclass is handed to the subclass (NotImplemented: torch then runs the subclass's __torch_dispatch__ with this
    mode still active, so the ops it issues come back here as plain tensors); DTensor's sharding propagation runs
    ops on FakeTensors (torch 2.13 torch/distributed/tensor/_sharding_prop.py), which run as they are."""

    def __init__(self):
        super().__init__()
        self.kernels: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)
        if any(t not in PLAIN_TYPES for t in types):
            return NotImplemented
        name = func.overloadpacket.__name__
        tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
        if name in MATMULS and len(tensors) >= 2:
            self.kernels.append(any(native_operands(tensors)))
        elif func.namespace not in NOT_GEMMS and any(native_operands(tensors)):
            self.kernels.append(True)  # a library's own low-precision GEMM op (torchao's CUTLASS MX kernels)
        return func(*args, **kwargs)


def emulates(tensor, ledger: WeightGemmLedger) -> bool:
    """Whether a low-precision GEMM on this operand is declared to run emulated: its values dequantized, then
    multiplied by a high-precision matmul (FP8's rounding, not an FP8 kernel); the recorder's fallback where it
    cannot see the GEMM that ran. The operand carries the kernel choice (torchao 0.18): a Float8TrainingTensor its
    ScaledMMConfig.emulate (float8/float8_ops.py `float8_mm`: `torch.mm` of the dequantized operands when set,
    `torch._scaled_mm` otherwise), an MXTensor its `kernel_preference` (mx_formats/mx_tensor.py
    `_addmm_mx_dispatch`: EMULATED dequantizes), a DTensor (tensor parallel) that of its local tensor; a plain
    tensor that holds dequantized FP8 values (the emulated MXFP8 grouped GEMMs, moe_training/mxfp8_grouped_mm.py) is
    emulated by what it is."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return emulates(local, ledger)
    config = getattr(tensor, "_linear_mm_config", None)
    if config is not None:
        return any(getattr(gemm, "emulate", False) for gemm in config)
    preference = getattr(tensor, "kernel_preference", None)
    if preference is not None:
        return getattr(preference, "value", preference) == "emulated"
    return not storage(tensor).format.startswith(LOW_PRECISION) and is_low_precision(ledger.format_of(tensor))


def describe_fp8(fp8: Counter) -> str:
    formats: Counter[str] = Counter()
    for (_, operands), n in fp8.items():
        formats["x".join(o.replace("fp8_", "") for o in operands)] += n  # e4m3xe4m3, e5m2xe4m3, mxfp8xmxfp8...
    return ", ".join(f"{k}: {v}" for k, v in sorted(formats.items()))


def family(fmt: str) -> str:
    """'fp8_e4m3' -> 'fp8', 'mxfp8' -> 'fp8' (FP8 values with block scales), 'fp4_e2m1' -> 'fp4'."""
    return fmt.removeprefix("mx").split("_")[0]


def low_precision_format(fp8: Counter) -> str:
    """'fp8', 'fp4' (or both) over the recorded low-precision operands."""
    found = {family(o) for (_, operands) in fp8 for o in operands if is_low_precision(o)}
    return "+".join(sorted(found))


def compute_dtype(other: Counter) -> tuple[str, str]:
    """Dominant operand dtype of the non-FP8 matmuls, with the breakdown."""
    dtypes: Counter[str] = Counter()
    for (_, operands), n in other.items():
        for o in set(operands):
            dtypes[o] += n
    if not dtypes:
        return "none", ""
    top = dtypes.most_common()
    return top[0][0] if len(top) == 1 else "+".join(sorted(dtypes)), ", ".join(f"{k}: {v}" for k, v in top)


def _stored_states(optimizer, skip: AbstractSet[int]) -> Iterator[tuple[str, Storage]]:
    """(state key, what it stores) for every tensor state but scalars (a step count) and the ids in `skip`."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if is_tensor_like(value) and value.numel() > 1 and id(value) not in skip:
                yield key, storage(value)


def optimizer_states(optimizer, skip: AbstractSet[int] = frozenset()) -> tuple[str, dict[str, Any]]:
    """Adam-like states as 'exp_avg+exp_avg_sq' storage formats; other optimizers: all tensor states.
    `skip`: ids of state tensors left out (those a low-bit optimizer keeps in full precision by design)."""
    per_key: dict[str, Counter] = {}
    for key, s in _stored_states(optimizer, skip):
        per_key.setdefault(key, Counter())[s.format] += s.numel
    if not per_key:
        return "none", {}
    ordered: list[str] = [k for k in ("exp_avg", "exp_avg_sq") if k in per_key] or sorted(per_key)
    parts = ["+".join(sorted(per_key[k])) for k in ordered]
    return "+".join(parts), {k: dict(v) for k, v in per_key.items()}


def state_layouts(optimizer, skip: AbstractSet[int] = frozenset()) -> dict[str, list[BlockLayout]]:
    """Per state key, the distinct block layouts of its block-quantized states (torchao's low-bit AdamW: codes
    dtype, block size, scale dtype, read from each state tensor); keys with none are left out."""
    layouts: dict[str, dict[BlockLayout, None]] = {}
    for key, s in _stored_states(optimizer, skip):
        if s.layout is not None:
            layouts.setdefault(key, {})[s.layout] = None
    return {key: list(found) for key, found in layouts.items()}


def describe_layouts(layouts: dict[str, list[BlockLayout]]) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """The layouts in words ('exp_avg: int8 codes (uint8), block 256, fp32 scale per block; exp_avg_sq: ...') and
    as the report's JSON holds them."""
    words = "; ".join(f"{key}: {' / '.join(layout.describe() for layout in found)}" for key, found in layouts.items())
    return words, {key: [asdict(layout) for layout in found] for key, found in layouts.items()}


def state_tensors(optimizer) -> list:
    return [t for state in optimizer.state.values() for t in state.values() if is_tensor_like(t) and t.numel() > 1]


def nbytes(tensors: Iterable) -> int:
    return sum(storage(t).nbytes for t in tensors)


def numel(tensors: Iterable) -> int:
    """Logical elements, where `.numel()` counts the packed storage (a bitsandbytes 4-bit weight's)."""
    return sum(storage(t).numel for t in tensors)


def bytes_per_param_by_format(tensors: Iterable) -> dict[str, float]:
    """Bytes held per element, per storage format (an NF4 base: its codes and scales apart from the 16-bit rest)."""
    held: Counter = Counter()
    elements: Counter = Counter()
    for t in tensors:
        s = storage(t)
        held[s.format] += s.nbytes
        elements[s.format] += s.numel
    return {fmt: round(held[fmt] / elements[fmt], 4) for fmt in sorted(held) if elements[fmt]}
