"""Audit inputs a user will hand it (issue 13): bare modules get an inferred input; a factory that raises, a
truncated or garbage safetensors file and a config.json that is not JSON exit 2 with the cause in one
message, never a traceback or torchrun's failure dump. And fp8dist's own runtime audits its first step."""
import shutil

import pytest

from tests.conftest import ROOT, run_cli
from tests.distributed.launch import cli_in_world, describe, in_world, torchrun

pytestmark = pytest.mark.distributed
TRAIN = ROOT / "launch" / "train.py"


def _clean_exit_2(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("factory,gemm_operands", [("token_mlp", "fp32"), ("feature_mlp", "fp32")])
def test_a_bare_module_gets_an_inferred_input(factory, gemm_operands):
    result = cli_in_world("audit", f"tests.audit_factories:{factory}", "--config", ROOT / "configs" / "fp32.yaml",
                     "--nproc", "1", "--format", "markdown", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "**PASS**" in result.stdout and f"| training | {gemm_operands} | {gemm_operands} |" in result.stdout


def test_a_module_with_no_inferable_input_asks_for_make_batch():
    result = cli_in_world("audit", "tests.audit_factories:conv_first", "--nproc", "1", timeout=300)
    _clean_exit_2(result, "cannot tell the input of ConvFirst", "make_batch")


def test_a_factory_that_raises_is_one_message():
    result = run_cli("audit", "tests.audit_factories:raises", "--nproc", "1", timeout=300)
    _clean_exit_2(result, "raised RuntimeError: weights file /data/ckpt.pt is missing")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import tiny_config

    path = tmp_path_factory.mktemp("hf") / "llama"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    return path


@pytest.mark.parametrize("damage,says", [
    ("truncate", "incomplete metadata, file not fully covered"),
    ("garbage", "header too large"),
])
def test_a_damaged_safetensors_file_is_named(tmp_path, saved_model, damage, says):
    model = tmp_path / "model"
    shutil.copytree(saved_model, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 5000)
    result = cli_in_world("audit", model, "--nproc", "1", timeout=120)
    _clean_exit_2(result, str(weights), says)


def test_a_config_json_that_is_not_json_is_named(tmp_path, saved_model):
    model = tmp_path / "model"
    shutil.copytree(saved_model, model)
    (model / "config.json").write_text("{not json")
    result = cli_in_world("audit", model, "--nproc", "1", timeout=120)
    _clean_exit_2(result, str(model / "config.json"), "not JSON")


def test_train_py_audits_step_1_and_prints_the_table_once():
    result = in_world(TRAIN, "--fp8dist-config", ROOT / "configs" / "fsdp2-bf16.yaml", "--steps", "2")
    assert result.returncode == 0, describe(result)
    assert result.stdout.count("fp8dist audit:") == 1 and "PASS: every phase" in result.stdout, result.stdout
    assert result.stdout.index("PASS") < result.stdout.index("step 1 loss")


def test_train_py_with_audit_raise_stops_on_a_mismatch():
    """A model that computes in fp32 under a bf16 config: audit.first_step=raise ends the run with exit 1 on
    every rank, naming the phase; warn would print the same table and go on."""
    result = torchrun(TRAIN, "--model", "tests.audit_factories:secretly_fp32", "--fp8dist-config",
                      ROOT / "configs" / "fsdp2-bf16.yaml", "--fp8dist-set", "audit.first_step=raise", "--steps", "2")
    assert result.returncode == 1, describe(result)
    assert "training" in result.stderr and "MISMATCH" in result.stderr and "step 2 loss" not in result.stdout
    off = in_world(TRAIN, "--model", "tests.audit_factories:secretly_fp32", "--fp8dist-config",
                   ROOT / "configs" / "fsdp2-bf16.yaml", "--fp8dist-set", "audit.first_step=off", "--steps", "2")
    assert off.returncode == 0 and "fp8dist audit" not in off.stdout + off.stderr, describe(off)
