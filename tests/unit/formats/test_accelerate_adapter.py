"""A LoRA config for Accelerate: the file's header carries the `adapter` section (Accelerate has no adapter setting;
the script applies PEFT) and `fp8dist import` reads it back; torchao float8 through Accelerate's own filter would
convert the adapters too, so it is refused naming adapter.kind, and fp8dist's filter leaves them out."""
import subprocess
import sys

import pytest
import torch
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.accelerate.kwargs import LinearFilter, accelerator_kwargs
from fp8dist.formats.accelerate.translate import NotExpressible
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file
from tests.conftest import ROOT

LORA = {"kind": "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


def _translate(tmp_path, config: dict):
    source, out = tmp_path / "lora.yaml", tmp_path / "accelerate.yaml"
    source.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "fp8dist", "translate", str(source), "--to", "accelerate", "-o",
                             str(out)], capture_output=True, text=True, cwd=ROOT)
    return result, out


@pytest.mark.parametrize("engine", [{"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}, {"engine": "fsdp2", "precision": {"reduce_dtype": "bf16"}}])
def test_the_adapter_rides_in_the_header_and_imports_back(tmp_path, engine):
    config = {**engine, "adapter": LORA}
    config["precision"] = {"preset": "bf16", **engine.get("precision", {})}
    result, out = _translate(tmp_path, config)
    assert result.returncode == 0, result.stderr
    header = out.read_text()
    assert "peft.get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, " \
           "target_modules=['q_proj', 'v_proj']), autocast_adapter_dtype=False)" in header
    adapter = load_config(yaml.safe_load(import_file(out, "accelerate"))).adapter
    assert (adapter.kind, adapter.r, adapter.alpha, adapter.dropout, adapter.target_modules) == \
        ("lora", 16, 32, 0.05, ("q_proj", "v_proj"))


def test_a_broken_adapter_header_is_refused_naming_it(tmp_path):
    result, out = _translate(tmp_path, {"engine": "deepspeed", "precision": {"preset": "bf16"}, "adapter": LORA})
    out.write_text(out.read_text().replace('adapter={"kind"', 'adapter={kind'))
    with pytest.raises(ImportProblem) as err:
        import_file(out, "accelerate")
    assert [issue.path for issue in err.value.issues] == ["adapter"]


def test_accelerates_own_float8_filter_with_an_adapter_is_refused():
    config = {"engine": "fsdp2", "adapter": LORA,
              "precision": {"preset": "torchao-float8", "load_dtype": "fp32",
                            "fp8": {"modules": {"exclude": [], "skip_first_last": True}}}}
    with pytest.raises(NotExpressible) as refused:
        accelerator_kwargs(load_config(config), world_size=2)
    assert "- adapter.kind:" in str(refused.value) and "lora_A" in str(refused.value)


def test_fp8dists_filter_for_accelerate_leaves_the_adapters_out():
    linear = torch.nn.Linear(32, 32)
    keep = LinearFilter([], 16)
    assert keep(linear, "model.layers.0.self_attn.q_proj.base_layer")
    assert not keep(linear, "model.layers.0.self_attn.q_proj.lora_A.default")
    assert not keep(linear, "model.layers.0.self_attn.q_proj.lora_B.default")



def test_fp8dists_filter_for_accelerate_matches_exclusions_on_the_base_models_names():
    linear = torch.nn.Linear(32, 32)
    keep = LinearFilter(["down_proj", "model.layers.0.*"], 16)
    assert not keep(linear, "base_model.model.model.layers.1.mlp.down_proj.base_layer")
    assert not keep(linear, "base_model.model.model.layers.0.mlp.up_proj.base_layer")
    assert keep(linear, "base_model.model.model.layers.1.mlp.up_proj.base_layer")


def test_the_script_line_carries_modules_to_save_and_dora(tmp_path):
    """The LoraConfig the header tells the script to build names every setting of the adapter that changes the run,
    and the header imports back to the same adapter."""
    adapter = {**LORA, "modules_to_save": ["lm_head"], "use_dora": True}
    result, out = _translate(tmp_path, {"engine": "fsdp2", "precision": {"preset": "bf16"}, "adapter": adapter})
    assert result.returncode == 0, result.stderr
    assert "target_modules=['q_proj', 'v_proj'], modules_to_save=['lm_head'], use_dora=True), " \
           "autocast_adapter_dtype=False)" in out.read_text()
    imported = load_config(yaml.safe_load(import_file(out, "accelerate"))).adapter
    assert (imported.modules_to_save, imported.use_dora) == (("lm_head",), True)
