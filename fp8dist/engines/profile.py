"""What fp8dist knows about an engine before anything runs, as one typed interface (torch-free): the questions the
runtime, the config commands, estimate and the audit would otherwise answer by testing the engine's name. Each
engine answers them in its own package (fp8dist/engines/<name>/profile.py); `fp8dist.engines.registry.profile_for`
hands out the one that `spec.engine` names. Lightning Fabric's strategies answer the same questions themselves
(lightning/fabric/strategies/strategy.py `module_init_context`, `setup_environment`).
"""
from __future__ import annotations

from typing import Literal, Protocol

from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.translate import EnginePlan

Store = Literal["weights", "master_weights", "gradients", "optimizer"]


class EngineProfile(Protocol):
    name: str
    launcher: Literal["torchrun", "deepspeed"]
    """The launcher `fp8dist run` starts the ranks with by default."""
    deepspeed_process_group: bool
    """Whether the process group is started by deepspeed.init_distributed (which also sets DeepSpeed's own
    communication backend) rather than torch.distributed.init_process_group."""
    efficient_loading: Literal["meta", "zero_init"]
    """How the engine builds a model that no rank holds whole (parallel.cpu_ram_efficient_loading): on the meta
    device, materialised shard by shard after sharding (FSDP2), or partitioned as it is built, inside
    deepspeed.zero.Init (ZeRO-3)."""
    moves_model_to_device: bool
    """Whether the engine moves a model built on the host to the accelerator itself (deepspeed.initialize does;
    fully_shard shards the model where it is)."""
    uses_device_mesh: bool
    """Whether the engine shards over the run's DeviceMeshes (handed to its setup as `meshes`,
    fp8dist.engines.mesh.Meshes) rather than process groups of its own."""
    runs_probes: bool
    """Whether the engine can run a forward and backward between optimizer steps, on another run's weights, and
    drop its gradients without moving the run (`full_weights`, `weights`, `probe`: `fp8dist compare
    --layer-steps`)."""

    def translate(self, spec: Spec) -> EnginePlan:
        """The plan the engine executes for `spec` (pure)."""
        ...

    def check_environment(self, spec: Spec, plan: EnginePlan) -> None:
        """What the engine itself refuses on this machine, before any rank starts (raises fp8dist.errors)."""
        ...

    def expected_stores(self, spec: Spec) -> dict[str, tuple[str, str]]:
        """The audit phases whose dtype depends on how the engine keeps the numbers: phase -> (dtype, why)."""
        ...

    def separate_master_bytes(self, spec: Spec) -> bool:
        """Whether the master weights are a store of their own beside the module's weights."""
        ...

    def gathers_weights(self, spec: Spec) -> bool:
        """Whether the weights are gathered from their shards for every forward and backward (FSDP2, ZeRO-3), rather
        than kept whole on every rank with the gradients reduced (ZeRO-0/1/2)."""
        ...

    def shard_counts(self, spec: Spec, dims: ParallelDims) -> dict[Store, int]:
        """Over how many ranks each store is divided."""
        ...

    def offloaded(self, spec: Spec) -> set[Store]:
        """The stores kept in host memory."""
        ...
