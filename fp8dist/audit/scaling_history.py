"""Delayed scaling's amax histories in the audited step (`numerics.scaling_history`): how much range each scale
left its tensor, and whether the scale lagged a new amax, read from what Transformer Engine holds.

A delayed-scaling recipe casts with a scale computed from earlier passes: each pass writes its tensor's amax into a
history, and after the pass the library sets the next scale from the history (TE DelayedScaling:
`scale = fp8_max / amax / 2^margin`, amax the history's largest value, `amax_compute_algo="max"`, or its newest,
`"most_recent"`). So a tensor whose amax jumps is cast with a scale that has not seen it (its largest values clamp
at the format's max: the history *lagged* the new amax), and one spike holds the scale up for as many passes as
the history is long (everything smaller loses range, and small values underflow).

Read from Transformer Engine (2.1 to 2.20: transformer_engine/pytorch/quantization.py
`DelayedScalingRecipeState` and `_update_amax_history`; the fused update
`tex.fused_amax_and_scale_update_after_reduction` rolls the same way): a module's `fp8_meta["scaling_fwd"]` and
`["scaling_bwd"]` hold `scale` (one per quantizer) and `amax_history` (history length x quantizers); a pass writes
its amax into row 0, and the update (forward: at the autocast's exit; backward: at the end of the first module's
backward) moves row 0 to the last row, the older rows up by one, and zeroes row 0. After the step, rows 1 to L-1
are the passes from the oldest to the newest. One pass is one forward (or backward) of the module: a step of M
micro-batches is M passes. Quantizers by index (transformer_engine/pytorch/csrc/common.h FP8FwdTensors /
FP8BwdTensors): forward GEMMn input, weight, output; backward GEMMn grad_output, grad_input.

Per quantizer that saw a nonzero amax in the step:
- `headroom_bits`: log2(fp8_max / (amax x scale)) of the step's first pass, the scale the one TE held when the
  step began: below 0, the amax outgrew the range the scale gave and the largest values clamped;
- `lagged_passes`: the step's passes whose amax exceeded fp8_max / scale of the scale each was cast with (the
  first: held at the start; each later one: recomputed from the rows the history still holds before it, which
  leaves out at most the one row that fell out of the window);
- `next_headroom_bits`: the newest amax under the scale TE holds now (for the next pass), and `stale_passes`:
  passes since the amax that sets that scale (0: the newest; a spike keeps it for `history_len - 1 - stale`
  more passes).

MS-AMP keeps amax windows too (msamp/common/tensor/meta.py ScalingMeta), but fp8dist's audit does not run in MS-AMP's
environment (torch 2.1, below fp8dist's torch floor: fp8dist/facts/msamp.py), so there is nothing to read there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

SCALING_STATES = (("scaling_fwd", "forward"), ("scaling_bwd", "backward"))
FORWARD_ROLES, BACKWARD_ROLES = ("input", "weight", "output"), ("grad_output", "grad_input")


def _role(direction: str, index: int) -> str:
    roles = FORWARD_ROLES if direction == "forward" else BACKWARD_ROLES
    return f"gemm{index // len(roles) + 1}_{roles[index % len(roles)]}"


def _fp8_max(recipe, direction: str) -> float:
    """TE's get_fp8_max: E4M3's largest value for E4M3, and for HYBRID's forward tensors; E5M2's otherwise."""
    helper = recipe.fp8_format.value
    return float(helper.max_fwd if direction == "forward" else helper.max_bwd)


def delayed_states(root: torch.nn.Module) -> Iterator[tuple[str, str, Any, Any]]:
    """(module name, direction, the library's scaling state, its recipe) of every TE module that keeps amax
    histories."""
    for name, module in root.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key, direction in SCALING_STATES:
            state = meta.get(key)
            recipe = getattr(state, "recipe", None) or meta.get("recipe")
            if (isinstance(getattr(state, "amax_history", None), torch.Tensor)
                    and isinstance(getattr(state, "scale", None), torch.Tensor) and recipe is not None
                    and hasattr(recipe, "margin")):
                yield name, direction, state, recipe


@dataclass
class Pass:
    """The forward passes of a module in the watched block (its backward passes are as many)."""
    count: int = 0


class ScalingHistories:
    """Entered with the watched block: the scales held when it begins and each module's passes; `rows()` after it."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.start: dict[tuple[str, str], torch.Tensor] = {}
        self.passes: dict[str, Pass] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> "ScalingHistories":
        for name, direction, state, _ in delayed_states(self.root):
            self.start[(name, direction)] = state.scale.detach().float().cpu().clone()
            if name not in self.passes:
                self.passes[name] = counter = Pass()
                module = self.root.get_submodule(name)
                self._hooks.append(module.register_forward_pre_hook(
                    lambda *_, counter=counter: _count(counter)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def rows(self, clean_name) -> list[dict[str, Any]]:
        found = []
        for name, direction, state, recipe in delayed_states(self.root):
            if (name, direction) not in self.start or not self.passes[name].count:
                continue
            history = state.amax_history.detach().float().cpu()
            scale = state.scale.detach().float().cpu()
            for index in range(history.shape[1]):
                row = history_row(history[:, index], float(self.start[(name, direction)][index]), float(scale[index]),
                                  self.passes[name].count, _fp8_max(recipe, direction), recipe.margin,
                                  recipe.amax_compute_algo)
                if row is not None:
                    found.append({"module": clean_name(name), "direction": direction,
                                  "tensor": _role(direction, index),
                                  "format": "e4m3" if _fp8_max(recipe, direction) == 448 else "e5m2", **row})
        return found


def _count(counter: Pass) -> None:
    if torch._C._current_graph_task_id() == -1:  # an activation-checkpoint recompute is not a pass
        counter.count += 1


def _bits(fp8_max: float, amax: float, scale: float) -> float | None:
    if amax <= 0 or scale <= 0 or not math.isfinite(amax * scale):
        return None
    return round(math.log2(fp8_max / (amax * scale)), 2)


def history_row(column: torch.Tensor, scale_at_start: float, scale_now: float, passes: int, fp8_max: float,
                margin: int, algo) -> dict[str, Any] | None:
    """One quantizer's row from its history column after the step (rows 1..L-1: oldest to newest). None when it saw
    no nonzero amax in the step (a quantizer the module does not use), or when the history keeps a single row (TE
    zeroes it at the update: nothing of the step is left to read; said by the caller's absence of the row)."""
    window = [float(v) for v in column[1:]]
    step = window[-passes:] if passes <= len(window) else []
    if not step or max(step) <= 0:
        return None
    lagged, scale = 0, scale_at_start
    for position in range(len(window) - len(step), len(window)):
        if window[position] * scale > fp8_max * (1 + 1e-6):
            lagged += 1
        earlier = window[:position + 1]
        reference = earlier[-1] if algo == "most_recent" else max(earlier)  # "max", or a callable: its usual
        if reference > 0 and math.isfinite(reference):
            scale = fp8_max / reference / 2 ** margin
    newest = window[-1]
    largest = newest if algo == "most_recent" else max(window)
    return {"history_len": len(column), "passes": len(step), "amax": newest, "scale": scale_now,
            "headroom_bits": _bits(fp8_max, step[0], scale_at_start), "lagged_passes": lagged,
            "next_headroom_bits": _bits(fp8_max, newest, scale_now),
            "stale_passes": len(window) - 1 - max(i for i, v in enumerate(window) if v == largest)}
