"""`fp8dist compare --layer-steps 1,8`: where, layer by layer, the config's run parts from its baseline.

At each chosen step (before it; step 1: the shared initial weights) both runs take one probe pass, a forward and
backward of the first micro-batch of that step without an optimizer step (the engine's `probe`), on the
**baseline's weights** (the config's run loads them for the probe and gets its own back after: engine `weights`)
and the same dropout draws. Taps on each transformer block record its output (the activation) and the gradient of
the loss with respect to that output; on a Mixture-of-Experts model, the output of each experts module too. Per
layer, the SQNR of the config's tensor against the baseline's, 10 log10(sum base^2 / sum (config - base)^2) over
every rank's tokens (torchao's `compute_error`, torchao 0.18 torchao/float8/float8_utils.py), says how much of the
baseline's signal the config's precision kept up to that layer, with the weights and batch held equal: the error
of the numerics, not of two trajectories that drifted apart.

A layer *parts* when its activation SQNR falls below the config's `audit.numerics.min_sqnr_db.forward` or its
gradient SQNR below `min_sqnr_db.input_grad`: the limits one FP8 GEMM's result must meet in the audit, so a block
output that kept less signal than one GEMM may lose has lost more than its own casts. The first such layer is where
to look (`fp8dist audit --numerics` names the GEMMs inside it).

Cost: each rank keeps, per chosen step, the baseline's full weights on the CPU (in fp32 or the load dtype) and
every tapped layer's activation and gradient for one micro-batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fp8dist.backends.experts import experts_modules
from fp8dist.engines.activation_checkpointing import in_backward
from fp8dist.engines.blocks import wrap_units
from fp8dist.errors import Fp8distError

# How a wrapper renames the modules below it: PEFT's model prefix, torch's checkpoint_wrapper.
_WRAPPER_PARTS = ("base_model.model.", "._checkpoint_wrapped_module", "_checkpoint_wrapped_module.")


def layer_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def parse_steps(text: str, steps: int) -> tuple[int, ...]:
    """'1,8' -> (1, 8): optimizer steps from 1, each at most `steps`."""
    try:
        chosen = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise Fp8distError(f"--layer-steps {text!r}: give step numbers separated by commas, e.g. 1,8") from None
    if not chosen or chosen[0] < 1 or chosen[-1] > steps:
        raise Fp8distError(f"--layer-steps {text!r}: each step must be between 1 and --steps ({steps})")
    return tuple(chosen)


def _plain_full(tensor: torch.Tensor) -> torch.Tensor:
    """A tapped tensor as this rank's tokens see it: a DTensor (tensor or sequence parallel) gathered whole."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().float().cpu()


@dataclass
class Taps:
    """Forward and gradient taps on the blocks and experts modules of one model, for one probe pass."""

    tensors: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (layer, kind) -> fp32 on the CPU
    loss: float = math.nan  # the probe pass's loss on this rank's micro-batch
    _hooks: list[Any] = field(default_factory=list)

    def install(self, model, spec) -> None:
        blocks = [(layer_name(name), module) for name, module in wrap_units(model, spec)]
        if not blocks:
            raise Fp8distError(f"--layer-steps: no transformer block in {type(model).__name__} to tap\n  fix: name "
                               "the block classes in fsdp2.wrap, or drop --layer-steps")
        modules = [(name, "activation", module) for name, module in blocks]
        for name, module in experts_modules(model):  # reported in the row of the block that holds it
            holder = next((block for block, _ in blocks if layer_name(name).startswith(block + ".")), layer_name(name))
            modules.append((holder, "expert_output", module))
        for name, kind, module in modules:
            self._hooks.append(module.register_forward_hook(
                lambda module, args, out, name=name, kind=kind: self._forward(name, kind, out)))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def unscale(self, gradient_scale: float) -> None:
        """The gradients as the loss gives them: the engine multiplied the loss by `gradient_scale` (fp16)."""
        if gradient_scale != 1.0:
            for key in [key for key in self.tensors if key[1] == "gradient"]:
                self.tensors[key] = self.tensors[key] / gradient_scale

    def _forward(self, name: str, kind: str, out) -> None:
        if in_backward():  # an activation-checkpoint recompute: the forward was tapped
            return
        output = out[0] if isinstance(out, (tuple, list)) else out
        if (name, kind) in self.tensors or not isinstance(output, torch.Tensor):  # a second call in one pass
            return
        self.tensors[(name, kind)] = _plain_full(output)
        if kind == "activation" and output.requires_grad:
            output.register_hook(lambda grad, name=name: self._gradient(name, grad))

    def _gradient(self, name: str, grad: torch.Tensor) -> None:
        self.tensors[(name, "gradient")] = _plain_full(grad)


