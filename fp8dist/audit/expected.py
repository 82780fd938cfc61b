"""The expected dtype per phase for a config, derived from its spec (pure, no torch).

Ground truth: schemas/dtype_tables.json (tables A and B, with their public sources; docs/config.md prints them). The
derivation below reproduces every row of those tables from the preset and engine the row names
(tests/unit/audit/test_audit_expected.py), so a config that is not a preset gets its expectation by the same rules.
"""
from __future__ import annotations

from fp8dist.facts.torchao import TORCHAO_MXFP8_DISPATCH
from fp8dist.dtypes import FAMILY_BYTES
from fp8dist.config.engines import TRAITS
from fp8dist.config.parallel import sequence_parallel
from fp8dist.config.schema import read_schema_file
from fp8dist.config.spec import Spec
from fp8dist.engines.registry import profile_for

# Optimizer states per parameter when a cell names one dtype for all of them (torch Adam/AdamW: exp_avg,
# exp_avg_sq; fp8dist's SGD has no momentum).
STATES_PER_PARAM = {"adam": 2, "adamw": 2, "sgd": 0}
# The audit's phases, in the order of its table, and what each measures (audit/watching.py observes them).
PHASES = {
    "loading": "the parameters as loading made them (or, RAM-efficient loading, the safetensors files read into them)",
    "preparation": "what the engine prepared for the optimizer to step: the master copy where the engine keeps one "
                   "apart, else the weights",
    "weights": "the module's parameters as each rank stores them (FSDP2's shards, ZeRO-3's partitions)",
    "master_weights": "the copy the optimizer steps, where it is not the weights themselves (`n/a`: none apart)",
    "training": "the operands of the matmuls that do not run in FP8: the compute dtype",
    "gemm": "the operands of the weight GEMMs: FP8 (or FP4) where converted; the table says `(emulated)` when "
            "dequantized values were multiplied in high precision",
    "weight_gradients": "the gradients the optimizer reads as it steps",
    "optimizer": "the optimizer states after the step (Adam: first moment + second moment)",
    "communication": "the gradient reductions on the wire (2+ ranks)",
    "weight_all_gather": "the weight all-gathers on the wire (FSDP2, 2+ ranks)",
    "tp_all_gather": "the activations all-gathered on the tensor-parallel axis (sequence parallel; tp > 1)",
    "tp_reduction": "the partial sums reduced on the tensor-parallel axis: row-wise Linears' outputs, column-wise "
                    "Linears' input gradients (tp > 1)",
    "ep_all_to_all": "the tokens sent to their experts' ranks and back on the expert-parallel axis (all-to-all; "
                     "expert_size > 1)",
    "frozen_weights": "an adapter run's frozen base as stored",
    "frozen_state": "gradients or optimizer states kept for the frozen base (expected: none)",
    "numerics": "with `--numerics` (`watch(..., numerics=True)`) only: every FP8 weight GEMM's operand casts (share "
                "underflowed to 0, share clamped) and its SQNR against high precision, within `audit.numerics`",
}
MULTI_RANK_PHASES = {"communication", "weight_all_gather"}
# The numerics row's values (fp8dist.audit.numerics): expected `healthy`; observed `outside thresholds` fails.
HEALTHY, OUTSIDE, NOT_MEASURED_VALUE = "healthy", "outside thresholds", "not measured"


def numerics_expected(spec: Spec) -> tuple[str, str]:
    """The numerics row, for a step watched with numerics: healthy FP8 GEMMs, or none without an FP8 backend."""
    if not spec.fp8.enabled:
        return "n/a", "no FP8 backend: no FP8 GEMM to measure"
    limits = spec.audit.numerics
    sqnr = limits.min_sqnr_db
    return HEALTHY, (f"audit.numerics: every cast underflows <= {limits.max_underflow:g} and saturates <= "
                     f"{limits.max_saturated:g}; SQNR >= {sqnr.forward:g} / {sqnr.input_grad:g} / "
                     f"{sqnr.weight_grad:g} dB (forward / input_grad / weight_grad)")


def tables() -> dict:
    return read_schema_file("dtype_tables.json")["tables"]


def normalize(value: str) -> str:
    """'fp32+fp32' -> 'fp32'; 'fp8_e4m3' -> 'fp8'; case-insensitive."""
    value = value.lower().strip()
    parts = {p.split("_")[0].split(" ")[0] for p in value.split("+")}
    return parts.pop() if len(parts) == 1 else "+".join(p.split("_")[0] for p in value.split("+"))


def _msamp_row(spec: Spec) -> dict[str, str]:
    name = f"MS-AMP {spec.fp8.msamp.opt_level}"
    return next(row["cells"] for row in tables()["A"]["rows"] if row["name"] == name)


