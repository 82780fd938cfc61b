"""`fp8dist compare` for real (2 gloo ranks: the kept world, and torchrun for the timeout): float8 and fp32 track bf16 within tolerance, a run built to
diverge fails with exit 1, the PNG and the JSON carry both curves, a user's text file feeds the batches."""
import json

import pytest

from tests.conftest import ROOT, run_cli
from tests.distributed.launch import cli_in_world

pytestmark = pytest.mark.distributed
CONFIGS = ROOT / "configs"


def compare(*args, timeout=600):
    """`fp8dist compare ARGS`, its 2-rank job in the kept world (the launcher's own timeout: a real launch below)."""
    return cli_in_world("compare", *args, timeout=timeout)


def _model_dir_with_tokenizer(path, text):
    """tiny-llama saved as a Hugging Face directory with a word-level tokenizer trained on `text` (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from fp8dist.config.models import tiny_llama_config

    AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(path)
    return path


def test_float8_tracks_bf16_on_a_users_text_file_with_a_plot(tmp_path):
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 150
    data = tmp_path / "sample.jsonl"
    data.write_text("\n".join(json.dumps({"text": text[i:i + 500]}) for i in range(0, len(text), 500)))
    model = _model_dir_with_tokenizer(tmp_path / "model", text)
    plot = tmp_path / "curves.png"
    result = compare("--config", CONFIGS / "fsdp2-torchao-float8.yaml", "--baseline", CONFIGS / "fsdp2-bf16.yaml",
                     "--model", model, "--steps", "8", "--data", data, "--plot", plot, "--format", "json",
                     "--tolerance", "0.02")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["max_relative_gap"] < 0.02
    assert len(report["losses"]["config"]) == len(report["losses"]["baseline"]) == 8
    assert report["losses"]["config"] != report["losses"]["baseline"]  # two real runs, not one
    assert "tokenised by" in result.stderr and "baseline step 8/8" in result.stderr  # data source, progress
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert plot.stat().st_mode & 0o777 == 0o666 & ~mask  # the umask's mode, not a temporary file's 0600


def test_fp32_and_bf16_agree_within_tolerance():
    result = compare("--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fp32.yaml", "--steps", "6")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "PASS" in result.stdout and "largest relative gap" in result.stdout


def test_a_diverging_run_fails_with_exit_1(tmp_path):
    unstable = tmp_path / "unstable.yaml"
    unstable.write_text("precision: {preset: bf16}\noptimizer: {lr: 1.0}\ntrain: {gradient_clipping: 0}\n")
    result = compare("--config", unstable, "--baseline", CONFIGS / "fsdp2-bf16.yaml", "--steps", "6",
                     "--format", "markdown")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "**FAIL**" in result.stdout


@pytest.mark.parametrize("content,says", [(b"\x00\x01binary", "binary file"), (b"  \n", "empty file")])
def test_bad_data_exits_2_before_launching(tmp_path, content, says):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    result = compare("--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fp32.yaml", "--data", data)
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


def test_missing_model_and_bad_config_exit_2(tmp_path):
    result = compare("--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fp32.yaml", "--model", "nope")
    assert result.returncode == 2 and "unknown MODEL" in result.stderr
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{broken")
    result = compare("--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fp32.yaml", "--model", model)
    assert result.returncode == 2 and "config.json" in result.stderr and "Traceback" not in result.stderr


def test_configs_with_other_batches_are_refused(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text("precision: {preset: bf16}\ntrain: {seq_len: 32}\n")
    result = compare("--config", other, "--baseline", CONFIGS / "fsdp2-bf16.yaml")
    assert result.returncode == 2 and "train.seq_len (32 vs baseline 64)" in result.stderr


def test_compare_is_bounded_in_time():
    result = run_cli("compare", "--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fp32.yaml",
                     "--timeout", "1")
    assert result.returncode == 2 and "did not finish within 1 s" in result.stderr and "Traceback" not in result.stderr


def test_json_stays_strict_when_a_loss_is_not_finite():
    from fp8dist.commands.compare import as_json, verdict

    report = json.loads(as_json(verdict({"config": [1.0, float("nan")], "baseline": [1.0, 1.1]}, 0.05)))
    assert report["passed"] is False and report["max_relative_gap"] is None and report["losses"]["config"][1] is None


def test_moe_experts_in_mxfp8_track_bf16_with_routing_fixed_and_a_layer_report():
    """An MoE pair on the same weights and batches, 2 ranks: experts (and Linears) in MXFP8 vs the bf16 baseline,
    8 steps, the baseline's expert choices replayed, the layer report at steps 1 and 8."""
    result = compare("--config", CONFIGS / "fsdp2-moe-mxfp8.yaml", "--baseline", CONFIGS / "fsdp2-bf16.yaml",
                     "--model", "tiny-mixtral", "--steps", "8", "--format", "json", "--tolerance", "0.05",
                     "--nproc", "2", "--fixed-routing", "--layer-steps", "1,8")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["max_relative_gap"] <= 0.05, report
    assert report["fixed_routing"] is True
    assert len(report["losses"]["config"]) == len(report["losses"]["baseline"]) == 8
    assert report["losses"]["config"] != report["losses"]["baseline"]
    assert [step["step"] for step in report["layers"]] == [1, 8]
    for step in report["layers"]:
        assert [row["layer"] for row in step["layers"]] == ["model.layers.0", "model.layers.1"]
        for row in step["layers"]:  # MXFP8 emulated: real rounding, tens of dB, never bitwise equal
            assert all(15 < row[key] < 60 for key in ("activation_sqnr_db", "gradient_sqnr_db",
                                                      "expert_output_sqnr_db")), row
        assert step["first_parting"] is None and step["loss"]["relative_gap"] < 0.01, step


