"""Pipeline parallel x FSDP2 with torchao float8: the bubble and the point-to-point bytes of each schedule, and
fp8dist's step time against the same schedule built by hand.

    python benchmarks/pipeline_parallel.py [--pairs 24] [--steps 8]   # launches itself under torchrun (2 gloo ranks)
    python benchmarks/pipeline_parallel.py --smoke                    # every figure once, tiny: not a measurement

small-llama (4 decoder layers, hidden 256), pipeline_size 2 x one data rank (`--dp-shard 2`: 4 ranks), torchao
float8 tensorwise (emulated on CPU, float8 all-gather), one micro-batch of 8 x 128 tokens per step cut into 4
microbatches, gradient clipping at 1.0.

1. Per schedule (1f1b, gpipe, interleaved_1f1b; zero_bubble is refused on FSDP2), through fp8dist
   (`engines.fsdp2.prepare` with `parallel.pipeline_*`, `run.train_step`): the bubble as each rank measured it
   (`run.pipeline.idle`: its time waiting on a neighbour over the schedule's time, the median over the timed steps)
   beside the schedule's theory (`run.pipeline.plan.bubble_theory`, (P - 1) / (V x M + P - 1)), and the bytes a rank
   sends and receives on the `pp` axis in one step (the audit's wire recorder, fp8dist/audit/wire.py) beside what
   the split implies: each stage boundary a rank's stages touch carries the micro-batch's hidden states forward and
   their gradients backward once, micro-batch x seq_len x hidden x 2 bytes (bf16, FSDP2's compute dtype). Info rows.
2. Step time, fp8dist's 1F1B (`--schedule`) over the same pipeline built by hand the way torchtitan builds it
   (torchtitan/distributed/pipeline_parallel.py and models/llama3/infra/parallelize.py): torchao's
   convert_to_float8_training on the whole model with the same Float8LinearConfig (checked equal), the model split by
   layer ranges into stage modules (embeddings with the first, norm and LM head with the last), fully_shard per
   block then per stage, torch's PipelineStage and the same schedule class, the same loss, the gradient norm summed
   over the pp group as torchtitan's clip_grad_norm_ does. All models live in the same processes, built from the same
   seed, and see the same batches; each round times one step of each, the three taking every order in turn (all six
   permutations, so that each runs equally often first, second and third); the median of the per-round ratios.
   Goal <= 1.01. The losses of both sides are compared step by step (FIRST_STEP_TOLERANCE, LOSS_TOLERANCE), the
   converted Linears by name; a third, hand-built copy gives the A/A row (hand vs hand): this machine's noise floor.
   The hand-built side copies fp8dist's FSDP2 settings (blocks reshard after forward, the stage roots do not), so that
   both do the same work; torchtitan's own default under PP keeps the blocks unsharded after forward instead
   (models/llama3/infra/parallelize.py apply_fsdp: `reshard_after_forward = not pp_enabled`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SMOKE_HELP, median, quiet_libraries, relaunch, result, under_torchrun  # noqa: E402
from fp8dist.runtime import process_group  # noqa: E402
from fp8dist.runtime.process_group import leave  # noqa: E402

MODEL, PP, MICROBATCHES, CLIP = "small-llama", 2, 4, 1.0
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # zero_bubble: refused on FSDP2 (README "Pipeline parallel")
# The losses of fp8dist and the hand-built pipeline, step by step (losses ~6.9). The first step runs the same ops on
# the same weights and batch: equal to FIRST_STEP_TOLERANCE (measured: bitwise, as were the next two steps). After it
# the two sum the gradient norm across stages in another order (fp8dist/engines/fsdp2/clipping.py: per-tensor sums of
# squares; torchtitan: torch's foreach norms: the one difference in arithmetic between the two steps known here), so
# the clip coefficient, and the weights after each update, may differ in their last bits, which float8's rounding of
# weights and activations then amplifies: a drift that grows with the steps (measured: the first 3 steps bitwise
# equal, at most 1.5e-3 apart over 26 steps, while the two hand-built copies stayed bitwise equal).
FIRST_STEP_TOLERANCE, LOSS_TOLERANCE = 1e-6, 1e-2
# The order of the three timed steps of each round, all six in turn. A fixed slot is not neutral on this machine: with
# the hand-built model always second (A B C / C B A), both outer models measured 1.03-1.04 x its step time, the A/A
# control included (benchmarks/README.md).
ORDERS = tuple(itertools.permutations(("ours", "hand", "other")))


def spec_for(schedule: str, args):
    from fp8dist import load_config

    return load_config({
        "engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}},
        "parallel": {"pipeline_size": PP, "pipeline_schedule": schedule, "pipeline_microbatches": MICROBATCHES},
        "train": {"micro_batch_size": args.micro_batch, "seq_len": args.seq_len, "gradient_clipping": CLIP},
        "audit": {"first_step": "off"}})


def batch(step: int, args) -> dict:
    """The micro-batch of `step` of this data rank: every pipeline rank of it reads the same one (the first stage its
    tokens, the last its labels). pp is the outermost mesh dim: the data rank is the rank modulo dp_shard."""
    import torch.distributed as dist

    from fp8dist.config.models import BUILTIN
    from fp8dist.runtime.models import causal_lm_batch

    make = causal_lm_batch(BUILTIN[MODEL]().vocab_size)
    return make(args.micro_batch, args.seq_len, 1000 * step + dist.get_rank() % args.dp_shard)


def fp8dist_side(schedule: str, args):
    from fp8dist.engines.fsdp2 import prepare
    from fp8dist.runtime.models import load_model

    spec = spec_for(schedule, args)
    run = prepare(load_model(MODEL, spec.precision.load_dtype, seed=0).model, spec)
    return run, (lambda b: run.train_step([b]))


def hand_float8_config():
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True,
                               enable_fsdp_float8_all_gather=True)


def float8_linears(model, within=None) -> list[str]:
    """The names, in the Hugging Face model, of its Float8Linears (those inside the modules `within` only)."""
    from torchao.float8.float8_linear import Float8Linear

    kept = None if within is None else {id(m) for module in within for m in module.modules()}
    return sorted(name for name, m in model.named_modules()
                  if isinstance(m, Float8Linear) and (kept is None or id(m) in kept))


def _stage_class():
    import torch

    class Stage(torch.nn.Module):
        """One stage of a Hugging Face Llama by layer range, as torchtitan's pipeline_module_split cuts its own
        models (torchtitan/distributed/pipeline_parallel.py: the stage keeps tok_embeddings on the first stage,
        norm and output on the last, its range of layers): the decoder's loop written out - embeddings, rotary
        position embeddings, the layers (attention_mask None: SDPA attends causally, transformers 5
        integrations/sdpa_attention.py), norm and LM head."""

        def __init__(self, model, layers: range, first: bool, last: bool):
            super().__init__()
            decoder = model.model
            self.embed_tokens = decoder.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(decoder.layers[i] for i in layers)
            self.rotary_emb = decoder.rotary_emb
            self.norm = decoder.norm if last else None
            self.lm_head = model.lm_head if last else None

        def forward(self, inputs):
            hidden = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            position_embeddings = self.rotary_emb(hidden, position_ids=positions)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings,
                               position_ids=positions)
            return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden

    return Stage


def hand_side(schedule: str, args, mirrored):
    """The pipeline a torchtitan user builds for the same run. `mirrored`: fp8dist's plan (FSDP2Plan), whose
    mixed-precision and reshard settings the hand-built side copies so that the step is the same work."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from fp8dist.engines.fsdp2.collectives import ByteViewAllGather
    from fp8dist.facts.torch import PIPELINE_SCHEDULES
    from fp8dist.runtime.models import load_model

    spec = spec_for(schedule, args)
    model = load_model(MODEL, "bf16", seed=0).model.float()  # fp32 masters
    # float8 before the split (torchtitan converts the whole model, then parallelises: its train.py)
    convert_to_float8_training(model, config=hand_float8_config(), module_filter_fn=lambda _, fqn: fqn != "lm_head")
    mesh = init_device_mesh("cpu", (PP, args.dp_shard), mesh_dim_names=("pp", "dp_shard"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    multi = PIPELINE_SCHEDULES[schedule].multi_stage
    count = PP * (2 if multi else 1)
    layers = len(model.model.layers)
    own = list(range(pp_rank, count, PP))  # torch's looped placement: rank r runs stages r, r + P, ...
    Stage = _stage_class()
    stages = [Stage(model, range(i * layers // count, (i + 1) * layers // count), i == 0, i == count - 1)
              for i in own]
    mp = mirrored.mixed_precision_policy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  cast_forward_inputs=mp.cast_forward_inputs)
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == ("bf16", "fp32", None), mp
    for stage in stages:  # per block, then the stage as the root (torchtitan apply_fsdp on each model part)
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=policy,
                        reshard_after_forward=mirrored.sharding.reshard_after_forward)
        fully_shard(stage, mesh=mesh["dp_shard"], mp_policy=policy,
                    reshard_after_forward=mirrored.sharding.root_reshard_after_forward)
        for module in stage.modules():  # gloo has no float8 dtypes (on NCCL this is not needed)
            if hasattr(module, "set_custom_all_gather"):
                module.set_custom_all_gather(ByteViewAllGather())

    def loss_fn(logits, labels):
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

    device = torch.device("cpu")
    pipeline_stages = [pipelining.PipelineStage(stage, index, count, device, group=pp_group)
                       for stage, index in zip(stages, own)]
    schedule_class = getattr(pipelining, PIPELINE_SCHEDULES[schedule].torch_class)
    pipe = schedule_class(pipeline_stages if multi else pipeline_stages[0], n_microbatches=MICROBATCHES,
                          loss_fn=loss_fn)
    params = [p for stage in stages for p in stage.parameters()]
    o = spec.optimizer
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    # torchtitan's float8 converter: precompute per model part after the optimizer step
    # (torchtitan/components/quantization/float8.py post_optimizer_hook)
    optimizer.register_step_post_hook(lambda *_: [precompute_float8_dynamic_scale_for_fsdp(s) for s in stages])
    first, last = 0 in own, count - 1 in own

    def clip_grad_norm_():
        """torchtitan/distributed/utils.py clip_grad_norm_ with a pp mesh: the norm of this rank's gradients, its
        p-th power summed over the pp group, then torch's clip_grads_with_norm_."""
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        total = total ** 2
        dist.all_reduce(total, group=pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, total ** 0.5, foreach=True)

    def step(b: dict) -> float:
        losses: list = []
        pipe.step(*((b["input_ids"],) if first else ()), **({"target": b["labels"], "losses": losses} if last else {}))
        clip_grad_norm_()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item() if last else math.nan  # the loss lives on the last stage

    return float8_linears(model, within=stages), step


def timed(step, b) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = step(b)
    dist.barrier()
    return time.perf_counter() - start, loss


def gathered(value) -> list:
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def boundary_units(own: list[int], count: int) -> int:
    """How many stage boundaries' tensors a rank holding stages `own` of `count` sends in one step (and receives as
    many): a stage sends its output forward unless it is the last, and its input's gradient backward unless it is
    the first."""
    return sum((index < count - 1) + (index > 0) for index in own)


def schedule_figures(schedule: str, args) -> dict:
    """fp8dist's run of `schedule`: each rank's bubble (median over the timed steps) and pp bytes of one step."""
    import torch.distributed as dist

    from fp8dist.audit.wire import WireRecorder

    run, step = fp8dist_side(schedule, args)
    for index in range(args.warmup):  # the stages' shape inference, the float8 scales
        step(batch(index, args))
    recorder = WireRecorder(run.inspector().mesh_axes())
    with recorder:  # a step of its own, untimed: the recorder's dispatch mode slows it
        step(batch(args.warmup, args))
    pp = recorder.by_axis().get("pp", {})
    first_timed = len(run.pipeline.idle)
    seconds = [timed(step, batch(args.warmup + 1 + index, args))[0] for index in range(args.steps)]
    plan = run.pipeline.plan
    mine = {"idle": median(run.pipeline.idle[first_timed:]),
            "send": {dtype: entry["bytes"] for dtype, entry in pp.get("send", {}).items()},
            "recv": {dtype: entry["bytes"] for dtype, entry in pp.get("recv", {}).items()},
            "units": boundary_units([index for index, _ in plan.own], plan.stages)}
    hidden = run.model.config.hidden_size
    del run, step
    dist.barrier()
    return {"ranks": gathered(mine), "theory": plan.bubble_theory, "stages": plan.stages,
            "unit": args.micro_batch * args.seq_len * hidden * 2, "step_s": median(seconds)}


def side_by_side(args) -> dict:
    """fp8dist vs hand vs a second hand-built copy, `args.pairs` rounds through ORDERS; the ratios' medians,
    every rank's losses of each side, and whether each rank's two sides converted the same Linears."""
    run, ours = fp8dist_side(args.schedule, args)
    if run.backend.float8_linear_config() != hand_float8_config():
        raise SystemExit("not a like-for-like comparison: the Float8LinearConfigs differ: "
                         f"{run.backend.float8_linear_config()} vs {hand_float8_config()}")
    converted, hand = hand_side(args.schedule, args, run.plan)
    _, other = hand_side(args.schedule, args, run.plan)
    converted = {"fp8dist": float8_linears(run.model), "hand": converted}
    losses: dict[str, list[float]] = {"ours": [], "hand": [], "other": []}
    ratios, noise, times = [], [], {"ours": [], "hand": [], "other": []}
    steps = {"ours": ours, "hand": hand, "other": other}
    for index in range(args.warmup + args.pairs):
        order = ORDERS[index % len(ORDERS)]
        seconds = {}
        for name in order:
            seconds[name], loss = timed(steps[name], batch(index, args))
            losses[name].append(loss)
        if index >= args.warmup:
            ratios.append(seconds["ours"] / seconds["hand"])
            noise.append(seconds["other"] / seconds["hand"])
            for name, value in seconds.items():
                times[name].append(value)
    return {"ratio": median(ratios), "noise": median(noise), "ms": {k: median(v) * 1e3 for k, v in times.items()},
            "losses": gathered(losses), "converted": gathered(converted)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=24,
                        help="timed rounds of the side-by-side, best a multiple of 6 (default 24)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per schedule (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--micro-batch", type=int, default=8, help="train.micro_batch_size (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="train.seq_len (default 128)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="the side-by-side's (default 1f1b)")
    parser.add_argument("--dp-shard", type=int, default=1, help="data ranks per pipeline rank: 2 runs 4 ranks")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.steps, args.warmup, args.micro_batch, args.seq_len = 1, 1, 1, 4, 32
    return args


def report(figures: dict, args) -> None:
    """Rank 0: the schedules' table and their result lines."""
    print(f"{MODEL} (4 layers), micro-batch {args.micro_batch} x {args.seq_len} tokens in {MICROBATCHES} microbatches, "
          f"pp {PP} x dp_shard {args.dp_shard} ({PP * args.dp_shard} gloo ranks), torchao float8 tensorwise "
          f"(emulated), float8 all-gather, clipping {CLIP}")
    print(f"{'schedule':18s}{'stages':>7s}{'bubble theory':>15s}{'measured (per rank)':>28s}"
          f"{'pp bytes/step theory':>22s}{'sent (per rank)':>26s}{'recv (per rank)':>26s}{'step ms':>9s}")
    rows = []
    for schedule, f in figures.items():
        ranks = f["ranks"]
        idle = [r["idle"] for r in ranks]
        sent = [sum(r["send"].values()) for r in ranks]
        received = [sum(r["recv"].values()) for r in ranks]
        theory = [r["units"] * f["unit"] for r in ranks]
        dtypes = sorted({d for r in ranks for d in (*r["send"], *r["recv"])})
        measured = f"{sum(idle) / len(idle):.3f} ({' / '.join(f'{x:.3f}' for x in idle)})"
        print(f"{schedule:18s}{f['stages']:7d}{f['theory']:15.3f}{measured:>28s}{max(theory):>22,d}"
              f"{' / '.join(f'{x:,d}' for x in sent):>26s}{' / '.join(f'{x:,d}' for x in received):>26s}"
              f"{f['step_s'] * 1e3:9.1f}  {','.join(dtypes)}")
        rows += [(f"pp_bubble_{schedule}", sum(idle) / len(idle),
                  f"measured idle fraction of the step, mean of ranks (theory {f['theory']:.3f})"),
                 (f"pp_bubble_theory_{schedule}", f["theory"], "(P - 1) / (V x M + P - 1)"),
                 (f"pp_p2p_bytes_{schedule}", max(sent),
                  f"bytes a rank sends on the pp axis per step, the largest (theory {max(theory):,d}; recv equal)"),
                 (f"pp_p2p_bytes_theory_{schedule}", max(theory),
                  "stage boundaries a rank touches x micro-batch x seq x hidden x 2 bytes"),
                 (f"pp_step_ms_{schedule}", f["step_s"] * 1e3, "median step time, fp8dist")]
    for name, value, label in rows:
        result(name, value, "info", label)


def worker(args) -> None:
    import torch.distributed as dist

    quiet_libraries()
    process_group.init()
    if dist.get_world_size() != PP * args.dp_shard:
        raise SystemExit(f"pipeline_parallel.py: {dist.get_world_size()} ranks, expected {PP * args.dp_shard}")
    figures = {schedule: schedule_figures(schedule, args) for schedule in SCHEDULES}
    pair = side_by_side(args)
    # every rank judges the same gathered figures; rank 0 prints them first, then all stop when the comparison is not
    # like for like
    last = [lists for lists in pair["losses"] if not any(math.isnan(x) for x in lists["hand"])][0]
    gaps = [abs(a - b) for a, b in zip(last["ours"], last["hand"])]
    gap_aa = max(abs(a - b) for a, b in zip(last["other"], last["hand"]))
    equal_steps = next((i for i, g in enumerate(gaps) if g != 0), len(gaps))
    differ = [f"rank {rank}: {c}" for rank, c in enumerate(pair["converted"]) if c["fp8dist"] != c["hand"]]
    problems = ([f"the float8 Linears differ: {differ}"] if differ else []) + (
        [f"the first step's losses differ by {gaps[0]:.2e} > {FIRST_STEP_TOLERANCE:g}"]
        if not gaps[0] <= FIRST_STEP_TOLERANCE else []) + (
        [f"the losses differ by {max(gaps):.2e} > {LOSS_TOLERANCE:g}"] if not max(gaps) <= LOSS_TOLERANCE else [])
    if dist.get_rank() != 0:
        if problems:
            raise SystemExit(1)
        leave(0)
    report(figures, args)
    ms = pair["ms"]
    print(f"\nstep time, {args.schedule}, {args.pairs} rounds through the 6 orders after {args.warmup} warm-up "
          f"(losses: the first step within {FIRST_STEP_TOLERANCE:g}, every step within {LOSS_TOLERANCE:g}; the same "
          "Float8LinearConfig; the same converted Linears)")
    print(f"{'case (B / A)':34s}{'A ms':>10s}{'B ms':>10s}{'ratio':>8s}{'loss gap':>12s}")
    print(f"{'fp8dist / by hand':34s}{ms['hand']:10.1f}{ms['ours']:10.1f}{pair['ratio']:8.3f}{max(gaps):12.2e}")
    print(f"{'A/A control: hand / hand':34s}{ms['hand']:10.1f}{ms['other']:10.1f}{pair['noise']:8.3f}{gap_aa:12.2e}")
    print(f"losses: the first {equal_steps} of {len(gaps)} steps bitwise equal; first 3: fp8dist "
          f"{[round(x, 6) for x in last['ours'][:3]]}, by hand {[round(x, 6) for x in last['hand'][:3]]}; last: "
          f"{last['ours'][-1]:.6f} vs {last['hand'][-1]:.6f}")
    if problems:
        raise SystemExit("not a like-for-like comparison: " + "; ".join(problems))
    result("pp_step_time_fp8dist_vs_hand", pair["ratio"], "<=1.01",
           f"PP x FSDP2 float8 step ({args.schedule}), fp8dist / by hand")
    result("pp_step_time_noise_floor_hand_vs_hand", pair["noise"], "info",
           "two hand-built copies: this machine's noise")
    result("pp_loss_gap_fp8dist_vs_hand", max(gaps), "info",
           f"largest step-by-step loss difference, fp8dist vs by hand (the first {equal_steps} steps bitwise equal)")
    leave(0)


if __name__ == "__main__":
    arguments = parse_args()
    if not under_torchrun():
        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        raise SystemExit(relaunch(os.path.abspath(__file__), nproc=PP * arguments.dp_shard, args=sys.argv[1:]))
    worker(arguments)
