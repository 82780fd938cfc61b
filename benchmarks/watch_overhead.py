"""Cost of `fp8dist.audit.watch`: on the step it observes, and on the steps outside it.

    python benchmarks/watch_overhead.py [--pairs 10] [--rounds 2]   # launches itself under torchrun (2 gloo ranks)
    python benchmarks/watch_overhead.py --smoke                     # every figure once, tiny-llama: not a measurement

Two copies of small-llama (same seed) live in the same two processes, prepared alike by fp8dist's engine with
the first-step audit off: A is never watched, B has its first step watched. Then timed steps alternate
A B / B A:
- `watched step / plain step`: B's step inside a fresh `watch` (entering, the dispatch modes on every op,
  the report and the ranks' agreement) over A's plain step. Info: it is paid once, on step 1.
- `after the watch / never watched`: B's plain steps after its watch over A's, goal <= 1.02: nothing stays
  installed (the modes, the optimizer hook and the compile stance are removed on exit). Checked, not assumed:
  the hooks on every module, parameter and the optimizer, the dispatch and function mode stacks and the
  compile stance are the same after each watch as before it, or the script stops.
- A/A control (FSDP2 bf16): the same rounds with B never watched either, so `after` compares two twins that
  were never watched: how far from 1.0 this machine's noise alone puts the `after` ratio.
Medians of per-pair ratios over rounds that alternate the build order, for FSDP2 bf16 and DeepSpeed ZeRO-2 bf16.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, median, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

MICRO_BATCH, SEQ_LEN, WARMUP = 2, 128, 2
CASES = {"fsdp2 bf16": "configs/fsdp2-bf16.yaml", "deepspeed zero2 bf16": "configs/deepspeed-bf16-zero2.yaml"}


def prepared(model_name: str, spec):
    """(model the loop calls, optimizer, step(batch) -> loss) from fp8dist's engine, first-step audit off."""
    from fp8dist.runtime.models import load_model

    model = load_model(model_name, spec.precision.load_dtype, seed=0).model
    if spec.engine == "deepspeed":
        from fp8dist.engines import deepspeed

        engine, *_ = deepspeed.initialize(model, spec, audit="off")
        return engine, engine.optimizer, lambda batch: deepspeed.train_step(engine, [batch])
    from fp8dist.engines import fsdp2

    run = fsdp2.prepare(model, spec, audit="off")
    return run.model, run.optimizer, lambda batch: fsdp2.train_step(run, [batch], spec.train.gradient_clipping)


def timed(step, batch) -> float:
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start


def installed(model, optimizer) -> dict:
    """What a watch could leave behind: hooks on modules, parameters and the optimizer (its own and torch's global
    ones), the dispatch and function mode stacks, the compile stance."""
    import torch
    from torch.nn.modules import module as module_globals
    from torch.optim import optimizer as optimizer_globals

    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    target = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer wraps a torch one
    return {
        "module hooks": sum(len(getattr(m, h, {})) for m in model.modules() for h in hooks),
        "global module hooks": sum(len(getattr(module_globals, f"_global{h}", {})) for h in hooks),
        "parameter hooks": sum(len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None)
                                                                   or {}) for p in model.parameters()),
        "optimizer hooks": sum(len(getattr(o, a, {})) for o in {id(optimizer): optimizer, id(target): target}.values()
                               for a in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")),
        "global optimizer hooks": len(optimizer_globals._global_optimizer_pre_hooks)
                                  + len(optimizer_globals._global_optimizer_post_hooks),
        "optimizer step on the instance": "step" in vars(optimizer),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "compile stance": str(torch._dynamo.eval_frame._stance),
    }


