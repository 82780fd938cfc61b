"""precision.fp8.policy: auto, the calibration pass: each candidate torchao recipe measured on the run's first
batches with the numerics probes of `audit --numerics` (fp8dist.audit.numerics), then one recipe per Linear
(fp8dist.backends.auto_policy decides).

Before the engine prepares the model (the run loop hands each rank's whole model here: fp8dist.runtime.loop.start),
the first `precision.fp8.calibration_steps` steps' micro-batches run forward and backward once, the model in high
precision, with a numerics probe per candidate recipe on each Linear `auto` decides: each probe casts the operands
of the Linear's three GEMMs as that recipe's module would (torchao's Float8Linear of the recipe's config, torchao
0.18 float8/float8_linear.py; MXFP8Linear) and measures what the casts lose, as `audit --numerics` does. Every
Linear is so judged on the activations and gradients of the high-precision model: a Linear's FP8 error upstream
does not decide for the Linears after it (measured: with model.layers.0.mlp.up_proj's outlier row, a tensorwise
up_proj flushes its own output to one feature, and down_proj's input looked healthy until up_proj was kept in
bf16). The gradients are dropped and no optimizer steps, so the run starts from the loaded weights, and the random
state is restored (dropout draws leave the run's own draws as they were). Each rank measures its own batches; the
counts and the signal / noise powers are summed over the ranks, so every rank decides the same. The calibration
runs in the dtype the model was loaded in (FSDP2's MixedPrecisionPolicy casts later), without compile. Cost: the
calibration steps once more, each probed GEMM cast and multiplied again per candidate; memory: the whole model and
its gradients on each rank (before sharding), and each probed Linear's input kept from its forward to its backward.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from fp8dist.audit.numerics import Tally, Thresholds, document, on_gradient, quiet
from fp8dist.engines.activation_checkpointing import in_backward
from fp8dist.backends.auto_policy import (AutoDecision, Limits, SpeedModel, candidates, choose, eligible, fits,
                                          overrides_of, report_lines)
from fp8dist.backends.module_filter import linear_infos, policy_of
from fp8dist.config.spec import Spec, min_speedup_of, with_overrides
from fp8dist.engines.base import forward_loss
from fp8dist.translate.fsdp2 import torchao_recipe_dims


@dataclass(frozen=True)
class Calibration:
    """What the calibration decided: one AutoDecision per Linear it decided, the overrides that say it (after the
    written ones), the candidates tried, the GPU the speed model predicted for (None: numerics only)."""
    decisions: list[AutoDecision]
    overrides: list[dict[str, Any]]
    recipes: tuple[str, ...]
    gpu: str | None
    steps: int
    micro_batches: int
    ranks: int

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for d in self.decisions:
            counts[d.recipe or "compute dtype"] = counts.get(d.recipe or "compute dtype", 0) + 1
        speed = (f"speed model: {self.gpu.upper()}" if self.gpu else "numerics only: no GPU the speed model knows "
                 "(hardware.gpu auto on a machine without one), so no speedup was predicted")
        return (f"precision.fp8.policy auto: calibrated {len(self.decisions)} Linears on the first {self.steps} "
                f"step(s) ({self.micro_batches} micro-batch(es) per rank, {self.ranks} rank(s)) per candidate recipe "
                f"({', '.join(self.recipes)}): {', '.join(f'{k} {n}' for k, n in counts.items())}; {speed}")

    def report(self) -> str:
        return self.summary() + ":\n" + "\n".join(report_lines(self.decisions))


def calibrate(spec: Spec, model: torch.nn.Module, steps: Sequence[Sequence[dict]], gpu: str | None) -> Calibration:
    """Measure each candidate recipe on `steps` (each step's micro-batches, on the model's device) and decide.
    `gpu`: the GPU the speed model predicts for (hardware.gpu resolved), None for numerics only."""
    from fp8dist.backends.torchao import TorchaoFloat8

    backend = TorchaoFloat8(spec)
    rules = backend.plan.module_filter
    infos = linear_infos(model)
    decided = eligible(infos, rules.exclude, rules.skip_first_last, policy_of(spec.fp8))
    recipes, dims = candidates(spec.fp8.torchao.recipe_name), torchao_recipe_dims(spec.fp8.torchao)
    measured: dict[str, dict[str, Any]] = {}
    unmeasured: dict[str, dict[str, str]] = {}
    limits = Thresholds.of(spec)
    plan = {recipe: [info.fqn for info in decided if fits(info, dims.get(recipe))] for recipe in recipes}
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        tallies = _measure(backend, model, plan, steps)
    for recipe, tally in tallies.items():
        tally = _summed(tally)
        measured[recipe], unmeasured[recipe] = document(tally, limits), dict(tally.unmeasured)
    model_speed = None
    if gpu is not None:
        model_speed = SpeedModel(gpu, spec.tokens_per_micro_batch, spec.compile,
                                 min_speedup_of(spec.fp8.min_speedup, gpu, spec.fp8.emulated))
    decisions = choose(decided, recipes, dims, measured,
                       Limits(limits.max_underflow, limits.max_saturated, limits.min_sqnr_db), model_speed, unmeasured)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return Calibration(decisions, overrides_of(decisions), recipes, gpu, len(steps),
                       max((len(s) for s in steps), default=0), world)


def _measure(backend, model: torch.nn.Module, plan: dict[str, list[str]],
             steps: Sequence[Sequence[dict]]) -> dict[str, Tally]:
    """The numerics of `steps` per recipe of `plan` (recipe -> the Linears it is tried on), the model running in high
    precision throughout: each Linear's probes cast the high-precision operands its GEMMs see, as that recipe's
    module would (fp8dist.audit.numerics' probes, handed a stand-in for the module: the recipe's torchao config, or
    MXFP8Linear's settings). So each Linear is judged on the activations and gradients of the high-precision model,
    not on what another Linear's FP8 casts made of them."""
    modules = dict(model.named_modules())
    tallies = {recipe: Tally() for recipe in plan}
    active = [True]
    with contextlib.ExitStack() as stack:
        for recipe, fqns in plan.items():
            kind, stand_in = _stand_in(backend, recipe)
            for fqn in fqns:
                probe = kind(stand_in, fqn, tallies[recipe], None)
                stack.enter_context(modules[fqn].register_forward_hook(
                    lambda module, args, output, probe=probe, tally=tallies[recipe]: _probe_forward(
                        probe, tally, module, args, output, lambda: active[0])))
        try:
            for batches in steps:
                for batch in batches:
                    (forward_loss(model, batch) / len(batches)).backward()
        finally:
            active[0] = False
            model.zero_grad(set_to_none=True)
    return tallies


def _stand_in(backend, recipe: str) -> tuple[Any, Any]:
    """(probe class, the module as the probe reads it) of `recipe`: a torchao Float8Linear reads `config` and
    `linear_mm_config` (torchao 0.18 float8/float8_linear.py); an MXFP8Linear `scale_calculation_mode` and
    `wgrad_with_hp` (set as fp8dist.backends.torchao converts it)."""
    from types import SimpleNamespace

    from fp8dist.audit.numerics import Float8LinearProbe, MXLinearProbe

    if recipe == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        return MXLinearProbe, SimpleNamespace(scale_calculation_mode=ScaleCalculationMode.RCEIL, wgrad_with_hp=False)
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(backend.float8_linear_config(recipe), enable_fsdp_float8_all_gather=False,
                                 force_recompute_fp8_weight_in_bwd=False)
    # the LinearMMConfig a Float8Linear of this config builds (its __init__), taken from one made on meta
    with torch.device("meta"):
        template = Float8Linear.from_float(torch.nn.Linear(16, 16, bias=False), config=config)
    return Float8LinearProbe, SimpleNamespace(config=config, linear_mm_config=template.linear_mm_config)


def _probe_forward(probe, tally: Tally, module, args, output, active) -> None:
    """As NumericsRecorder does for an FP8 module: the forward GEMM now, the gradient GEMMs when the output's gradient
    arrives; an activation-checkpoint recompute is not measured again."""
    if not active() or in_backward() or not args or not isinstance(args[0], torch.Tensor):
        return
    saved = None
    with quiet(tally, probe.name):
        saved = probe.forward(args[0].detach(), module.weight)
    on_gradient(output, probe, saved, tally, active)


def _summed(tally: Tally) -> Tally:
    """The ranks' tallies summed (counts and signal / noise powers), on every rank: each rank saw its own batches."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return tally
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (tally.casts, tally.gemms, tally.unmeasured))
    out = Tally()
    for casts, gemms, unmeasured in gathered:
        for target, rows in ((out.casts, casts), (out.gemms, gemms)):
            for key, row in rows.items():
                entry = target.setdefault(key, [row[0]] + [0] * (len(row) - 1))
                for index in range(1, len(row)):
                    entry[index] += row[index]
        out.unmeasured.update(unmeasured)
    return out


def calibrated_spec(spec: Spec, model: torch.nn.Module, steps: Sequence[Sequence[dict]], gpu: str | None,
                    rank: int, say: Callable[[str], None]) -> Spec:
    """The run's spec with the calibration's overrides after its written ones (the engine converts by them, the
    audit checks them); the decision per Linear with both reasons said on rank 0 (`say`: the caller's channel to
    the user, which knows whether the rank is a CLI command's)."""
    calibration = calibrate(spec, model, steps, gpu)
    if rank == 0:
        say(f"fp8dist: note: {calibration.report()}")
    return with_overrides(spec, calibration.overrides)
