"""fp8dist/estimate/ below the command: the typed `Estimate` and its JSON document, the phases of the memory model,
the activations a rank holds per checkpointing mode, the shape names the CLI offers, and a package that imports no
torch until a model is built. (The estimate of real models: tests/unit/commands/test_estimate.py.)"""
import dataclasses
import json
import subprocess
import sys

import pytest

from fp8dist.commands.output import dump_json
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.estimate.memory import estimate, phases
from fp8dist.estimate.model import MeasuredActivations
from fp8dist.estimate.result import (PHASES, STORES, ActivationBytes, Estimate, ExpertParallelCounted, Fp8Coverage,
                                     FrozenFormat, LeftOut, TensorParallelCounted, TransientBytes)
from tests.conftest import ROOT

# The documented keys of `fp8dist estimate --format json`, in order (README: "Estimate memory before a run").
JSON_KEYS = ["model", "shape_only", "parameters", "world_size", "mesh", "trainable_parameters", "frozen_parameters",
             "frozen_bytes_per_param", "frozen_bytes_by_format", "nf4_kept", "engine", "config", "preset",
             "micro_batch_size", "seq_len", "bytes_per_param", "master_weights_note", "shards", "tensor_parallel", "expert_parallel", "per_rank_bytes",
             "offloaded_to_host", "host_bytes", "activations_bytes", "phases_bytes", "highest_phase", "peak_bytes",
             "fp8_extras_counted", "transient_bytes", "fp8_coverage"]


