"""CLI contract: exit codes, stdout holds only the document, atomic -o, light imports."""
import json
import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, ROOT, run_cli

HEAVY = ("torch", "deepspeed", "torchao", "transformers", "transformer_engine", "msamp", "accelerate")


@pytest.mark.parametrize("argv", [
    ["validate", "configs/fsdp2-bf16.yaml"],
    ["translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "deepspeed"],
    ["translate", "configs/fsdp2-torchao-float8.yaml", "--to", "fsdp2"],
    ["translate", "configs/fsdp2-bf16-pure.yaml", "--to", "accelerate"],
    ["translate", "configs/deepspeed-bf16-zero3.yaml", "--to", "accelerate"],
    ["import", "tests/data/fixtures/accelerate_fsdp_config.yaml"],
    ["import", "tests/data/fixtures/axolotl_fp8_fsdp2.yaml"],
    ["schema"],
])
def test_light_commands_do_not_import_heavy_packages(argv):
    code = ("import sys; from fp8dist.cli import main; rc = main(%r); "
            "print('LOADED=' + ','.join(m for m in %r if m in sys.modules), file=sys.stderr); raise SystemExit(rc)"
            % (argv, HEAVY))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "LOADED=\n" in result.stderr or result.stderr.rstrip().endswith("LOADED="), result.stderr


def test_validate_all_examples():
    result = run_cli("validate", *CONFIGS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ok ") == len(CONFIGS)


def test_validate_prints_resolved_config_as_json():
    result = run_cli("validate", "configs/fsdp2-bf16.yaml", "--format", "json", "train.steps=3")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["train"]["steps"] == 3 and doc["precision"]["master_weights"] == "fp32"


def test_schema_command_prints_a_json_schema():
    from jsonschema import Draft202012Validator

    result = run_cli("schema")
    Draft202012Validator.check_schema(json.loads(result.stdout))


def test_translate_stdout_is_only_json_and_o_writes_atomically(tmp_path):
    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "deepspeed")
    assert json.loads(result.stdout)["bf16"] == {"enabled": True}
    out = tmp_path / "ds.json"
    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "deepspeed", "-o", out)
    assert result.returncode == 0 and result.stdout == "" and json.loads(out.read_text())["zero_optimization"]
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]


def test_translate_error_writes_no_file(tmp_path):
    out = tmp_path / "ds.json"
    result = run_cli("translate", "configs/msamp-o3.yaml", "--to", "deepspeed", "--deepspeed-version", "0.19.8",
                     "-o", out)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_exit_2():
    assert run_cli().returncode == 2
    assert run_cli("translate", "configs/fp32.yaml").returncode == 2  # --to missing
    assert run_cli("translate", "configs/fp32.yaml", "--to", "fsdp2", "--deepspeed-version", "0.13.1").returncode == 2
    result = run_cli("translate", "configs/fp32.yaml", "--to", "deepspeed", "--deepspeed-version", "banana")
    assert result.returncode == 2 and "not a version" in result.stderr


def test_env_reports_backends_and_reasons():
    result = run_cli("env", "--format", "json")
    assert result.returncode == 0
    info = json.loads(result.stdout)
    assert set(info["backends"]) == {"fsdp2", "deepspeed", "torchao_float8", "transformer_engine", "msamp"}
    for status in info["backends"].values():
        assert status["reason"]
    if not info["device"]["cuda_available"]:
        assert info["backends"]["transformer_engine"]["usable"] is False
        assert "emulate" in info["backends"]["torchao_float8"]["reason"]


@pytest.mark.parametrize("argv,says", [
    (["estimate", "tiny-llama", "--config", "configs/fsdp2-bf16.yaml", "train.seq_len=zero"], "train.seq_len"),
    (["audit", "tiny-llama", "--config", "configs/fsdp2-bf16.yaml", "precision.load_dtyp=bf16"], "did you mean"),
    (["compare", "--config", "configs/fsdp2-torchao-float8.yaml", "--baseline", "configs/fsdp2-bf16.yaml",
      "engine=ddp"], "engine"),
])
def test_audit_estimate_and_compare_take_overrides_and_refuse_bad_ones_before_launching(argv, says):
    """The same KEY=VALUE overrides as validate/translate; a bad one is exit 2 naming the key, before any rank is
    launched (estimate: before torch is imported, as the light commands)."""
    code = ("import sys; from fp8dist.cli import main; rc = main(%r); "
            "print('TORCH=' + str('torch' in sys.modules), file=sys.stderr); raise SystemExit(rc)" % (argv,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert argv[0] != "estimate" or "TORCH=False" in result.stderr, result.stderr


def test_estimate_override_changes_the_estimate():
    base = run_cli("estimate", "tiny-llama", "--config", "configs/fsdp2-bf16.yaml", "--format", "json")
    longer = run_cli("estimate", "tiny-llama", "--config", "configs/fsdp2-bf16.yaml", "train.seq_len=256",
                     "--format", "json")
    assert base.returncode == longer.returncode == 0, base.stderr + longer.stderr
    base, longer = json.loads(base.stdout), json.loads(longer.stdout)
    assert longer["seq_len"] == 256 and base["seq_len"] == 64
    assert longer["per_rank_bytes"]["activations"] > 3 * base["per_rank_bytes"]["activations"]
    assert longer["per_rank_bytes"]["weights"] == base["per_rank_bytes"]["weights"]
