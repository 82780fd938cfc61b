"""`fp8dist estimate` under pipeline parallel (fp8dist/estimate/pipeline.py): each pipeline rank's stores, the
activations its schedule keeps in flight, the heaviest rank named, the JSON's `pipeline` table, and the speed
section's bubble and point-to-point bytes; checked by hand on small-llama (4 layers) split in two stages."""
import json

import pytest

from fp8dist.commands.output import dump_json
from fp8dist.config.load import load_config
from fp8dist.config.parallel import pipeline_bubble
from fp8dist.estimate.memory import estimate
from fp8dist.estimate.pipeline import gathers_per_stage, peak_in_flight, schedule_ops
from tests.conftest import run_cli

# small-llama (fp8dist/config/models.py): vocab 1024, hidden 256, MLP 768, 4 layers, 8 heads of 32, 4 KV heads.
HIDDEN, VOCAB, SEQ = 256, 1024, 64
LAYER = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 768 + 2 * 256  # q, o; k, v; gate, up, down; two norms: 786,944
EMBED = HEAD = VOCAB * HIDDEN  # 262,144 each (untied)
FIRST = EMBED + 2 * LAYER  # stage 0: the embeddings and layers 0-1: 1,836,032
LAST = 2 * LAYER + HIDDEN + HEAD  # stage 1: layers 2-3, the final norm and lm_head: 1,836,288


def _spec(*overrides: str):
    return load_config(None, overrides=["train.micro_batch_size=4", *overrides])


def _pp2(*overrides: str, world: int = 4, gpu: str | None = None):
    return estimate("small-llama", _spec("parallel.pipeline_size=2", *overrides), world, gpu=gpu)


