"""Distributed checkpoints of FSDP2 runs (torch.distributed.checkpoint), float8 models included.

Model and optimizer state go through torch.distributed.checkpoint.state_dict's get/set_state_dict,
so each rank writes its own shards. torchao registers its float8 tensor subclasses as safe globals
(torchtitan#651 was the failure before it did).
"""
from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(run, directory: str) -> None:
    model_state, optim_state = get_state_dict(run.model, run.optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)


def load(run, directory: str) -> None:
    model_state, optim_state = get_state_dict(run.model, run.optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
