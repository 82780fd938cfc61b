"""`fp8dist estimate`: meta-device model, parameter counts, per-rank stores, the Model Memory Usage tool's cells,
one peak, labelled output, bad input.
(Agreement with the audit's measured bytes: tests/distributed/test_estimate_vs_audit.py.)"""
import json
import subprocess
import sys

import pytest

from fp8dist.config.load import load_config
from fp8dist.estimate.memory import estimate
from fp8dist.estimate.model import build_meta_model
from fp8dist.config.models import tiny_config
from tests.conftest import ROOT, run_cli

# Published parameter counts of the public checkpoints whose shapes are built in.
PUBLISHED = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "bert-base-cased": 108_310_272,
             "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_builtin_shapes_have_the_published_parameter_counts(name):
    meta = build_meta_model(name, "bf16")
    assert meta.shape_only and sum(p.numel() for p in meta.model.parameters()) == PUBLISHED[name]
    assert all(p.device.type == "meta" for p in meta.model.parameters())


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gpt2"])
def test_unseen_hf_configs_count_like_the_real_model(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(tiny_config(arch))
    real.config.save_pretrained(tmp_path)  # config.json only: no weights are needed
    spec = load_config(ROOT / "configs" / "fsdp2-bf16.yaml")
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert estimate(model, spec, 2).parameters == sum(p.numel() for p in real.parameters())


def test_the_model_memory_usage_tools_bert_cells_reproduce():
    """The Model Memory Usage tool (huggingface.co/spaces/hf-accelerate/model-memory-usage), bert-base-cased in
    fp32: Model 413.18 MB, Optimizer step 1.61 GB, which are MiB and GiB (powers of 1024). Its Model cell is
    parameters plus buffers (two int64 buffers of 512); its Backward pass (826.36) is model + gradients without
    activations, which fp8dist adds (README, `fp8dist estimate`)."""
    result = estimate("bert-base-cased", load_config(ROOT / "configs" / "fp32.yaml"), 1)
    phases = result.phases_bytes
    assert round(phases["model"] / 2**20, 2) == 413.18
    assert round(phases["optimizer_step"] / 2**30, 2) == 1.61
    # The tool doubles the model cell buffers included (826.36); gradients exist for parameters only.
    assert phases["gradients"] / 2**20 == pytest.approx(826.36, abs=0.02)
    assert phases["backward_pass"] == phases["gradients"] + result.per_rank_bytes["activations"]


def test_stores_follow_the_engine_sharding():
    fsdp = estimate("tiny-llama", load_config(ROOT / "configs" / "fsdp2-bf16.yaml"), 4)
    n = fsdp.parameters
    assert fsdp.per_rank_bytes["weights"] == pytest.approx(n * 4 / 4, abs=1)  # fp32 shards
    assert fsdp.per_rank_bytes["master_weights"] == 0
    assert fsdp.master_weights_note is not None and fsdp.master_weights_note.startswith("the sharded fp32 parameters are the master weights")
    zero1 = estimate("tiny-llama", load_config(ROOT / "configs" / "deepspeed-bf16-zero1.yaml"), 4)
    assert zero1.master_weights_note is None and zero1.per_rank_bytes["master_weights"] == n * 4 / 4
    zero1_bytes = zero1.per_rank_bytes
    zero3 = estimate("tiny-llama", load_config(ROOT / "configs" / "deepspeed-bf16-zero3.yaml"), 4).per_rank_bytes
    assert zero1_bytes["weights"] == n * 2 and zero3["weights"] == pytest.approx(n * 2 / 4, abs=1)
    assert zero1_bytes["gradients"] == n * 2 and zero3["gradients"] == pytest.approx(n * 2 / 4, abs=1)
    assert zero1_bytes["optimizer"] == pytest.approx(n * 8 / 4, abs=1)


def test_offloaded_stores_leave_the_device_phases():
    spec = load_config({"engine": "deepspeed", "deepspeed": {"offload_optimizer": "cpu"}})
    result = estimate("tiny-llama", spec, 2)
    pr, phases = result.per_rank_bytes, result.phases_bytes
    assert result.offloaded_to_host == ("master_weights", "optimizer")
    assert result.host_bytes == pr["master_weights"] + pr["optimizer"] > 0
    assert phases["model"] == pr["weights"] + pr["buffers"] and phases["optimizer_step"] == phases["gradients"]
    assert result.peak_bytes == max(phases.values()) == phases[result.highest_phase]


def test_one_peak_labelled_columns_and_one_unit():
    """The table gives one total (the peak per rank), says its phase columns are cumulative, labels its binary
    units, and says where the masters are when they have no store of their own."""
    from fp8dist.commands.estimate import human, render_table

    result = estimate("tiny-llama", load_config(ROOT / "configs" / "fsdp2-bf16.yaml"), 2)
    text = render_table(result)
    assert "total" not in text.lower() and "Highest" not in text and "total" not in result.per_rank_bytes
    assert text.count("Peak per rank on the device: ") == 1
    assert f"Peak per rank on the device: {human(result.peak_bytes)}, in phase Backward, step 2+" in text
    assert "cumulative: each column holds every store alive then" in text and "powers of 1024" in text
    masters = next(line for line in text.splitlines() if line.startswith("master weights"))
    assert "the sharded fp32 parameters are the master weights" in masters and "0 B" not in masters
    assert " GB" not in text and " MB" not in text and "KiB" in text
    fp32 = estimate("tiny-llama", load_config(ROOT / "configs" / "fp32.yaml"), 2)
    assert "master weights  none: the optimizer steps the weights themselves" in render_table(fp32)
    assert "| master weights | none: the optimizer steps the weights themselves" in render_table(fp32, markdown=True)


def test_activation_checkpointing_saves_activations():
    result = estimate("llama-3-8b", load_config(ROOT / "configs" / "fsdp2-bf16.yaml"), 8)
    act = result.activations_bytes
    assert 0 < act.full_checkpointing < act.selective_checkpointing < act.none / 2
    assert result.per_rank_bytes["activations"] == act.none  # the config's mode: none


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_activations_are_what_the_engine_keeps(mode):
    """The estimate's kept bytes per mode equal what the engines' activation checkpointing really keeps after a
    forward (engines/activation_checkpointing.py kept_for_backward), on a real bf16 model on this CPU; the
    per-rank figure adds one block recomputed in backward."""
    import torch

    from fp8dist.estimate.model import activation_bytes
    from fp8dist.engines import activation_checkpointing
    from fp8dist.engines.blocks import wrap_units
    from fp8dist.runtime.models import load_model

    spec = load_config(ROOT / "configs" / "fsdp2-bf16.yaml",
                       overrides=[f"parallel.activation_checkpointing={mode}", "train.micro_batch_size=2",
                                  "train.seq_len=64"])
    counted = activation_bytes(build_meta_model("tiny-llama", "bf16"), spec)
    model = load_model("tiny-llama", "bf16").model
    activation_checkpointing.apply(model, wrap_units(model, spec), mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    with activation_checkpointing.kept_for_backward() as kept:
        model(input_ids=ids, labels=ids)
        assert counted.kept[mode] == pytest.approx(kept(), rel=0.10)
    assert estimate("tiny-llama", spec, 1).per_rank_bytes["activations"] == counted.per_rank(mode)


# Published peaks, torchao's Llama-3-8B on 8xH100, batch 1 x 8192, FSDP2 + compile + selective AC
# (pytorch/ao docs/source/workflows/training.md): bf16 47.65, float8 tensorwise 47.77, headed "GB" but torchtitan's
# memory figures, which it reports in GiB (the bf16 figure is "memory: 47.65GiB" in the torchtitan log quoted in
# pytorch/torchtitan commit 7a04053).
@pytest.mark.parametrize("config, published", [("fsdp2-bf16.yaml", 47.65 * 2**30),
                                               ("fsdp2-torchao-float8.yaml", 47.77 * 2**30)])
def test_llama_3_8b_highest_is_within_20_percent_of_the_published_peak(config, published):
    spec = load_config(ROOT / "configs" / config, overrides=[
        "parallel.activation_checkpointing=selective", "train.micro_batch_size=1", "train.seq_len=8192"])
    result = estimate("llama-3-8b", spec, 8)
    assert result.highest_phase == "later_backward_pass"
    assert result.peak_bytes == pytest.approx(published, rel=0.20)
    assert result.transient_bytes.logits_gradient == 8192 * 128256 * 6  # fp32 + bf16 logits gradient


def test_fp8_coverage_follows_the_module_filter():
    spec = load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml")
    coverage = estimate("llama-3-8b", spec, 8).fp8_coverage
    assert coverage.converted == coverage.linears - 1  # lm_head excluded
    assert any(item.fqn == "lm_head" and "excluded" in item.reason for item in coverage.left_out)
    assert 0.7 < coverage.fp8_share < 1.0  # lm_head stays in bf16
    small = estimate("tiny-llama", spec, 2).fp8_coverage
    assert small.too_small_to_gain and small.converted + len(small.left_out) == small.linears
    assert estimate("tiny-llama", load_config(ROOT / "configs" / "fsdp2-bf16.yaml"), 2).fp8_coverage.fp8_share == 0


@pytest.mark.parametrize("experts", ["none", "mxfp8"])
def test_moe_coverage_counts_the_experts_as_the_audit_measures_them(experts):
    """estimate's FP8 share of weight-GEMM FLOPs (top-k experts per token) within a few points of the share the
    audit measures on the same model and config (tests/unit/audit/test_gemm_flops.py runs the step)."""
    from tests.unit.audit.test_gemm_flops import _converted_mixtral

    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "experts": experts}}}})
    coverage = estimate("tiny-mixtral", spec, 2).fp8_coverage
    # enough tokens that MXFP8's padding of each expert's rows to 32 (real FLOPs, not in the estimate) is small
    measured = _converted_mixtral(experts, tokens=(8, 256))["fp8_share"]
    assert abs(coverage.fp8_share - measured) < 0.05, (coverage.fp8_share, measured)
    left_out = {item.fqn for item in coverage.left_out}
    assert ("model.layers.0.mlp.experts" in left_out) == (experts == "none")
    big = estimate("mixtral-8x7b", spec, 8).fp8_coverage.fp8_share
    assert (big > 0.95) if experts == "mxfp8" else (big < 0.2)  # experts are ~89% of Mixtral's weight GEMMs