def probe(session, step: int, seed: int) -> Taps:
    """One probe pass of `session` on the first micro-batch of optimizer step `step` (from 0), tapped, with the
    random streams (CPU and this rank's device) seeded alike in both runs and given back afterwards."""
    taps = Taps()
    engine = session.engine
    batch = session.batches(step)[0]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        taps.install(engine.model if isinstance(engine.model, torch.nn.Module) else session.loaded.model,
                     session.spec)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + step)
            taps.loss, gradient_scale = engine.probe(batch)
    finally:
        taps.remove()
    taps.unscale(gradient_scale)
    return taps


def _sums(base: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    if base.shape != got.shape:
        raise Fp8distError(f"--layer-steps: a tapped tensor has shape {tuple(got.shape)} in the config's run and "
                           f"{tuple(base.shape)} in the baseline's")
    return float(base.double().pow(2).sum()), float((got.double() - base.double()).pow(2).sum())


NON_FINITE = "non-finite"  # an SQNR that is no number: no signal, or an inf / NaN in either run's tensor


def sqnr_db(signal: float, noise: float) -> float | str | None:
    """10 log10(signal / noise), rounded to 0.01 dB; None where the two are bitwise equal (no noise, some
    signal); NON_FINITE where it is no number (strict JSON keeps it as a string)."""
    if not (math.isfinite(signal) and math.isfinite(noise)) or signal <= 0:
        return None if signal == 0 and noise == 0 else NON_FINITE
    return None if noise == 0 else round(10 * math.log10(signal / noise), 2)


def _parts(row: dict[str, Any], key: str, limit: float) -> bool:
    value = row.get(key)
    return value == NON_FINITE or (isinstance(value, float) and value < limit)


def layer_report(step: int, base: Taps, got: Taps, limits) -> dict[str, Any]:
    """The report of one chosen step (1-based): `loss`, both probe passes' losses (the mean over ranks) and their
    relative gap, on the same weights and batch, so no drift of the trajectories is in it; per layer, in model
    order, the SQNR of each tapped tensor summed over every rank; `first_parting`: the first layer in model order
    whose activation SQNR is below audit.numerics.min_sqnr_db.forward, `first_parting_gradient`: the first in
    backward order (from the loss down: where gradient error starts) whose gradient SQNR is below
    min_sqnr_db.input_grad; None where none is. `limits`: the config's audit.numerics."""
    if set(base.tensors) != set(got.tensors):
        raise Fp8distError("--layer-steps: the two runs' models have different layers: "
                           f"{sorted(set(base.tensors) ^ set(got.tensors))[:4]}")
    keys = list(base.tensors)
    sums = torch.tensor([value for key in keys for value in _sums(base.tensors[key], got.tensors[key])]
                        + [base.loss, got.loss], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)  # every rank's tokens (tp peers count twice, in signal and noise alike)
    world = dist.get_world_size() if dist.is_initialized() else 1
    base_loss, loss = float(sums[-2]) / world, float(sums[-1]) / world
    layers: dict[str, dict[str, Any]] = {}
    for i, (name, kind) in enumerate(keys):
        layers.setdefault(name, {"layer": name})[f"{kind}_sqnr_db"] = sqnr_db(float(sums[2 * i]),
                                                                             float(sums[2 * i + 1]))
    rows = list(layers.values())

    def first(key: str, limit: float, order) -> dict[str, Any] | None:
        row = next((row for row in order if _parts(row, key, limit)), None)
        return None if row is None else {"layer": row["layer"], "sqnr_db": row[key], "limit": limit}

    def finite(value: float) -> float | None:  # strict JSON: a diverged loss is null
        return round(value, 6) if math.isfinite(value) else None

    gap = abs(loss - base_loss) / abs(base_loss) if base_loss and math.isfinite(loss - base_loss) else None
    return {"step": step, "loss": {"baseline": finite(base_loss), "config": finite(loss),
                                   "relative_gap": None if gap is None else round(gap, 6)},
            "layers": rows,
            "first_parting": first("activation_sqnr_db", limits.min_sqnr_db.forward, rows),
            "first_parting_gradient": first("gradient_sqnr_db", limits.min_sqnr_db.input_grad, reversed(rows))}
