"""Weight GEMMs by FLOPs: which module's parameter each matmul multiplies, how many FLOPs, in which format.

Counting converted modules says nothing about where the FLOPs run: on a Mixture-of-Experts model the experts
are 3-D parameters multiplied by `torch._grouped_mm` (transformers 5 integrations/moe.py), not `nn.Linear`s,
and hold most of the weight-GEMM FLOPs. So every matmul is followed back to the parameter it multiplies:

- **Ownership**: a forward pre-hook on each module that holds parameters marks the tensors it is about to use
  (after FSDP2 or ZeRO-3 gathered them) with (module, parameter shape). A mark follows every op whose marked
  inputs all come from one parameter and whose other inputs are scalars or integers: views, slices, the
  float8/MX quantization casts. A matmul's output is an activation and carries no mark.
- **Format**: an operand is as precise as its values. A tensor computed only from low-precision tensors
  (an emulated kernel's dequantized FP8 or MXFP8 operand: `qdata.to(fp32) * scale`) keeps their format, so
  an emulated MXFP8 GEMM counts as MXFP8 and a bf16 GEMM of bf16 weights as bf16.
- **Phases**: a marked matmul inside its module's forward (or its activation-checkpoint recompute) is the
  forward GEMM; outside it, in backward, the input-gradient GEMM. The weight-gradient GEMM multiplies two
  activations; it is the backward matmul whose output has a parameter's shape, attributed to the latest
  forward (not recompute) of a parameter of that shape not yet given its weight gradient (backward runs in
  reverse order).
- **FLOPs** from the shapes: 2*M*N*K; grouped GEMMs count the rows up to their last offset.

Attention's own matmuls (activation x activation) are not weight GEMMs and are left out.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fp8dist.backends.module_filter import ROUTER_REASON, is_router
from fp8dist.backends.storage import storage
from fp8dist.engines.activation_checkpointing import in_backward

LOW_PRECISION = ("fp8", "fp4")
# Scale formats: an operand built from a low-precision payload and these block scales is a microscaled one.
BLOCK_SCALE = "fp8_e8m0"
GROUPED = {"_grouped_mm", "_scaled_grouped_mm", "grouped_mm"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm"} | GROUPED
# Wrapper names the audit strips from module names (activation checkpointing, torch.compile).
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class Mark:
    """The parameter a tensor was computed from: its module and its shape."""
    module: str
    shape: tuple[int, ...]


def clean_name(fqn: str) -> str:
    for part in WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor and, for a wrapper subclass (torchao Float8TrainingTensor, MXTensor), its inner tensors."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return [tensor]
    try:
        names, _ = flatten()
    except Exception:  # a subclass whose flatten needs state it does not have here: read the wrapper only
        return [tensor]
    return [tensor] + [inner for name in names if isinstance(inner := getattr(tensor, name, None), torch.Tensor)]


def _matters(tensor: torch.Tensor) -> bool:
    """Float payload: not a scalar (a tensorwise scale, a loss) and not an index or offset tensor."""
    return tensor.numel() > 1 and (tensor.is_floating_point() or storage(tensor).format.startswith(LOW_PRECISION))


def combine(formats: set[str]) -> str:
    """One format for values built from these: FP8 payload + e8m0 block scales = 'mxfp8'; else the lowest."""
    payload = sorted(f for f in formats if f != BLOCK_SCALE)
    if BLOCK_SCALE in formats and payload:
        return "mx" + payload[0].split("_")[0]
    return payload[0] if payload else BLOCK_SCALE


def gemm_flops(name: str, args: tuple, out) -> int:
    """FLOPs of one matmul-like op from its operand shapes (2 per multiply-add)."""
    a, b = args[0], args[1]
    if name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    if name in GROUPED:
        offs = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
        if a.dim() == 2 and b.dim() == 2:  # weight gradient: (N, rows) x (rows, K) per group, rows summed
            rows = int(offs[-1]) if offs is not None and offs.numel() else a.shape[1]
            return 2 * a.shape[0] * rows * b.shape[1]
        if a.dim() == 2:  # tokens (rows, K) x experts (E, K, N): each row meets one expert
            rows = int(offs[-1]) if offs is not None and offs.numel() else a.shape[0]
            return 2 * rows * a.shape[1] * b.shape[-1]
        return 2 * out.numel() * a.shape[-1]
    if name == "linear":  # input (..., K), weight (N, K)
        return 2 * a.numel() * b.shape[0]
    return 2 * out.numel() * a.shape[-1]


class WeightGemmLedger:
    """FLOPs per (module, format) of every weight GEMM seen, fed op by op by the audit's dispatch mode."""

    def __init__(self):
        # by identity, held weakly: a tensor freed during the step takes its mark with it
        self.marks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.lineage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.flops: dict[tuple[str, str], int] = defaultdict(int)   # (module, format) -> FLOPs
        # (module, phase) -> FLOPs of its high-precision weight GEMMs; phase: forward, input_gradient, weight_gradient
        self.high_precision_phases: dict[tuple[str, str], int] = defaultdict(int)
        self.activation_flops = 0
        self.running: dict[str, int] = defaultdict(int)             # modules inside their forward now
        self._awaiting_wgrad: dict[tuple[int, ...], list[str]] = defaultdict(list)
        self.routers: set[str] = set()
        self.kinds: dict[str, str] = {}       # module -> class name
        self.experts: dict[str, bool] = {}    # module -> holds 3-D (per-expert) weights
        # module -> (M, K, N) of its latest forward weight GEMM (2-D weights): the shape the audit's speed row predicts
        self.shapes: dict[str, tuple[int, int, int]] = {}
        # (module, phase) -> FLOPs, and the scalings its GEMMs ran in (gemm_scaling): what the policy check reads
        self.phase_flops: dict[tuple[str, str], int] = defaultdict(int)
        self.phase_scalings: dict[tuple[str, str], set[str]] = defaultdict(set)

    # -- marks, set by the module hooks ---------------------------------------------------------------------
    @contextlib.contextmanager
    def owners(self, root: torch.nn.Module):
        """While active, each module with parameters marks them as its forward starts (after any hook that
        gathered them, registered earlier) and is `running` until its forward returns."""
        handles = []
        modules = dict(root.named_modules())
        for fqn, module in modules.items():
            if next(module.parameters(recurse=False), None) is None:
                continue
            name = clean_name(fqn)
            self.kinds[name] = type(module).__name__
            self.experts[name] = any(p.dim() == 3 for p in module.parameters(recurse=False))
            if is_router(name, module, modules.get(fqn.rpartition(".")[0])):
                self.routers.add(name)
            handles.append(module.register_forward_pre_hook(self._entering(name)))
            handles.append(module.register_forward_hook(self._leaving(name), always_call=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _entering(self, name: str):
        def hook(module, args):
            for param in module.parameters(recurse=False):
                for part in _parts(param):  # each with its own shape: a DTensor's local tensor (an expert-parallel
                    self.marks[part] = Mark(name, tuple(part.shape))  # rank's experts) meets GEMMs at its own
            self.running[name] += 1
        return hook

    def _leaving(self, name: str):
        def hook(module, args, output):
            self.running[name] -= 1
        return hook

    def _mark_of(self, tensor: torch.Tensor) -> Mark | None:
        return next((m for part in _parts(tensor) if (m := self.marks.get(part)) is not None), None)

    def format_of(self, tensor: torch.Tensor) -> str:
        own = storage(tensor).format
        scale = getattr(tensor, "scale", None)  # torchao's MXTensor: FP8 `qdata` with e8m0 block scales
        if own.startswith(LOW_PRECISION) and isinstance(scale, torch.Tensor) and storage(scale).format == BLOCK_SCALE:
            return combine({own, BLOCK_SCALE})
        if own.startswith(LOW_PRECISION):
            return own
        return next((f for part in _parts(tensor) if (f := self.lineage.get(part)) is not None), own)

    # -- every op -------------------------------------------------------------------------------------------
    def observe(self, name: str, args: tuple, kwargs: dict, out) -> None:
        if name in MATMULS:
            self._gemm(name, args, out)
            return
        tensors = [t for t in _tensors((args, kwargs)) if t.numel() > 1]
        if name == "copy_" and tensors:
            tensors = tensors[1:]  # copy_(destination, source): the result is the source's
        outputs = _tensors(out)
        if not tensors or not outputs:
            return
        inputs = [t for t in tensors if _matters(t)]
        # marks follow through index and mask tensors too (a quantization's exponent arithmetic runs in uint8)
        marks = {self._mark_of(t) for t in tensors} - {None}
        if len(marks) == 1 and all(self._mark_of(t) is not None for t in inputs):
            mark = marks.pop()
            for t in outputs:
                for part in _parts(t):
                    self.marks[part] = mark
        if not inputs:
            return
        formats = {self.format_of(t) for t in inputs}
        if all(is_low_precision(f) for f in formats):
            low = combine(formats)
            for t in outputs:
                if not storage(t).format.startswith(LOW_PRECISION):
                    self.lineage[t] = low

    def _gemm(self, name: str, args: tuple, out) -> None:
        operands = [a for a in args[:3] if isinstance(a, torch.Tensor) and _matters(a)]
        if name in ("addmm", "baddbmm"):
            operands = operands[1:]
        if len(operands) < 2 or not isinstance(out, torch.Tensor):
            return
        flops = gemm_flops(name, args, out)
        fmt = self._operand_format(operands)
        backward = in_backward()
        mark = next((m for m in map(self._mark_of, operands) if m is not None), None)
        if mark is not None:
            if self.running[mark.module] > 0:  # forward, or its recompute in backward
                if not backward:  # its weight gradient comes later (a recompute's belongs to the first forward,
                    # and checkpointing may stop recomputing before a block's last GEMM)
                    self._awaiting_wgrad[mark.shape].append(mark.module)
                    if len(mark.shape) == 2 and mark.shape[0] * mark.shape[1]:  # weight (N out, K in)
                        n, k = mark.shape
                        self.shapes[mark.module] = (flops // (2 * k * n), k, n)
                self._count(mark.module, fmt, "forward", flops, operands)
            else:
                self._count(mark.module, fmt, "input_gradient", flops, operands)
            return
        owner = self._weight_gradient_owner(out) if backward else None
        if owner is None:
            self.activation_flops += flops
        else:
            self._count(owner, fmt, "weight_gradient", flops, operands)

    def _count(self, module: str, fmt: str, phase: str, flops: int, operands: list[torch.Tensor]) -> None:
        self.flops[(module, fmt)] += flops
        self.phase_flops[(module, phase)] += flops
        self.phase_scalings[(module, phase)].add(gemm_scaling(fmt, operands))
        if not is_low_precision(fmt):
            self.high_precision_phases[(module, phase)] += flops

    def _operand_format(self, operands: list[torch.Tensor]) -> str:
        formats = [self.format_of(t) for t in operands[:2]]
        low = [f for f in formats if is_low_precision(f)]
        return low[0] if low else formats[0]

    def _weight_gradient_owner(self, out: torch.Tensor) -> str | None:
        if out.dim() not in (2, 3):
            return None
        shape = tuple(out.shape)
        flipped = shape[:-2] + (shape[-1], shape[-2])
        for key in (shape, flipped):
            waiting = self._awaiting_wgrad.get(key)
            if waiting:
                return waiting.pop()
        return None

    def add_library_gemm(self, library: str, fmt: str, flops: int) -> None:
        """A GEMM run by a library's own kernel entry point (Transformer Engine), which aten never sees: counted
        under the library's name, as its entry point does not say which module called it."""
        self.flops[(library, fmt)] += flops

    # -- the ledgers of a pipeline's stages, one per rank, as one ----------------------------------------------
    _COUNTS = ("flops", "high_precision_phases", "phase_flops")

    def tallies(self) -> dict:
        """What was counted, as plain data (no tensor): what another rank merges (`merge`)."""
        return {"counts": {name: dict(getattr(self, name)) for name in self._COUNTS},
                "phase_scalings": {key: sorted(value) for key, value in self.phase_scalings.items()},
                "routers": sorted(self.routers), "kinds": dict(self.kinds), "experts": dict(self.experts),
                "shapes": dict(self.shapes), "activation_flops": self.activation_flops}

    def merge(self, tallies: dict) -> None:
        """Add another rank's `tallies`: a pipeline stage's weight GEMMs, whose modules no other stage runs."""
        for name, counts in tallies["counts"].items():
            mine = getattr(self, name)
            for key, value in counts.items():
                mine[key] += value
        for key, scalings in tallies["phase_scalings"].items():
            self.phase_scalings[key].update(scalings)
        self.routers.update(tallies["routers"])
        self.kinds.update(tallies["kinds"])
        self.experts.update(tallies["experts"])
        self.shapes.update(tallies["shapes"])
        self.activation_flops += tallies["activation_flops"]


def merged_over(ledger: WeightGemmLedger, group) -> WeightGemmLedger:
    """One ledger of every rank of `group` (a pipeline's ranks, each running other stages of the model): the step's
    weight GEMMs of the whole model, whichever rank ran them."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, ledger.tallies(), group=group)
    merged = WeightGemmLedger()
    for tallies in everyone:
        merged.merge(tallies)
    return merged


def is_low_precision(fmt: str) -> bool:
    return fmt.startswith(LOW_PRECISION) or fmt.startswith("mx")


def gemm_scaling(fmt: str, operands: list[torch.Tensor]) -> str:
    """How one weight GEMM's operands were scaled, as a recipe sees it: `mxfp8` (block scales), `tensorwise` (torchao's
    Float8TrainingTensor operands all with one scale each), `rowwise` (one of them scaled per row or column: torchao's
    rowwise recipes; in rowwise_with_gw_hp the input gradient's weight is tensorwise, its grad_output rowwise),
    `fp8` (low precision, no scale seen), else the high-precision operand format."""
    if not is_low_precision(fmt):
        return fmt
    if fmt.startswith("mx"):
        return fmt
    scales = [scale for t in operands if isinstance(scale := getattr(t, "_scale", None), torch.Tensor)]
    if not scales:
        return "fp8"
    return "rowwise" if any(scale.numel() > 1 for scale in scales) else "tensorwise"


def summarize(ledger: WeightGemmLedger, kept: dict[str, str], fp8_expected: bool,
              phases_by_design: dict[str, str] | None = None) -> dict:
    """The audit JSON's `gemm_flops`. `kept`: module -> why the config keeps it in high precision (the FP8
    backend's exclusions); `phases_by_design`: phase -> why the recipe runs that GEMM of every converted module
    in high precision (facts.torchao.TORCHAO_HIGH_PRECISION_GEMMS). A high-precision weight GEMM is `allowed` when the
    config says so (or no FP8 is configured); any other is what the gemm row fails on."""
    phases_by_design = phases_by_design or {}
    total = sum(ledger.flops.values())
    by_format: dict[str, int] = defaultdict(int)
    high: dict[str, int] = defaultdict(int)
    for (module, fmt), flops in ledger.flops.items():
        by_format[fmt] += flops
        if not is_low_precision(fmt):
            high[module] += flops
    share = (lambda n: round(n / total, 4)) if total else (lambda n: 0.0)
    rows = []
    for module, flops in sorted(high.items(), key=lambda item: -item[1]):
        if not fp8_expected:
            reason, allowed = "no FP8 backend in the config", True
        elif module in ledger.routers:
            reason, allowed = ROUTER_REASON, True
        elif module in kept:
            reason, allowed = kept[module], True
        elif (by_design := _by_design(ledger, module, phases_by_design)) is not None:
            reason, allowed = by_design, True
        else:
            reason, allowed = _not_converted(module, ledger), False
        rows.append({"module": module, "share": share(flops), "reason": reason, "allowed": allowed})
    return {"fp8_share": share(sum(n for (_, f), n in ledger.flops.items() if is_low_precision(f))),
            "by_format": {fmt: share(n) for fmt, n in sorted(by_format.items())},
            "high_precision": rows, "weight_gemm_flops": total,
            "activation_gemm_flops": ledger.activation_flops}


def _by_design(ledger: WeightGemmLedger, module: str, phases_by_design: dict[str, str]) -> str | None:
    """The recipe's reason when every high-precision GEMM of `module` is in a phase the recipe keeps so."""
    phases = {phase for (name, phase), flops in ledger.high_precision_phases.items() if name == module and flops}
    if phases and phases <= set(phases_by_design):
        return "; ".join(phases_by_design[phase] for phase in sorted(phases))
    return None


def _not_converted(module: str, ledger: WeightGemmLedger) -> str:
    kind = ledger.kinds.get(module, "module")
    if ledger.experts.get(module):
        return (f"not converted: {kind} holds MoE experts as 3-D parameters (no nn.Linear); "
                "precision.fp8.torchao.experts converts them")
    return f"not converted: {kind} is not an FP8 module of this backend"
