"""A refusal's fix is one the user can apply: a type or range error names values that pass (and the suggested
value does pass), a bad override is named as the override (not the valid file), and `validate` refuses what
`translate` would refuse in `deepspeed.extra`, naming the fp8dist key that produces the conflicting DeepSpeed key."""
import json
import re

import pytest

from fp8dist.config.load import load_config
from fp8dist.config.schema import schema
from fp8dist.errors import ConfigError
from fp8dist.translate.deepspeed import GENERATED_FROM, extra_issues, generated_from, to_deepspeed
from tests.conftest import CONFIGS, ROOT, run_cli


def _leaves(node, path=()):
    for key, sub in node.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            yield from _leaves(sub, path + (key,))
        else:
            yield path + (key,), sub


def _nested(path, value):
    document = value
    for key in reversed(path):
        document = {key: document}
    return document


# Every key whose fix is a form and an example (not a list of allowed values): the numbers, booleans, lists.
FORM_KEYS = [".".join(path) for path, node in _leaves(schema()) if "enum" not in node and "$ref" not in node
             and node.get("type") != "object" and "default" in node]


@pytest.mark.parametrize("key", FORM_KEYS)
def test_a_type_error_suggests_a_value_that_passes(key):
    """`optimizer.lr: abc` used to print the schema's description ("fix: Learning rate."): the fix now says which
    values pass, and its example, written back, is accepted."""
    path = tuple(key.split("."))
    with pytest.raises(ConfigError) as caught:
        load_config(_nested(path, {"not": "this"}))
    (issue,) = [issue for issue in caught.value.issues if issue.path == key]
    assert issue.fix.startswith("write ") and "e.g. " in issue.fix, issue.fix
    example = re.search(r"e\.g\. (.*) \(the default\)$", issue.fix).group(1)
    load_config(_nested(path, json.loads(example)))  # passes


def test_a_range_error_names_the_bound():
    with pytest.raises(ConfigError) as caught:
        load_config({"optimizer": {"lr": -1, "betas": [0.9, 1.5]}})
    fixes = {issue.path: issue.fix for issue in caught.value.issues}
    assert fixes["optimizer.lr"] == "write a number > 0, e.g. 0.001 (the default)"
    assert fixes["optimizer.betas.1"] == "write a number >= 0 and < 1"


def test_a_bad_override_is_named_as_the_override_not_the_valid_file():
    config = ROOT / "configs" / "fsdp2-bf16.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(config, overrides=["train.steps=4", "optimizer.lr=abc"])
    message = str(caught.value)
    assert message.startswith(f"invalid override 'optimizer.lr=abc' of {config}: 1 problem(s)"), message
    assert "invalid fp8dist config" not in message and "train.steps=4" not in message
    with pytest.raises(ConfigError, match="invalid override 'precision=3' of"):
        load_config(config, overrides=["precision=3"])
    with pytest.raises(ConfigError, match="invalid override 'novalue' of"):
        load_config(config, overrides=["novalue"])


def test_an_invalid_file_is_still_named_with_an_override(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("engine: ddp\n")
    with pytest.raises(ConfigError, match=f"invalid fp8dist config in {re.escape(str(config))}: 2 problem"):
        load_config(config, overrides=["optimizer.lr=abc"])


CONFLICTING_EXTRA = "engine: deepspeed\ndeepspeed:\n  extra:\n    zero_optimization: {stage: 3}\n    gradient_clipping: 0.5\n"


def test_validate_refuses_the_extra_that_translate_refuses_and_names_the_fp8dist_key(tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text(CONFLICTING_EXTRA)
    translated = run_cli("translate", config, "--to", "deepspeed")
    validated = run_cli("validate", config)
    for result in (translated, validated):
        assert result.returncode == 2, result.stdout + result.stderr
        assert "deepspeed.extra.zero_optimization.stage: conflicts with `zero_optimization.stage` = 2, which fp8dist " \
               "generates from parallel.sharding (or deepspeed.zero_stage)" in result.stderr, result.stderr
        assert "fix: set train.gradient_clipping instead, or drop gradient_clipping from deepspeed.extra" \
               in result.stderr, result.stderr
    assert validated.stdout == ""


def test_every_generated_deepspeed_key_names_the_fp8dist_key_it_comes_from():
    """GENERATED_FROM keeps up with the translator: every key it generates for the shipped configs (and for a few
    settings none of them uses) has its fp8dist key, and every entry is a key it generates."""
    specs = [load_config(path) for path in CONFIGS]
    specs += [load_config({"engine": "deepspeed", **extra}) for extra in (
        {"parallel": {"sharding": "hybrid", "shard_size": 2}},
        {"parallel": {"expert_size": 2}},
        {"precision": {"mixed_precision": "fp16", "master_weights": "fp16"}, "parallel": {"offload": "optimizer"}},
        {"precision": {"mixed_precision": "bf16", "master_weights": "bf16"}, "optimizer": {"state_dtype": "bf16"}},
        {"precision": {"master_weights": "none", "reduce_dtype": "bf16"}},
        {"optimizer": {"name": "sgd"}, "parallel": {"offload": "optimizer"}},
        {"deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": "/nvme",
                       "grad_accum_dtype": "fp32"}},
    )]
    seen = set()
    for spec in specs:
        config = to_deepspeed(spec, "0.13.1" if spec.fp8.backend == "msamp" else "0.19.8")
        for leaf in _dotted_leaves(config):
            assert generated_from(leaf), f"{spec.source}: no fp8dist key for the generated `{leaf}`"
            seen.update(".".join(leaf.split(".")[:n]) for n in range(1, leaf.count(".") + 2))
    assert set(GENERATED_FROM) <= seen, sorted(set(GENERATED_FROM) - seen)


def _dotted_leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _dotted_leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_an_extra_that_adds_keys_passes_both():
    spec = load_config({"engine": "deepspeed", "deepspeed": {"extra": {"wall_clock_breakdown": True,
                                                                       "zero_optimization": {"round_robin_gradients": True}}}})
    assert extra_issues(spec) == []
    assert to_deepspeed(spec)["zero_optimization"]["round_robin_gradients"] is True
