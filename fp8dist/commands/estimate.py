"""`fp8dist estimate MODEL --config X --world-size N`: the arguments and the table, markdown or JSON of an estimate
(the model and the memory model: fp8dist/estimate/). Sizes print in binary units (KiB, MiB, GiB: powers of 1024)."""
from __future__ import annotations

import argparse

from fp8dist.commands.output import dump_json
from fp8dist.commands.estimate_speed import NO_GPU, render_speed
from fp8dist.config.load import load_config
from fp8dist.config.parallel import CP, TP
from fp8dist.errors import ExitCode, Fp8distError
from fp8dist.estimate.memory import estimate
from fp8dist.estimate.result import PHASES, STORES, Estimate, Phase

# The column heads of the phases; the first four are the Model Memory Usage tool's training columns.
PHASE_LABELS: dict[Phase, str] = {"model": "Model", "gradients": "Gradients", "backward_pass": "Backward pass",
                                  "optimizer_step": "Optimizer step", "later_backward_pass": "Backward, step 2+"}


def human(n: float) -> str:
    """`n` bytes in binary units (B, KiB, MiB, GiB, TiB: powers of 1024)."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"


def _store_rows(result: Estimate) -> list[tuple[str, str]]:
    """(label, size) per store; a store in host memory says so, and master weights without bytes of their own say
    why."""
    rows = [(store.replace("_", " ") + (" (host)" if store in result.offloaded_to_host else ""),
             human(result.per_rank_bytes[store])) for store in STORES]
    if result.master_weights_note:
        rows[STORES.index("master_weights")] = ("master weights", result.master_weights_note)
    return rows


def _coverage_note(result: Estimate) -> str:
    cov = result.fp8_coverage
    if cov.backend == "none":
        note = "FP8 coverage: none (no FP8 backend)"
    else:
        experts = f", {cov.experts} MoE experts modules" if cov.experts else ""
        note = (f"FP8 coverage: {cov.fp8_share:.1%} of weight-GEMM FLOPs ({cov.converted} of {cov.linears} "
                f"Linears converted{experts})")
    left = "; ".join(f"{item.fqn} ({item.reason})" for item in cov.left_out[:8])
    more = f" and {len(cov.left_out) - 8} more" if len(cov.left_out) > 8 else ""
    if cov.too_small_to_gain:
        more += (f"; {len(cov.too_small_to_gain)} converted Linears are below torchao's size heuristics "
                 "(too small to gain on H100)")
    return note + (f"; left out: {left}" if left else "") + more


def _mesh(result: Estimate) -> str:
    """The mesh's axes and sizes; under expert parallel the experts' own mesh over the dp_shard ranks too."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in result.mesh.items())
    experts = result.expert_parallel
    return mesh + (f", experts efsdp {experts.efsdp} x ep {experts.ep}" if experts.ep > 1 else "")


def _divided_note(result: Estimate) -> str:
    """What each store was divided by: the mesh axes, so that a figure can be traced to them."""
    shards = ", ".join(f"{store.replace('_', ' ')} {n}" for store, n in result.shards.items())
    tp, cp, split = result.mesh[TP], result.mesh[CP], result.tensor_parallel
    if tp == 1:
        note = f"divided by mesh {_mesh(result)}: each store over the ranks it is sharded on ({shards})"
        if result.pipeline:
            note = (f"divided by mesh {_mesh(result)}: each pp rank holds its stages' parameters (pipeline line), each "
                    f"store over the data ranks of its pp slice ({shards})")
    else:
        vocabulary = "with" if split.vocabulary_split else "without"
        note = (f"divided by mesh {_mesh(result)}: the {split.split_parameters / 1e6:,.2f}M parameters tensor "
                f"parallel splits ({split.plan}; {vocabulary} the vocabulary) by tp {tp} x the ranks each store "
                f"is sharded on, the rest by those alone ({shards})")
    experts = result.expert_parallel
    if experts.ep > 1:
        note += (f"; the {experts.expert_parameters / 1e6:,.2f}M expert parameters ({experts.moe_layers} MoE "
                 f"layers) split whole over ep {experts.ep}, then sharded over efsdp {experts.efsdp}: per rank the "
                 f"same share as without expert parallel, gathered a block at a time over efsdp (E / ep experts)")
    sequence = [f"the sequence by cp {cp}"] if cp > 1 else []
    if tp > 1:
        sequence.append(f"inside attention and MLP by tp {tp} (heads and columns; their input whole)")
    if split.sequence_parallel:
        sequence.append(f"the rest of each block by tp {tp} (sequence parallel)")
    if experts.ep > 1:
        sequence.append(f"the experts' rows as without expert parallel (balanced routing: each rank receives its "
                        f"tokens x top_k rows), plus {human(experts.dispatch_kept)} of the dispatch's regroup "
                        "indices")
    return note + ("; activations: " + ", ".join(sequence) if sequence else "")