def measure(name: str, config: str, args, control: bool = False) -> tuple[float, float]:
    """Median ratios over `rounds` fresh pairs of models; rounds alternate which of the two is built first
    (on the 2-core machine the build order alone moves an A/A ratio by up to 4%: benchmarks/overhead.py)."""
    import torch.distributed as dist

    from fp8dist import load_config

    spec = load_config(config)
    during, after, times = [], [], {"plain": [], "watched": [], "after": []}
    for round_index in range(args.rounds):
        one_round(args.model, spec, args.pairs, round_index % 2 == 1, during, after, times, control)
    if dist.get_rank() == 0:
        print(f"{name:24s}{median(times['plain']) * 1e3:10.1f}{median(times['watched']) * 1e3:12.1f}"
              f"{median(times['after']) * 1e3:12.1f}{median(during):10.3f}{median(after):10.3f}", flush=True)
    return median(during), median(after)


def one_round(model_name: str, spec, pairs: int, watched_first: bool, during: list, after: list, times: dict,
              control: bool) -> None:
    """One fresh pair of twins; `control`: B's "watched" step runs without the watch (the A/A row)."""
    import torch.distributed as dist

    from fp8dist.audit import watch
    from fp8dist.runtime.models import causal_lm_batch

    if watched_first:
        model, optimizer, watched = prepared(model_name, spec)
        _, _, plain = prepared(model_name, spec)
    else:
        _, _, plain = prepared(model_name, spec)
        model, optimizer, watched = prepared(model_name, spec)
    batch = causal_lm_batch(getattr(model, "module", model).config.vocab_size)(MICRO_BATCH, SEQ_LEN, dist.get_rank())

    def observed(batch):
        if control:
            return watched(batch)
        before = installed(model, optimizer)
        with watch(model, optimizer, spec, on_mismatch="ignore") as audit:
            watched(batch)
        assert audit.passed, audit.report  # the comparison is of a correct run
        if installed(model, optimizer) != before:
            raise SystemExit(f"the watch left something installed: {before} before, {installed(model, optimizer)} "
                             "after")
    for _ in range(WARMUP):
        plain(batch), watched(batch)
    for i in range(pairs):
        first, second = ((plain, "plain"), (observed, "watched")) if i % 2 == 0 else ((observed, "watched"), (plain, "plain"))
        seconds = {label: timed(step, batch) for step, label in (first, second)}
        during.append(seconds["watched"] / seconds["plain"])
        first, second = ((plain, "plain"), (watched, "after")) if i % 2 == 0 else ((watched, "after"), (plain, "plain"))
        again = {label: timed(step, batch) for step, label in (first, second)}
        after.append(again["after"] / again["plain"])
        for label, value in {**seconds, "after": again["after"]}.items():
            times[label].append(value)


def worker(args) -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init(deepspeed=True)  # gloo on the CPU accelerator; serves the FSDP2 case too
    if dist.get_rank() == 0:
        print(f"{args.model}, micro-batch {MICRO_BATCH} x {SEQ_LEN} tokens, 2 gloo ranks, {args.rounds} rounds x "
              f"{args.pairs} interleaved pairs")
        print(f"{'case':24s}{'plain ms':>10s}{'watched ms':>12s}{'after ms':>12s}{'watched':>10s}{'after':>10s}",
              flush=True)
    figures = {name: measure(name, config, args) for name, config in CASES.items()}
    _, noise = measure("A/A: fsdp2, never watched", CASES["fsdp2 bf16"], args, control=True)
    if dist.get_rank() == 0:
        for name, (during, after) in figures.items():
            key = name.replace(" ", "_")
            result(f"watch_observed_step_{key}", during, "info", f"{name}: watched step / plain step")
            result(f"watch_after_{key}", after, "<=1.02", f"{name}: steps after the watch / never watched")
        result("watch_after_noise_floor_fsdp2_bf16", noise, "info", "A/A: twins never watched, same rounds")
    leave(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="timed pairs of each kind per round")
    parser.add_argument("--rounds", type=int, default=2, help="fresh pairs of models (build order alternates)")
    parser.add_argument("--model", default="small-llama", help="built-in model")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.rounds, args.model = 1, 1, "tiny-llama"
    if under_torchrun():
        worker(args)
        return 0
    return relaunch(os.path.abspath(__file__), args=sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
