"""The run's parallel dimensions: one object that derives every mesh axis from the config and the world size
(pure, no torch), in the spirit of torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py) and
Accelerate's ParallelismConfig (accelerate 1.15 accelerate/parallelism_config.py).

Axes, outermost first (the order of the DeviceMesh and of the rank numbering):
- `dp_replicate`: copies of the model that only all-reduce gradients (HSDP's replicate dim, `parallel.sharding:
  replicate`);
- `dp_shard`: the ranks one copy is sharded over (FSDP2's shard dim; DeepSpeed's ZeRO partition group);
- `cp`, `tp`: context and tensor parallel. The schema does not offer them yet, so both are 1; a new axis gets its
  config key, its size rule in `parallel_dims`, and its mesh dim here, and nothing else in this module changes.

The data-parallel group is dp_replicate x dp_shard: the ranks that read different batches. Data loading,
checkpoints and the audit count data-parallel ranks (`data_rank`, `data_size`), which equal the global rank and
world size only while cp and tp are 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from fp8dist.errors import Fp8distError

# The mesh dims, outermost first (torchtitan's order: dp_replicate, dp_shard, cp, tp).
AXES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    replicate_dim: bool = False
    """Keep the dp_replicate dim in the mesh at size 1 too: `parallel.sharding` hybrid and replicate name a 2-D
    (replicate, shard) layout, and FSDP2 runs HSDP on it as configured whatever the world size."""

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"ParallelDims.{axis} must be >= 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_size(self) -> int:
        """The data-parallel ranks: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`: the ranks of one cp x tp group read the same batch."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank // (self.cp * self.tp)

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dim names, sizes) of the DeviceMesh: (dp_replicate, dp_shard) when ranks replicate or the layout
        names the replicate dim (FSDP2 wants a named 2-D mesh for HSDP and replicate, torch 2.13 _fsdp_init.py
        _validate_mesh), else a 1-D shard mesh; cp and tp only when they are used."""
        dims = [("dp_replicate", self.dp_replicate)] if self.dp_replicate > 1 or self.replicate_dim else []
        dims.append(("dp_shard", self.dp_shard))
        dims += [(axis, getattr(self, axis)) for axis in ("cp", "tp") if getattr(self, axis) > 1]
        return tuple(name for name, _ in dims), tuple(size for _, size in dims)


def parallel_dims(spec, world: int) -> ParallelDims:
    """The dims of `spec` on `world` ranks, or an Fp8distError naming the key when they do not fit (said when the
    ranks start, and by the launching commands before they do)."""
    par = spec.parallel
    if par.sharding == "hybrid":
        size = par.shard_size
        if world % size:
            raise Fp8distError(f"parallel.shard_size={size} does not divide the {world} ranks of this job: hybrid "
                               f"sharding needs whole shard groups\n  fix: set parallel.shard_size to a divisor of "
                               f"{world} (e.g. the GPUs per node), or launch a multiple of it")
        return ParallelDims(dp_replicate=world // size, dp_shard=size, replicate_dim=True)
    if par.sharding == "replicate":
        return ParallelDims(dp_replicate=world, dp_shard=1, replicate_dim=True)
    return ParallelDims(dp_shard=world)