def test_json_contract_and_formats():
    result = run_cli("estimate", "tiny-llama", "--config", "configs/fsdp2-torchao-float8.yaml", "--world-size", "2",
                     "--format", "json")
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout)
    assert isinstance(data["parameters"], int) and data["world_size"] == 2
    assert set(data["per_rank_bytes"]) == {"weights", "master_weights", "gradients", "optimizer", "buffers",
                                            "fp8_extras", "activations"}
    assert data["peak_bytes"] == data["phases_bytes"][data["highest_phase"]]
    assert data["per_rank_bytes"]["fp8_extras"] > 0
    table = run_cli("estimate", "llama-3-8b", "--world-size", "64")
    assert table.returncode == 0 and "shape only" in table.stdout and "Optimizer step" in table.stdout
    md = run_cli("estimate", "bert-base-cased", "--config", "configs/fp32.yaml", "--format", "markdown")
    assert md.returncode == 0 and ("| Model | Gradients | Backward pass | Optimizer step | Backward, step 2+ |"
                                   in md.stdout) and "**Peak per rank on the device: " in md.stdout


def test_estimate_imports_no_torch_before_the_config_is_valid(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: {load_dtype: fp64}\n")
    code = ("import sys; from fp8dist.cli import main; rc = main(['estimate', 'tiny-llama', '--config', %r]); "
            "print('TORCH=' + str('torch' in sys.modules), file=sys.stderr); raise SystemExit(rc)" % str(bad))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "precision.load_dtype" in result.stderr and "TORCH=False" in result.stderr


@pytest.mark.parametrize("setup,args,says", [
    (None, ["no-such-model"], "unknown MODEL"),
    ("{not json", ["{dir}"], "not a JSON config"),
    ('{"hidden_size": 8}', ["{dir}/config.json"], "needs a `model_type` key"),
    (None, ["tiny-llama", "--world-size", "0"], "--world-size must be at least 1"),
])
def test_bad_input_exits_2(tmp_path, setup, args, says):
    if setup is not None:
        (tmp_path / "config.json").write_text(setup)
    result = run_cli("estimate", *[a.replace("{dir}", str(tmp_path)) for a in args])
    assert result.returncode == 2 and says in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_help_names_every_built_in_model_and_shape():
    from fp8dist.cli import build_parser
    from fp8dist.estimate.shapes import SHAPES
    from fp8dist.config.models import BUILTIN

    estimate_parser = build_parser()._subparsers._group_actions[0].choices["estimate"]
    help_text = next(action.help for action in estimate_parser._actions if action.dest == "model")
    assert all(name in help_text for name in [*SHAPES, *BUILTIN]), help_text
