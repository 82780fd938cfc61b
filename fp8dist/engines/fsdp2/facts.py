"""What fp8dist knows about FSDP2 before anything runs (torch-free): where it keeps each number (the audit's
expected rows, estimate's sharding and offload), and its translation. The runtime side is engine.py."""
from __future__ import annotations

from fp8dist.config.spec import Spec
from fp8dist.config.vocabulary import fsdp2_layout
from fp8dist.translate.fsdp2 import to_fsdp2

NAME = "fsdp2"
translate = to_fsdp2
USES_DEEPSPEED_PROCESS_GROUP = False


def expected_stores(spec: Spec) -> dict[str, tuple[str, str]]:
    """The phases whose dtype depends on how FSDP2 keeps the numbers: phase -> (dtype, why)."""
    p = spec.precision
    master, compute = p.weight_dtype, p.compute_dtype
    separate = p.master_weights not in ("none", compute)
    row = {
        "preparation": (master, "local shards are upcast to the master dtype before fully_shard"),
        "weights": (master, "FSDP2 stores the sharded weights in the master dtype"),
        "master_weights": (p.master_weights if separate else "n/a", "precision.master_weights" if separate else
                           "no copy in a dtype other than the compute dtype (precision.master_weights)"),
        "weight_gradients": (master, "sharded gradients take the dtype of the sharded weights"),
        "weight_all_gather": ("fp8", "float8 all-gather") if spec.float8_all_gather
        else (compute, "MixedPrecisionPolicy.param_dtype"),
    }
    if fsdp2_layout(spec.to_dict())["shard_size"] == 1:
        row["weight_all_gather"] = ("none", "shard size 1 (parallel.sharding): nothing is sharded, nothing gathered")
    if spec.adapter.enabled:
        row["frozen_weights"] = (p.load_dtype, "frozen base weights are not upcast: only trainable parameters get the "
                                 "master dtype (torchao float8 keeps their storage, casting on the fly)")
    return row


def separate_master_bytes(spec: Spec) -> bool:
    """FSDP2's sharded weights are the master copy: no separate store beside them."""
    return False


def shard_counts(spec: Spec, world: int) -> dict[str, int]:
    """Over how many ranks each store is divided: the shard group (all ranks, a hybrid group, or 1 for replicate)."""
    size = fsdp2_layout(spec.to_dict())["shard_size"]
    size = world if size == "world" else size
    return {"weights": size, "master_weights": size, "gradients": size, "optimizer": size}


def offloaded(spec: Spec) -> set[str]:
    """The stores in host memory: CPUOffloadPolicy moves parameters, gradients and the optimizer step together."""
    return {"weights", "gradients", "optimizer"} if spec.parallel.offload == "params" else set()
