"""`fp8dist.audit.watch`: the dtype audit inside any training loop.

    with fp8dist.audit.watch(model, optimizer, "fp8dist.yaml") as w:
        loss = model(**batch).loss
        loss.backward()            # or engine.backward(loss) / accelerator.backward(loss)
        optimizer.step()           # or engine.step()
        optimizer.zero_grad()
    w.passed, w.report             # the report is the JSON document of `fp8dist audit --format json`

Everything inside the block is observed, nothing is read from settings: the storage of the weights and of
what the optimizer steps (asked of the engine that prepared the model, fp8dist.engines.inspector), the
operand formats of every matmul (fp8dist.audit.probes), the gradients as the optimizer is about to step,
the collectives on the wire (fp8dist.audit.wire) and the optimizer states after the step. The engine is
recognised from the objects; one that differs from the config's is reported as a mismatch of its own.
Ranks agree on one verdict, so `on_mismatch="raise"` raises on every rank alike.

Outside the block nothing is installed: the observing dispatch modes and hooks exist only inside it. Inside
it, torch.compile'd code runs eagerly (`torch.compiler.set_stance("force_eager")`), as dispatch modes
cannot observe compiled graphs; the dtypes are those of the compiled run.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Literal, cast

import fp8dist.audit.probes as probes
from fp8dist.audit.gemm_flops import clean_name, merged_over, summarize as summarize_gemm_flops
from fp8dist.audit.numerics import NumericsRecorder, observe as observe_numerics
from fp8dist.audit.policy_check import check as check_policy, describe as describe_policy
from fp8dist.audit.speed_row import speed_row
from fp8dist.backends.module_filter import SPEED_KEPT, LinearInfo, decide, linear_infos, policy_of
from fp8dist.audit.expected import expected, normalize
from fp8dist.audit.report import build, table, verdict
from fp8dist.audit.wire import DATA_AXES, REDUCTIONS, WireRecorder
from fp8dist.backends.storage import bnb_4bit_quant_states, held_of, is_scaling_tensor
from fp8dist.config.load import load_config
from fp8dist.config.parallel import EP, TP, ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.engines.optim import full_precision_by_design
from fp8dist.engines.registry import inspector_for
from fp8dist.facts.torchao import TORCHAO_HIGH_PRECISION_GEMMS
from fp8dist.backends.adapters import split_parameters, trained_beside_base
from fp8dist.errors import ExitCode, Fp8distError
from fp8dist.translate.fsdp2 import module_filter_plan, torchao_recipe_dims

ON_MISMATCH = ("warn", "raise", "ignore", "defer")  # defer: decide later with Watch.conclude
FLOAT8_WIRE = {"uint8", "fp8_e4m3", "fp8_e5m2"}  # gloo carries float8 as uint8 (engines/collectives.py)


class AuditMismatch(Fp8distError):
    """The watched block ran in another precision regime than its config says (exit code 1, like the CLI)."""

    exit_code = ExitCode.MISMATCH


def _obs(value: str, detail: str = "", measured: bool = True) -> dict[str, Any]:
    return {"observed": value, "detail": detail, "measured": measured}


def model_name(module) -> str:
    """The Hugging Face name or path of the model, else its class (FSDP2's FSDP<Class> wrapper class left out)."""
    path = getattr(getattr(module, "config", None), "name_or_path", "")
    return path or next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def _spec(config) -> Spec:
    return config if isinstance(config, Spec) else load_config(config)


class Watch:
    """Context manager behind `watch`. After the block: `report`, `passed`, and `observed` (the raw cells)."""

    def __init__(self, model, optimizer, config, *, on_mismatch: str = "warn", name: str | None = None,
                 verbose: bool = False, loading: dict | None = None, numerics: bool = False, step: int = 1):
        if on_mismatch not in ON_MISMATCH:
            raise Fp8distError(f"on_mismatch={on_mismatch!r}: use one of {', '.join(ON_MISMATCH)}")
        self.spec = _spec(config)
        self.model, self.optimizer = model, optimizer
        self.on_mismatch, self.verbose, self.name = on_mismatch, verbose, name
        self.observed: dict[str, Any] = {} if loading is None else {"loading": loading}
        self.report: dict[str, Any] | None = None
        self.passed: bool | None = None
        self._gradients: dict[str, Any] | None = None
        self._bnb_states: dict[int, object] = {}  # id(weight) -> quant_state of bitsandbytes 4-bit modules
        self._stack: contextlib.ExitStack | None = None
        self.matmuls: probes.MatmulRecorder | None = None  # the step's recorders, from __enter__ to _release
        self.wire: WireRecorder | None = None
        self.numerics = numerics
        self._numerics: NumericsRecorder | None = None
        # the watched step (from 1): after precision.schedule's switch its GEMMs are expected in the compute dtype
        switch = self.spec.switch_step
        self.switched = self.spec.precision.schedule.gemms if switch is not None and step >= switch else None
        self.step = step

    # -- entering: what the prepared run stores before the step -------------------------------------------
    def __enter__(self) -> "Watch":
        import fp8dist.distributed as distributed

        self.inspector = inspector_for(self.model, self.optimizer)
        self.nproc = distributed.world_size()
        self.rank = distributed.rank() if self.nproc > 1 else 0
        # the ranks whose gradients reduce: the watch is this process's entry (a user's own loop), so it builds the
        # layout the config gives this world
        self.data_size = ParallelDims.of(self.spec, self.nproc).data_size
        self._observe_stores()
        self.matmuls, self.wire = probes.MatmulRecorder(), WireRecorder(self.inspector.mesh_axes())
        import torch

        with contextlib.ExitStack() as stack:  # a failure halfway removes what was installed so far
            # Compiled code runs eagerly in the watched block: a dispatch mode cannot see inside a compiled
            # graph, and Dynamo refuses to compile while a non-infra dispatch mode is active (fullgraph=True
            # raises, torchao's low-bit AdamW is one) (torch 2.13 torch/_dynamo/eval_frame.py). Same dtypes.
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            if self.numerics:  # before the dispatch modes: its weight gathers are not the step's wire
                self._numerics = stack.enter_context(NumericsRecorder(self.inspector.module))
            stack.enter_context(self.inspector.capture_gradients(self._record_gradients))
            stack.enter_context(self.wire)
            stack.enter_context(self.matmuls.ledger.owners(self.inspector.module))
            stack.enter_context(self.matmuls)
            self._stack = stack.pop_all()
        return self

    def _scope(self, tensors: list) -> tuple[list, str]:
        """Table A's MS-AMP cells describe the Linear weights MS-AMP converted (ScalingParameters); embeddings,
        norms and biases follow the engine's own precision and are named in the detail only."""
        if self.spec.fp8.backend != "msamp":
            return tensors, ""
        scope = [t for t in tensors if is_scaling_tensor(t)]
        rest, counts = probes.summarize(t for t in tensors if not is_scaling_tensor(t))
        return scope, f" converted by MS-AMP ({len(scope)}; the other parameters: {rest} {counts})"

    def _observe_stores(self) -> None:
        out, inspector = self.observed, self.inspector
        out["engine"] = _obs(inspector.engine, f"recognised from {type(self.model).__name__} and "
                                               f"{type(self.optimizer).__name__}")
        weights, where = inspector.weights()
        scope, note = self._scope(weights)
        value, counts = probes.summarize(scope)
        out["weights"] = _obs(value, f"{where}{note}: {counts}")
        masters, where, separate = inspector.masters()
        master_value, counts = probes.summarize(masters)
        self._masters = (master_value, f"{where}: {counts}", separate)
        out["preparation"] = (_obs(master_value, f"{where}: {counts}") if separate
                              else _obs(value, "what the engine prepared is what the optimizer steps"))
        covered = sum(t.numel() for t in (masters or weights))
        self._bytes = {"weights": probes.nbytes(weights) / max(sum(t.numel() for t in weights), 1)}
        if separate and masters:
            self._bytes["master"] = probes.nbytes(masters) / covered
        self._covered = max(covered, 1)
        self._observe_frozen()

    def _observe_frozen(self) -> None:
        """Trainable vs frozen. Under `adapter` the base is every parameter that is neither a LoRA adapter's nor a
        module to save's trained copy (PEFT's names, backends/adapters.trained_beside_base), whatever the loop did
        with it: stored in the expected dtype (an fp32 copy of a bf16 base is a mismatch), with no gradient and
        never stepped by the optimizer."""
        named = list(self.inspector.module.named_parameters())
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        trainable, frozen_count = split_parameters(self.inspector.module)
        self._bnb_states = bnb_4bit_quant_states(self.inspector.module)
        # a bitsandbytes 4-bit weight's numel() counts its packed storage: its quant_state has the logical shape
        frozen_count += sum(math.prod(self._bnb_states[id(p)].shape) - p.numel()  # type: ignore[attr-defined]
                            for _, p in frozen if id(p) in self._bnb_states)
        self.observed["_parameters"] = {"trainable": trainable, "frozen": frozen_count}
        stored = [self._stored(p) for _, p in frozen]
        if stored:
            self.observed["_frozen_bytes"] = round(probes.nbytes(stored) / max(probes.numel(stored), 1), 2)
            self.observed["_frozen_bytes_by_format"] = probes.bytes_per_param_by_format(stored)
        if not self.spec.adapter.enabled:
            return
        base = [(n, p) for n, p in named if not trained_beside_base(n)]
        value, counts = probes.summarize(self._stored(p) for _, p in base)
        detail = f"the base weights (every parameter outside the adapters and the modules to save): {counts}"
        whole = self.inspector.left_whole([(n, p) for n, p in base if p.numel()])
        if whole:  # stored as the config says, but on every rank whole: the bytes FSDP2 should divide are not
            value += "+unsharded"
            detail += (f"; {len(whole)} of them whole on every rank, left out of FSDP2 ({', '.join(whole[:3])}"
                       f"{' ...' if len(whole) > 3 else ''})")
            by_name = dict(base)
            if any(id(by_name[name]) in self._bnb_states for name in whole):
                detail += ("; a bitsandbytes 4-bit base in uint8 storage is (FSDP2 shards floating-point storage; "
                           "accelerate#3983 reports such runs training wrong); fix: BitsAndBytesConfig("
                           "bnb_4bit_quant_storage=torch.bfloat16), the dtype of the other weights")
            else:
                detail += "; fix: shard them with the rest (fully_shard's ignored_params, or a dtype it cannot shard?)"
        self.observed["frozen_weights"] = _obs(value, detail)
        stepped = {id(p) for p in self.inspector.stepped()}
        kept = {"gradients": [n for n, p in base if p.requires_grad or p.grad is not None],
                "optimizer": [n for n, p in base if id(p) in stepped]}
        kept = {kind: names for kind, names in kept.items() if names}
        detail = "; ".join(f"{kind} for {len(names)} base tensors ({', '.join(names[:3])}"
                           f"{' ...' if len(names) > 3 else ''})" for kind, names in kept.items())
        self.observed["frozen_state"] = _obs("+".join(kept) or "none", detail or
                                             f"{len(base)} base tensors: no gradient, not stepped by the optimizer")

    def _stored(self, param):
        """What this rank stores of a frozen parameter; a bitsandbytes 4-bit weight that FSDP2 sharded (a plain
        tensor of packed codes now) read by its module's quant_state (fp8dist.backends.storage.bnb_4bit_shard)."""
        return held_of(param, self.inspector.stored(param), self._bnb_states)

    def _record_gradients(self, grads: list, where: str) -> None:
        if self._gradients is None or (not self._gradients["numel"] and grads):  # the first step that has them
            value, counts = probes.summarize(grads)
            self._gradients = {"value": value, "where": where, "counts": counts, "nbytes": probes.nbytes(grads),
                               "numel": sum(t.numel() for t in grads)}

    # -- leaving: what the step did ------------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        cast(contextlib.ExitStack, self._stack).close()  # __enter__ made it
        try:
            if exc_type is not None:
                return False  # the block's own error goes on; nothing is reported for a step that did not finish
            self._observe_step()
            self.report = build(self.spec, self.name or model_name(self.inspector.module), self.observed,
                                self.nproc, outside={} if "loading" in self.observed else {
                                    "loading": "the watch starts with the model already loaded"},
                                data_size=self.data_size)
        finally:
            self._release()
        self._agree()
        if self.on_mismatch != "defer":
            self.conclude(self.on_mismatch, self.verbose)
        return False

    def _release(self) -> None:
        """Keep only the report: the model, the optimizer, the engine's inspector and the recorders go, so that a
        Watch the loop keeps (its `audit` variable) holds nothing of the run alive, down to its process group, once
        the loop lets go of it (a process that ends with destroy_process_group)."""
        self.model = self.optimizer = self.inspector = self.matmuls = self.wire = self._stack = self._numerics = None

    def _observe_step(self) -> None:
        out = self.observed
        matmuls = cast(probes.MatmulRecorder, self.matmuls)  # __enter__ made it; _release drops it after this
        fp8, other = matmuls.split()
        compute, detail = probes.compute_dtype(other)
        kernels = matmuls.kernels()
        if kernels is not None:  # a library kernel's own precision: said, not judged (not the run's GEMMs)
            out["_kernel_matmuls"] = kernels
            detail += (f"; not counted: {sum(kernels['matmuls'].values())} matmuls inside {kernels['calls']} "
                       f"{kernels['kernel']} calls ({kernels['matmuls']}, from {kernels['inputs']} inputs): "
                       f"{kernels['reason']}")
        out["training"] = _obs(compute, f"non-FP8 matmul operands: {detail}", measured=bool(other or fp8))
        notes = "".join(f"; {note}" for note in matmuls.notes)
        emulated = sum(matmuls.emulated.values())
        if emulated:
            notes = (f"; emulated: {emulated} of {sum(fp8.values())} low-precision GEMMs multiplied dequantized "
                     f"values in high precision (FP8's rounding, not an FP8 kernel)") + notes
        out["gemm"] = (_obs(probes.low_precision_format(fp8), probes.describe_fp8(fp8) + notes) if fp8
                       else _obs(compute, "no FP8/FP4 operands seen" + notes, measured=bool(other)))
        out["_fp8_emulated"] = bool(emulated)
        self._weigh_gemms(out["gemm"])
        out["_speed"] = self._predict_speed()
        master_value, where, separate = self._masters
        if not separate and self._no_master_expected() and normalize(master_value) == self.spec.precision.weight_dtype:
            out["master_weights"] = _obs("n/a", f"no separate master copy: the optimizer steps the weights themselves, "
                                                f"in the config's weight dtype ({where})")
        else:
            out["master_weights"] = _obs(master_value, where)
        grads = self._gradients
        if grads is None:
            out["weight_gradients"] = _obs("not observed", "the optimizer did not step inside the watched block", False)
            out["optimizer"] = _obs("not observed", "the optimizer did not step inside the watched block", False)
        else:
            out["weight_gradients"] = _obs(grads["value"], f"{grads['where']}: {grads['counts']}")
            if grads["numel"]:
                self._bytes["gradients"] = grads["nbytes"] / grads["numel"]
            holder = self.inspector.state_optimizer()
            kept = full_precision_by_design(holder)
            state, per_key = probes.optimizer_states(holder, skip=kept)
            words, layouts = probes.describe_layouts(probes.state_layouts(holder, skip=kept))
            note = f"; {len(kept)} states of small tensors left out, kept in full precision by design" if kept else ""
            out["optimizer"] = _obs(state, f"state storage: {per_key}{f'; {words}' if words else ''}{note}")
            if layouts:  # block-quantized states: codes dtype, block size and scale dtype per state key
                out["optimizer"]["layouts"] = layouts
            self._bytes["optimizer"] = probes.nbytes(probes.state_tensors(holder)) / self._covered
        if self.nproc > 1:
            self._observe_wire()
        out["_bytes"] = self._bytes
        out["_decisions"] = [d.__dict__ for d in self.inspector.decisions]
        if self._numerics is not None:
            out["numerics"], out["_numerics"] = observe_numerics(self._numerics.tally, matmuls.ledger, self.spec)

    def _weigh_gemms(self, gemm: dict) -> None:
        """The FLOP view of the gemm row: the share of weight-GEMM FLOPs in FP8, and the modules whose weight GEMMs
        ran in high precision although the config converts them (the row then shows their format too)."""
        matmuls = cast(probes.MatmulRecorder, self.matmuls)  # __enter__ made it; _release drops it after this
        if self.inspector.pipeline_mesh() is not None:  # each rank ran its stages: the row is the whole model's
            matmuls.ledger = merged_over(matmuls.ledger, self.inspector.pipeline_mesh().get_group())
        ledger = matmuls.ledger
        decisions = self.inspector.decisions or self._config_decisions()
        kept = {d.fqn: d.reason for d in decisions if not d.convert}
        by_design = dict(TORCHAO_HIGH_PRECISION_GEMMS.get(self.spec.fp8.torchao.recipe_name, {})
                         if self.spec.fp8.backend == "torchao" else {})
        if self.switched:
            switched = (f"precision.schedule: from step {self.spec.switch_step} ({self.switched} GEMMs in the compute "
                        "dtype)")
            by_design.update(dict.fromkeys(("forward",) if self.switched == "forward" else
                                           ("forward", "input_gradient", "weight_gradient"), switched))
        if self.spec.fp8.backend == "torchao" and self.spec.fp8.overrides:  # several recipes: each Linear's own
            by_design.update(TORCHAO_HIGH_PRECISION_GEMMS["rowwise_with_gw_hp"])  # the policy check judges them
        flops = summarize_gemm_flops(ledger, kept, self.spec.fp8.enabled, by_design)
        self.observed["_gemm_flops"] = flops
        if not flops["weight_gemm_flops"]:
            return
        if self.switched == "all":
            gemm["expects"] = (expected(self.spec, 1)["training"][0], switched)
        if self.spec.fp8.backend == "torchao":
            policy = check_policy(ledger, self._policy_expected(decisions), self.switched,
                                  switched if self.switched else "")
            flops["policy"] = policy
            if policy["mismatches"]:
                gemm["fails"] = True
                gemm["detail"] = ("Linears not in the format the policy says: " + describe_policy(policy["mismatches"])
                                  + "; " + gemm["detail"])
        if decisions and not any(d.convert for d in decisions) and any(SPEED_KEPT in d.reason for d in decisions):
            # the config's own speed rule kept every Linear: the run it asked for has no FP8 GEMM to find
            gemm["expects"] = (expected(self.spec, 1)["training"][0],
                               "precision.fp8.min_speedup kept every Linear in the compute dtype (FP8 is predicted "
                               "slower for each on this GPU: the module filter's report says why)")
        elif decisions and not any(d.convert for d in decisions) and flops.get("policy", {}).get(
                "asked_fp8_share") == 0.0 and self.spec.fp8.policy == "auto" and not self.switched:
            # policy auto's calibration (its overrides) kept every Linear: no FP8 GEMM is what the run asked for
            gemm["expects"] = (expected(self.spec, 1)["training"][0],
                               "precision.fp8.policy auto kept every Linear in the compute dtype (none passed its "
                               "numerics and speed checks: the calibration's start report says why for each)")
        gemm["detail"] += f"; FP8 share of weight-GEMM FLOPs {flops['fp8_share']:.1%}"
        stray = [row for row in flops["high_precision"] if not row["allowed"]]
        if stray:
            formats = sorted({probes.family(fmt) for (module, fmt) in ledger.flops
                              if any(module == row["module"] for row in stray)})
            gemm["observed"] = "+".join(dict.fromkeys([v for v in gemm["observed"].split("+") if v != "none"]
                                                      + formats))
            gemm["detail"] += "; weight GEMMs in high precision: " + "; ".join(
                f"{row['module']} {row['share']:.1%} of the FLOPs ({row['reason']})" for row in stray)

    def _predict_speed(self) -> dict | None:
        """The `speed` info row (audit/speed_row.py): the step's observed weight GEMMs on the run's GPU."""
        from fp8dist.machine import device_info

        ledger = cast(probes.MatmulRecorder, self.matmuls).ledger
        return speed_row(self.spec, ledger, device_info().get("name"))

    def _config_decisions(self) -> list:
        """Which Linears the config keeps in high precision and in which recipe it runs the others, for a model fp8dist
        did not convert (Accelerate, HF Trainer, a hand-written loop) and for the policy check: its module filter and
        per-Linear policy applied to the model as it is, the rule every fp8dist backend applies
        (backends/module_filter.py)."""
        if self.spec.fp8.backend in ("none", "msamp"):  # MS-AMP: table A's scope, not a module filter
            return []
        rules = module_filter_plan(self.spec)
        infos = [LinearInfo(clean_name(i.fqn), i.in_features, i.out_features, i.router, i.block, i.blocks)
                 for i in linear_infos(self.inspector.module)]
        dims = torchao_recipe_dims(self.spec.fp8.torchao) if self.spec.fp8.backend == "torchao" else {}
        return decide(infos, rules.exclude, rules.skip_first_last, rules.require_dims_multiple_of,
                      policy=policy_of(self.spec.fp8, dims))

    def _policy_expected(self, decisions: list) -> dict[str, tuple[str | None, str]]:
        """Linear -> (the recipe the config's policy gives it, None: compute dtype; why), from the config, not from
        what the engine says it did; a Linear the run's speed rule kept (precision.fp8.min_speedup, decided on the
        run's GPU) is expected kept."""
        speed_kept = {d.fqn: d.reason for d in decisions if not d.convert and SPEED_KEPT in d.reason}
        return {d.fqn: (None, speed_kept[d.fqn]) if d.fqn in speed_kept else
                (d.recipe if d.convert else None, d.reason) for d in self._config_decisions()}

    def _no_master_expected(self) -> bool:
        return expected(self.spec, self.data_size)["master_weights"][0] == "n/a"

    def _observe_wire(self) -> None:
        out, wire = self.observed, cast(WireRecorder, self.wire)  # __enter__ made it; _release drops it after this
        record = wire.as_dict(axes=DATA_AXES)  # the tp axis has its own rows (_observe_tensor_parallel)
        # MS-AMP sends its FP8 gradients as uint8 (ScalingTensor bytes): name them by what they carry.
        msamp = self.spec.fp8.backend == "msamp"
        reduced = sorted({"fp8" if d == "uint8" and msamp else d for d in wire.dtypes(REDUCTIONS)})
        out["communication"] = _obs("+".join(reduced) or "none",
                                    f"gradient reductions on the wire (scalars left out): "
                                    f"{ {k: v for k, v in record.items() if k in REDUCTIONS} }")
        gathered = set(wire.dtypes({"all_gather"}))
        float8_weights = sum(1 for p in self.inspector.module.parameters()  # frozen ones too (an adapter run's base)
                             if "Float8" in type(getattr(p, "_local_tensor", p)).__name__)
        if float8_weights and gathered & FLOAT8_WIRE:
            gather = "fp8"
        else:
            gather = "+".join(sorted(gathered - {"uint8"} or gathered)) or "none"
        out["weight_all_gather"] = _obs(gather, f"all-gathers {record.get('all_gather', {})}; "
                                                f"{float8_weights} float8 weights")
        out["_comm"] = wire.as_dict()
        out["_comm_axes"] = wire.by_axis()
        if self.spec.parallel.tensor_size > 1:
            self._observe_tensor_parallel(wire)
        if self.spec.parallel.expert_size > 1:
            sent = wire.dtypes({"all_to_all"}, axes=(EP,))
            carried = [dtype for dtype in sent if not dtype.startswith(("int", "uint"))]  # split counts are int64
            out["ep_all_to_all"] = _obs("+".join(carried) or "none", "all-to-alls on the ep axis (the split counts "
                                        f"left out): {wire.by_axis().get('ep', {}).get('all_to_all', {})}")
        if self.inspector.engine == "none":
            if wire.dtypes({"all_reduce"}):
                # The loop handed over the bare module (HF Trainer does so under DDP): replicated training is
                # seen from its gradient all-reduces.
                out["engine"] = _obs("ddp", "a module with no sharding wrapper whose gradients were all-reduced "
                                            "on the wire (replicated data parallel)")
            elif not reduced:
                out["engine"]["detail"] += (f"; {self.nproc} ranks and no gradient reduction on the wire: "
                                            "each rank trains alone")

    def _observe_tensor_parallel(self, wire: WireRecorder) -> None:
        """What crossed the `tp` axis: the activations all-gathered (sequence parallel) and the partial sums
        reduced (row-wise outputs, column-wise input gradients)."""
        out, record = self.observed, wire.by_axis().get(TP, {})
        reduced = wire.dtypes(REDUCTIONS, axes=(TP,))
        out["tp_reduction"] = _obs("+".join(reduced) or "none", f"reductions on the tp axis (scalars left out): "
                                   f"{ {k: v for k, v in record.items() if k in REDUCTIONS} }")
        gathered = set(wire.dtypes({"all_gather"}, axes=(TP,)))
        float8 = gathered & FLOAT8_WIRE
        gather = "fp8" if float8 and normalize(expected(self.spec, self.data_size).get(
            "tp_all_gather", ("",))[0]) == "fp8" else "+".join(sorted(gathered)) or "none"
        out["tp_all_gather"] = _obs(gather, f"all-gathers on the tp axis: {record.get('all_gather', {})}")

    def _agree(self) -> None:
        """One verdict for the job: a rank that saw a mismatch fails every rank."""
        report = cast(dict[str, Any], self.report)  # __exit__ built it before agreeing
        self.passed = report["passed"]
        if self.nproc > 1:
            import torch.distributed as dist

            verdicts: list = [None] * self.nproc
            failing = [c["phase"] for c in report["checks"] if not c["ok"]]
            dist.all_gather_object(verdicts, (self.passed, failing))
            self.passed = all(passed for passed, _ in verdicts)
            report["passed"] = self.passed
            report["failing_by_rank"] = {rank: phases for rank, (_, phases) in enumerate(verdicts) if phases}

    def conclude(self, on_mismatch: str, verbose: bool) -> None:
        """Print the table (rank 0, `verbose`) and act on a mismatch: warn, raise on every rank, or ignore."""
        report = cast(dict[str, Any], self.report)  # called after the block, whose __exit__ built it
        text = table(report)
        if verbose and self.rank == 0:
            print(text, end="", flush=True)
        if self.passed or on_mismatch == "ignore":
            return
        if on_mismatch == "raise":
            raise AuditMismatch(f"fp8dist audit of the watched step: {verdict(report)}\n{text}")
        if self.rank == 0:
            print(("" if verbose else text) + "fp8dist audit: the watched step did not run in the precision "
                  "its config says (see above)", file=sys.stderr, flush=True)


def watch(model, optimizer, config, *, on_mismatch: str = "warn", name: str | None = None,
          verbose: bool = False, loading: dict | None = None, numerics: bool = False, step: int = 1) -> Watch:
    """Audit everything run inside the `with` block against `config` (a path, a dict or a Spec).

    model: what the loop calls (fp8dist-prepared, `fully_shard`ed, a DeepSpeedEngine, DDP, a plain module,
        Accelerate's prepared model); optimizer: what the loop steps (Accelerate's wrapper is fine).
    on_mismatch: `warn` (default: one table on rank 0, to stderr), `raise` (AuditMismatch on every rank),
        `ignore` (only `w.report` / `w.passed`), `defer` (decide later with `w.conclude(...)`).
    name: the model name in the report (default: its class). verbose: print the table on rank 0 whatever the
        verdict. loading: the `loading` cell when the caller observed the model as loaded (the CLI audit).
    numerics: also measure every FP8 weight GEMM's casts and SQNR (fp8dist.audit.numerics): a `numerics` row
        checked against `audit.numerics`, and `numerics` in the report; the watched step costs more.
    step: which step of the run the block is (from 1): from precision.schedule's switch on, its GEMMs are expected
        in the compute dtype (the forward ones, or all).
    """
    return Watch(model, optimizer, config, on_mismatch=on_mismatch, name=name, verbose=verbose, loading=loading,
                 numerics=numerics, step=step)