def _estimate(**changes) -> Estimate:
    """A hand-made estimate: each store a different power of two, so that a sum names the stores it holds."""
    per_rank = {store: 2 ** i for i, store in enumerate(STORES)}
    fields = dict(
        model="m", shape_only=True, world_size=4, mesh={"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2},
        trainable_parameters=10, frozen_parameters=5,
        frozen_bytes_per_param=2.0,
        frozen_bytes_by_format={"bf16": FrozenFormat(parameters=5, bytes=10, per_rank_bytes=10, bytes_per_param=2.0)},
        nf4_kept=(), engine="deepspeed", config="c.yaml", preset=None, micro_batch_size=2, seq_len=8,
        bytes_per_param={"weights": 2.0, "master_weights": 4.0, "gradients": 2.0, "optimizer": 8.0},
        master_weights_note=None, shards={"weights": 1, "master_weights": 2, "gradients": 2, "optimizer": 2},
        tensor_parallel=TensorParallelCounted(plan="LlamaConfig.base_model_tp_plan", split_parameters=8,
                                              vocabulary_split=False, sequence_parallel=True),
        expert_parallel=ExpertParallelCounted(ep=1, efsdp=2, expert_parameters=0, moe_layers=0, dispatch_kept=0),
        per_rank_bytes=per_rank, offloaded_to_host=("master_weights", "optimizer"),
        activations_bytes=ActivationBytes(none=64, full_checkpointing=16, selective_checkpointing=32, mode="none"),
        phases_bytes={"model": 3, "gradients": 7, "backward_pass": 30, "optimizer_step": 15,
                      "later_backward_pass": 38},
        fp8_extras_counted="no FP8 backend", transient_bytes=TransientBytes(unsharded_units=0, logits_gradient=6),
        fp8_coverage=Fp8Coverage(backend="torchao", fp8_share=0.5, linears=3, converted=2,
                                 left_out=(LeftOut("lm_head", "excluded by pattern 'lm_head'"),),
                                 too_small_to_gain=("layers.0.q",), experts=0))
    return Estimate(**{**fields, **changes})


def test_the_json_document_keeps_its_keys_and_derives_the_totals():
    result = _estimate()
    document = json.loads(dump_json(result.to_json()))  # strict JSON: every value is JSON's own
    assert list(document) == JSON_KEYS
    assert document["parameters"] == 15  # trainable + frozen
    assert document["host_bytes"] == result.per_rank_bytes["master_weights"] + result.per_rank_bytes["optimizer"]
    assert document["highest_phase"] == "later_backward_pass" and document["peak_bytes"] == 38
    assert document["offloaded_to_host"] == ["master_weights", "optimizer"]
    assert document["activations_bytes"] == {"none": 64, "full_checkpointing": 16, "selective_checkpointing": 32,
                                             "mode": "none"}
    assert document["frozen_bytes_by_format"] == {"bf16": {"parameters": 5, "bytes": 10, "per_rank_bytes": 10,
                                                           "bytes_per_param": 2.0}}
    assert document["nf4_kept"] == []
    assert document["fp8_coverage"]["left_out"] == [{"fqn": "lm_head", "reason": "excluded by pattern 'lm_head'"}]
    assert document["fp8_coverage"]["too_small_to_gain"] == ["layers.0.q"]
    assert list(document["per_rank_bytes"]) == list(STORES) and list(document["phases_bytes"]) == list(PHASES)
    assert document["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert document["tensor_parallel"] == {"plan": "LlamaConfig.base_model_tp_plan", "split_parameters": 8,
                                           "vocabulary_split": False, "sequence_parallel": True}
    assert document["expert_parallel"] == {"ep": 1, "efsdp": 2, "expert_parameters": 0, "moe_layers": 0,
                                           "dispatch_kept": 0}


def test_the_peak_is_the_highest_phase_wherever_it_is():
    one_step = _estimate(phases_bytes={"model": 3, "gradients": 7, "backward_pass": 9, "optimizer_step": 40,
                                       "later_backward_pass": 20})
    assert one_step.highest_phase == "optimizer_step" and one_step.peak_bytes == 40
    assert _estimate(offloaded_to_host=()).host_bytes == 0


def test_an_estimate_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _estimate().world_size = 8


def test_each_phase_holds_the_stores_alive_in_it():
    """Cumulative phases (the Model Memory Usage tool's columns, then backward from step 2 on): which stores and
    transient bytes each holds, read back from sums of distinct powers of two."""
    device = {store: 2 ** i for i, store in enumerate(STORES)}
    transient = TransientBytes(unsharded_units=2 ** 7, logits_gradient=2 ** 8, all_to_all=2 ** 9,
                               nf4_dequantize=2 ** 10)
    names = [*STORES, "unsharded_units", "logits_gradient", "all_to_all", "nf4_dequantize"]

    def alive(total: int) -> set[str]:
        return {name for i, name in enumerate(names) if total >> i & 1}

    counted = {phase: alive(n) for phase, n in phases(device, transient).items()}
    model = {"weights", "master_weights", "buffers"}
    backward = model | {"gradients", "activations", "fp8_extras", "unsharded_units", "logits_gradient", "all_to_all",
                        "nf4_dequantize"}
    assert counted == {"model": model, "gradients": model | {"gradients"}, "backward_pass": backward,
                       "optimizer_step": model | {"gradients", "optimizer"},
                       "later_backward_pass": backward | {"optimizer"}}
    host = {**device, "optimizer": 0, "master_weights": 0}  # what offloading leaves on the device
    assert "optimizer" not in alive(phases(host, transient)["later_backward_pass"])


def test_checkpointing_adds_one_recomputed_block_to_what_is_kept():
    measured = MeasuredActivations(kept={"none": 1000, "full": 100, "selective": 300}, recomputed_block=50)
    assert [measured.per_rank(mode) for mode in ("none", "full", "selective")] == [1000, 150, 350]


def test_a_world_the_parallel_dims_do_not_fit_is_refused_before_a_model_is_built():
    spec = load_config({"parallel": {"sharding": "hybrid", "shard_size": 4}})
    with pytest.raises(Fp8distError, match="parallel.shard_size=4"):
        estimate("no-such-model", spec, 6)  # the world is checked first: no model is looked up


def test_the_help_reads_the_shape_names_from_the_shape_zoo(monkeypatch):
    from fp8dist.cli import build_parser
    from fp8dist.estimate import shapes

    monkeypatch.setitem(shapes.SHAPES, "new-shape-7b", {"model_type": "llama"})
    estimate_parser = build_parser()._subparsers._group_actions[0].choices["estimate"]
    help_text = next(action.help for action in estimate_parser._actions if action.dest == "model")
    assert "new-shape-7b" in help_text


def test_the_package_imports_no_torch_until_a_model_is_built():
    code = ("import sys, fp8dist.commands.estimate, fp8dist.estimate.coverage, fp8dist.estimate.memory, "
            "fp8dist.estimate.model; print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]
