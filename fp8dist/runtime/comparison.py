"""The two runs of `fp8dist compare`. Before any rank starts, the parent's checks (`check_before_launch`: whether the
configs can be compared, on this model, on these ranks, here). Then the rank side (one torchrun job, `python -m
fp8dist.runtime.comparison`): both runs in each rank's process, the baseline first, then the config, from the same
initial weights on the same batches; with --layer-steps, the probe passes at the chosen steps
(fp8dist/runtime/layer_probes.py), with --fixed-routing, the baseline's expert choices replayed in the config's run
(fp8dist/runtime/routing_replay.py). Rank 0 writes the losses (and the layer reports) for
fp8dist/commands/compare.py, which renders them."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from fp8dist.config.load import load_config
from fp8dist.dtypes import torch_dtype
from fp8dist.errors import Checks, Fp8distError
from fp8dist.runtime.ranks import PROGRESS, emit


# --- before any rank starts ----------------------------------------------------------------------------------

def check_before_launch(specs: dict[str, Any], model: str, nproc: int, *, layer_steps: str | None, steps: int,
                        fixed_routing: bool, data: str | None) -> tuple[int, ...]:
    """Everything the parent can refuse before a rank starts, every refusal at once (Problems): the two configs
    against each other, the model, each config's mesh on `nproc` ranks (--nproc) and its environment, the flags, the
    data file. Returns the --layer-steps chosen."""
    from pathlib import Path

    from fp8dist.runtime.data import read_texts
    from fp8dist.runtime.layer_probes import parse_steps
    from fp8dist.runtime.models import check_mesh_fits
    from fp8dist.config.models import check_model_name
    from fp8dist.runtime.preflight import preflight

    checks = Checks()
    chosen: tuple[int, ...] = ()
    with checks.one():
        check_same_batches(specs["baseline"], specs["config"])
    with checks.one():
        check_engine_order(specs["baseline"], specs["config"])
    with checks.one():
        chosen = parse_steps(layer_steps, steps) if layer_steps else ()
    with checks.one():
        check_probes(specs, chosen, fixed_routing)
    named = len(checks.errors)
    with checks.one():
        check_model_name(model)
    for spec in specs.values():
        if len(checks.errors) == named:  # the model is known: its sizes on each config's mesh
            with checks.one():
                check_mesh_fits(spec, model, nproc, "--nproc")
        with checks.one():
            preflight(spec)
    if fixed_routing and len(checks.errors) == named:
        with checks.one():
            check_has_experts(model)
    if data:
        with checks.one():
            read_texts(Path(data))  # binary, empty or unreadable: here, not in the ranks
    checks.raise_found()
    return chosen


# The batches (and the initial weights' seed) come from these keys; both configs must agree on them.
BATCH_KEYS = ("micro_batch_size", "seq_len", "gradient_accumulation_steps", "seed")


def check_same_batches(baseline, config) -> None:
    differ = [f"train.{key} ({getattr(config.train, key)} vs baseline {getattr(baseline.train, key)})"
              for key in BATCH_KEYS if getattr(config.train, key) != getattr(baseline.train, key)]
    if differ:
        raise Fp8distError("compare runs both configs on the same batches from the same weights, but they differ in "
                           + ", ".join(differ) + "\n  fix: give both configs the same train section values")


def check_engine_order(baseline, config) -> None:
    """The baseline's engine is built first, in the same process: after DeepSpeed AutoTP, DeepSpeed 0.19.8 keeps its
    groups in module globals (deepspeed/utils/groups.py) and a DeepSpeed engine without AutoTP cannot start next."""
    autotp = [spec.engine == "deepspeed" and spec.parallel.tensor_size > 1 for spec in (baseline, config)]
    if autotp == [True, False] and config.engine == "deepspeed":
        raise Fp8distError("--baseline runs DeepSpeed AutoTP and --config DeepSpeed without it: the second engine "
                           "cannot start after AutoTP in one process\n  fix: swap --config and --baseline")


def check_probes(specs: dict[str, Any], layer_steps: tuple[int, ...], fixed_routing: bool) -> None:
    """--layer-steps needs engines that run probe passes between steps; both flags need eager blocks (their taps and
    the routing replay are module hooks and a TorchFunctionMode, which a compiled block would trace or skip)."""
    from fp8dist.engines.registry import profile_for

    flags = " and ".join(flag for flag, on in (("--layer-steps", layer_steps), ("--fixed-routing", fixed_routing))
                         if on)
    if not flags:
        return
    for role, spec in specs.items():
        if layer_steps and not profile_for(spec).runs_probes:
            raise Fp8distError(f"--layer-steps: the {role}'s engine ({spec.engine}) cannot run a probe pass between "
                               "optimizer steps (an extra backward would move DeepSpeed's gradient-accumulation "
                               "boundary and fill its reduce buckets)\n  fix: compare engine: fsdp2 configs for "
                               "the layer report, or drop --layer-steps")
        if spec.parallel.pipeline_size > 1:
            raise Fp8distError(f"{flags}: the {role} runs pipeline parallel (parallel.pipeline_size="
                               f"{spec.parallel.pipeline_size}): each rank holds some layers only, and the probe "
                               "passes and the routing replay run the whole model on every rank\n  fix: compare "
                               f"configs without pipeline parallel for {flags}")
        split = [f"parallel.{key}={getattr(spec.parallel, key)}" for key in ("tensor_size", "context_size")
                 if getattr(spec.parallel, key) > 1]
        if layer_steps and split:
            raise Fp8distError(f"--layer-steps: the {role} splits each block's output over ranks ({', '.join(split)}: "
                               "sequence or head shards), and the report compares whole outputs per rank\n  fix: "
                               "compare configs without tensor or context parallel for the layer report")
        if layer_steps and spec.adapter.enabled and spec.adapter.base_dtype == "nf4":
            raise Fp8distError(f"--layer-steps: the {role} holds an NF4 base, which loading another run's weights "
                               "would re-quantize shard by shard (torchao's NF4Tensor copy_, with a scale mean per "
                               "shard) and not restore bitwise\n  fix: compare with adapter.base_dtype=auto for the "
                               "layer report")
        if layer_steps and spec.fp8.backend in ("te", "msamp"):
            raise Fp8distError(f"--layer-steps: the {role} runs {spec.fp8.backend}, whose modules keep FP8 state "
                               "(amax histories, scales) that a probe pass would move and the weights swap cannot "
                               "restore\n  fix: the layer report runs torchao configs; `fp8dist audit --numerics` "
                               "reads TE's delayed scaling")
        if spec.compile:
            raise Fp8distError(f"{flags}: the {role} compiles its blocks (compile: true), and the taps need them "
                               "eager\n  fix: add the override compile=false")


def check_has_experts(model_name: str) -> None:
    """--fixed-routing on a model whose config says it has no experts (a factory model's is not known here: the
    ranks refuse it when they find no router)."""
    from fp8dist.config.parallel import expert_count
    from fp8dist.config.models import config_values

    values = config_values(model_name)
    if values is not None and not expert_count(values):
        raise Fp8distError(f"--fixed-routing replays a Mixture-of-Experts model's expert choices, and {model_name} "
                           "has no experts\n  fix: drop --fixed-routing, or compare an MoE model")


# --- the rank side -------------------------------------------------------------------------------------------


@dataclass
class Probes:
    """What the two runs share for --layer-steps and --fixed-routing: the chosen steps (from 1), the baseline's
    weights and taps at each, its layer reports, and the routing log."""

    steps: tuple[int, ...]
    routing: Any = None  # a routing_replay.RoutingLog, or None
    weights: dict[int, Any] = field(default_factory=dict)
    taps: dict[int, Any] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)


def _train(name: str, session, steps: int, rank: int, probes: Probes, seed: int) -> list[float]:
    """The run's steps; at each chosen step, first the probe pass: the baseline's on its own weights (kept), the
    config's on those weights."""
    from fp8dist.runtime.layer_probes import layer_report, probe

    losses = []
    if probes.routing is not None:
        probes.routing.install(session.loaded.model, replay=name == "config")
    try:
        for step in range(steps):
            if step + 1 in probes.steps and name == "baseline":
                probes.weights[step + 1] = session.engine.full_weights()
                probes.taps[step + 1] = probe(session, step, seed)
            elif step + 1 in probes.steps:
                with session.engine.weights(probes.weights.pop(step + 1)):
                    taps = probe(session, step, seed)
                probes.reports.append(layer_report(step + 1, probes.taps.pop(step + 1), taps,
                                                   session.spec.audit.numerics))
                if rank == 0:
                    emit(PROGRESS, name, _parting_line(probes.reports[-1]))
            losses.append(session.step(step)[0])
            if rank == 0:
                emit(PROGRESS, name, f"{name} step {step + 1}/{steps} loss {losses[-1]:.4f}")
    finally:
        if probes.routing is not None:
            probes.routing.remove()
    if probes.routing is not None and name == "config":
        probes.routing.check_consumed()
    return losses


