"""torchrun --nproc_per_node 2 checkpoint_roundtrip.py CONFIG DIR [MODEL]: the library's save / resume with an LR
scheduler. Two steps, save, two more (the reference); then a fresh model, optimizer and scheduler resume from
the checkpoint and take the same two steps: weights, scheduler and losses must be identical."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fp8dist import load_config
from fp8dist.runtime.data import batches_for
import fp8dist.engines.checkpoint as checkpoint
from fp8dist.engines.fsdp2 import prepare, train_step
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime import process_group
from fp8dist.runtime.process_group import leave


def build(spec, model):
    loaded = load_for_run(model, spec)  # adapter runs: the base built again, the adapters added
    run = prepare(loaded.model, spec, audit="off")
    scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 1.0 / (1 + step))
    return loaded, run, scheduler


def steps(spec, loaded, run, scheduler, first, last):
    out = []
    for index in range(first, last):
        out.append(train_step(run, batches_for(loaded.make_batch, spec, index, dist.get_rank()), 1.0))
        scheduler.step()
    return out


def main(config, directory, model="tiny-llama"):
    process_group.init()
    spec = load_config(config)
    loaded, run, scheduler = build(spec, model)
    steps(spec, loaded, run, scheduler, 0, 2)
    checkpoint.save(run, directory, 2, spec=spec, scheduler=scheduler, model_name=model)
    with torch.no_grad():  # the saved model's logits on a fixed batch, for the export tests to compare with
        logits = run.model(**loaded.make_batch(2, 16, 123)).logits.float()
    if dist.get_rank() == 0:
        torch.save(logits, Path(directory) / "logits-step2.pt")
    reference = steps(spec, loaded, run, scheduler, 2, 4)
    expected = {n: p.detach().full_tensor().float().clone() for n, p in run.model.named_parameters()}

    loaded, run, scheduler = build(spec, model)
    resumed = checkpoint.resume(run, directory, scheduler=scheduler)
    kinds = sorted({type(p.to_local()).__name__ for p in run.model.parameters()})
    size = sum(f.stat().st_size for f in (Path(directory) / checkpoint.step_name(2)).rglob("*") if f.is_file())
    again = steps(spec, loaded, run, scheduler, resumed.step, 4)
    same = all(torch.equal(expected[n], p.detach().full_tensor().float()) for n, p in run.model.named_parameters())
    if dist.get_rank() == 0:
        print(f"resumed_step={resumed.step} weights_identical={same} losses_identical={reference == again} "
              f"lr={scheduler.get_last_lr()[0]:.6g} local_kinds={','.join(kinds)} checkpoint_bytes={size}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave(0)
