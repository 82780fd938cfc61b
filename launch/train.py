"""A small real training run whose precision comes from an fp8dist config.

    deepspeed --num_gpus 2 launch/train.py --fp8dist-config configs/deepspeed-bf16-zero2.yaml
    torchrun --nproc_per_node 2 launch/train.py --fp8dist-config configs/fsdp2-bf16.yaml

The engine comes from the config (`engine: deepspeed | fsdp2`). Data is synthetic token batches; the
model is the built-in tiny-llama unless --model names another (see fp8dist.models). On a machine
without CUDA the ranks run on CPU with gloo. Prints the loss of every step on rank 0 and, last,
`final_loss=<x> first_loss=<y>`. Step 1 runs under the dtype audit (fp8dist.audit.watch): its table is
printed once on rank 0; `audit.first_step` in the config says what a mismatch does (warn | raise | off).

Checkpoints (fp8dist.engines.checkpoint): `--checkpoint-dir DIR` saves at the end, `--save-every N` also every
N steps, `--resume` continues from the newest complete checkpoint in DIR, and `--export-hf OUT` writes the
final model in Hugging Face format. `--steps` is the step the run ends at: `--steps 4 --resume` after a
checkpoint at step 2 runs steps 3 and 4.

Exit codes: 0 done; 1 the first-step audit failed under audit.first_step=raise; 2 bad input or environment
(the message says which and the fix); 3 another rank died or stopped answering within
train.process_group_timeout_s (the message says when; `--resume` continues from the last checkpoint).
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
    parser.add_argument("--steps", type=int, default=None,
                        help="the step the run ends at (default train.steps); with --resume, counted from step 0")
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                        help="write checkpoints to DIR/step-NNNNNNNN (at the end, and every --save-every steps)")
    parser.add_argument("--save-every", metavar="N", type=int, default=None,
                        help="with --checkpoint-dir: also save after every N optimizer steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir (from step 0 if none)")
    parser.add_argument("--export-hf", metavar="DIR", default=None,
                        help="at the end, write the model to DIR in Hugging Face format (config.json + "
                             "safetensors, in the load dtype)")
    fp8dist.add_config_arguments(parser)
    return parser.parse_args(argv)


def check_args(args) -> None:
    if args.save_every is not None and args.save_every < 1:
        raise Fp8distError(f"--save-every {args.save_every}: must be at least 1")
    if (args.save_every is not None or args.resume) and not args.checkpoint_dir:
        flag = "--resume" if args.resume else "--save-every"
        raise Fp8distError(f"{flag} needs --checkpoint-dir DIR (where the checkpoints are)")
    if args.steps is not None and args.steps < 1:
        raise Fp8distError(f"--steps {args.steps}: must be at least 1")


def init_distributed(spec) -> None:
    """One process group per job: DeepSpeed's init (gloo on its CPU accelerator) or torch's (nccl/gloo), with
    `train.process_group_timeout_s` as the bound of every collective."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=spec.train.process_group_timeout_s)
    if spec.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(timeout=timeout)
        return
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def deepspeed_session(spec, loaded):
    """The engine, and one optimizer step of it: step index -> (loss, note)."""
    from fp8dist.engines.deepspeed import initialize, train_step

    engine, _, _, _ = initialize(loaded.model, spec)

    def step(index):
        skipped_before = engine.skipped_steps
        loss = train_step(engine, batches_for(loaded.make_batch, spec, index, engine.global_rank))
        return loss, "skipped by DeepSpeed (overflow)" if engine.skipped_steps > skipped_before else None

    return engine, step


def fsdp2_session(spec, loaded):
    import torch
    import torch.distributed as dist

    from fp8dist.engines.fsdp2 import prepare, train_step

    cuda = torch.cuda.is_available()
    if cuda and loaded.materialize is None:  # a meta-built model is allocated on the device by prepare
        loaded.model.to("cuda")
    run = prepare(loaded.model, spec, materialize=loaded.materialize)

    def step(index):
        batches = batches_for(loaded.make_batch, spec, index, dist.get_rank())
        if cuda:
            batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        loss = train_step(run, batches, spec.train.gradient_clipping)
        outcome = run.last_step
        note = (f"skipped on every rank (non-finite gradients; loss scale {outcome.scale_before:g} -> "
                f"{outcome.scale_after:g})") if outcome is not None and outcome.skipped else None
        return loss, note

    return run, step