def _pipeline_note(result: Estimate) -> str:
    """The pipeline line: the schedule and its sizes, the bubble, each pipeline rank's stages and peak, and which
    rank the figures above are (the heaviest) and why."""
    pipe = result.pipeline
    assert pipe is not None
    stages = {stage.stage: stage for stage in pipe.stages}

    def describe(stage: int) -> str:
        row = stages[stage]
        span = f"layers {row.layers[0]}-{row.layers[-1]}" if len(row.layers) > 1 else f"layer {row.layers[0]}"
        return f"stage {stage}: " + ("embeddings + " if row.embeddings else "") + span + (
            " + norm + lm_head" if row.lm_head else "")

    ranks = "; ".join(f"pp rank {rank.pp_rank} ({', '.join(describe(stage) for stage in rank.stages)}; "
                      f"{rank.microbatches_in_flight} in flight) {human(rank.peak_bytes)}" for rank in pipe.ranks)
    return (f"pipeline: {pipe.schedule} over pp {pipe.pipeline_size} ({pipe.stages_per_rank} stage(s) per rank), "
            f"{pipe.microbatches} microbatches of {pipe.microbatch_sequences} sequence(s), bubble "
            f"{pipe.bubble_theory:.1%} (theory: (P - 1) / (V x M + P - 1)); peak per pp rank: {ranks}; the figures "
            f"above are pp rank {pipe.heaviest_rank}'s, the heaviest: {pipe.heaviest_why}")


def _notes(result: Estimate) -> list[str]:
    act, transient = result.activations_bytes, result.transient_bytes
    pipe = result.pipeline
    kept = (f"activations in flight on pp rank {pipe.heaviest_rank} (microbatches of {pipe.microbatch_sequences} "
            "sequence(s) its schedule keeps at once)" if pipe else "activations per micro batch")
    notes = [_divided_note(result), _coverage_note(result),
             f"{kept}: {human(act.none)} without checkpointing, "
             f"{human(act.selective_checkpointing)} selective, {human(act.full_checkpointing)} full "
             f"(counted: {act.mode})",
             f"transient in backward: {human(transient.unsharded_units)} of gathered weights, "
             f"{human(transient.logits_gradient)} of logits gradient" + (
                 f", {human(transient.all_to_all)} of all-to-all buffers (one MoE layer's send and receive, "
                 "tokens x top_k x hidden each)" if result.expert_parallel.ep > 1 else "") + (
                 f", {human(transient.nf4_dequantize)} to dequantize the largest NF4 weight for its GEMM (eager; "
                 "int64 code indices and three copies)" if transient.nf4_dequantize else "") + (
                 f", {human(transient.dora)} of DoRA's update in the largest adapted Linear (an in x in identity "
                 "and three out x in copies)" if transient.dora else "") + (
                 f", {human(transient.pipeline_weights)} of the rank's stages left gathered after a microbatch's "
                 f"backward and {human(transient.pipeline_gradients)} of their gradients accumulated unsharded until "
                 "the last microbatch (torch's pipeline stages defer FSDP2's reshard and reduce-scatter)"
                 if transient.pipeline_weights else ""),
             f"fp8 extras: {result.fp8_extras_counted}"]
    if result.frozen_parameters:
        notes.insert(0, _frozen_note(result))
    if pipe:
        notes.insert(0, _pipeline_note(result))
    return notes


