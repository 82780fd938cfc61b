"""DeepSpeed checkpoints through its own engine.save_checkpoint / load_checkpoint."""
from __future__ import annotations

from pathlib import Path

from fp8dist.engines.checkpoint import EngineCheckpointing, ModelReader, exported_bytes, model_key
from fp8dist.errors import Fp8distError


class Checkpointing(EngineCheckpointing):
    """Every rank writes its optimizer partition (the engine keeps its LR scheduler and loss scaler in them), under
    the tag `deepspeed`. ZeRO partitions are tied to the world size that wrote them (DeepSpeed refuses another one
    without its universal-checkpoint conversion), so this is not reshardable. Frozen parameters (an adapter run's
    base) are left out of the module file (`exclude_frozen_parameters`, DeepSpeed 0.19.8 runtime/engine.py
    save_checkpoint) and not required on load (`load_module_strict=False`): a resume reads them from the model
    directory again, as loading did."""

    engine = "deepspeed"
    reshardable = False
    TAG = "deepspeed"

    def __init__(self, run, model_name: str = "", scheduler=None):
        ds = run.model
        # the engine's own scheduler is in DeepSpeed's files already
        super().__init__(ds.module, model_name, None if scheduler is ds.lr_scheduler else scheduler)
        self.run, self.ds = run, ds

    def _frozen(self) -> bool:
        return any(not p.requires_grad for p in self.ds.module.parameters())

    def shape(self, param) -> list[int]:
        return list(getattr(param, "ds_shape", param.shape))  # ZeRO-3 parameters are empty outside forward

    def write(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=self.TAG, client_state={}, save_latest=False,
                                exclude_frozen_parameters=self._frozen())
        self.run.saved_checkpoint = True

    def read(self, directory: Path) -> None:
        if self.ds.zero_optimization_stage() == 3 and self.run.saved_checkpoint:
            # deepspeed 0.19 runtime/engine.py load_checkpoint docstring: under ZeRO-3 an engine cannot load
            # right after it saved
            raise Fp8distError("DeepSpeed ZeRO-3 cannot load a checkpoint into an engine that has saved one"
                               "\n  fix: build a new engine with fp8dist.engines.deepspeed.initialize, then resume")
        path, _ = self.ds.load_checkpoint(str(directory), tag=self.TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=not self._frozen())
        if path is None:
            raise Fp8distError(f"{directory}: DeepSpeed found no checkpoint under tag {self.TAG!r}"
                               f"\n  fix: delete {directory} to resume from the checkpoint before it")


class Reader(ModelReader):
    """Model tensors of a DeepSpeed checkpoint: the fp32 masters that DeepSpeed's zero_to_fp32 assembles from
    the ZeRO partitions (deepspeed 0.19 utils/zero_to_fp32.py get_fp32_state_dict_from_zero_checkpoint,
    lazily), or without ZeRO the module weights of mp_rank_00_model_states.pt."""

    def __init__(self, path: Path, manifest: dict):
        import torch

        super().__init__(path, manifest)
        tag = Checkpointing.TAG
        # one file without ZeRO-3, one per rank with it (runtime/engine.py _get_ckpt_name)
        first = next(iter(sorted((path / tag).glob("*mp_rank_00_model_states.pt"))))
        states = torch.load(first, map_location="cpu", weights_only=False)
        if any(path.joinpath(tag).glob("*zero_pp_rank_*_optim_states.pt")) and states.get("ds_config", {}).get(
                "zero_optimization", {}).get("stage", 0) > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            self.state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag, lazy_mode=True)
        else:  # ZeRO-0: the fp32 masters sit inside DeepSpeed's optimizer state; the module holds the weights
            self.state = states["module"]
            self.stored = {v.dtype for v in self.state.values() if v.is_floating_point()}

    def sizes(self, dtype) -> dict[str, int]:
        return {key: exported_bytes(value.shape, getattr(value, "dtype", None), dtype)
                for key, value in self.state.items()}

    def read(self, keys: list[str]):
        for key in keys:
            yield model_key(key), self.state[key].contiguous()  # a lazy GatheredTensor assembles itself here
