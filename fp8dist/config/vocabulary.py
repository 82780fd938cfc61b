"""The engine-agnostic `parallel` vocabulary and what it means on each engine (pure, no torch).

One config keeps its meaning when `engine` switches: `parallel.sharding` and `parallel.offload` decide the
DeepSpeed keys `deepspeed.zero_stage`, `offload_optimizer` and `offload_param` unless those are written too,
in which case they must agree (a conflict names both keys: no silent precedence). A key written at the value
it holds anyway (`parallel.offload: none`, the default) decides nothing (fp8dist.config.load written_settings: the
resolved config `validate` prints reads back the same). FSDP2 reads `parallel` only (its old
`fsdp2.reshard_after_forward` / `fsdp2.offload` keys moved here).

| sharding  | FSDP2 (fully_shard)                                     | DeepSpeed                               |
|-----------|---------------------------------------------------------|-----------------------------------------|
| full      | 1-D mesh, reshard_after_forward=True (FULL_SHARD)       | ZeRO-3                                  |
| grad_op   | 1-D mesh, reshard_after_forward=False (SHARD_GRAD_OP)   | ZeRO-2                                  |
| hybrid    | 2-D mesh (replicate, shard=shard_size) (HYBRID_SHARD)   | ZeRO-3 + ZeRO++ hpZ (see below)         |
| replicate | 2-D mesh (world, 1): nothing sharded (NO_SHARD)         | ZeRO-0                                  |
| auto      | full                                                    | deepspeed.zero_stage (default 2)        |

hybrid on DeepSpeed: ZeRO-3 + ZeRO++ hpZ (zero_hpz_partition_size=shard_size).

Sources: torchtitan docs/fsdp.md (FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD mapping), torch 2.13
torch/distributed/fsdp/_fully_shard/_fsdp_init.py (2-D mesh = HSDP), torchtitan PR #2900 (replicate as
shard size 1), DeepSpeed 0.19 runtime/zero/config.py (zero_hpz_partition_size). DeepSpeed's MiCS would be
closer to HSDP but does not run on its CPU accelerator (DeepSpeed tests/unit/v1/zero/test_zero.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.errors import Issue

# Names users know from FSDP1 / Accelerate's fsdp_config (accelerate examples/config_yaml_templates/fsdp.yaml),
# accepted and rewritten to ours.
SHARDING_ALIASES = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "HYBRID_SHARD": "hybrid", "NO_SHARD": "replicate"}
ZERO_STAGE = {"full": 3, "grad_op": 2, "hybrid": 3, "replicate": 0}
# parallel.offload -> (deepspeed.offload_optimizer, deepspeed.offload_param)
DEEPSPEED_OFFLOAD = {"none": ("none", "none"), "optimizer": ("cpu", "none"), "params": ("cpu", "cpu")}


def normalize(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """FSDP1 / Accelerate strategy names rewritten to the vocabulary's, before validation."""
    parallel = document.get("parallel")
    if not isinstance(parallel, Mapping):  # not a section: the schema's to refuse
        return document
    sharding = parallel.get("sharding")
    if isinstance(sharding, str) and sharding in SHARDING_ALIASES:  # any other value is the schema's to refuse
        document = {**document, "parallel": {**parallel, "sharding": SHARDING_ALIASES[sharding]}}
    return document


def _written(explicit: Mapping[str, Any], section: str, key: str) -> bool:
    block = explicit.get(section)
    return isinstance(block, Mapping) and key in block


def derive(doc: dict[str, Any], explicit: Mapping[str, Any], own: Mapping[str, Any] | None = None) -> list[Issue]:
    """Fill the DeepSpeed keys the user did not write from `parallel`, in place; report conflicts and
    values that cannot mean anything (what an engine cannot run at the values derived here: its rules,
    fp8dist.config.rules). `explicit`: what the user wrote, a preset's values included (a preset
    that sets deepspeed.zero_stage conflicts with parallel.sharding like a written key does); `own`: the user's
    document alone, to say when the other key came from the preset."""
    own = explicit if own is None else own

    def origin(section: str, key: str) -> str:
        return "" if _written(own, section, key) else f" (set by preset {doc['precision']['preset']})"

    par, ds, issues = doc["parallel"], doc["deepspeed"], []
    sharding = par["sharding"]
    if sharding == "hybrid" and par["shard_size"] is None:
        issues.append(Issue("parallel.shard_size", "hybrid sharding needs the size of a shard group", None,
                            "set parallel.shard_size to the ranks that shard one copy (e.g. the GPUs of a node)"))
    if sharding != "hybrid" and par["shard_size"] is not None:
        issues.append(Issue("parallel.shard_size", f"only hybrid sharding has shard groups; "
                            f"parallel.sharding is {sharding}", par["shard_size"],
                            "remove parallel.shard_size, or set parallel.sharding=hybrid"))
    if sharding != "auto":
        stage = ZERO_STAGE[sharding]
        if _written(explicit, "deepspeed", "zero_stage") and ds["zero_stage"] != stage:
            preset_sharding = {v: k for k, v in ZERO_STAGE.items() if k != "hybrid"}.get(ds["zero_stage"], "auto")
            issues.append(Issue("deepspeed.zero_stage", f"{origin('deepspeed', 'zero_stage')} conflicts with "
                                f"parallel.sharding={sharding}, which is ZeRO-{stage} on DeepSpeed".lstrip(),
                                ds["zero_stage"],
                                "remove one of the two keys (parallel.sharding keeps its meaning on both engines)"
                                if not origin("deepspeed", "zero_stage") else
                                f"leave parallel.sharding auto, or set it to the preset's stage "
                                f"({preset_sharding})"))
        ds["zero_stage"] = stage
    if _written(explicit, "parallel", "offload"):
        optimizer, param = DEEPSPEED_OFFLOAD[par["offload"]]
        for key, want in (("offload_optimizer", optimizer), ("offload_param", param)):
            if _written(explicit, "deepspeed", key) and ds[key] != want:
                issues.append(Issue(f"deepspeed.{key}", f"{origin('deepspeed', key)} conflicts with parallel.offload="
                                    f"{par['offload']} ({key}={want} on DeepSpeed)".lstrip(), ds[key],
                                    "remove one of the two keys (nvme offload: write only the deepspeed keys)"))
            ds[key] = want
    return issues


def deepspeed_extras(doc: Mapping[str, Any]) -> dict[str, Any]:
    """zero_optimization keys the vocabulary adds on DeepSpeed beyond the stage (hybrid: ZeRO++ hpZ)."""
    par = doc["parallel"]
    return {"zero_hpz_partition_size": par["shard_size"]} if par["sharding"] == "hybrid" else {}

