"""FP8 numerics of the audited step: what each FP8 weight GEMM loses to its casts (`watch(..., numerics=True)`,
`fp8dist audit --numerics`).

For every FP8 weight GEMM the step runs (forward, input gradient, weight gradient), a probe casts the GEMM's
high-precision operands again, with the library's own cast functions and the scaling the module's config gives
that GEMM, and records:
- per operand cast: `underflow`, the share of the nonzero high-precision values that became 0, and `saturated`,
  the share of all values that the cast clamped at the format's largest value;
- per GEMM: `sqnr_db`, 10 log10(sum ref^2 / sum (ref - fp8)^2) (torchao's `compute_error`, torchao 0.18
  torchao/float8/float8_utils.py), where `ref` is the GEMM of the high-precision operands and `fp8` the GEMM of
  the dequantized casts, both in fp32: what torchao's emulated kernels compute (float8/float8_ops.py
  `float8_mm`), and FP8 tensor cores up to their accumulation order.
A module called several times in the step (micro-batches) counts all its calls together.

Probes, one per kind of FP8 module (`PROBES`; the FP8 GEMMs of a kind without one are listed as not measured):
- torchao `Float8Linear` (recipes tensorwise, rowwise, rowwise_with_gw_hp): the cast configs, roles and axes of
  torchao 0.18 float8/float8_linear.py `matmul_with_hp_or_float8_args`; a GEMM whose two casts the config
  disables runs in high precision and is not an FP8 GEMM. A weight that reaches the module already in float8
  (FSDP2's float8 all-gather casts each shard before gathering, float8/fsdp_utils.py) is the cast itself,
  compared with the high-precision weight that the probe gathers when the watch starts.
- torchao `MXFP8Linear` (prototype/moe_training/mxfp8_linear.py `mx_mm`): e4m3 values with an e8m0 scale per 32
  along each GEMM's contracted dimension (`to_mx`, the emulated path's cast).
- fp8dist's MXFP8 experts (fp8dist.backends.experts): the two grouped GEMMs of each experts module, cast as
  torchao's emulated grouped GEMM does (prototype/moe_training/mxfp8_grouped_mm.py: tokens padded per expert to
  the 32-row block for the weight gradient).
Delayed scaling (Transformer Engine's DelayedScaling) is read from the amax histories and scales TE holds:
`scaling_history`, each quantizer's headroom and the passes whose scale lagged a new amax
(fp8dist.audit.scaling_history); a lagged pass clamped its tensor's largest values and fails the row.

Transformer Engine and MS-AMP cast inside their own kernels (fp8dist.audit.library_gemms sees their GEMM entry
points, not the modules); a probe for them is one more `PROBES` entry: a function that recognises the module and
returns a `Probe` class for it (the casts it would read: TE's quantized tensors, MS-AMP's ScalingTensors).

The probes compute with the audit's dispatch modes suspended (their GEMMs are not the step's) and without
autograd; an activation-checkpoint recompute is not measured again. Cost: each FP8 GEMM is cast again and
multiplied twice in fp32 (over at most SQNR_ROWS output rows); memory: each probed module keeps a reference to its
input and weight from its forward to its backward (activations autograd keeps anyway, except those activation
checkpointing drops; under ZeRO-3 the gathered weight stays alive until its backward), and float8 all-gather runs
keep a gathered high-precision copy of the converted weights for the step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fp8dist.audit.expected import HEALTHY, NOT_MEASURED_VALUE, OUTSIDE
from fp8dist.audit.gemm_flops import clean_name, is_low_precision
from fp8dist.audit.scaling_history import ScalingHistories
from fp8dist.engines.activation_checkpointing import in_backward
from fp8dist.backends.storage import short

GEMMS = ("forward", "input_grad", "weight_grad")
# A clamped value exceeds the dequantized largest value; one that rounds to the largest value stays within
# half a step of it (1/16 for e4m3, 1/8 for e5m2). The slack keeps fp32 rounding of the scale out of it.
CLAMP_SLACK = 1e-3
MX_BLOCK = 32  # MXFP8: one e8m0 scale per 32 values (torchao's block_size for MXFP8 training)
# The SQNR is summed over at most this many output rows of a GEMM, evenly spread: a sample of the output estimates
# the whole one's power ratio, and keeps the two fp32 GEMMs per FP8 GEMM cheap next to the step's own GEMMs.
SQNR_ROWS = 64
WORST = 5  # modules the `worst` list and the table show at least


@dataclass
class Cast:
    """One operand cast: its format, the dequantized values (fp32, the operand's shape) and its counts."""
    format: str
    dequantized: torch.Tensor
    underflowed: int
    nonzero: int
    clamped: int
    numel: int

    def transposed(self) -> "Cast":
        """The same cast with its last two dimensions swapped (the orientation a GEMM reads it in)."""
        return dataclasses.replace(self, dequantized=self.dequantized.transpose(-2, -1))


class Operand(NamedTuple):
    """One GEMM operand: its name, its high-precision values and its cast (None: it stays in high precision), both
    in the orientation the GEMM reads them."""
    name: str
    values: torch.Tensor
    cast: Cast | None


def measure_cast(hp: torch.Tensor, payload: torch.Tensor, dequantized: torch.Tensor, fmt: str,
                 numel: int | None = None) -> Cast:
    """Counts of one cast from the high-precision values, the float8 payload (same shape) and its dequantized
    values. A scaled cast turns 0 into 0, so the values it flushed are the nonzero ones less the nonzero payload;
    the payload is read as its bytes without the sign bit (a float8 value is 0 exactly when they are 0, and the
    format's largest magnitude is one code). `numel`: the values that are the operand's own (a cast of a padded
    operand counts its padding out)."""
    largest = torch.tensor(torch.finfo(payload.dtype).max, dtype=payload.dtype).view(torch.uint8).item()
    magnitude = payload.view(torch.uint8) & 0x7F
    nonzero = int(torch.count_nonzero(hp))
    at_max = magnitude == largest
    clamped = 0
    if bool(at_max.any()):
        clamped = int((hp[at_max].float().abs() > dequantized[at_max].abs() * (1 + CLAMP_SLACK)).sum())
    return Cast(fmt, dequantized, nonzero - int(torch.count_nonzero(magnitude)), nonzero, clamped,
                hp.numel() if numel is None else numel)


def _sampled_rows(a: torch.Tensor) -> torch.Tensor | None:
    """The output rows (rows of `a`) the SQNR sums over: None for all, else SQNR_ROWS of them evenly spread."""
    step = -(-a.shape[0] // SQNR_ROWS)
    return None if step == 1 else torch.arange(0, a.shape[0], step, device=a.device)


class Tally:
    """Counts per (module, gemm, operand) cast and signal / noise power per (module, gemm), over the whole step."""

    def __init__(self) -> None:
        self.casts: dict[tuple[str, str, str], list] = {}   # -> [format, underflowed, nonzero, clamped, numel]
        self.gemms: dict[tuple[str, str], list] = {}        # -> [format, signal, noise]
        self.measured: set[str] = set()                     # modules as the audit's ledger names them
        self.unmeasured: dict[str, str] = {}                # module -> why a probe could not measure it
        self.owners: dict[str, str] = {}                    # a GEMM's name -> its module (experts: the weight's)
        self.scaling: list[dict[str, Any]] = []             # delayed scaling's histories (scaling_history.py)

    def gemm(self, module: str, owner: str, gemm: str, a: Operand, b: Operand, offsets: torch.Tensor | None = None,
             rows_grouped: bool = False) -> None:
        """Record one GEMM `a @ b` (`offsets`: torch._grouped_mm's, over the rows of `a` when `rows_grouped`, else
        over the contracted dimension); `owner`: the module as the audit's ledger names it. Both operands in high
        precision: a high-precision GEMM by the config, not recorded."""
        if a.cast is None and b.cast is None:
            return
        for operand in (a, b):
            if operand.cast is not None:
                entry = self.casts.setdefault((module, gemm, operand.name), [operand.cast.format, 0, 0, 0, 0])
                counts = (operand.cast.underflowed, operand.cast.nonzero, operand.cast.clamped, operand.cast.numel)
                for index, value in enumerate(counts, start=1):
                    entry[index] += value
        rows, grouped = _sampled_rows(a.values), offsets
        if rows is not None and offsets is not None and rows_grouped:  # each expert's group keeps its sampled rows
            grouped = torch.searchsorted(rows, offsets.to(rows.dtype)).to(torch.int32)

        def product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            left = left.float() if rows is None else left[rows].float()
            return left @ right.float() if grouped is None else torch._grouped_mm(left, right.float(), offs=grouped)

        reference = product(a.values, b.values)
        low = product(a.values if a.cast is None else a.cast.dequantized,
                      b.values if b.cast is None else b.cast.dequantized)
        formats = [short(o.values.dtype) if o.cast is None else o.cast.format for o in (a, b)]
        entry = self.gemms.setdefault((module, gemm), ["+".join(dict.fromkeys(formats)), 0.0, 0.0])
        entry[1] += float(reference.square().sum())
        entry[2] += float((reference - low).square().sum())
        self.measured.add(owner)
        self.owners[module] = owner


@contextlib.contextmanager
def quiet(tally: Tally, name: str) -> Iterator[None]:
    """A probe's own arithmetic: outside the audit's dispatch modes, without autograd or autocast. A probe that fails
    leaves its module not measured, with the error; the watched step goes on (the check only observes it)."""
    try:
        with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False), \
                (torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()):
            yield
    except Exception as exc:  # noqa: BLE001 - any failure of the observer, reported instead of raised
        tally.unmeasured[name] = f"its probe failed: {type(exc).__name__}: {exc}"


def _forward_weight_values(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision values of a weight as its forward sees them, kept for its backward: torchao's float8
    all-gather wrapper holds them in `_tensor`; a ZeRO-3 parameter's gathered values are copied (DeepSpeed frees
    or reuses their memory after the module's forward), FSDP2's unsharded ones are gathered again for backward."""
    values = getattr(tensor, "_tensor", tensor).detach()
    return values.clone() if hasattr(tensor, "ds_tensor") else values


# -- torchao Float8Linear --------------------------------------------------------------------------------------
def _float8_cast(hp: torch.Tensor, cast_config, role, axis: int, module) -> Cast | None:
    """`hp` cast as torchao's Float8Linear casts that operand of that GEMM; None when the config disables it."""
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    fp8 = hp_tensor_to_float8_dynamic(hp, cast_config.target_dtype, module.linear_mm_config, gemm_input_role=role,
                                      scaling_granularity=cast_config.scaling_granularity,
                                      axiswise_dim=get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
                                      round_scales_to_power_of_2=module.config.round_scales_to_power_of_2)
    return _float8_values(hp, fp8)


def _float8_values(hp: torch.Tensor, fp8) -> Cast:
    """A torchao Float8TrainingTensor against the values it was cast from."""
    return measure_cast(hp, fp8._data, fp8._data.float().div_(fp8._scale.float()), short(fp8._data.dtype))


def _t(cast: Cast | None) -> Cast | None:
    return None if cast is None else cast.transposed()


class Float8LinearProbe:
    """The three GEMMs of a torchao Float8Linear (torchao 0.18 float8/float8_linear.py): forward `input @ weight_t`,
    input gradient `grad_output @ weight` (the weight cast along the other axis: `cast_config_weight_for_grad_input`,
    axiswise over the output features), weight gradient `grad_output_t @ input` (both cast along the tokens)."""

    def __init__(self, module, name: str, tally: Tally, full_weight: torch.Tensor | None):
        self.module, self.name, self.tally, self.full_weight = module, name, tally, full_weight

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> Any:
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_training_tensor import GemmInputRole

        config = self.module.config
        x = x.reshape(-1, x.shape[-1])
        given: Cast | None = None
        weight_t: Cast | None
        if tensor_already_casted_to_fp8(weight):  # FSDP2 float8 all-gather: the one cast both weight GEMMs use
            if self.full_weight is None:
                self.tally.unmeasured[self.name] = "its weight arrived in float8 with no high-precision copy known"
                return None
            hp = self.full_weight
            given = _float8_values(hp, weight)
            weight_t = given.transposed()
        else:
            hp = _forward_weight_values(weight)
            weight_t = _float8_cast(hp.t(), config.cast_config_weight, GemmInputRole.WEIGHT, 0, self.module)
        self.tally.gemm(self.name, self.name, "forward",
                        Operand("input", x, _float8_cast(x, config.cast_config_input, GemmInputRole.INPUT, -1,
                                                         self.module)),
                        Operand("weight", hp.t(), weight_t))
        return x, hp, given

    def backward(self, saved: Any, grad_output: torch.Tensor) -> None:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, hp, given = saved
        config, module = self.module.config, self.module
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        weight = given if given is not None else _t(
            _float8_cast(hp.t(), config.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, module))
        grad_cast = _float8_cast(grad, config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, module)
        self.tally.gemm(self.name, self.name, "input_grad", Operand("grad_output", grad, grad_cast),
                        Operand("weight", hp, weight))
        if config.cast_config_grad_output_for_grad_weight == config.cast_config_grad_output and \
                config.cast_config_grad_output.scaling_granularity is ScalingGranularity.TENSORWISE:
            grad_t = _t(grad_cast)  # one scale for the whole tensor: the same cast whichever axis
        else:
            grad_t = _t(_float8_cast(grad, config.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT,
                                     0, module))
        self.tally.gemm(self.name, self.name, "weight_grad", Operand("grad_output", grad.t(), grad_t),
                        Operand("input", x, _float8_cast(x, config.cast_config_input_for_grad_weight,
                                                         GemmInputRole.INPUT, 0, module)))


# -- MXFP8 ------------------------------------------------------------------------------------------------------
def _mx_cast(hp: torch.Tensor, mode, numel: int | None = None) -> Cast:
    """`hp` in MXFP8 along its last dimension: e4m3 values, an e8m0 scale per 32 (torchao's `to_mx`)."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    hp = hp.contiguous()
    scale, data = to_mx(hp if hp.dtype in (torch.float32, torch.bfloat16) else hp.float(), torch.float8_e4m3fn,
                        MX_BLOCK, mode)
    blocks = data.float().reshape(*data.shape[:-1], -1, MX_BLOCK) * scale.to(torch.float32).unsqueeze(-1)
    return measure_cast(hp, data, blocks.reshape(data.shape), "mxfp8", numel)


def _mx_cast_t(hp: torch.Tensor, mode, numel: int | None = None) -> Cast:
    """`hp` (2-D, or experts' 3-D) in MXFP8 along its second-last dimension, in `hp`'s orientation."""
    return _mx_cast(hp.transpose(-2, -1), mode, numel).transposed()


class MXLinearProbe:
    """The three GEMMs of torchao's MXFP8Linear (prototype/moe_training/mxfp8_linear.py `mx_mm`): each operand in
    MXFP8 blocks along the GEMM's contracted dimension; the weight gradient in high precision with
    `wgrad_with_hp`."""

    def __init__(self, module, name: str, tally: Tally, full_weight: torch.Tensor | None):
        self.module, self.name, self.tally = module, name, tally  # its weight is never gathered in float8

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> Any:
        mode = self.module.scale_calculation_mode
        x, hp = x.reshape(-1, x.shape[-1]), _forward_weight_values(weight)
        self.tally.gemm(self.name, self.name, "forward", Operand("input", x, _mx_cast(x, mode)),
                        Operand("weight", hp.t(), _mx_cast(hp, mode).transposed()))
        return x, hp

    def backward(self, saved: Any, grad_output: torch.Tensor) -> None:
        x, hp = saved
        mode = self.module.scale_calculation_mode
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        self.tally.gemm(self.name, self.name, "input_grad", Operand("grad_output", grad, _mx_cast(grad, mode)),
                        Operand("weight", hp, _mx_cast_t(hp, mode)))
        if not self.module.wgrad_with_hp:
            self.tally.gemm(self.name, self.name, "weight_grad",
                            Operand("grad_output", grad.t(), _mx_cast(grad.t(), mode)),
                            Operand("input", x, _mx_cast_t(x, mode)))


class Probe(Protocol):
    """What a `PROBES` entry returns for a module it recognises: a class, made with (module, its name, the Tally, its
    whole high-precision weight where FSDP2 gathers it in float8, else None). `forward` measures the forward GEMM
    from the module's input and its weight as its forward saw them, and returns what `backward` needs (None: no
    backward to measure); `backward` measures the gradient GEMMs once the gradient of the module's output arrives.
    `name`: the module's, for what the audit reports of it."""

    name: str

    def __init__(self, module: torch.nn.Module, name: str, tally: Tally, full_weight: torch.Tensor | None) -> None:
        ...

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> Any:
        ...

    def backward(self, saved: Any, grad_output: torch.Tensor) -> None:
        ...


def _float8_linear(module) -> type[Probe] | None:
    linear = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    return Float8LinearProbe if linear is not None and isinstance(module, linear) else None


def _mx_linear(module) -> type[Probe] | None:
    linear = getattr(sys.modules.get("torchao.prototype.moe_training.mxfp8_linear"), "MXFP8Linear", None)
    return MXLinearProbe if linear is not None and isinstance(module, linear) else None


# module -> the probe class for it, or None. Only libraries already imported are looked at (the audit never imports
# a library itself).
PROBES: list[Callable[[torch.nn.Module], type[Probe] | None]] = [_float8_linear, _mx_linear]


# -- MoE experts: fp8dist's MXFP8 grouped GEMMs ------------------------------------------------------------------
class GroupedGemmProbe:
    """One grouped GEMM of an experts module, `tokens (rows, K) @ weight_t (E, K, N)` per expert group, as torchao's
    emulated MXFP8 grouped GEMM casts it (prototype/moe_training/mxfp8_grouped_mm.py `_compute_fwd_emulated`,
    `_compute_dgrad_emulated`, `_compute_wgrad_emulated`): tokens and weight along K in forward, the gradient and
    the weight along N for the input gradient, both along the tokens of each expert (groups padded to 32 rows) for
    the weight gradient."""

    def __init__(self, name: str, owner: str, tally: Tally):
        self.name, self.owner, self.tally = name, owner, tally

    def forward(self, tokens: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> Any:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        mode = ScaleCalculationMode.RCEIL
        tokens, weight_t = tokens.detach(), weight_t.detach()
        self.tally.gemm(self.name, self.owner, "forward", Operand("input", tokens, _mx_cast(tokens, mode)),
                        Operand("weight", weight_t, _mx_cast_t(weight_t, mode)), offsets, rows_grouped=True)
        return tokens, weight_t, offsets

    def backward(self, saved: Any, grad_output: torch.Tensor) -> None:
        from torchao.prototype.moe_training.utils import pad_token_groups
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        tokens, weight_t, offsets = saved
        mode = ScaleCalculationMode.RCEIL
        weight = weight_t.transpose(-2, -1)  # (E, N, K)
        self.tally.gemm(self.name, self.owner, "input_grad",
                        Operand("grad_output", grad_output, _mx_cast(grad_output, mode)),
                        Operand("weight", weight, _mx_cast_t(weight, mode)), offsets, rows_grouped=True)
        padded_grad, _, padded_offsets = pad_token_groups(grad_output, offsets, MX_BLOCK, KernelPreference.EMULATED)
        padded_tokens, _, _ = pad_token_groups(tokens, offsets, MX_BLOCK, KernelPreference.EMULATED)
        self.tally.gemm(self.name, self.owner, "weight_grad",
                        Operand("grad_output", padded_grad.t(),
                                _mx_cast(padded_grad.t(), mode, numel=grad_output.numel())),
                        Operand("input", padded_tokens, _mx_cast_t(padded_tokens, mode, numel=tokens.numel())),
                        padded_offsets)
class ExpertsProbe:
    """While active, the fp8dist MXFP8 experts implementation that `model` uses runs its grouped GEMMs through
    GroupedGemmProbes (named `<experts module>.<weight>`: gate_up_proj / up_proj, then down_proj, in the order
    fp8dist.backends.experts.experts_forward calls them)."""

    def __init__(self, model: torch.nn.Module, tally: Tally, active: Callable[[], bool]):
        self.model, self.tally, self.active = model, tally, active
        self._restore: tuple[dict, str, Any] | None = None

    def __enter__(self) -> "ExpertsProbe":
        from fp8dist.backends.experts import IMPLEMENTATION, experts_modules

        name = getattr(getattr(self.model, "config", None), "_experts_implementation", None)
        interface = getattr(sys.modules.get("transformers.integrations.moe"), "ExpertsInterface", None)
        if name != IMPLEMENTATION.format(mode="mxfp8") and name != IMPLEMENTATION.format(mode="mxfp8_emulated"):
            return self
        if interface is None or not isinstance(interface._global_mapping.get(name), partial):
            return self
        registered = interface._global_mapping[name]
        names = {id(module): clean_name(fqn) for fqn, module in experts_modules(self.model)}
        interface._global_mapping[name] = partial(self._forward, registered, names)
        self._restore = (interface._global_mapping, name, registered)
        return self

    def _forward(self, registered: partial, names: dict[int, str], module, *args, **kwargs):
        """The experts forward, its grouped GEMM wrapped for this call (the registered partial's first argument)."""
        owner = names.get(id(module))
        if owner is None or not self.active() or in_backward():
            return registered(module, *args, **kwargs)
        weights = iter(("gate_up_proj" if module.has_gate else "up_proj", "down_proj"))
        grouped_mm = registered.args[0]

        def observed(tokens, weight_t, offsets):
            out = grouped_mm(tokens, weight_t, offsets)
            probe = GroupedGemmProbe(f"{owner}.{next(weights)}", owner, self.tally)
            saved = None
            with quiet(self.tally, probe.name):
                saved = probe.forward(tokens, weight_t, offsets)
            on_gradient(out, probe, saved, self.tally, self.active)
            return out

        return registered.func(observed, module, *args, **kwargs)

    def __exit__(self, *exc) -> None:
        if self._restore is not None:
            mapping, name, registered = self._restore
            mapping[name] = registered
            self._restore = None


def on_gradient(output, probe, saved, tally: Tally, active: Callable[[], bool]) -> None:
    """The probe's backward GEMMs once the gradient of `output` (the GEMM's result) arrives."""
    if not isinstance(output, torch.Tensor) or not output.requires_grad or saved is None:
        return

    def hook(grad: torch.Tensor) -> None:
        if active():
            with quiet(tally, probe.name):
                probe.backward(saved, grad.detach())

    output.register_hook(hook)


# -- the recorder the watch enters ---------------------------------------------------------------------------------
class NumericsRecorder:
    """Installs the probes on `root`'s FP8 modules for as long as it is active (the watched block); `tally` holds
    what they measured. Entered before the audit's dispatch modes: a float8 all-gather run's high-precision weights
    are gathered here (a collective every rank runs in the same order), not on the audited wire."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.tally = Tally()
        self._active = False
        self._stack: contextlib.ExitStack | None = None
        self._histories: ScalingHistories | None = None

    def active(self) -> bool:
        return self._active

    def __enter__(self) -> "NumericsRecorder":
        with contextlib.ExitStack() as stack:
            for fqn, module in self.root.named_modules():
                kind = next((found for probe in PROBES if (found := probe(module)) is not None), None)
                if kind is not None:
                    probe = kind(module, clean_name(fqn), self.tally, _full_weight(module))
                    stack.enter_context(module.register_forward_hook(partial(self._forward, probe)))
            stack.enter_context(ExpertsProbe(self.root, self.tally, self.active))
            self._histories = stack.enter_context(ScalingHistories(self.root))
            self._stack = stack.pop_all()
        self._active = True
        return self

    def _forward(self, probe, module, args, output) -> None:
        if not self._active or in_backward() or not args or not isinstance(args[0], torch.Tensor):
            return
        saved = None
        with quiet(self.tally, probe.name):
            saved = probe.forward(args[0].detach(), module.weight)
        on_gradient(output, probe, saved, self.tally, self.active)

    def __exit__(self, *exc) -> None:
        self._active = False
        try:
            if self._histories is not None:  # after the block: TE has updated its histories and scales
                self.tally.scaling = self._histories.rows(clean_name)
        finally:  # the probes' hooks leave the model whatever happened
            self._histories = None
            if self._stack is not None:
                self._stack.close()
                self._stack = None


def _full_weight(module) -> torch.Tensor | None:
    """The whole high-precision weight of a module whose weight FSDP2 all-gathers in float8 (torchao's
    WeightWithDynamicFloat8CastTensor inside a DTensor shard): gathered now, before the step; else None."""
    weight = getattr(module, "weight", None)
    wrapper = getattr(sys.modules.get("torchao.float8.fsdp_utils"), "WeightWithDynamicFloat8CastTensor", None)
    local = getattr(weight, "_local_tensor", None)
    if weight is None or wrapper is None or not isinstance(local, wrapper):
        return None
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        sharded = DTensor.from_local(local._tensor, weight.device_mesh, weight.placements, run_check=False,
                                     shape=weight.shape, stride=weight.stride())
        return sharded.full_tensor().detach()


# -- the report ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """audit.numerics: the largest underflow and saturation share per cast, the lowest SQNR per kind of GEMM."""
    max_underflow: float
    max_saturated: float
    min_sqnr_db: dict[str, float]

    @classmethod
    def of(cls, spec) -> "Thresholds":
        limits = spec.audit.numerics
        return cls(limits.max_underflow, limits.max_saturated,
                   {gemm: getattr(limits.min_sqnr_db, gemm) for gemm in GEMMS})


def sqnr_db(signal: float, noise: float) -> float | None:
    """10 log10(signal / noise); None where it is no number: no signal, or no noise (an exact GEMM)."""
    if signal <= 0 or noise <= 0 or not math.isfinite(signal) or not math.isfinite(noise):
        return None
    return round(10 * math.log10(signal / noise), 2)


def document(tally: Tally, limits: Thresholds) -> dict[str, Any]:
    """The audit JSON's `numerics`: `casts`, `gemms` and `worst`: every metric beyond its limit, the worst first,
    then, up to WORST modules in all, the passing modules by their metric nearest to its limit."""
    casts = [{"module": module, "gemm": gemm, "operand": operand, "format": fmt,
              "underflow": round(under / nonzero, 4) if nonzero else 0.0,
              "saturated": round(clamped / numel, 4) if numel else 0.0}
             for (module, gemm, operand), (fmt, under, nonzero, clamped, numel) in tally.casts.items()]
    gemms = [{"module": module, "gemm": gemm, "format": fmt, "sqnr_db": sqnr_db(signal, noise)}
             for (module, gemm), (fmt, signal, noise) in tally.gemms.items()]
    findings: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for cast in casts:
        for metric, limit in (("underflow", limits.max_underflow), ("saturated", limits.max_saturated)):
            findings[cast["module"]].append(_finding(cast, metric, cast[metric], limit))
    for gemm in gemms:
        findings[gemm["module"]].append(_finding(gemm, "sqnr_db", gemm["sqnr_db"], limits.min_sqnr_db[gemm["gemm"]]))
    for row in tally.scaling:  # a pass cast with a scale that had not seen its amax clamped: none may
        findings[row["module"]].append(_finding({"module": row["module"], "gemm": row["direction"],
                                                 "operand": row["tensor"]}, "lagged_passes", row["lagged_passes"], 0))
    failing = sorted((f for items in findings.values() for f in items if f["fails"]), key=lambda f: -f["_severity"])
    passing = sorted((max(items, key=lambda f: f["_severity"]) for items in findings.values()
                      if not any(f["fails"] for f in items)), key=lambda f: -f["_severity"])
    shown = failing + passing[:max(WORST - len({f["module"] for f in failing}), 0)]
    return {"casts": casts, "gemms": gemms, "scaling_history": tally.scaling,
            "worst": [{k: v for k, v in f.items() if k != "_severity"} for f in shown]}


def _finding(row: dict[str, Any], metric: str, value: float | None, limit: float) -> dict[str, Any]:
    """`value` against its limit; `_severity` above 1 fails (a share over its largest, an SQNR under its lowest)."""
    if value is None:
        severity = 0.0
    elif metric == "sqnr_db":
        severity = limit / value if value > 0 else math.inf
    else:
        severity = value / limit if limit > 0 else (math.inf if value > 0 else 0.0)
    return {"module": row["module"], "gemm": row["gemm"], "operand": row.get("operand"), "metric": metric,
            "value": value, "limit": limit, "fails": severity > 1, "_severity": severity}


def observe(tally: Tally, ledger, spec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the `numerics` row's observed cell, the JSON's `numerics`) of a watched step. The row is `outside thresholds`
    when a module passes a limit (its detail names them and the fix), not measured when an FP8 GEMM ran that no probe
    measured (the ledger's FP8 modules, fp8dist.audit.gemm_flops), `n/a` when no FP8 GEMM ran and none was asked."""
    numerics = document(tally, Thresholds.of(spec))
    in_fp8 = {module for (module, fmt), flops in ledger.flops.items() if flops and is_low_precision(fmt)}
    unmeasured = {**{module: "no numerics probe for its FP8 GEMMs" for module in in_fp8 - tally.measured},
                  **tally.unmeasured}
    left = "; ".join(f"{module} ({why})" for module, why in sorted(unmeasured.items()))
    failing = [f for f in numerics["worst"] if f["fails"]]
    if failing:
        detail = "; ".join(map(describe, failing)) + (f"; not measured: {left}" if left else "")
        return _cell(OUTSIDE, f"{detail}; fix: {fix(failing, tally, spec)}"), numerics
    if unmeasured:
        return _cell(NOT_MEASURED_VALUE, f"not measured: {left}", measured=False), numerics
    if not tally.measured:
        if spec.fp8.enabled:
            return _cell(NOT_MEASURED_VALUE, "no FP8 weight GEMM ran in the step", measured=False), numerics
        return _cell("n/a", "no FP8 weight GEMM in the step"), numerics
    return _cell(HEALTHY, f"{len(numerics['casts'])} casts and {len(numerics['gemms'])} GEMMs of "
                          f"{len(tally.measured)} FP8 modules within audit.numerics"), numerics


def _cell(value: str, detail: str, measured: bool = True) -> dict[str, Any]:
    return {"observed": value, "detail": detail, "measured": measured}


def describe(finding: dict[str, Any]) -> str:
    """'model.layers.0.mlp.up_proj forward weight underflow 0.992 > 0.01'."""
    what = " ".join(part for part in (finding["module"], finding["gemm"], finding["operand"]) if part)
    if finding["metric"] == "sqnr_db":
        return f"{what} SQNR {finding['value']} dB < {finding['limit']:g} dB"
    if finding["metric"] == "lagged_passes":
        return (f"{what}: the delayed scale lagged a new amax in {finding['value']} pass(es) "
                "(its largest values clamped)")
    return f"{what} {finding['metric']} {finding['value']:.3g} > {finding['limit']:g}"


def fix(failing: list[dict[str, Any]], tally: Tally, spec) -> str:
    """What to do about the failing modules: keep them in high precision (always possible), give each row its own
    scale (tensorwise torchao), keep the weight gradient in high precision, or scale from the current amax."""
    modules = sorted({tally.owners.get(f["module"], f["module"]) for f in failing})
    exclude = list(dict.fromkeys([*spec.fp8.modules.exclude, *modules]))  # the list replaces the config's own
    advice = [f"keep them in high precision: precision.fp8.modules.exclude: {exclude}"]
    recipe = spec.fp8.torchao.recipe_name if spec.fp8.backend == "torchao" else None
    if recipe == "tensorwise" and any(f["gemm"] == "forward" for f in failing):
        advice.append("or scale each row of the forward GEMM's operands apart: precision.fp8.torchao.recipe_name: "
                      "rowwise")
    if recipe in ("tensorwise", "rowwise") and any(f["gemm"] == "weight_grad" for f in failing):
        advice.append("or keep the weight-gradient GEMM in high precision: precision.fp8.torchao.recipe_name: "
                      "rowwise_with_gw_hp")
    if any(f["gemm"] == "input_grad" and f["operand"] == "weight" and f["metric"] == "underflow" for f in failing):
        advice.append("the input-gradient GEMM scales the weight per column (per tensor under tensorwise), so one "
                      "outlier row underflows it under every recipe: only excluding the module keeps it")
    if any(f["metric"] == "lagged_passes" for f in failing):
        advice.append("the amax history lagged a jump of its tensor: scale from the current amax "
                      "(precision.fp8.te.recipe: current), or leave headroom above it (precision.fp8.te.margin)")
    if any(f["metric"] == "saturated" for f in failing):
        advice.append("values were clamped: scale from the current amax (dynamic or current scaling) instead of an "
                      "amax history")
    return "; ".join(advice)
