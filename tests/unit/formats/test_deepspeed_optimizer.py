"""A DeepSpeed JSON's optimizer section as DeepSpeed 0.19.8 runs it (runtime/engine.py _configure_basic_optimizer):
type Adam is AdamW unless adam_w_mode is false; updates torch.optim has no setting for are refused."""
import json

import pytest
import yaml

from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file


def imported(tmp_path, optimizer):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                                "optimizer": optimizer}))
    text = import_file(path)
    return yaml.safe_load(text)["optimizer"], text


@pytest.mark.parametrize("optimizer,name", [
    ({"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1}}, "adamw"),  # DeepSpeed's default adam_w_mode
    ({"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": True, "torch_adam": True}}, "adamw"),
    ({"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1, "adam_w_mode": False}}, "adam"),  # L2 decay
    ({"type": "AdamW", "params": {"lr": 1e-4, "adam_w_mode": False}}, "adamw"),  # AdamW forces it
    ({"type": "SGD", "params": {"lr": 1e-2}}, "sgd"),
])
def test_the_optimizer_deepspeed_would_run(tmp_path, optimizer, name):
    got, text = imported(tmp_path, optimizer)
    assert got["name"] == name and got["lr"] == optimizer["params"]["lr"]
    if optimizer["type"] == "Adam":
        assert "DeepSpeed's type Adam is AdamW (decoupled weight decay) unless adam_w_mode is false" in text
    for key in ("adam_w_mode", "torch_adam"):
        if key in optimizer["params"]:
            assert f"# not kept: optimizer.params.{key}:" in text


@pytest.mark.parametrize("params,key", [({"bias_correction": False}, "bias_correction"), ({"amsgrad": True}, "amsgrad")])
def test_an_adam_update_torch_has_no_setting_for_is_refused(tmp_path, params, key):
    with pytest.raises(ImportProblem) as err:
        imported(tmp_path, {"type": "AdamW", "params": {"lr": 1e-4, **params}})
    assert f"optimizer.params.{key}" in str(err.value) and f"fix: remove optimizer.params.{key}" in str(err.value)
    got, text = imported(tmp_path, {"type": "AdamW", "params": {"lr": 1e-4, "bias_correction": True, "amsgrad": False}})
    assert got["name"] == "adamw" and "# not kept: optimizer.params.bias_correction: true - torch's own" in text
    assert "# not kept: optimizer.params.amsgrad: false" in text