def test_the_layer_report_leaves_both_runs_as_they_were():
    """The config's run loads the baseline's weights for each probe pass and gets its own back bitwise: its losses
    with --layer-steps are those without; on identical configs every layer is equal."""
    args = ["--config", CONFIGS / "fsdp2-torchao-float8.yaml", "--baseline", CONFIGS / "fsdp2-bf16.yaml",
            "--steps", "3", "--nproc", "2", "--format", "json",
            "audit.numerics.min_sqnr_db.forward=31"]  # between the two layers' activation SQNRs (about 34 and 29)
    plain, probed = compare(*args), compare(*args, "--layer-steps", "1,3")
    assert plain.returncode == probed.returncode == 0, probed.stderr[-3000:]
    plain_report, report = json.loads(plain.stdout), json.loads(probed.stdout)
    assert report["losses"] == plain_report["losses"] and "layers" not in plain_report
    rows = [row for step in report["layers"] for row in step["layers"]]
    assert len(rows) == 4 and all(20 < row["activation_sqnr_db"] < 60 for row in rows), rows
    for step in report["layers"]:  # the first layer below the limit, with its value
        assert step["first_parting"]["layer"] == "model.layers.1" and step["first_parting"]["sqnr_db"] < 31
        assert step["first_parting"]["limit"] == 31 and step["first_parting_gradient"] is None
    same = compare("--config", CONFIGS / "fsdp2-bf16.yaml", "--baseline", CONFIGS / "fsdp2-bf16.yaml", "--steps",
                   "2", "--nproc", "2", "--format", "table", "--layer-steps", "2")
    assert same.returncode == 0 and "equal" in same.stdout and "no layer parts" in same.stdout, same.stdout


def test_a_lora_run_against_its_full_fine_tune(tmp_path):
    """The config's `adapter` is applied by compare too: with LoRA's B at zero the first step's loss is the full
    fine-tune's exactly (same weights, same batch), then the two runs train different parameters and part."""
    lora = tmp_path / "lora.yaml"
    lora.write_text((CONFIGS / "fsdp2-bf16.yaml").read_text() + "\nadapter:\n  kind: lora\n  r: 4\n")
    result = compare("--config", lora, "--baseline", CONFIGS / "fsdp2-bf16.yaml", "--steps", "4", "--format", "json",
                     "--tolerance", "0.05")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout)["losses"]
    assert losses["config"][0] == losses["baseline"][0]
    assert losses["config"][1:] != losses["baseline"][1:]
