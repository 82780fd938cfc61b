"""torchrun --nproc_per_node 2 checkpoint_roundtrip.py CONFIG DIR: train, save, wipe, load, compare, train on."""
import sys

import torch
import torch.distributed as dist

from fp8dist import load_config
from fp8dist.engines.checkpoint import load, save
from fp8dist.engines.fsdp2 import prepare, train_step
from fp8dist.models import load_model


def snapshot(model):
    return {n: p.detach().full_tensor().float().clone() for n, p in model.named_parameters()}


def main(config, directory):
    dist.init_process_group("gloo")
    spec = load_config(config)
    loaded = load_model("tiny-llama", spec.precision.load_dtype)
    run = prepare(loaded.model, spec)
    batch = lambda i: [loaded.make_batch(2, 32, seed=i + 10 * dist.get_rank())]
    for i in range(3):
        train_step(run, batch(i), 1.0)
    save(run, directory)
    before = snapshot(run.model)
    with torch.no_grad():
        for p in run.model.parameters():
            p.zero_()
    assert all(v.abs().sum() == 0 for v in snapshot(run.model).values())
    load(run, directory)
    after = snapshot(run.model)
    same = all(torch.equal(before[n], after[n]) for n in before)
    kinds = sorted({type(p.to_local()).__name__ for p in run.model.parameters()})
    loss = train_step(run, batch(3), 1.0)
    if dist.get_rank() == 0:
        print(f"restored_identical={same} loss_after={loss:.4f} local_kinds={','.join(kinds)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
