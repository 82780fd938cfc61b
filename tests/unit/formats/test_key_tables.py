"""Every key of every importer's table (fp8dist/formats/keys.py: kept, no effect, refused) does what its class says,
in a real import: a refused key stops the import naming it (with a fix), a key with no effect is noted
(`# not kept: KEY`), a kept key is mapped (never left to the rule, which would stop on it as an importer bug, and
never noted as dropped). A key the tables do not know is noted as unknown, never dropped without a word."""
import json

import pytest

from fp8dist.formats.accelerate.importer import DEEPSPEED_KEYS as ACCELERATE_DEEPSPEED_KEYS
from fp8dist.formats.accelerate.importer import KEYS as ACCELERATE_KEYS
from fp8dist.formats.accelerate.sections import FSDP_KEYS
from fp8dist.formats.axolotl.importer import KEYS as AXOLOTL_KEYS
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.deepspeed.importer import KEYS as DEEPSPEED_KEYS
from fp8dist.formats.importing import import_file
from fp8dist.formats.keys import KeyClass
from fp8dist.formats.peft.importer import KEYS as PEFT_KEYS
from fp8dist.formats.trl.importer import KEYS as TRL_KEYS

DS_FILE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
           "bf16": {"enabled": True}}


def nested(dotted: str, value):
    head, _, rest = dotted.partition(".")
    return {head: nested(rest, value) if rest else value}


