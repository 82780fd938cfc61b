"""What fp8dist knows about DeepSpeed before anything runs (torch-free), as fp8dist.engines.profile.EngineProfile:
where it keeps each number (the audit's expected rows, estimate's partitioning and offload), its translation, how
it loads and launches. The runtime side is engine.py."""
from __future__ import annotations

from typing import Any, Literal

from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.engines.profile import Store
from fp8dist.translate import EnginePlan
from fp8dist.translate.deepspeed import to_deepspeed


class DeepSpeedProfile:
    name = "deepspeed"
    launcher: Literal["torchrun", "deepspeed"] = "deepspeed"
    deepspeed_process_group = True
    efficient_loading: Literal["meta", "zero_init"] = "zero_init"
    moves_model_to_device = True
    uses_device_mesh = False  # ZeRO builds its own partition groups over the data-parallel ranks
    # An extra backward moves DeepSpeed's micro-step counter and gradient-accumulation boundary
    # (deepspeed/runtime/engine.py `backward` / `is_gradient_accumulation_boundary`) and fills ZeRO's reduce buckets.
    runs_probes = False

    def translate(self, spec: Spec) -> dict[str, Any]:
        return to_deepspeed(spec)

    def check_environment(self, spec: Spec, plan: EnginePlan) -> None:
        """What DeepSpeed itself would reject here (engine.py check_environment; imports DeepSpeed)."""
        from fp8dist.engines.deepspeed.engine import check_environment

        check_environment(spec, plan if isinstance(plan, dict) else self.translate(spec))

    def expected_stores(self, spec: Spec) -> dict[str, tuple[str, str]]:
        """The phases whose dtype depends on how DeepSpeed keeps the numbers: phase -> (dtype, why). DeepSpeed 0.19.8
        runtime/engine.py, runtime/zero/stage_1_and_2.py, stage3.py, runtime/bf16_optimizer.py."""
        p, ds = spec.precision, spec.deepspeed
        stage, section = ds.zero_stage, p.master_weights != "none" and p.mixed_precision != "none"
        module = p.mixed_precision if section else p.load_dtype
        prep = p.master_weights if section else ("fp32" if (stage >= 1 or section) else p.load_dtype)
        row = {
            "preparation": (prep, "DeepSpeed builds its master partitions in fp32 (bf16 with "
                            "bf16_master_weights_and_grads) whatever the loading dtype"),
            "weights": (module, "the bf16/fp16 section casts module weights; otherwise they stay as loaded"),
            "master_weights": (prep if (section or stage >= 1) else "n/a", "DeepSpeed optimizer partitions"),
            "weight_gradients": (ds.grad_accum_dtype or (p.mixed_precision if section else "fp32"),
                                 "data_types.grad_accum_dtype, else the model dtype from the precision flags"),
        }
        if stage in (1, 2) and ds.offload_optimizer != "none":
            row["weight_gradients"] = ("fp32", "ZeRO-Offload accumulates the reduced gradients in fp32 CPU partitions "
                                       "(stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu)")
        if spec.adapter.enabled:
            row["frozen_weights"] = (module, "the bf16/fp16 section casts the whole module, frozen weights too; "
                                     "the ZeRO optimizer partitions trainable parameters only")
        state = spec.optimizer_state_dtype
        if state in ("fp32", "bf16", "fp16") and p.master_weights == "none":
            # the ZeRO optimizer steps its partitions, in the dtype it built them (preparation)
            row["optimizer"] = (prep, "optimizer.state_dtype (auto: the dtype of the weights it steps)")
        return row

    def separate_master_bytes(self, spec: Spec) -> bool:
        """DeepSpeed's master partitions are a store of their own beside the module's weights."""
        return True

    def gathers_weights(self, spec: Spec) -> bool:
        """ZeRO-3 partitions the parameters and gathers them per module (deepspeed 0.19 runtime/zero/stage3.py)."""
        return spec.deepspeed.zero_stage >= 3

    def shard_counts(self, spec: Spec, dims: ParallelDims) -> dict[Store, int]:
        """Over how many ranks each store is divided by the ZeRO stage: the data-parallel ranks (world / tp: AutoTP's
        tensor-parallel groups sit outside ZeRO's data-parallel group, deepspeed 0.19.8 runtime/engine.py
        _init_tp_mesh_device). A Linear AutoTP splits is partitioned as its tp shard, so its stores are divided by
        tp on top: fp8dist/estimate/tensor_parallel.py. ZeRO-0 keeps everything whole (bf16 runs at stage 0 use
        the unpartitioned DDP bf16 optimizer, engine.py 0.19.8)."""
        stage, world = spec.deepspeed.zero_stage, dims.data_size
        return {"weights": world if stage >= 3 else 1, "master_weights": world if stage >= 1 else 1,
                "gradients": world if stage >= 2 else 1, "optimizer": world if stage >= 1 else 1}

    def offloaded(self, spec: Spec) -> set[Store]:
        """The stores in host memory: ZeRO-Offload keeps fp32 masters, their gradients and the states on the host;
        parameter offload (ZeRO-3) the weights."""
        ds, out = spec.deepspeed, set[Store]()
        if ds.offload_optimizer != "none":
            out |= {"master_weights", "optimizer"}
        if ds.offload_param != "none":
            out.add("weights")
        return out


PROFILE = DeepSpeedProfile()
