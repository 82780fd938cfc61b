"""A small real training run whose precision comes from an fp8dist config.

    deepspeed --num_gpus 2 launch/train.py --fp8dist-config configs/deepspeed-bf16-zero2.yaml
    torchrun --nproc_per_node 2 launch/train.py --fp8dist-config configs/fsdp2-bf16.yaml

The engine comes from the config (`engine: deepspeed | fsdp2`). Data is synthetic token batches; the
model is the built-in tiny-llama unless --model names another (see fp8dist.models). On a machine
without CUDA the ranks run on CPU with gloo. Prints the loss of every step on rank 0 and, last,
`final_loss=<x> first_loss=<y>`. Step 1 runs under the dtype audit (fp8dist.audit.watch): its table is
printed once on rank 0; `audit.first_step` in the config says what a mismatch does (warn | raise | off).
"""
from __future__ import annotations

import argparse
import os
import sys

import fp8dist
from fp8dist.data import batches_for
from fp8dist.errors import Fp8distError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="built-in name, local HF directory or module:factory")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="FSDP2: save a distributed checkpoint here at the end (torch.distributed.checkpoint)")
    fp8dist.add_config_arguments(parser)
    return parser.parse_args(argv)


def init_distributed(engine: str) -> None:
    """One process group per job: DeepSpeed's init (gloo on its CPU accelerator) or torch's (nccl/gloo)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed()
        return
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def run_deepspeed(spec, loaded, steps, on_step, checkpoint_dir):
    from fp8dist.engines.deepspeed import initialize, train_step

    engine, _, _, _ = initialize(loaded.model, spec)
    for step in range(steps):
        skipped_before = engine.skipped_steps
        loss = train_step(engine, batches_for(loaded.make_batch, spec, step, engine.global_rank))
        note = "skipped by DeepSpeed (overflow)" if engine.skipped_steps > skipped_before else None
        on_step(step, loss, note)


def run_fsdp2(spec, loaded, steps, on_step, checkpoint_dir):
    import torch
    import torch.distributed as dist

    from fp8dist.engines.fsdp2 import prepare, train_step

    cuda = torch.cuda.is_available()
    if cuda and loaded.materialize is None:  # a meta-built model is allocated on the device by prepare
        loaded.model.to("cuda")
    run = prepare(loaded.model, spec, materialize=loaded.materialize)
    for step in range(steps):
        batches = batches_for(loaded.make_batch, spec, step, dist.get_rank())
        if cuda:
            batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        loss = train_step(run, batches, spec.train.gradient_clipping)
        outcome = run.last_step
        note = (f"skipped on every rank (non-finite gradients; loss scale {outcome.scale_before:g} -> "
                f"{outcome.scale_after:g})") if outcome is not None and outcome.skipped else None
        on_step(step, loss, note)
    if checkpoint_dir:
        from fp8dist.engines.checkpoint import save

        save(run, checkpoint_dir)


def train(spec, loaded, steps, on_step, checkpoint_dir=None) -> None:
    """Run `steps` optimizer steps of `loaded` under `spec` (the process group is already initialised)."""
    runner = run_deepspeed if spec.engine == "deepspeed" else run_fsdp2
    runner(spec, loaded, steps, on_step, checkpoint_dir)


def shutdown():
    """Leave together: a rank that tears gloo down while its peer still talks aborts the job."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    losses: list[float] = []

    def on_step(step, loss, note=None):
        losses.append(loss)
        if rank == 0:
            print(f"step {step + 1} loss {loss:.4f}", flush=True)
            if note:
                print(f"step {step + 1} {note}", flush=True)

    try:
        spec = fp8dist.spec_from_args(args)
        from fp8dist.config.vocabulary import check_world_size
        from fp8dist.engines.advice import advise
        from fp8dist.engines.loading import check_efficient_loading, load_for_run
        from fp8dist.engines.preflight import preflight

        preflight(spec)
        if args.checkpoint_dir and spec.engine == "deepspeed":
            raise Fp8distError("--checkpoint-dir is for engine=fsdp2; use engine.save_checkpoint with DeepSpeed")

        check_efficient_loading(args.model, spec)
        init_distributed(spec.engine)
        import torch.distributed as dist

        check_world_size(spec, dist.get_world_size())  # before any weight is loaded
        advise(spec, dist.get_world_size())
        loaded = load_for_run(args.model, spec)
        train(spec, loaded, args.steps or spec.train.steps, on_step, args.checkpoint_dir)
        shutdown()
    except Fp8distError as exc:  # bad input or environment: 2; the first-step audit with audit.first_step=raise: 1
        print(f"train.py: {exc}", file=sys.stderr)
        return exc.exit_code
    if rank == 0:
        print(f"final_loss={losses[-1]:.6f} first_loss={losses[0]:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalisation: gloo's worker threads can still hold tensors then, and tearing
    # them down aborted a rank that had finished its work ("terminate called without an active exception",
    # SIGABRT; seen once in this suite, described in pytorch/pytorch PR #179291). Output is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
