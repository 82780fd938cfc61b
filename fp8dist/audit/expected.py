"""The expected dtype per phase for a config, derived from its spec (pure, no torch).

Ground truth: schemas/dtype_tables.json (tables A and B). The derivation below reproduces every row
of those tables from the preset and engine the row names (tests/unit/test_audit_expected.py), so a
config that is not a preset gets its expectation by the same rules.
"""
from __future__ import annotations

from fp8dist.config.rules import effective_state_dtype, weight_dtype
from fp8dist.config.schema import read_schema_file
from fp8dist.config.spec import Spec
from fp8dist.config.vocabulary import fsdp2_layout

DTYPE_BYTES = {"none": 0, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp4": 0.5, "n/a": 0}
# Optimizer states per parameter when a cell names one dtype for all of them (torch Adam/AdamW: exp_avg,
# exp_avg_sq; fp8dist's SGD has no momentum).
STATES_PER_PARAM = {"adam": 2, "adamw": 2, "sgd": 0}
PHASES = ("loading", "preparation", "weights", "master_weights", "training", "gemm", "weight_gradients",
          "optimizer", "communication", "weight_all_gather")
MULTI_RANK_PHASES = {"communication", "weight_all_gather"}


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
    doc = spec.to_dict()
    p, engine = spec.precision, spec.engine
    master = weight_dtype(doc)
    compute = p.mixed_precision if p.mixed_precision != "none" else p.load_dtype
    row: dict[str, tuple[str, str]] = {"loading": (p.load_dtype, "precision.load_dtype")}
    if engine == "fsdp2":
        row["preparation"] = (master, "local shards are upcast to the master dtype before fully_shard")
        row["weights"] = (master, "FSDP2 stores the sharded weights in the master dtype")
        separate = p.master_weights not in ("none", compute)
        row["master_weights"] = (p.master_weights if separate else "n/a",
                                 "precision.master_weights" if separate else
                                 "no copy in a dtype other than the compute dtype (precision.master_weights)")
        row["weight_gradients"] = (master, "sharded gradients take the dtype of the sharded weights")
        ao = spec.fp8.torchao
        float8_gather = spec.fp8.backend == "torchao" and (
            ao.enable_fsdp_float8_all_gather is True or
            (ao.enable_fsdp_float8_all_gather == "auto" and ao.recipe_name == "tensorwise"))
        row["weight_all_gather"] = ("fp8" if float8_gather else compute,
                                    "float8 all-gather" if float8_gather else "MixedPrecisionPolicy.param_dtype")
        if fsdp2_layout(doc)["shard_size"] == 1:
            row["weight_all_gather"] = ("none", "shard size 1 (parallel.sharding): nothing is sharded, nothing gathered")
    else:
        stage, section = spec.deepspeed.zero_stage, p.master_weights != "none" and p.mixed_precision != "none"
        module = p.mixed_precision if section else p.load_dtype
        keeps_fp32 = stage >= 1 or section
        prep = p.master_weights if section else ("fp32" if keeps_fp32 else p.load_dtype)
        row["preparation"] = (prep, "DeepSpeed builds its master partitions in fp32 (bf16 with "
                              "bf16_master_weights_and_grads) whatever the loading dtype")
        row["weights"] = (module, "the bf16/fp16 section casts module weights; otherwise they stay as loaded")
        row["master_weights"] = (prep if (section or stage >= 1) else "n/a", "DeepSpeed optimizer partitions")
        row["weight_gradients"] = (spec.deepspeed.grad_accum_dtype or (p.mixed_precision if section else "fp32"),
                                   "data_types.grad_accum_dtype, else the model dtype from the precision flags")
        if stage in (1, 2) and spec.deepspeed.offload_optimizer != "none":
            row["weight_gradients"] = ("fp32", "ZeRO-Offload accumulates the reduced gradients in fp32 CPU "
                                       "partitions (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu)")
    row["training"] = (compute, "precision.mixed_precision (or the weight dtype without it)")
    if not spec.fp8.enabled:
        row["gemm"] = (compute, "no FP8 backend: GEMMs run in the compute dtype")
    elif spec.fp8.backend == "te" and spec.fp8.te.recipe == "nvfp4":
        row["gemm"] = ("fp4", "Transformer Engine NVFP4BlockScaling: E2M1 operands")
    else:
        row["gemm"] = ("fp8", f"FP8 backend {spec.fp8.backend}")
    state = effective_state_dtype(doc)
    if engine == "deepspeed" and state in ("fp32", "bf16", "fp16") and p.master_weights == "none":
        state = row["preparation"][0]
    row["optimizer"] = (state, "optimizer.state_dtype (auto: the dtype of the weights it steps)")
    if spec.optimizer.name == "sgd":
        row["optimizer"] = ("none", "fp8dist's SGD has no momentum: no optimizer state")
    row["communication"] = (p.reduce_dtype, "precision.reduce_dtype (gradient reduction)")
    if spec.fp8.backend == "msamp":
        cells = _msamp_row(spec)
        for phase in ("gemm", "communication", "weights", "master_weights", "weight_gradients", "optimizer"):
            row[phase] = (cells[phase], f"table A, MS-AMP {spec.fp8.msamp.opt_level}")
    if nproc < 2:
        for phase in MULTI_RANK_PHASES:
            row.pop(phase, None)
    return {phase: row[phase] for phase in PHASES if phase in row}


def implied_bytes_per_param(spec: Spec) -> dict[str, float]:
    """Bytes per parameter that the expected row implies, per store: the weights the engine keeps, a separate
    master copy (0 under FSDP2, whose sharded weights are the master copy), gradients, optimizer states.
    E.g. fp32 Adam 4+0+4+8 = 16; DeepSpeed bf16 2+4+2+8 = 16; MS-AMP O2 2+0+1+3 = 6."""
    row = expected(spec, nproc=2)

    def size(cell: str) -> float:
        return sum(DTYPE_BYTES[normalize(part)] for part in cell.split("+"))

    states = row["optimizer"][0]
    optimizer = size(states) if "+" in states else size(states) * STATES_PER_PARAM[spec.optimizer.name]
    return {"weights": size(row["weights"][0]),
            "master": 0.0 if spec.engine == "fsdp2" else size(row["master_weights"][0]),
            "gradients": size(row["weight_gradients"][0]), "optimizer": optimizer}
