"""One rank of a dp_shard x tp mesh, measured: the FSDP2 engine prepares a built-in model on rank 0 of torch's fake
process group (torch.testing._internal.distributed.fake_pg: one process holds rank 0 of WORLD ranks, collectives
return without communicating, and every shard has the shape a real rank's has), then the bytes rank 0 holds are
read from its tensors: parameters, gradients after one backward, optimizer states after one step, and the
activations one forward keeps for backward. Prints them as JSON, beside `fp8dist estimate`'s figures.

    python tests/unit/estimate/one_rank_of_a_mesh.py MODEL CONFIG WORLD KEY=VALUE...
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines.fsdp2.engine import prepare
from fp8dist.engines.mesh import build_meshes
from fp8dist.estimate.memory import estimate
from fp8dist.runtime.models import load_model
from tests.unit.estimate.saved_bytes import kept_for_backward


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def main(name: str, config: str, world: int, overrides: list[str]) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    spec = load_config(config, overrides=overrides)
    run = prepare(load_model(name, spec.precision.load_dtype).model, spec,
                  build_meshes(ParallelDims.of(spec, world)), audit="off")
    t = spec.train
    ids = torch.randint(0, run.model.config.vocab_size, (t.micro_batch_size, t.seq_len))
    batch = {"input_ids": ids, "labels": ids}
    activations = kept_for_backward(run.model, batch)
    run.accumulate([batch])
    params = list(run.model.parameters())
    gradients = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    run.apply_gradients()
    states = [v for state in run.optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]  # Adam's step counters are scalars
    measured = {"weights": sum(local_bytes(p) for p in params), "gradients": gradients,
                "optimizer": sum(local_bytes(v) for v in states), "activations": activations}
    result = estimate(name, spec, world)
    estimated = {store: result.per_rank_bytes[store] for store in ("weights", "gradients", "optimizer")}
    estimated["activations"] = result.activations_bytes.none
    print(json.dumps({"measured": measured, "estimated": estimated}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
