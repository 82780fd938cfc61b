"""Delayed scaling's amax histories in the audited step (`numerics.scaling_history`): how much range each scale
left its tensor, and whether the scale lagged a new amax, read from what Transformer Engine holds.

A delayed-scaling recipe casts with a scale computed from earlier passes: each pass writes its tensor's amax into a
history, and after the pass the library sets the next scale from the history (TE DelayedScaling:
`scale = fp8_max / amax / 2^margin`, amax the history's largest value, `amax_compute_algo="max"`, or its newest,
`"most_recent"`). So a tensor whose amax jumps past the range of its scale is cast with that scale anyway (its
largest values clamp at the format's max: the history *lagged* the new amax), and one spike keeps the history's
amax high, and the scale low, for as many passes as the history is long (everything smaller loses range, and small
values underflow).

Read from Transformer Engine (2.1 to 2.20: transformer_engine/pytorch/quantization.py
`DelayedScalingRecipeState` and `_update_amax_history`; the fused update
`tex.fused_amax_and_scale_update_after_reduction` rolls the same way): a module's `fp8_meta["scaling_fwd"]` and
`["scaling_bwd"]` hold `scale` (one per quantizer) and `amax_history` (history length L x quantizers); a pass writes
its amax into row 0, and the update (forward: at the autocast's exit; backward: at the end of the first module's
backward) computes the next scale from the L rows, then moves row 0 to the last row, the older rows up by one, and
zeroes row 0. So rows 1 to L-1 are the passes from the oldest to the newest. The histories and scales are copied
when the watched block begins (TE creates them at a module's first forward under autocast: a module without them
yet starts from TE's initial state, zero histories and unit scales) and read again after it; the block's passes
(one per forward of the module; a step of M micro-batches is M passes) are the newest rows after it, and every
scale they were cast with is recomputed from the rows before each, as TE computed it. Quantizers by index
(transformer_engine/pytorch/csrc/common.h FP8FwdTensors / FP8BwdTensors): forward GEMMn input, weight, output;
backward GEMMn grad_output, grad_input.

Per quantizer that saw a nonzero amax in the block:
- `headroom_bits`: log2(fp8_max / (amax x scale)) of the block's first pass under the scale it was cast with:
  below 0, the amax outgrew that scale's range and the largest values clamped;
- `lagged_passes`: the block's passes whose amax outgrew the range of the scale each was cast with (clamped);
- `next_headroom_bits`: the newest amax under the scale TE holds now (for the next pass), and `stale_passes`:
  passes since the amax that sets that scale (0: the newest; a spike sets it for `history_len - 1 - stale` more
  passes).
A block with more passes than the history keeps (L - 1) has lost its first passes: that quantizer is left out.

MS-AMP keeps amax windows too (msamp/common/tensor/meta.py ScalingMeta), but fp8dist's audit does not run in MS-AMP's
environment (torch 2.1, below fp8dist's torch floor: fp8dist/facts/msamp.py), so there is nothing to read there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from fp8dist.engines.activation_checkpointing import in_backward
from fp8dist.facts.transformer_engine import TE_QUANTIZER_ROLES, TE_SCALING_STATES

def _role(direction: str, index: int) -> str:
    roles = TE_QUANTIZER_ROLES[direction]
    return f"gemm{index // len(roles) + 1}_{roles[index % len(roles)]}"


def _fp8_max(recipe, direction: str) -> float:
    """TE's get_fp8_max: E4M3's largest value for E4M3, and for HYBRID's forward tensors; E5M2's otherwise."""
    helper = recipe.fp8_format.value
    return float(helper.max_fwd if direction == "forward" else helper.max_bwd)


def delayed_states(module: torch.nn.Module) -> Iterator[tuple[str, Any, Any]]:
    """(direction, the library's scaling state, its recipe) of a TE module's amax histories. TE creates them at the
    module's first forward under its autocast (base.py init_fp8_metadata), so a module watched from its first step
    has none before it."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict):
        return
    for key, direction in TE_SCALING_STATES:
        state = meta.get(key)
        recipe = getattr(state, "recipe", None) or meta.get("recipe")
        if (isinstance(getattr(state, "amax_history", None), torch.Tensor)
                and isinstance(getattr(state, "scale", None), torch.Tensor) and hasattr(recipe, "margin")):
            yield direction, state, recipe


@dataclass
class Start:
    """What a module's histories held when the watched block began (None: TE had not created them yet), and the
    forward passes the module ran in the block (its backward passes are as many)."""
    held: dict[str, tuple[torch.Tensor, torch.Tensor]]  # direction -> (amax_history, scale), copies
    passes: int = 0


class ScalingHistories:
    """Entered with the watched block: each TE module's histories and scales as they were, and its passes; `rows()`
    after the block."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.start: dict[str, Start] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> "ScalingHistories":
        for name, module in self.root.named_modules():
            if not isinstance(getattr(module, "fp8_meta", None), dict):
                continue
            self.start[name] = start = Start({direction: (state.amax_history.detach().float().cpu().clone(),
                                                          state.scale.detach().float().cpu().clone())
                                              for direction, state, _ in delayed_states(module)})
            self._hooks.append(module.register_forward_pre_hook(lambda *_, start=start: _count(start)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def rows(self, clean_name) -> list[dict[str, Any]]:
        found = []
        for name, start in self.start.items():
            if not start.passes:
                continue
            for direction, state, recipe in delayed_states(self.root.get_submodule(name)):
                history = state.amax_history.detach().float().cpu()
                scale = state.scale.detach().float().cpu()
                # absent before the block: TE's initial state (RecipeState: zero histories, unit scales)
                before, scale_before = start.held.get(direction, (torch.zeros_like(history), torch.ones_like(scale)))
                fp8_max = _fp8_max(recipe, direction)
                for index in range(history.shape[1]):
                    row = history_row(before[:, index], history[:, index], float(scale_before[index]),
                                      float(scale[index]), start.passes, fp8_max, recipe.margin,
                                      recipe.amax_compute_algo)
                    if row is not None:
                        found.append({"module": clean_name(name), "direction": direction,
                                      "tensor": _role(direction, index), "format": "e4m3" if fp8_max == 448 else "e5m2",
                                      **row})
        return found


def _count(start: Start) -> None:
    if not in_backward():  # an activation-checkpoint recompute is not a pass
        start.passes += 1


def _bits(fp8_max: float, amax: float, scale: float) -> float | None:
    if amax <= 0 or scale <= 0 or not math.isfinite(amax * scale):
        return None
    return round(math.log2(fp8_max / (amax * scale)), 2)


def _largest(values: list[float]) -> float:
    """The largest finite amax (a non-finite one is TE's no-update case: the scale stays)."""
    return max((v for v in values if math.isfinite(v)), default=0.0)


def history_row(before: torch.Tensor, after: torch.Tensor, scale_before: float, scale_now: float, passes: int,
                fp8_max: float, margin: int, algo) -> dict[str, Any] | None:
    """One quantizer, from its history column before and after the block (TE's layout after an update: rows 1..L-1
    the passes from the oldest to the newest, row 0 zero). The passes of the block are the newest `passes` rows
    after it; the rows before them, the history before it. Each pass's scale is recomputed as TE computes it
    after the pass before (from the L rows ending there: `max`, or the newest: `most_recent`), the first pass's is
    the scale held before the block. None when the quantizer saw no nonzero amax in the block (one the module does
    not use), or when the block ran more passes than the history keeps (its first passes are gone)."""
    length = len(after)
    if passes > length - 1:
        return None
    step = [float(v) for v in after[length - passes:]]
    if not step or _largest(step) <= 0:
        return None
    sequence = [float(v) for v in before[1:]] + step  # oldest to newest, the block's passes last
    first = len(sequence) - passes
    lagged, scale = 0, scale_before
    for position in range(first, len(sequence)):
        amax = sequence[position]
        if math.isfinite(amax) and amax * scale > fp8_max * (1 + 1e-6):
            lagged += 1  # cast with a scale whose range its amax outgrew: its largest values clamped
        window = sequence[max(position + 1 - length, 0):position + 1]
        reference = window[-1] if algo == "most_recent" else _largest(window)
        if reference > 0 and math.isfinite(reference):
            scale = fp8_max / reference / 2 ** margin
    newest = step[-1]
    window = sequence[-length:]
    setting = newest if algo == "most_recent" else _largest(window)
    stale = next(len(window) - 1 - i for i in range(len(window) - 1, -1, -1) if window[i] == setting)
    return {"history_len": length, "passes": passes, "amax": newest, "scale": scale_now,
            "headroom_bits": _bits(fp8_max, step[0], scale_before), "lagged_passes": lagged,
            "next_headroom_bits": _bits(fp8_max, newest, scale_now), "stale_passes": stale}
