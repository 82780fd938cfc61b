"""Warnings a user of FP8 needs before a long run, said once, on rank 0 (stderr): combinations that run but
are known to be slower than bf16 or broken elsewhere. Refusals live in fp8dist.config.rules; these are not
errors because each is right on some machine."""
from __future__ import annotations

import sys

from fp8dist.backends.module_filter import SPEED_KEPT, policy_lines
from fp8dist.config.spec import Spec
from fp8dist.facts.torchao import torchao_fp8_hardware, torchao_too_small_to_gain

_SAID: set[str] = set()


def _say(key: str, message: str, rank: int) -> None:
    if key not in _SAID and rank == 0:
        print(f"fp8dist: note: {message}", file=sys.stderr, flush=True)
    _SAID.add(key)


def say(key: str, message: str) -> None:
    """A note about what the engine did (e.g. how the tensor-parallel plan split the model), once, on rank 0."""
    import os

    _say(key, message, int(os.environ.get("RANK", "0")))


def advise(spec: Spec, world: int, rank: int | None = None, cuda: bool | None = None,
           capability: tuple[int, int] | None = None) -> list[str]:
    """The notes for this config on this machine (printed on rank 0 once per process); returns their keys.
    `cuda` and `capability` (the GPU's compute capability): this machine's unless given."""
    import os

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
        capability = tuple(torch.cuda.get_device_capability()) if cuda else None  # type: ignore[assignment]
    keys = []
    ao = spec.fp8.torchao
    if (spec.fp8.enabled and spec.fp8.backend == "torchao" and ao.emulate and capability is not None
            and torchao_fp8_hardware(ao.recipe_name, capability)[0]):
        keys.append("fp8-emulated-on-fp8-gpu")
        _say(keys[-1], f"precision.fp8.torchao.emulate=true on a GPU of compute capability {capability[0]}."
                       f"{capability[1]}, which runs torchao's '{ao.recipe_name}' FP8 GEMMs natively: they run "
                       "emulated (FP8's rounding, high-precision matmuls: no speedup, the audit says 'emulated'); "
                       "set precision.fp8.torchao.emulate=false", rank)
    for note in spec.notes:  # keys of the engine not selected (fp8dist.config.rules.notes)
        keys.append(note)
        _say(note, note, rank)
    fp8, par = spec.fp8.enabled, spec.parallel
    if fp8 and cuda and not spec.compile:
        keys.append("fp8-without-compile")
        _say(keys[-1], "FP8 without torch.compile: the casts run as separate kernels and eat the GEMM gain "
                       "(Axolotl docs/mixed_precision.qmd: compile is 'almost always necessary for FP8 speedups'); "
                       "set compile: true", rank)
    if fp8 and spec.engine == "fsdp2" and spec.compile and par.activation_checkpointing != "none":
        keys.append("fp8-fsdp2-compile-ac")
        _say(keys[-1], "FP8 + FSDP2 + torch.compile + activation checkpointing tends to be slower than the bf16 "
                       "equivalent (Axolotl docs/mixed_precision.qmd, known issues); measure both with "
                       "`fp8dist compare` before a long run", rank)
    if fp8 and spec.compile and par.sharding == "replicate" and world > 1:
        keys.append("fp8-replicate-compile")
        _say(keys[-1], "FP8 + replicated data parallel (DDP-like) + torch.compile is known broken "
                       "(Axolotl docs/support-matrix.qmd); use parallel.sharding=full or grad_op, or compile: false",
             rank)
    return keys


def advise_small_gemms(spec: Spec, model, rank: int | None = None) -> bool:
    """After FP8 conversion: say so when no converted Linear is big enough to gain from torchao's float8
    (torchao's own size heuristics, torchao_too_small_to_gain)."""
    import os

    import torch

    if spec.fp8.backend != "torchao":
        return False
    recipe = spec.fp8.torchao.recipe_name
    converted = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and type(m).__name__ == "Float8Linear"]
    if converted and all(torchao_too_small_to_gain(recipe, m.out_features, m.in_features) for m in converted):
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        _say("fp8-small-gemms", f"all {len(converted)} float8 Linears are below torchao's size heuristics for "
                                f"{recipe} (torchao/float8/float8_linear_utils.py): on an H100 float8 is expected to "
                                "be slower than bf16 for this model; it runs, for numerics, not for speed", rank)
        return True
    return False


def say_when_fp8_is_kept_off_every_linear(decisions: list) -> None:
    """precision.fp8.min_speedup kept every Linear in the compute dtype: the run asked for FP8 and computes without
    it, said at start (the audit's gemm row then expects the compute dtype, and says why)."""
    kept = [d for d in decisions if SPEED_KEPT in d.reason]
    if kept and not any(d.convert for d in decisions):
        say("speed-kept-every-linear",
            f"precision.fp8.min_speedup kept all {len(kept)} Linears in the compute dtype, so this run computes "
            f"without FP8: FP8 is predicted slower for each at its tokens per micro-batch on this GPU (e.g. "
            f"{kept[0].reason})\n  fix, if FP8 is what you want: compile: true and more tokens per micro-batch "
            "(docs/speed.md), or precision.fp8.min_speedup=off")


def say_policy(spec: Spec, decisions: list) -> None:
    """The start report of a per-Linear policy (precision.fp8.overrides, keep_first_layers / keep_last_layers) and
    of precision.schedule: each Linear with what it got and why."""
    fp8 = spec.fp8
    if not (fp8.overrides or fp8.keep_first_layers or fp8.keep_last_layers or spec.switch_step is not None):
        return
    linears = [d for d in decisions if d.recipe is not None or not d.convert]
    counts: dict[str, int] = {}
    for d in linears:
        key = d.recipe if d.convert else "compute dtype"
        counts[key] = counts.get(key, 0) + 1
    schedule = spec.precision.schedule
    switch = (f"; from step {spec.switch_step} the {schedule.gemms} GEMMs run in the compute dtype "
              "(precision.schedule)" if spec.switch_step is not None else "")
    say("fp8-policy", f"FP8 policy per Linear ({', '.join(f'{k} {n}' for k, n in counts.items())}){switch}:\n"
        + "\n".join(policy_lines(linears)))
