"""A new user's first hour, round two (issue 46): each fix names the flag of the command that prints it (item 4), a
bad word gets the command's own usage and `run` its `--` (item 7), one model resolver (item 8), every up-front
problem at once (item 9), and the smaller ones (item 11). In-process (tests/unit/commands/test_odd_input.py cli)."""
import os
import warnings

import pytest

from fp8dist import library_noise
from tests.conftest import ROOT
from tests.unit.commands.test_odd_input import cli, refused

EP = ROOT / "configs" / "fsdp2-moe-ep-mxfp8.yaml"
BF16 = ROOT / "configs" / "fsdp2-bf16.yaml"


# -- item 4: the fix names the command's own flag -------------------------------------------------------------
def test_the_readme_expert_parallel_compare_on_one_process_names_nproc():
    result = cli("compare", "--config", EP, "--baseline", BF16, "--model", "tiny-mixtral")
    refused(result, "parallel.expert_size=2 does not divide", "fix: run on a multiple of 2 ranks (--nproc 2)")


def test_estimate_names_world_size():
    result = cli("estimate", "tiny-mixtral", "--config", EP, "--world-size", "3")
    refused(result, "fix: run on a multiple of 2 ranks (--world-size 4)")


# -- item 7: usage and help -----------------------------------------------------------------------------------
def test_a_bad_flag_prints_the_commands_usage_not_the_top_level_one():
    result = cli("audit", "tiny-llama", "--bogus")
    refused(result, "usage: fp8dist audit", "fp8dist audit: error: unrecognized arguments: --bogus")
    assert "{validate," not in result.err


def test_run_without_double_dash_says_where_the_script_goes():
    result = cli("run", BF16, "launch/train.py", "--model", "tiny-llama")
    refused(result, "usage: fp8dist run CONFIG", "fix: the script and its arguments follow `--`: fp8dist run CONFIG "
            "[KEY=VALUE ...] -- launch/train.py --model tiny-llama")


def test_the_top_level_help_is_whole_and_names_every_command():
    from fp8dist.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    description = parser.description or ""
    assert description.startswith("fp8dist: one precision config for DeepSpeed and FSDP2, with FP8 and a dtype audit.")
    assert all(name in description for name in commands) and "run" in commands


# -- item 8: one model resolver -------------------------------------------------------------------------------
def test_estimate_has_the_audits_did_you_mean_and_takes_a_shapes_hub_id():
    refused(cli("estimate", "llama3-8b"), "unknown MODEL 'llama3-8b': did you mean llama-3-8b?")
    refused(cli("audit", "tiny-lama"), "unknown MODEL 'tiny-lama': did you mean tiny-llama?")
    from fp8dist.estimate.model import _hf_config

    config = _hf_config("meta-llama/Meta-Llama-3-8B")  # the shape kept for that id: no network
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 32, 4096)


def test_estimate_reads_a_hub_id_as_the_audit_does_and_refuses_a_factory():
    from fp8dist.estimate.shapes import SHAPES
    from fp8dist.config.models import model_kind

    assert model_kind("acme/some-model", SHAPES) == model_kind("acme/some-model") == "hub"
    refused(cli("estimate", "tests.tp_models:unseen_qwen2_qlora"), "is a factory", "name DIR or DIR/config.json")


def test_no_network_turns_on_the_hub_offline_mode_at_once(monkeypatch):
    """An unreachable Hub is found with one connection attempt, and offline mode set where the ranks inherit it
    and where huggingface_hub reads it, instead of 28 s of retries."""
    from huggingface_hub import constants

    from fp8dist.config import models

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a real connection, refused: port 9 listens nowhere here
    assert models.offline_unless_reachable() == "127.0.0.1"
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    assert models.offline_unless_reachable() is None  # set already: no second attempt


# -- item 9: every up-front problem at once -------------------------------------------------------------------
def test_a_compiled_config_on_cpu_without_emulate_lists_both_problems(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine may run FP8 for real")
    config = tmp_path / "compiled.yaml"
    config.write_text("precision: {preset: torchao-float8}\ncompile: true\n")
    result = cli("run", config, "--", "launch/train.py")
    refused(result, "2 problems", "set precision.fp8.torchao.emulate=true",
            "once precision.fp8.torchao.emulate=true is set (the fix above)",
            "emulated float8 does not work with torch.compile", "set compile=false")


def test_compare_says_every_refusal_at_once(tmp_path):
    result = cli("compare", "--config", EP, "--baseline", BF16, "--model", "tiny-mixtrl", "--plot",
                 tmp_path / "no-such-dir" / "x.png")
    refused(result, "2 problems", "--plot", "did you mean tiny-mixtral?")


# -- item 11 --------------------------------------------------------------------------------------------------
def test_a_tolerance_given_in_percent_is_refused_with_the_fraction():
    refused(cli("compare", "--config", BF16, "--baseline", BF16, "--tolerance", "5"),
            "--tolerance 5", "(500% here)", "fix: --tolerance 0.05 for 5%")


def test_presets_say_what_tables_a_and_b_are(capsys):
    from fp8dist.commands.schema import run_presets

    run_presets(None)
    out = capsys.readouterr().out
    assert "Table A row 'FP16 AMP'" in out
    assert "Table A: Precision per optimization level. Source: MS-AMP docs" in out
    assert "Table B: Dtypes by framework. Source: Accelerate docs" in out
    assert "https://huggingface.co/docs/accelerate/concept_guides/fsdp_and_deepspeed" in out


def test_pefts_read_of_the_deprecated_checkpointing_property_says_nothing():
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import BUILTIN

    model = AutoModelForCausalLM.from_config(BUILTIN["tiny-llama"]())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library_noise.install()
        getattr(model, "is_gradient_checkpointing", True)  # as peft 0.21 PeftModel.__init__ reads it
        warnings.warn("another FutureWarning", FutureWarning)
    assert [str(w.message) for w in caught] == ["another FutureWarning"]


def test_the_merged_export_shows_no_progress_bars():
    from transformers.utils import logging as transformers_logging

    from fp8dist.runtime.adapter_files import _no_progress_bars

    transformers_logging.enable_progress_bar()  # whatever a test before this one left
    with _no_progress_bars():
        assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled()