def _frozen_note(result: Estimate) -> str:
    """The adapter's split of the parameters, and the frozen base by storage format (the audit's
    frozen_bytes_by_format): each format's parameters, bytes in one whole copy and per rank; an NF4 base's Linears
    kept in the load dtype and why."""
    formats = "; ".join(f"{fmt} {part.parameters / 1e6:,.2f}M at {part.bytes_per_param:g} bytes, "
                        f"{human(part.bytes)} in all, {human(part.per_rank_bytes)} per rank"
                        for fmt, part in result.frozen_bytes_by_format.items())
    note = (f"adapter: {result.trainable_parameters / 1e6:,.2f}M trainable parameters carry masters, gradients and "
            f"optimizer states; {result.frozen_parameters / 1e6:,.2f}M frozen ones their weights only, "
            f"{result.frozen_bytes_per_param:g} bytes per parameter: {formats}")
    if result.nf4_kept:
        by_reason: dict[str, list[str]] = {}
        for item in result.nf4_kept:
            by_reason.setdefault(item.reason, []).append(item.fqn)
        note += (f"; {len(result.nf4_kept)} frozen Linears kept out of NF4: "
                 + "; ".join(f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''} "
                             f"({why})" for why, names in by_reason.items()))
    return note


def render_table(result: Estimate, markdown: bool = False) -> str:
    """The estimate as a text table (or markdown): each store per rank, the device bytes of each phase of a step
    (cumulative), the one peak, then notes."""
    r = result
    head = (f"fp8dist estimate: {r.model}{' (shape only)' if r.shape_only else ''}, "
            f"{r.parameters / 1e6:,.2f}M parameters, {r.engine} on {r.world_size} rank(s) (mesh {_mesh(r)}), "
            f"micro batch {r.micro_batch_size} x {r.seq_len} tokens, config {r.config}")
    store_rows = _store_rows(r)
    which = f" (pp rank {r.pipeline.heaviest_rank}, the heaviest)" if r.pipeline else ""
    stores_title = f"Per rank{which}, by store (KiB, MiB, GiB: powers of 1024)" + (
        f"; (host): in host memory, {human(r.host_bytes)} in all, outside the phases below"
        if r.offloaded_to_host else "")
    phases_title = (f"Per rank{which} on the device, by phase of a step (cumulative: each column holds every store "
                    "alive then)")
    labels = [PHASE_LABELS[phase] for phase in PHASES]
    cells = [human(r.phases_bytes[phase]) for phase in PHASES]
    peak = f"Peak per rank{which} on the device: {human(r.peak_bytes)}, in phase {PHASE_LABELS[r.highest_phase]}"
    notes = _notes(r) + ([] if r.speed else [NO_GPU])
    speed = render_speed(r.speed, markdown) if r.speed else []
    if markdown:
        lines = [f"**{head}**", "", f"{stores_title}:", "", "| store | per rank |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in store_rows]
        lines += ["", f"{phases_title}:", "", "| " + " | ".join(labels) + " |",
                  "|" + "---|" * len(labels), "| " + " | ".join(cells) + " |", "", f"**{peak}**", ""]
        return "\n".join(lines + [f"- {note}" for note in notes] + ([""] + speed if speed else [])) + "\n"
    width = max(len(name) for name, _ in store_rows)
    lines = [head, "", stores_title + ":"] + [f"{name.ljust(width)}  {value}" for name, value in store_rows]
    widths = [max(len(label), len(cell)) for label, cell in zip(labels, cells)]
    lines += ["", phases_title + ":", "  ".join(h.ljust(w) for h, w in zip(labels, widths)).rstrip(),
              "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(), "", peak, ""] + notes
    lines += [""] + speed if speed else []
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """The CLI command: the config is loaded (and refused) before torch is imported."""
    import sys

    spec = load_config(args.config, overrides=args.overrides)
    if args.gpu is None and spec.hardware.gpu == "auto" and args.nodes != 1:
        raise Fp8distError(f"--nodes {args.nodes}: the nodes place the ranks for the speed prediction, which needs a "
                           "GPU to predict for\n  fix: add --gpu h100 (or h200, b200, l40s), or set hardware.gpu")
    result = estimate(args.model, spec, args.world_size, gpu=args.gpu, nodes=args.nodes)
    sys.stdout.write(dump_json(result.to_json()) if args.format == "json"
                     else render_table(result, markdown=args.format == "markdown"))
    return ExitCode.OK
