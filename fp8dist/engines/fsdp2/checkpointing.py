"""FSDP2 checkpoints through torch.distributed.checkpoint."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fp8dist.engines.checkpoint import EngineCheckpointing, ModelReader, exported_bytes, model_key


class Checkpointing(EngineCheckpointing):
    """Every rank writes its own shards of the model and optimizer state (get_state_dict / set_state_dict), and any
    number of ranks can read them back (DCP reshards). torchao's float8 weight wrappers are pickled by DCP and
    loadable because torchao registers them as safe globals (torchao 0.18 float8/fsdp_utils.py; torchtitan#651
    before it did). After a load the float8 scales precomputed for the all-gather are recomputed from the loaded
    weights, as after an optimizer step, so the next forward is the one the uninterrupted run would have made.
    Frozen parameters (an adapter run's base) are left out (`ignore_frozen_params`, torch 2.13
    distributed/checkpoint/state_dict.py): a resume reads them from the model directory again, as loading did, and
    loads the rest non-strictly so that their absence is no error."""

    engine = "fsdp2"
    reshardable = True

    def __init__(self, run, model_name: str = "", scheduler=None):
        super().__init__(run.model, model_name, scheduler)
        self.run = run

    def _options(self) -> StateDictOptions:
        """A pipeline run's optimizer state is flattened to one key per parameter (`flatten_optimizer_state_dict`,
        torch 2.13 distributed/checkpoint/state_dict.py, as torchtitan saves its model parts): its param groups
        differ per stage, and DCP keeps one copy of a non-tensor entry such as `param_groups`."""
        frozen = any(not p.requires_grad for p in self.run.model.parameters())
        return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen,
                                flatten_optimizer_state_dict=self.run.pipeline is not None)

    def _state(self) -> dict:
        model_state, optim_state = get_state_dict(self.run.model, self.run.optimizer, options=self._options())
        return {"model": model_state, "optimizer": optim_state}

    def write(self, directory: Path) -> None:
        dcp.save(self._state(), checkpoint_id=directory / "dcp")

    def read(self, directory: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=directory / "dcp")
        set_state_dict(self.run.model, self.run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=self._options())
        self.run.backend.after_optimizer_step(self.run.model)

    def rank_state(self) -> dict:
        scaler = self.run.scaler.state_dict() if self.run.scaler is not None else None
        return {**super().rank_state(), "loss_scaler": scaler}

    def load_rank_state(self, state: dict) -> None:
        super().load_rank_state(state)
        if self.run.scaler is not None and state.get("loss_scaler") is not None:
            self.run.scaler.load_state_dict(state["loss_scaler"])


class Reader(ModelReader):
    """Model tensors of an FSDP2 checkpoint, read with torch.distributed.checkpoint without a process group
    (each group of keys is loaded into full-size plain tensors; DCP assembles the ranks' shards)."""

    def __init__(self, path: Path, manifest: dict):
        super().__init__(path, manifest)
        if manifest["config"]["precision"]["fp8"]["backend"] == "torchao":
            import torchao.float8  # noqa: F401  registers its float8 wrapper as a safe global for torch.load
        self.directory = path / "dcp"
        metadata = dcp.FileSystemReader(str(self.directory)).read_metadata().state_dict_metadata
        self.tensors = {key[len("model."):]: meta for key, meta in metadata.items()
                        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def sizes(self, dtype) -> dict[str, int]:
        return {key: exported_bytes(meta.size, meta.properties.dtype, dtype) for key, meta in self.tensors.items()
                if model_key(key)}

    def read(self, keys: list[str]):
        state = {key: torch.empty(tuple(self.tensors[key].size), dtype=self.tensors[key].properties.dtype)
                 for key in keys}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(self.directory), no_dist=True)
        for key in keys:
            yield model_key(key), state.pop(key)
