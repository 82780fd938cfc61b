"""A small real training run whose precision comes from an fp8dist config.

    deepspeed --num_gpus 2 launch/train.py --fp8dist-config configs/deepspeed-bf16-zero2.yaml
    torchrun --nproc_per_node 2 launch/train.py --fp8dist-config configs/fsdp2-bf16.yaml

The engine comes from the config (`engine: deepspeed | fsdp2`); `--fp8dist-set KEY=VALUE` (repeatable) overrides
one of its keys, e.g. `--fp8dist-set precision.fp8.backend=none` (the `fp8dist` commands take the same KEY=VALUE as
bare words). Data is synthetic token batches; the model is the built-in tiny-llama unless --model names another
(see fp8dist.runtime.models). On a machine without CUDA the ranks run on CPU with gloo. Prints the loss of every
step on rank 0 and, last, `final_loss=<x> first_loss=<y>`. Step 1 runs under the dtype audit
(fp8dist.audit.watch): its table is printed once on rank 0; `audit.first_step` in the config says what a mismatch
does (warn | raise | off).

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
from fp8dist.errors import Checks, ExitCode, Fp8distError
from fp8dist.config.models import MODEL_FORMS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help=f"{MODEL_FORMS} (default tiny-llama)")
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
    parser.add_argument("--check", action="store_true",
                        help="check the config, this machine and the arguments in this one process, then exit (0: "
                             "it can run; 2: why not): no rank is started (launch/torchrun.sh and deepspeed.sh run "
                             "it first, so a refusal is one message, not one per rank plus the launcher's report)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --check: the ranks the run will have, so that the mesh (parallel.tensor_size, "
                             "context_size, shard_size) is checked against them and the model (launch/torchrun.sh "
                             "passes it)")
    fp8dist.add_config_arguments(parser)
    return parser.parse_args(argv)


def argument_problems(args) -> list[Fp8distError]:
    """Every argument the run cannot take."""
    problems = []
    if args.save_every is not None and args.save_every < 1:
        problems.append(Fp8distError(f"--save-every {args.save_every}: must be at least 1"))
    if (args.save_every is not None or args.resume) and not args.checkpoint_dir:
        flag = "--resume" if args.resume else "--save-every"
        problems.append(Fp8distError(f"{flag} needs --checkpoint-dir DIR (where the checkpoints are)"))
    if args.steps is not None and args.steps < 1:
        problems.append(Fp8distError(f"--steps {args.steps}: must be at least 1"))
    if args.world_size is not None and args.world_size < 1:
        problems.append(Fp8distError(f"--world-size {args.world_size}: must be at least 1"))
    elif args.world_size is not None and not args.check:
        problems.append(Fp8distError(f"--world-size {args.world_size} goes with --check (a run's ranks come from its "
                                     "launcher)"))
    return problems


def checked_spec(args):
    """The run's spec, after every up-front check that can fail: the arguments, the config and its overrides, and
    (with --check, or when something failed already) the machine, the model and the export destination; every
    problem at once."""
    from fp8dist.runtime import loop

    checks, spec = Checks(), None
    for problem in argument_problems(args):
        checks.add(problem)
    with checks.one():
        spec = fp8dist.spec_from_args(args)
    if spec is not None and (args.check or checks.errors):
        with checks.one():
            loop.check_before_launch(spec, args.model, export_hf=args.export_hf, world_size=args.world_size)
    checks.raise_found()
    return spec


def main(argv=None) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    from fp8dist.engines.checkpoint import failure_text
    from fp8dist.runtime import loop, process_group

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    losses: list[float] = []
    progress = {"step": 0}

    def say(line):
        if rank == 0:
            print(line, flush=True)

    def on_step(step, loss, note=None):
        losses.append(loss)
        progress["step"] = step + 1
        say(loop.step_line(step, loss))
        if note:
            say(f"step {step + 1} {note}")

    spec = None
    try:
        spec = checked_spec(args)
        if args.check:
            print(f"train.py: {args.fp8dist_config or 'the schema defaults'}: can run here (engine {spec.engine}, FP8 backend "
                  f"{spec.fp8.backend}, --model {args.model})", flush=True)
            return ExitCode.OK
        loaded, plan, dims = loop.prepare_run(spec, args.model, export_hf=args.export_hf)
        session = loop.start(spec, loaded, plan=plan, dims=dims)
        to_export = loop.train(session, loop.TrainOptions(steps=args.steps or spec.train.steps, model_name=args.model,
                                                  checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                                                  resume=args.resume, export_hf=args.export_hf), on_step, say)
        process_group.tear_down()
        if to_export and rank == 0:
            loop.export(*to_export, args.export_hf, say)
    except Fp8distError as exc:  # bad input or environment: 2; the first-step audit with audit.first_step=raise: 1
        print(f"train.py: {exc}", file=sys.stderr)
        return exc.exit_code
    except CheckpointException as exc:  # torch.distributed.checkpoint gathers every rank's failure (a BaseException)
        print(f"train.py: a checkpoint in {args.checkpoint_dir} could not be written or read: {failure_text(exc)}"
              "\n  fix: check the space and permissions of that directory on every node", file=sys.stderr)
        return ExitCode.ERROR
    except RuntimeError as exc:
        if not loop.lost_peer(exc):
            raise
        where = f"after step {progress['step']}" if progress["step"] else "before the first step ended"
        timeout = spec.train.process_group_timeout_s if spec else "?"
        print(f"train.py: rank {rank}: another rank died or stopped answering ({where}); stopping this rank.\n"
              f"  cause: {str(exc).splitlines()[0][:300]}\n"
              f"  a hung rank is given up on after train.process_group_timeout_s={timeout} s"
              + (f"\n  fix: look at the failed rank's log, then rerun with --resume to continue from the newest "
                 f"complete checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""), file=sys.stderr)
        return ExitCode.LOST_PEER
    if rank == 0 and losses:
        print(f"final_loss={losses[-1]:.6f} first_loss={losses[0]:.6f}", flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    from fp8dist.runtime.process_group import leave

    leave(main())
