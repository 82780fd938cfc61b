"""Another tool's file given where an fp8dist config belongs (issue 46, item 6): one problem naming the tool and the
`fp8dist import` to run, recognised by the importers' own evidence, instead of one unknown-key line per key."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError
from tests.conftest import ROOT

CORPUS = ROOT / "tests" / "data" / "corpus"


@pytest.mark.parametrize("relative, tool", [
    ("axolotl/deepspeed_configs/zero3_bf16.json", "a DeepSpeed config"),
    ("accelerate/accelerate__examples_config_yaml_templates_fp8.yaml", "an Accelerate config"),
    ("axolotl/axolotl__examples_llama-2_lora.yml", "an Axolotl config"),
    ("trl/alignment-handbook__recipes_constitutional-ai_dpo_config_anthropic.yaml", "a TRL / alignment-handbook recipe"),
])
def test_another_tools_file_is_named_with_the_import_to_run(relative, tool):
    path = CORPUS / relative
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    (issue,) = raised.value.issues
    assert issue.message.startswith(f"this is {tool}, not an fp8dist config"), issue.message
    assert issue.fix == f"fp8dist import {path} -o {path.stem}.fp8dist.yaml, then pass {path.stem}.fp8dist.yaml instead"
    assert "unknown key" not in str(raised.value)


def test_a_dict_of_another_tool_names_no_file_and_an_fp8dist_config_with_a_stray_key_gets_its_key_named():
    with pytest.raises(ConfigError) as raised:
        load_config({"zero_optimization": {"stage": 3}, "train_batch_size": 8})
    assert "this is a DeepSpeed config" in str(raised.value) and "fp8dist import FILE -o fp8dist.yaml" in str(raised.value)
    # fp8dist configs with a DeepSpeed key in them (its `engine`; its `optimizer` in fp8dist's form): the key is named
    for document in ({"engine": "deepspeed", "zero_optimization": {"stage": 3}},
                     {"optimizer": {"lr": 1e-4}, "zero_optimization": {"stage": 3}}):
        with pytest.raises(ConfigError) as raised:
            load_config(document)
        assert [(issue.path, issue.message) for issue in raised.value.issues] == [("zero_optimization", "unknown key")]
    with pytest.raises(ConfigError) as raised:  # a key both write (`optimizer`), alone, wrong in fp8dist's form
        load_config({"optimizer": {"lr": -1}})
    assert [issue.path for issue in raised.value.issues] == ["optimizer.lr"]


def test_the_cli_says_it_once_and_exits_2():
    from tests.unit.commands.test_odd_input import cli, refused

    path = CORPUS / "axolotl/deepspeed_configs/zero3_bf16.json"
    result = cli("validate", path)
    refused(result, "1 problem(s)", "this is a DeepSpeed config", f"fp8dist import {path}")