def expected(spec: Spec, nproc: int = 1) -> dict[str, tuple[str, str]]:
    """phase -> (expected dtype, why). Phases that need 2+ ranks are left out for nproc 1."""
    p, compute = spec.precision, spec.precision.compute_dtype
    row: dict[str, tuple[str, str]] = {"loading": (p.load_dtype, "precision.load_dtype")}
    row.update(profile_for(spec).expected_stores(spec))  # what the engine keeps where (engines/<name>/profile.py)
    row["training"] = (compute, "precision.mixed_precision (or the weight dtype without it)")
    if not spec.fp8.enabled:
        row["gemm"] = (compute, "no FP8 backend: GEMMs run in the compute dtype")
    elif spec.fp8.backend == "te" and spec.fp8.te.recipe == "nvfp4":
        row["gemm"] = ("fp4", "Transformer Engine NVFP4BlockScaling: E2M1 operands")
    else:
        row["gemm"] = ("fp8", f"FP8 backend {spec.fp8.backend}")
    row.setdefault("optimizer", (spec.optimizer_state_dtype, "optimizer.state_dtype (auto: the dtype of the weights "
                                                               "it steps)"))
    if spec.optimizer.name == "sgd":
        row["optimizer"] = ("none", "fp8dist's SGD has no momentum: no optimizer state")
    row["communication"] = (p.reduce_dtype, "precision.reduce_dtype (gradient reduction)")
    if spec.fp8.backend == "msamp":
        cells = _msamp_row(spec)
        for phase in ("gemm", "communication", "weights", "master_weights", "weight_gradients", "optimizer"):
            row[phase] = (cells[phase], f"table A, MS-AMP {spec.fp8.msamp.opt_level}")
    if spec.parallel.tensor_size > 1:
        row.update(_tensor_parallel_rows(spec, compute))
    if spec.parallel.expert_size > 1 and TRAITS[spec.engine].own_expert_parallel:  # AutoEP's groups are its own
        row["ep_all_to_all"] = (compute, "fp8dist's expert parallel dispatches and combines tokens in the compute "
                                         f"dtype (no low-precision dispatch: {TORCHAO_MXFP8_DISPATCH})")
    if spec.adapter.enabled:
        row["frozen_state"] = ("none", "adapter.kind=lora: the frozen base gets no gradient and no optimizer state")
    if nproc < 2:
        for phase in MULTI_RANK_PHASES:
            row.pop(phase, None)
    return {phase: row[phase] for phase in PHASES if phase in row}


def _tensor_parallel_rows(spec: Spec, compute: str) -> dict[str, tuple[str, str]]:
    """What crosses the tp axis: partial sums in the compute dtype; under sequence parallel, activation all-gathers
    in float8 where torchao's float8 styles run (tensorwise Float8Linears: engines/fsdp2/tensor_parallel.py), else in
    the compute dtype (torchtitan docs/float8.md: "For float8 with rowwise scaling, all distributed communication is
    done in high precision"; MXFP8 likewise, torchtitan mxfp8.md)."""
    rows = {"tp_reduction": (compute, "tensor parallel reduces partial sums in the compute dtype")}
    if sequence_parallel(spec):
        tensorwise = spec.fp8.backend == "torchao" and spec.fp8.torchao.recipe_name == "tensorwise"
        rows["tp_all_gather"] = (("fp8", "tensorwise float8 with sequence parallel: torchao's float8 styles gather "
                                         "activations in float8") if tensorwise else
                                 (compute, "sequence parallel gathers activations in the compute dtype (float8 only "
                                           "with tensorwise scaling)"))
    return rows


def frozen_bytes_per_param(spec: Spec) -> float:
    """Bytes per frozen parameter (an adapter run's base): its weight only, in the frozen_weights dtype."""
    if not spec.adapter.enabled:
        return 0.0
    return float(FAMILY_BYTES[normalize(expected(spec)["frozen_weights"][0])])


def implied_bytes_per_param(spec: Spec) -> dict[str, float]:
    """Bytes per parameter that the expected row implies, per store: the weights the engine keeps, a separate
    master copy (0 under FSDP2, whose sharded weights are the master copy), gradients, optimizer states.
    E.g. fp32 Adam 4+0+4+8 = 16; DeepSpeed bf16 2+4+2+8 = 16; MS-AMP O2 2+0+1+3 = 6."""
    row = expected(spec, nproc=2)

    def size(cell: str) -> float:
        return sum(FAMILY_BYTES[normalize(part)] for part in cell.split("+"))

    states = row["optimizer"][0]
    optimizer = size(states) if "+" in states else size(states) * STATES_PER_PARAM[spec.optimizer.name]
    return {"weights": size(row["weights"][0]),
            "master": size(row["master_weights"][0]) if profile_for(spec).separate_master_bytes(spec) else 0.0,
            "gradients": size(row["weight_gradients"][0]), "optimizer": optimizer}