def test_each_pipeline_rank_holds_its_stages_parameters_divided_over_its_data_ranks():
    result = _pp2()  # pp 2 x dp_shard 2
    pipe = result.pipeline
    assert result.mesh == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    assert result.shards == {"weights": 2, "master_weights": 2, "gradients": 2, "optimizer": 2}
    assert FIRST + LAST == result.parameters == 3_672_320
    assert [(s.stage, s.pp_rank, s.layers, s.embeddings, s.lm_head, s.parameters) for s in pipe.stages] == [
        (0, 0, (0, 1), True, False, FIRST), (1, 1, (2, 3), False, True, LAST)]
    # the defaults: fp32 parameters (the masters), fp32 gradients, two fp32 Adam moments; bf16 compute, fp32 reduce
    assert result.bytes_per_param == {"weights": 4, "master_weights": 0, "gradients": 4, "optimizer": 8}
    for row, numel in zip(pipe.ranks, (FIRST, LAST)):
        held = row.per_rank_bytes
        assert (held["weights"], held["gradients"], held["optimizer"]) == (numel * 4 // 2, numel * 4 // 2,
                                                                          numel * 8 // 2)
        assert held["buffers"] == 128  # the rotary inverse frequencies (head_dim / 2 fp32) on every stage
        # sharded weights under a pipeline: each stage left gathered (bf16) after a microbatch's backward, its
        # gradients accumulated unsharded (fp32) until the last microbatch
        assert row.transient_bytes.pipeline_weights == numel * 2
        assert row.transient_bytes.pipeline_gradients == numel * 4
        assert row.transient_bytes.unsharded_units == 0
    # the logits' gradient of one microbatch (1 sequence): fp32 from the loss + a bf16 copy, on the last stage only
    assert [row.transient_bytes.logits_gradient for row in pipe.ranks] == [0, 1 * SEQ * VOCAB * (4 + 2)]
    # without pipeline parallel on the same data ranks each rank holds both halves
    whole = estimate("small-llama", _spec(), 2)
    assert whole.per_rank_bytes["weights"] == sum(row.per_rank_bytes["weights"] for row in pipe.ranks) == 7_344_640


def test_1f1b_keeps_p_minus_rank_microbatches_and_the_first_rank_is_the_heaviest():
    result = _pp2()
    pipe = result.pipeline
    assert (pipe.schedule, pipe.microbatches, pipe.microbatch_sequences, pipe.bubble_theory) == ("1f1b", 4, 1, 0.2)
    first, last = (stage.activations_per_microbatch for stage in pipe.stages)
    # a stage's microbatch is its part of one sequence through the model: the two add up to the whole model's
    single = estimate("small-llama", load_config(None, overrides=["train.micro_batch_size=1"]), 2)
    assert first + last == single.activations_bytes.none
    assert [row.microbatches_in_flight for row in pipe.ranks] == [2, 1]  # P - rank
    assert [row.per_rank_bytes["activations"] for row in pipe.ranks] == [2 * first, 1 * last]
    # rank 0: 2 x 1.45 MiB of activations outweighs the last stage's logits and its one microbatch
    assert pipe.heaviest_rank == 0 and "activations in flight" in pipe.heaviest_why
    assert "stage 0: embeddings + layers 0-1" in pipe.heaviest_why
    heaviest = pipe.ranks[0]
    assert result.per_rank_bytes == heaviest.per_rank_bytes and result.peak_bytes == heaviest.peak_bytes
    held = heaviest.per_rank_bytes
    transient = heaviest.transient_bytes
    # step 2+: the model, the unsharded gradients in place of the sharded ones, the activations, the stage gathered,
    # the optimizer's states
    assert result.phases_bytes["later_backward_pass"] == (held["weights"] + held["buffers"]
                                                          + transient.pipeline_gradients + held["activations"]
                                                          + transient.pipeline_weights + held["optimizer"])
    assert result.peak_bytes == 25_074_816 and result.highest_phase == "later_backward_pass"


@pytest.mark.parametrize("schedule, in_flight", [("gpipe", [4, 4]), ("interleaved_1f1b", [5, 3])])
def test_each_schedule_keeps_what_its_order_keeps(schedule, in_flight):
    result = _pp2(f"parallel.pipeline_schedule={schedule}")
    pipe = result.pipeline
    assert [row.microbatches_in_flight for row in pipe.ranks] == in_flight
    acts = {stage.stage: stage.activations_per_microbatch for stage in pipe.stages}
    if schedule == "gpipe":
        assert [row.per_rank_bytes["activations"] for row in pipe.ranks] == [4 * acts[0], 4 * acts[1]]
        return
    # two stages a rank, one layer each: rank 0 runs stages 0 (with the embeddings) and 2, rank 1 stages 1 and 3
    assert [row.stages for row in pipe.ranks] == [(0, 2), (1, 3)]
    assert [stage.layers for stage in pipe.stages] == [(0,), (1,), (2,), (3,)]
    assert pipe.bubble_theory == pytest.approx(1 / 9)  # (P - 1) / (V x M + P - 1) = 1 / (2 x 4 + 1)
    if schedule == "interleaved_1f1b":
        # rank 0 runs F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 ... (global stages): 5 chunks in flight after F0.2
        # (3 of stage 0, 2 of stage 2), and after F0.3 4 of stage 0 (with the embeddings, the heavier) and 1 of 2
        assert acts[0] > acts[2]
        assert pipe.ranks[0].per_rank_bytes["activations"] == 4 * acts[0] + acts[2]


def test_the_schedules_orders_are_torchs():
    """The interleaved schedules' per-rank order is torch 2.13's own (_calculate_single_rank_operations)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for name, cls in (("interleaved_1f1b", schedules.ScheduleInterleaved1F1B),
                      ("zero_bubble", schedules.ScheduleInterleavedZeroBubble)):
        for pp, local, micro in ((2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 2, 4)):
            rounds = max(1, micro // pp)
            fake = type("Fake", (), {"n_local_stages": local, "pp_group_size": pp, "_n_microbatches": micro,
                                     "microbatches_per_round": micro // rounds})()
            for rank in range(pp):
                theirs = [(kinds[a.computation_type.name], a.stage_index // pp, a.microbatch_index)
                          for a in cls._calculate_single_rank_operations(fake, rank) if a is not None]
                assert schedule_ops(name, pp, local, micro, rank) == theirs, (name, pp, local, micro, rank)


def test_the_order_helpers():
    ops = schedule_ops("1f1b", 2, 1, 4, 0)
    assert ops == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2),
                   ("B", 0, 3)]
    assert peak_in_flight(ops, [10]) == (20, 2)
    # FSDP2 gathers a stage for each forward (resharded after it) and for each backward that follows a forward
    assert gathers_per_stage(ops, 1, True) == [5] and gathers_per_stage(ops, 1, False) == [1]
    assert gathers_per_stage(schedule_ops("gpipe", 2, 1, 4, 0), 1, True) == [5]
    assert pipeline_bubble(2, 1, 4) == 0.2 and pipeline_bubble(4, 2, 8) == 3 / 19


def test_the_bubble_formula_is_the_engines():
    """The engine's PipelinePlan.bubble_theory and config/parallel.py pipeline_bubble say the same."""
    pipeline_parallel = pytest.importorskip("fp8dist.engines.fsdp2.pipeline_parallel")
    for pp, local, micro in ((2, 1, 4), (4, 2, 8), (8, 1, 16)):
        plan = pipeline_parallel.PipelinePlan(schedule="1f1b", microbatches=micro, stages=pp * local,
                                              own=tuple((k * pp, range(k, k + 1)) for k in range(local)))
        assert plan.bubble_theory == pytest.approx(pipeline_bubble(pp, local, micro))


def test_the_json_has_the_pipeline_table_and_only_with_pipeline_parallel():
    document = json.loads(dump_json(_pp2().to_json()))
    assert list(document)[-1] == "pipeline"
    pipe = document["pipeline"]
    assert list(pipe) == ["schedule", "pipeline_size", "stages_per_rank", "microbatches", "microbatch_sequences",
                          "in_flight_rule", "bubble_theory", "heaviest_rank", "heaviest_why", "stages", "ranks"]
    assert pipe["stages"][0] == {"stage": 0, "pp_rank": 0, "layers": [0, 1], "embeddings": True, "lm_head": False,
                                 "parameters": FIRST,
                                 "activations_per_microbatch": pipe["stages"][0]["activations_per_microbatch"]}
    assert list(pipe["ranks"][1]) == ["pp_rank", "stages", "microbatches_in_flight", "per_rank_bytes",
                                      "transient_bytes", "phases_bytes", "highest_phase", "peak_bytes"]
    assert document["peak_bytes"] == pipe["ranks"][pipe["heaviest_rank"]]["peak_bytes"]
    assert "Schedule1F1B" in pipe["in_flight_rule"]
    assert "pipeline" not in estimate("small-llama", _spec(), 2).to_json()


def test_the_speed_section_has_the_bubble_and_the_point_to_point_bytes():
    result = _pp2(gpu="h100")
    speed = result.speed
    assert speed is not None and speed.pipeline is not None
    # each rank sends one direction: rank 0 the activations forward, rank 1 their gradients backward; 4 microbatches
    # of 1 x 64 tokens x 256 hidden in bf16
    assert speed.communication["pp"]["bytes"] == 4 * 1 * SEQ * HIDDEN * 2 == speed.pipeline["point_to_point_bytes"]
    assert not speed.communication["pp"]["overlapped"]
    busy = speed.step_s - speed.parts["optimizer"] - speed.parts["pipeline_bubble"]
    assert speed.parts["pipeline_bubble"] == pytest.approx(busy * 0.2 / 0.8)
    assert speed.pipeline["bubble_theory"] == 0.2
    # every pipeline rank of a data rank runs the same tokens: per GPU, half of them
    assert speed.tokens_per_s == pytest.approx(4 * SEQ / 2 / speed.step_s)
    # the GEMMs are a microbatch's: 1 x 64 tokens
    assert {row.m for row in speed.linears} == {SEQ}
    assert "pp" not in estimate("small-llama", _spec(), 2, gpu="h100").speed.communication


def test_the_cli_prints_the_per_stage_line():
    result = run_cli("estimate", "small-llama", "--world-size", "4", "parallel.pipeline_size=2",
                     "train.micro_batch_size=4")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("pipeline: "))
    assert "1f1b over pp 2" in line and "bubble 20.0%" in line
    assert "pp rank 0 (stage 0: embeddings + layers 0-1; 2 in flight) 23.91 MiB" in line
    assert "pp rank 1 (stage 1: layers 2-3 + norm + lm_head; 1 in flight)" in line
    assert "Peak per rank (pp rank 0, the heaviest) on the device: 23.91 MiB" in result.stdout


def test_a_model_the_engine_cannot_split_is_refused_naming_the_key(tmp_path):
    """OPT's decoder keeps its layers under model.decoder: the run's own refusal (engines/fsdp2/pipeline_parallel.py
    decoder_of), said by the estimate before it counts anything."""
    from transformers import OPTConfig

    OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
              word_embed_proj_dim=64, max_position_embeddings=256, tie_word_embeddings=False).save_pretrained(tmp_path)
    result = run_cli("estimate", tmp_path, "--world-size", "2", "parallel.pipeline_size=2", "train.micro_batch_size=4")
    assert result.returncode == 2
    assert "parallel.pipeline_size" in result.stderr and "not a Hugging Face decoder" in result.stderr
    assert "fix: parallel.pipeline_size=1" in result.stderr
    # microbatches that do not divide the micro-batch: the config's own rule, with the key and the fix
    result = run_cli("estimate", "small-llama", "--world-size", "2", "parallel.pipeline_size=2",
                     "train.micro_batch_size=2")
    assert result.returncode == 2
    assert "parallel.pipeline_microbatches" in result.stderr and "train.micro_batch_size" in result.stderr
