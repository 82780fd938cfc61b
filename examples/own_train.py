"""Your own training script with fp8dist: your loop and your data; fp8dist's arguments, loader, engine setup,
step-1 audit and checkpoints. The engine comes from the config.

    torchrun --nproc_per_node 2 examples/own_train.py --fp8dist-config configs/fsdp2-bf16.yaml
    deepspeed --num_gpus 2 examples/own_train.py --fp8dist-config configs/deepspeed-bf16-zero2.yaml
    ... --checkpoint-dir ckpt --steps 4            # saves at the end; run again with --resume --steps 8

On a machine without CUDA the ranks run on the CPU (gloo). What fp8dist does here, in order:
`fp8dist.add_config_arguments` / `spec_from_args` (--fp8dist-config, --fp8dist-set KEY=VALUE);
`fp8dist.load_model` (RAM-efficient where the config says parallel.cpu_ram_efficient_loading: FSDP2 reads each
rank's shards after sharding, DeepSpeed builds under zero.Init); the engine setup
(`fp8dist.engines.fsdp2.prepare` / `fp8dist.engines.deepspeed.initialize`: FP8 conversion, activation
checkpointing, sharding, the optimizer); `fp8dist.audit.watch` around the first step; and
`fp8dist.engines.checkpoint.save` / `resume`. Everything else is this script's.
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

import fp8dist
from fp8dist.audit import watch
from fp8dist.engines import checkpoint, deepspeed as fp8dist_deepspeed, fsdp2 as fp8dist_fsdp2
from fp8dist.runtime.process_group import leave


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="built-in name, local HF directory or module:factory")
    parser.add_argument("--steps", type=int, default=4, help="the step the run ends at")
    parser.add_argument("--checkpoint-dir", help="save here at the end")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    fp8dist.add_config_arguments(parser)
    return parser.parse_args()


def my_batches(vocab_size: int, micro_batch: int, seq_len: int, rank: int):
    """Your data: here, random token sequences, a different stream per rank."""
    generator = torch.Generator().manual_seed(1234 + rank)
    while True:
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator)
        yield {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    args = parse_args()
    spec = fp8dist.spec_from_args(args)
    cuda = torch.cuda.is_available()
    if spec.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed()
    else:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()

    loaded = fp8dist.load_model(args.model, spec)
    if spec.engine == "deepspeed":
        engine, optimizer, _, _ = fp8dist_deepspeed.initialize(loaded.model, spec, audit="off")
        model, target, device = engine, engine, engine.device

        def backward_and_step(loss):
            engine.backward(loss)
            engine.step()
    else:
        if cuda and loaded.materialize is None:
            loaded.model.to("cuda")
        run = fp8dist_fsdp2.prepare(loaded.model, spec, materialize=loaded.materialize, audit="off")
        model, optimizer, target, device = run.model, run.optimizer, run, "cuda" if cuda else "cpu"

        def backward_and_step(loss):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.gradient_clipping)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    if args.checkpoint_dir:  # a directory holding another run's checkpoints: refused now, not after training
        checkpoint.check_run_directory(args.checkpoint_dir, args.resume)
    start = 0
    if args.resume:
        resumed = checkpoint.resume(target, args.checkpoint_dir, model_name=args.model)
        start = resumed.step if resumed else 0
        if rank == 0:
            print(f"resumed at step {start}" if resumed else "nothing to resume: step 0", flush=True)
    data = my_batches(loaded.model.config.vocab_size if hasattr(loaded.model, "config") else 256,
                      spec.train.micro_batch_size, spec.train.seq_len, rank)
    for step in range(start, args.steps):
        batch = {k: v.to(device) for k, v in next(data).items()}
        # The audit of the first step of this process: the dtypes it really ran in, against the config.
        with watch(model, optimizer, spec) if step == start else contextlib.nullcontext() as audit:
            loss = model(**batch).loss
            backward_and_step(loss)
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}" + (f" audit {'PASS' if audit.passed else 'FAIL'}"
                                                               if audit is not None else ""), flush=True)
    if args.checkpoint_dir:
        saved = checkpoint.save(target, args.checkpoint_dir, args.steps, spec=spec, model_name=args.model)
        if rank == 0:
            print(f"saved {saved}", flush=True)


if __name__ == "__main__":
    # Leave through fp8dist's clean exit: every rank tears the process group down together, then the process ends
    # without interpreter finalisation, where gloo's threads can abort it ("terminate called without an active
    # exception", pytorch #179291) after the work is done and saved.
    main()
    leave(0)