def _parting_line(report: dict[str, Any]) -> str:
    first, gradient = report["first_parting"], report["first_parting_gradient"]
    where = "; ".join(f"{what} first part at {row['layer']}" for what, row in (("activations", first),
                                                                             ("gradients", gradient)) if row)
    return f"layer report at step {report['step']}: {where or 'no layer parts'}"
def worker(model_name: str, baseline: str, config: str, steps: int, data: str,
           overrides: Sequence[str] = (), layer_steps: tuple[int, ...] = (), fixed_routing: bool = False
           ) -> dict[str, Any]:
    """Both runs in this rank's process: the baseline, then the config, from the same initial weights (built in
    fp32 from the same seed, then cast to each run's load dtype) on the same batches, with the same random stream
    for whatever the run draws (dropout)."""
    import torch

    from fp8dist.config.parallel import ParallelDims
    from fp8dist.engines.registry import profile_for
    from fp8dist.runtime import loop, process_group
    from fp8dist.runtime.data import SYNTHETIC_BATCHES, BatchMaker, file_batches, token_stream
    from fp8dist.backends.adapters import apply_adapter
    from fp8dist.runtime.models import load_model

    result: dict[str, Any] = {}
    probes = Probes(layer_steps)
    if fixed_routing:
        from fp8dist.runtime.routing_replay import RoutingLog

        probes.routing = RoutingLog()
    try:
        specs = {"baseline": load_config(baseline, overrides=overrides),
                 "config": load_config(config, overrides=overrides)}
        # one group for both runs (DeepSpeed's init serves an FSDP2 config too)
        process_group.init(deepspeed=any(profile_for(spec).deepspeed_process_group for spec in specs.values()))
        rank, seed = process_group.rank(), specs["baseline"].train.seed  # the parent checked both train sections
        # both runs read batches by the data ranks of the run that splits the model most (the tp, cp and pp peers
        # of one data rank read one batch: a pipeline's first stage its tokens, its last the labels)
        layouts = {name: ParallelDims.of(spec, process_group.world_size()) for name, spec in specs.items()}
        batch_dims = max(layouts.values(), key=lambda dims: dims.world_size // dims.data_size)
        make_batch: BatchMaker | None = None
        pool: int | None = SYNTHETIC_BATCHES
        for name, spec in specs.items():
            loaded = load_model(model_name, "fp32", seed=seed)
            loaded.model.to(torch_dtype(spec.precision.load_dtype))
            loaded.model = apply_adapter(loaded.model, spec.adapter, spec.precision.weight_dtype, seed)
            if make_batch is None:
                make_batch = loaded.make_batch
                if data:
                    vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
                    if vocab is None:
                        raise Fp8distError(f"--data needs a model with `config.vocab_size`; {model_name} has none")
                    ids, how = token_stream(data, model_name, vocab)
                    make_batch, pool = file_batches(ids), None  # fresh windows every step
                    if rank == 0:
                        emit(PROGRESS, "data", f"data: {len(ids)} tokens, {how}")
            session = loop.start(spec, loaded, make_batch=make_batch, pool=pool, batch_dims=batch_dims,
                                 dims=layouts[name])
            torch.manual_seed(seed)
            result[name] = _train(name, session, steps, rank, probes, seed)
        if layer_steps:
            result["layers"] = probes.reports
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits 2 with it
        result = {"_error": str(exc) if isinstance(exc, Fp8distError) else f"{type(exc).__name__}: {exc}"}
    return result


if __name__ == "__main__":
    from fp8dist.runtime.ranks import finish

    finish(worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5],
                  [o for o in sys.argv[6].split("\n") if o], tuple(int(s) for s in sys.argv[7].split(",") if s),
                  bool(sys.argv[8])), sys.argv[9])
