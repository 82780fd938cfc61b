"""What the mesh rank scripts (tests/distributed/scripts/tensor_parallel_runs.py, expert_parallel_runs.py,
pipeline_runs.py) share: the
bytes a rank holds of sharded tensors, and a checkpoint round trip on the mesh (save, resume bitwise, export)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable


def local_bytes(tensors) -> int:
    """What this rank holds of these tensors (a DTensor's local shard)."""
    held = 0
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        held += local.numel() * local.element_size()
    return held


def checkpoint_round_trip(spec, model_name: str, shapes_of: Callable[[str], bool]) -> dict:
    """Train 4 steps saving at steps 2 and 4; a fresh run resumes from a copy of step 2 and steps 3 and 4 (its losses
    and weights must equal the first run's bitwise); step 4 is exported as a plain Hugging Face model, read back by
    transformers on rank 0: whether its names and tensors are the gathered weights of every rank (a pipeline rank
    holds its stages' only), and the shapes of the names `shapes_of` picks."""
    import torch
    import torch.distributed as dist

    from fp8dist.runtime import loop
    from fp8dist.runtime.loading import load_for_run

    shared = [tempfile.mkdtemp(prefix="fp8dist-mesh-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    first, second = Path(shared[0]) / "first", Path(shared[0]) / "second"
    quiet = lambda *_: None  # noqa: E731 - the loop's progress lines are not the test's business
    lost: list[float] = []
    session = loop.start(spec, load_for_run(model_name, spec))
    loop.train(session, loop.TrainOptions(steps=4, checkpoint_dir=str(first), save_every=2, model_name=model_name),
               on_step=lambda index, loss, note: lost.append(loss), say=quiet)
    mine = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in session.engine.model.named_parameters()}
    if dist.get_rank() == 0:
        second.mkdir()
        shutil.copytree(first / "step-00000002", second / "step-00000002")
    dist.barrier()
    resumed: list[float] = []
    session = loop.start(spec, load_for_run(model_name, spec))
    loop.train(session, loop.TrainOptions(steps=4, checkpoint_dir=str(second), resume=True, model_name=model_name),
               on_step=lambda index, loss, note: resumed.append(loss), say=quiet)
    again = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p)
             for name, p in session.engine.model.named_parameters()}
    same = torch.tensor(float(all(torch.equal(mine[name], again[name]) for name in mine)))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: tensor.to(torch.bfloat16) for name, tensor in mine.items()})
    out: dict = {"losses": lost, "resumed": resumed, "weights_bitwise": bool(same.item()),
                 "names_by_rank": [sorted(names) for names in everyone]}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        whole = {name: tensor for names in everyone for name, tensor in names.items()}
        exported = Path(shared[0]) / "export"
        loop.export(first / "step-00000004", False, str(exported), say=quiet)
        model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
        read = dict(model.named_parameters())
        out["exported"] = {"names_match": sorted(read) == sorted(whole),
                           "equal": all(torch.equal(read[name].detach(), whole[name])
                                        for name in whole if name in read),
                           "shapes": {name: list(t.shape) for name, t in read.items() if shapes_of(name)}}
        shutil.rmtree(shared[0], ignore_errors=True)
    return out