# Kept keys whose meaning needs another key of the same file (fp8 options need fp8, a replica count a shard size...)
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}
AXOLOTL_CONTEXT = {"fp8_enable_fsdp_float8_all_gather": {"fp8": True, **FSDP2}, "fsdp_version": FSDP2,
                   "fsdp": FSDP2, "dp_replicate_size": {"dp_shard_size": 2}, "tf32": {"bf16": False},
                   **{key: FSDP2 for key in ("tensor_parallel_size", "context_parallel_size",
                                             "sequence_parallel_degree", "expert_parallel_size")},
                   "fp16": {"bf16": False},
                   **{key: {"adapter": "lora", "lora_target_linear": True} for key in (
                       "lora_r", "lora_alpha", "lora_dropout", "lora_fan_in_fan_out", "lora_model_dir", "lora_modules_to_save",
                       "lora_target_parameters", "peft_use_rslora", "peft_layers_to_transform", "peft_use_dora")},
                   "lora_target_modules": {"adapter": "lora"}, "lora_target_linear": {"adapter": "lora"},
                   "bnb_config_kwargs": {"adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True}}
ACCELERATE_CONTEXT = {"fp8_config": {"mixed_precision": "fp8"}}
TRL_LORA = {"use_peft": True, "lora_target_modules": "all-linear"}
TRL_CONTEXT = {"tf32": {"bf16": False}, "fp16": {"bf16": False}, "fsdp_config": {"fsdp": "full_shard"},
               "use_peft": {"lora_target_modules": ["q_proj", "v_proj"]},
               **{key: TRL_LORA for key in ("lora_r", "lora_alpha", "lora_dropout", "use_dora", "use_rslora",
                                            "lora_modules_to_save", "lora_target_parameters", "lora_task_type")},
               "lora_target_modules": {"use_peft": True}}


def axolotl(key: str, rule, tmp_path) -> dict:
    if key == "deepspeed":
        (tmp_path / "ds.json").write_text(json.dumps(DS_FILE))
        return {"base_model": "x", "deepspeed": "ds.json"}
    return {"base_model": "x", **AXOLOTL_CONTEXT.get(key, {}), key: rule.example}


def trl(key: str, rule, tmp_path) -> dict:
    if key == "deepspeed":
        (tmp_path / "ds.json").write_text(json.dumps(DS_FILE))
    return {"model_name_or_path": "x", **TRL_CONTEXT.get(key, {}), key: rule.example}


def peft(key: str, rule, tmp_path) -> dict:
    return {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"], key: rule.example}


def accelerate(key: str, rule, tmp_path) -> dict:
    if key.startswith("megatron_lm_config."):  # read with Accelerate's Megatron-LM mode only
        return {"distributed_type": "MEGATRON_LM", "mixed_precision": "bf16",
                "megatron_lm_config": {key.split(".", 1)[1]: rule.example}}
    doc = {"distributed_type": "MULTI_GPU", "mixed_precision": "bf16", **ACCELERATE_CONTEXT.get(key, {})}
    if key == "fsdp_config":
        doc["distributed_type"] = "FSDP"
    if key == "deepspeed_config":
        doc["distributed_type"] = "DEEPSPEED"
    return {**doc, key: rule.example}


def accelerate_deepspeed(key: str, rule, tmp_path) -> dict:
    config = {"zero_stage": 3 if key.startswith("zero3") or key == "offload_param_device" else 2, key: rule.example}
    if key == "deepspeed_config_file":  # as `accelerate config` writes it: the JSON decides, no mixed_precision
        (tmp_path / "ds.json").write_text(json.dumps(DS_FILE))
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": {key: "ds.json"}}
    return {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "deepspeed_config": config}


def fsdp_config(key: str, rule, tmp_path) -> dict:
    wrap = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"} if "cls" in key else {}
    return {"distributed_type": "FSDP", "mixed_precision": "bf16",
            "fsdp_config": {"fsdp_version": 2, **wrap, f"fsdp_{key}": rule.example}}


def deepspeed(key: str, rule, tmp_path) -> dict:
    doc = json.loads(json.dumps(DS_FILE))
    if key in ("fp16", "torch_autocast", "amp"):  # a 16-bit mode of its own instead of the file's bf16
        del doc["bf16"]
    if key == "zero_optimization.offload_param":
        doc["zero_optimization"]["stage"] = 3
    if key.startswith("expert_parallel."):  # the section's keys act with AutoEP on and splitting
        doc["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    part = nested(key, rule.example)
    for head, value in part.items():
        if isinstance(value, dict) and isinstance(doc.get(head), dict):
            doc[head].update(value)
        else:
            doc[head] = value
    return doc


TABLES = [("axolotl", AXOLOTL_KEYS, axolotl, ""), ("accelerate", ACCELERATE_KEYS, accelerate, ""),
          ("accelerate", ACCELERATE_DEEPSPEED_KEYS, accelerate_deepspeed, "deepspeed_config."),
          ("accelerate", FSDP_KEYS, fsdp_config, "fsdp_config.fsdp_"), ("deepspeed", DEEPSPEED_KEYS, deepspeed, ""),
          ("trl", TRL_KEYS, trl, ""), ("peft", PEFT_KEYS, peft, "")]
CASES = [(kind, table, build, shown, key) for kind, table, build, shown in TABLES for key in table.rules]


@pytest.mark.parametrize("kind,table,build,shown,key", CASES,
                         ids=[f"{table.tool}:{key}" for _, table, _, _, key in CASES])
def test_every_key_does_what_its_class_says(kind, table, build, shown, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rule = table.rules[key]
    path = tmp_path / ("file.json" if kind in ("deepspeed", "peft") else "file.yaml")
    document = build(key, rule, tmp_path)
    path.write_text(json.dumps(document))
    name = shown + key
    try:
        text = import_file(path, kind)
    except ImportProblem as exc:
        named = [issue for issue in exc.issues if issue.path == name]
        assert rule.cls is KeyClass.REFUSED and named, f"{name} ({rule.cls.value}) stopped the import: {exc}"
        assert named[0].fix and named[0].message == rule.why, exc
        return
    assert rule.cls is not KeyClass.REFUSED, f"{name} is refused by the table but imported:\n{text}"
    noted = f"# not kept: {name}:" in text
    if rule.cls is KeyClass.NO_EFFECT:
        assert noted, f"{name} has no effect but is not noted:\n{text}"
    else:
        assert not noted, f"{name} is kept but noted as dropped:\n{text}"


@pytest.mark.parametrize("kind,document,shown", [
    ("axolotl", {"base_model": "x", "shiny_new_precision_knob": 1}, "shiny_new_precision_knob"),
    ("accelerate", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_magic": 1}},
     "fsdp_config.fsdp_magic"),
    ("deepspeed", {**DS_FILE, "cuda_visible_devices": "0,1"}, "cuda_visible_devices"),
    ("trl", {"model_name_or_path": "x", "shiny_new_precision_knob": 1}, "shiny_new_precision_knob"),
    ("peft", {"peft_type": "LORA", "target_modules": ["q_proj"], "shiny_new_lora_knob": 1}, "shiny_new_lora_knob"),
])
def test_a_key_no_table_knows_is_noted_as_unknown(kind, document, shown, tmp_path):
    path = tmp_path / "file.json"
    path.write_text(json.dumps(document))
    text = import_file(path, kind)
    assert f"# not kept: {shown}:" in text and "not in fp8dist's table of" in text, text


def test_the_tables_refuse_what_the_issue_names():
    """The settings that turned imports into other runs are refused by the tables themselves."""
    for table, key in ((AXOLOTL_KEYS, "adapter"), (AXOLOTL_KEYS, "load_in_4bit"), (AXOLOTL_KEYS, "load_in_8bit"),
                       (AXOLOTL_KEYS, "qat"), (AXOLOTL_KEYS, "expert_parallel_token_capacity"),
                       (DEEPSPEED_KEYS, "sequence_parallel_size"),
                       (DEEPSPEED_KEYS, "expert_parallel.expert_tensor_parallel_size"),
                       (DEEPSPEED_KEYS, "expert_parallel.load_balance_coeff"), (DEEPSPEED_KEYS, "tensor_parallel.tp.tp_size"),
                       (DEEPSPEED_KEYS, "tensor_parallel.partition_config"), (DEEPSPEED_KEYS, "amp"),
                       (TRL_KEYS, "parallelism_config"),
                       (TRL_KEYS, "load_in_4bit"), (TRL_KEYS, "load_in_8bit"),
                       (TRL_KEYS, "use_rslora"), (TRL_KEYS, "tf32"),
                       (PEFT_KEYS, "use_rslora"),
                       (PEFT_KEYS, "layers_to_transform"), (PEFT_KEYS, "rank_pattern"), (PEFT_KEYS, "bias"),
                       (PEFT_KEYS, "init_lora_weights"), (PEFT_KEYS, "target_parameters")):
        assert table.rules[key].cls is KeyClass.REFUSED, key


def test_the_import_doc_is_current():
    from tests.conftest import ROOT
    from tests.import_tables import document

    assert (ROOT / "docs" / "import.md").read_text() == document(), \
        "docs/import.md is stale: python -m tests.import_tables > docs/import.md"