def train(spec, loaded, args, on_step, say):
    """Run to step `--steps` of `loaded` under `spec` (the process group is already initialised): resume,
    train, checkpoint. With --export-hf, returns (checkpoint to export from, whether it is a scratch one)."""
    from fp8dist.engines import checkpoint

    target, step = (deepspeed_session if spec.engine == "deepspeed" else fsdp2_session)(spec, loaded)
    if args.export_hf and checkpoint.checkpointing_for(target).hf_config() is None:  # said before training
        raise Fp8distError(f"--export-hf: the model {args.model} is not a Hugging Face model (no `config` with "
                           "to_json_file), so there is no config.json to export\n  fix: drop --export-hf and keep "
                           "--checkpoint-dir, or train a transformers model")
    steps, start, latest = args.steps or spec.train.steps, 0, None  # latest: this run's newest checkpoint
    if args.checkpoint_dir:
        checkpoint.check_run_directory(args.checkpoint_dir, args.resume)
    if args.resume:
        resumed = checkpoint.resume(target, args.checkpoint_dir, model_name=args.model)
        if resumed is None:
            say(f"no complete checkpoint in {args.checkpoint_dir}: starting from step 0")
        else:
            start, latest = resumed.step, (resumed.step, resumed.path)
            say(f"resumed from {resumed.path} (step {resumed.step})")
            for note in resumed.notes:
                say(f"note: {note}")
            if start >= steps:
                say(f"the checkpoint is at step {start}, --steps is {steps}: no step to run")
    for index in range(start, steps):
        loss, note = step(index)
        on_step(index, loss, note)
        done = index + 1
        if args.checkpoint_dir and ((args.save_every and done % args.save_every == 0) or done == steps):
            latest = (done, checkpoint.save(target, args.checkpoint_dir, done, spec=spec, model_name=args.model))
            say(f"saved {latest[1]}")
    if args.export_hf:
        return checkpoint_for_export(target, spec, args, latest, max(steps, start))
    return None


def checkpoint_for_export(target, spec, args, latest, step):
    """The checkpoint the export is made from, and whether it is a scratch one to delete afterwards: the final
    checkpoint of the run, or one written beside the export when the run keeps none. Exporting from a
    checkpoint makes the same files here as `fp8dist export` makes later."""
    import tempfile

    import torch.distributed as dist

    from fp8dist.engines import checkpoint

    if latest is not None and latest[0] == step:
        return latest[1], False
    parent = os.path.dirname(os.path.abspath(args.export_hf))
    if dist.get_rank() == 0:
        os.makedirs(parent, exist_ok=True)
    scratch = [tempfile.mkdtemp(prefix=".fp8dist-export-", dir=parent) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scratch, src=0)
    return checkpoint.save(target, scratch[0], step, spec=spec, model_name=args.model), True


def export(source, scratch, destination, say) -> None:
    """Rank 0, after the process group is gone (an export of a large model must not hold the others in a
    collective that times out)."""
    import shutil

    from fp8dist.export import export_hf

    try:
        exported = export_hf(source, destination)
        say(f"exported {exported.directory} ({exported.dtype}, {exported.tensors} tensors, {exported.bytes} bytes)")
    finally:
        if scratch:
            shutil.rmtree(source.parent, ignore_errors=True)


def shutdown():
    """Leave together: a rank that tears gloo down while its peer still talks aborts the job."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank died or stopped answering (gloo raises a plain RuntimeError
    naming its transport; NCCL and the store raise torch.distributed.DistError)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "gloo", "Timed out")))


EXIT_LOST_PEER = 3


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    losses: list[float] = []
    progress = {"step": 0, "phase": "starting"}

    def say(line):
        if rank == 0:
            print(line, flush=True)

    def on_step(step, loss, note=None):
        losses.append(loss)
        progress["step"] = step + 1
        say(f"step {step + 1} loss {loss:.4f}")
        if note:
            say(f"step {step + 1} {note}")

    spec = None
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        check_args(args)
        spec = fp8dist.spec_from_args(args)
        from fp8dist.config.vocabulary import check_world_size
        from fp8dist.engines.advice import advise
        from fp8dist.engines.loading import check_efficient_loading, load_for_run
        from fp8dist.engines.preflight import preflight

        preflight(spec)
        if args.export_hf:
            from fp8dist.export import check_destination

            check_destination(args.export_hf)
        check_efficient_loading(args.model, spec)
        init_distributed(spec)
        import torch.distributed as dist

        check_world_size(spec, dist.get_world_size())  # before any weight is loaded
        advise(spec, dist.get_world_size())
        loaded = load_for_run(args.model, spec)
        progress["phase"] = "training"
        to_export = train(spec, loaded, args, on_step, say)
        shutdown()
        if to_export and rank == 0:
            export(*to_export, args.export_hf, say)
    except Fp8distError as exc:  # bad input or environment: 2; the first-step audit with audit.first_step=raise: 1
        print(f"train.py: {exc}", file=sys.stderr)
        return exc.exit_code
    except CheckpointException as exc:  # torch.distributed.checkpoint gathers every rank's failure (a BaseException)
        from fp8dist.engines.checkpoint import failure_text

        print(f"train.py: a checkpoint in {args.checkpoint_dir} could not be written or read: {failure_text(exc)}"
              "\n  fix: check the space and permissions of that directory on every node", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not lost_peer(exc):
            raise
        where = f"after step {progress['step']}" if progress["step"] else "before the first step ended"
        timeout = spec.train.process_group_timeout_s if spec else "?"
        print(f"train.py: rank {rank}: another rank died or stopped answering ({where}); stopping this rank.\n"
              f"  cause: {str(exc).splitlines()[0][:300]}\n"
              f"  a hung rank is given up on after train.process_group_timeout_s={timeout} s"
              + (f"\n  fix: look at the failed rank's log, then rerun with --resume to continue from the newest "
                 f"complete checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""), file=sys.stderr)
        return EXIT_LOST_PEER
    if rank == 0 and losses:
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
