"""What fp8dist knows about FSDP2 before anything runs (torch-free), as fp8dist.engines.profile.EngineProfile: where it
keeps each number (the audit's expected rows, estimate's sharding and offload), its translation, how it loads and
launches. The runtime side is engine.py."""
from __future__ import annotations

from typing import Literal

from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.engines.profile import Store
from fp8dist.translate import EnginePlan
from fp8dist.translate.fsdp2 import FSDP2Plan, to_fsdp2


class FSDP2Profile:
    name = "fsdp2"
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    deepspeed_process_group = False
    efficient_loading: Literal["meta", "zero_init"] = "meta"
    moves_model_to_device = False
    uses_device_mesh = True
    runs_probes = True

    def translate(self, spec: Spec) -> FSDP2Plan:
        return to_fsdp2(spec)

    def check_environment(self, spec: Spec, plan: EnginePlan) -> None:
        """Context parallel needs an attention kernel torch's context_parallel can shard: it maps only the CUDA
        flash / memory-efficient / cuDNN SDPA ops (torch 2.13 torch/distributed/tensor/experimental/
        _context_parallel/_attention.py _sdpa_handler); on CPU, SDPA's flash_attention_for_cpu has no sharding
        strategy, and attention computed over each rank's slice alone would be silently wrong."""
        from fp8dist.errors import UnsupportedEnvironment
        from fp8dist.machine import device_info

        if spec.parallel.context_size > 1 and not device_info()["cuda_available"]:
            raise UnsupportedEnvironment(
                f"parallel.context_size={spec.parallel.context_size}: context parallel shards attention through "
                "torch's CUDA SDPA kernels (flash / memory-efficient / cuDNN); this machine has no CUDA device, and "
                "aten._scaled_dot_product_flash_attention_for_cpu has no sharding rule",
                "run on GPUs, or set parallel.context_size=1 (parallel.tensor_size with sequence parallel splits "
                "activations along the sequence on any device)")

    def expected_stores(self, spec: Spec) -> dict[str, tuple[str, str]]:
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
        if spec.parallel.sharding == "replicate" or spec.parallel.shard_size == 1:
            row["weight_all_gather"] = ("none", "shard size 1 (parallel.sharding): nothing is sharded, nothing "
                                        "gathered")
        if spec.adapter.enabled and spec.adapter.base_dtype == "nf4":
            row["frozen_weights"] = ("+".join(sorted((p.load_dtype, "nf4"))), "adapter.base_dtype=nf4: the frozen "
                                     "Linears in NF4 (torchao's NF4Tensor codes and scales), the rest (embeddings, "
                                     "norms, biases, the output layer, MoE experts) in the load dtype")
        elif spec.adapter.enabled:
            row["frozen_weights"] = (p.load_dtype, "frozen base weights are not upcast: only trainable parameters get "
                                     "the master dtype (torchao float8 keeps their storage, casting on the fly)")
        return row

    def separate_master_bytes(self, spec: Spec) -> bool:
        """FSDP2's sharded weights are the master copy: no separate store beside them."""
        return False

    def gathers_weights(self, spec: Spec) -> bool:
        return True

    def shard_counts(self, spec: Spec, dims: ParallelDims) -> dict[Store, int]:
        """Every store is divided over the shard dim (the data-parallel ranks, a hybrid group, or 1 for replicate)
        with cp folded in: FSDP2 shards over dp_shard x cp (ParallelDims.fsdp_size; torchtitan
        parallel_dims.py "fsdp = dp_shard * cp"). A parameter tensor parallel splits is sharded as its tp shard
        (torchao 0.18 torchao/float8/fsdp_utils.py: "apply TP first then FSDP2"), so its stores are divided by tp
        on top: fp8dist/estimate/tensor_parallel.py."""
        shard = dims.dp_shard * dims.cp
        return {"weights": shard, "master_weights": shard, "gradients": shard, "optimizer": shard}

    def offloaded(self, spec: Spec) -> set[Store]:
        """CPUOffloadPolicy moves parameters, gradients and the optimizer step together."""
        return {"weights", "gradients", "optimizer"} if spec.parallel.offload == "params" else set()


PROFILE = FSDP2Profile()
