"""The facts (fp8dist.facts) against the libraries installed here: each version record is checked against the release
pip installed, and each gated API, key or constant a record names is looked up in that release's own source.

A library's source is read as text from its installed package (found without importing it), so these checks cost
no imports; torchao's size heuristic is the one exception, called for real. Transformer Engine and MS-AMP cannot be
installed on this CPU machine: their checks skip, saying so (TE's records are checked against its registry wheels
in tests/unit/backends/test_te_recipe_contract.py).
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from fp8dist.facts import versions
from fp8dist.facts.accelerate import (ACCELERATE_AO_DIM_MULTIPLE, ACCELERATE_FP8_BACKEND, ACCELERATE_KNOWN,
                                      ACCELERATE_MSAMP_OPT_LEVELS, accelerate_matches)
from fp8dist.facts.deepspeed import (DS_AMP_REMOVED, DS_AUTOEP, DS_AUTOEP_PRESETS, DS_BF16_MASTER,
                                     DS_CLIPPING_DEFAULT_CHANGED, DS_TORCH_AUTOCAST, NEWEST_KNOWN_DEEPSPEED)
from fp8dist.facts.msamp import MSAMP_DISTRIBUTION, MSAMP_RELEASE
from fp8dist.facts.peft import PEFT_ALL_LINEAR, is_lora_module
from fp8dist.facts.torch import TORCH_FLOOR, TORCH_FSDP2_CUSTOM_COLLECTIVES, TORCH_FSDP2_PUBLIC, torch_supported
from fp8dist.facts.torchao import (NEWEST_KNOWN_TORCHAO, TORCHAO_EXPERTS_DIM_MULTIPLE, TORCHAO_EXPERTS_EMULATED,
                                   TORCHAO_FORCE_RECOMPUTE_NOOP, TORCHAO_HIGH_PRECISION_GEMMS,
                                   TORCHAO_LOW_BIT_MIN_NUMEL, TORCHAO_MX_BLOCK, TORCHAO_PROTOTYPE_VERIFIED,
                                   TORCHAO_RECIPE_MIN_CAPABILITY, torchao_force_recompute, torchao_too_small_to_gain)
from fp8dist.facts.transformer_engine import TE_NEWEST_KNOWN, te_supported
from fp8dist.facts.transformers import HF_MAX_SHARD_BYTES
from fp8dist.facts.versions import Version, fmt, parse_version
from fp8dist.formats.accelerate.sections import LAUNCH_FP8_DEFAULTS
from fp8dist.formats.deepspeed.importer import FP16_DEFAULTS, ZERO_DEFAULTS
from fp8dist.formats.peft.importer import DEFAULTS as PEFT_LORA_DEFAULTS
from fp8dist.translate.fsdp2 import TE_DISTRIBUTIONS

# Libraries that cannot be installed on this machine, and where their facts are checked instead.
NOT_INSTALLABLE_HERE = {
    "transformer-engine": "Transformer Engine needs CUDA to build and import; its records are checked against its "
                          "registry wheels in tests/unit/backends/test_te_recipe_contract.py",
    MSAMP_DISTRIBUTION: "MS-AMP is not on PyPI and needs an environment of its own (fp8dist.facts.msamp)",
}


def installed(distribution: str) -> Version:
    found = next((v for v in map(versions.installed_version, (distribution, *_aliases(distribution))) if v), None)
    if found is None:
        if distribution in NOT_INSTALLABLE_HERE:
            pytest.skip(f"{distribution} is not installed: {NOT_INSTALLABLE_HERE[distribution]}")
        pytest.fail(f"{distribution} is not installed; the facts are checked against it: pip install -e '.[all]'")
    return parse_version(found)


def _aliases(distribution: str) -> tuple[str, ...]:
    return TE_DISTRIBUTIONS if distribution == "transformer-engine" else ()


def source(package: str, relative: str) -> str:
    """The text of `relative` inside the installed `package`, found without importing it."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    assert path.is_file(), f"{package} no longer has {relative}: the facts citing it need a new source"
    return path.read_text(encoding="utf-8")


def tree(package: str, relative: str) -> ast.Module:
    return ast.parse(source(package, relative))


def top_level_names(module: ast.Module) -> set[str]:
    """Names a module binds at its top: functions, classes, assignments and imports."""
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def class_body(module: ast.Module, name: str) -> list[ast.stmt]:
    found = [n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name}"
    return found[0].body


def members(body: list[ast.stmt]) -> dict[str, Any]:
    """`NAME = literal` statements of a class body (an Enum's members): name -> value."""
    return {t.id: ast.literal_eval(n.value) for n in body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)}


def constant(module: ast.Module, name: str) -> Any:
    """The literal value a module assigns to `name` at its top; None if it assigns none."""
    for node in module.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def dict_keys(module: ast.Module, name: str) -> set[Any]:
    """The literal keys of the dict a module assigns to `name` at its top (its values may be computed)."""
    for node in module.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            assert isinstance(node.value, ast.Dict), f"{name} is no longer a dict"
            return {ast.literal_eval(k) for k in node.value.keys if k is not None}
    return set()


def field_defaults(body: list[ast.stmt]) -> dict[str, Any]:
    """Annotated class fields and their literal defaults: `x: int = 8`, `x: int = field(default=8)`,
    `x: int = Field(pp_int(5e8), alias="y")` (then keyed by the alias, as a config file writes it)."""
    out: dict[str, Any] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            continue
        key = node.target.id
        value: ast.expr | None = node.value
        if isinstance(value, ast.Call):
            keywords = {k.arg: k.value for k in value.keywords}
            key = ast.literal_eval(keywords["alias"]) if "alias" in keywords else key
            value = keywords.get("default", value.args[0] if value.args else None)
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "pp_int":  # DeepSpeed's int wrapper
                value = value.args[0]
        try:
            literal = ast.literal_eval(value) if value is not None else None
        except ValueError:
            continue  # a default computed at run time
        out[key] = int(literal) if isinstance(literal, float) and literal.is_integer() else literal
    return out


@pytest.mark.parametrize("distribution,known", [
    ("torchao", NEWEST_KNOWN_TORCHAO), ("deepspeed", NEWEST_KNOWN_DEEPSPEED), ("accelerate", ACCELERATE_KNOWN),
    ("transformer-engine", TE_NEWEST_KNOWN), (MSAMP_DISTRIBUTION, MSAMP_RELEASE)])
def test_the_newest_known_release_is_the_one_installed_here(distribution, known):
    """Not older than what pip installed (the facts would not know the release that runs), and not more than one
    minor release newer (the facts would claim a release nobody checked here)."""
    here = installed(distribution)
    assert here <= known, (f"{distribution} {fmt(here)} is installed, newer than the newest release the facts know "
                           f"({fmt(known)}): check the facts against it, then raise the record")
    assert known[:2] <= (here[0], here[1] + 1), (f"the facts claim {distribution} {fmt(known)}, far ahead of the "
                                                 f"installed {fmt(here)} they are checked against")


def test_the_installed_te_is_one_fp8dist_supports():
    assert te_supported(installed("transformer-engine"))[0]


def test_the_installed_torch_has_the_fsdp2_api_the_gates_name():
    """fp8dist runs on the torch installed here, which has the API of each gate it passes."""
    torch_version = installed("torch")
    assert torch_supported(torch_version)[0] and TORCH_FLOOR >= TORCH_FSDP2_CUSTOM_COLLECTIVES >= TORCH_FSDP2_PUBLIC
    assert "fully_shard" in top_level_names(tree("torch", "distributed/fsdp/__init__.py"))
    fsdp_module = {n.name for n in class_body(tree("torch", "distributed/fsdp/_fully_shard/_fully_shard.py"),
                                               "FSDPModule") if isinstance(n, ast.FunctionDef)}
    assert {"set_custom_all_gather", "set_custom_reduce_scatter"} <= fsdp_module
    collectives = top_level_names(tree("torch", "distributed/fsdp/_fully_shard/_fsdp_collectives.py"))
    assert {"DefaultAllGather", "DefaultReduceScatter"} <= collectives


def test_the_installed_torchao_has_the_recipes_and_the_prototype_api():
    assert installed("torchao") >= TORCHAO_PROTOTYPE_VERIFIED
    config = tree("torchao", "float8/config.py")
    recipes = set(members(class_body(config, "Float8LinearRecipeName")).values())
    assert set(TORCHAO_RECIPE_MIN_CAPABILITY) - {"mxfp8"} <= recipes  # mxfp8 is the MX Linear, not a float8 recipe
    assert set(TORCHAO_HIGH_PRECISION_GEMMS) <= recipes
    moe = "prototype/moe_training/"
    assert {"_to_mxfp8_then_scaled_grouped_mm", "_to_fp8_rowwise_then_scaled_grouped_mm"} <= top_level_names(
        tree("torchao", moe + "__init__.py"))  # what backends/experts.py imports
    assert "MXFP8Linear" in top_level_names(tree("torchao", moe + "mxfp8_linear.py"))
    preference = tree("torchao", "quantization/quantize_/common/kernel_preference.py")
    assert {"AUTO", "EMULATED"} <= set(members(class_body(preference, "KernelPreference")))


def test_the_installed_torchao_blocks_and_multiples():
    mx_linear = source("torchao", "prototype/moe_training/mxfp8_linear.py")
    assert set(map(int, re.findall(r"^\s+block_size = (\d+)$", mx_linear, re.M))) == {TORCHAO_MX_BLOCK}
    grouped = source("torchao", "prototype/moe_training/mxfp8_grouped_mm.py")
    grouped_blocks = set(map(int, re.findall(r"^\s+block_size = (\d+)$", grouped, re.M)))
    assert grouped_blocks == {TORCHAO_EXPERTS_DIM_MULTIPLE["mxfp8"]}
    float8_grouped = source("torchao", "prototype/moe_training/fp8_grouped_mm.py")
    assert set(map(int, re.findall(r"% (\d+) == 0", float8_grouped))) == {TORCHAO_EXPERTS_DIM_MULTIPLE["float8"]}
    # the float8 grouped GEMM is refused emulated exactly while torchao says it has no emulated mode
    assert ("TODO: support emulated mode" in float8_grouped) == ("float8" not in TORCHAO_EXPERTS_EMULATED)
    adam = source("torchao", "optim/adam.py")
    assert re.findall(r"numel\(\) >= (\d+)", adam) == [str(TORCHAO_LOW_BIT_MIN_NUMEL)]


def test_force_recompute_is_the_no_op_the_installed_torchao_says():
    torchao_version = installed("torchao")
    config = tree("torchao", "float8/config.py")
    fields = {n.target.id for n in class_body(config, "Float8LinearConfig")
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert "force_recompute_fp8_weight_in_bwd" in fields
    deprecated = "force_recompute_fp8_weight_in_bwd` is deprecated" in source("torchao", "float8/config.py")
    assert deprecated == (torchao_version >= TORCHAO_FORCE_RECOMPUTE_NOOP)
    assert torchao_force_recompute(torchao_version, True, True)[0] is not deprecated


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_too_small_to_gain_is_torchaos_own_filter(recipe):
    """torchao's auto filter, called on Linears of every size pair on a grid of multiples of 16: fp8dist calls a
    Linear too small exactly where torchao's filter leaves it out for its size."""
    import torch
    from torchao.float8 import float8_linear_utils

    keeps = getattr(float8_linear_utils, f"_auto_filter_for_{recipe}")
    sizes = [16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for out_features in sizes:
        for in_features in sizes:
            linear = torch.nn.Linear(in_features, out_features, device="meta")
            assert (not keeps(linear, "layer", [])) == torchao_too_small_to_gain(recipe, out_features, in_features), \
                (recipe, out_features, in_features)


def test_the_installed_deepspeed_has_the_config_keys_and_defaults_the_records_name():
    """Each DeepSpeed record is a release where a key appeared or a default changed: the installed release has the
    key (the new default) exactly when it is that release or later."""
    ds = installed("deepspeed")
    constants = tree("deepspeed", "runtime/constants.py")
    assert (constant(constants, "TORCH_AUTOCAST") == "torch_autocast") == (ds >= DS_TORCH_AUTOCAST)
    precision = tree("deepspeed", "runtime/precision_config.py")
    bf16 = field_defaults(class_body(precision, "DeepSpeedBF16Config"))
    assert ({"bf16_master_weights_and_grads", "bf16_optimizer_states"} <= set(bf16)) == (ds >= DS_BF16_MASTER)
    removed = dict_keys(tree("deepspeed", "runtime/config.py"), "_REMOVED_TOP_LEVEL_CONFIG_KEYS")
    assert ("amp" in removed) == (ds >= DS_AMP_REMOVED)
    assert (constant(constants, "GRADIENT_CLIPPING_DEFAULT") == 1.0) == (ds >= DS_CLIPPING_DEFAULT_CHANGED)
    # what the DeepSpeed importer resolves a left-out key to (fp8dist/formats/deepspeed/importer.py)
    fp16 = field_defaults(class_body(precision, "DeepSpeedFP16Config"))
    assert {k: fp16[k] for k in FP16_DEFAULTS} == FP16_DEFAULTS
    zero = field_defaults(class_body(tree("deepspeed", "runtime/zero/config.py"), "DeepSpeedZeroConfig"))
    assert {k: zero[k] for k in ZERO_DEFAULTS} == ZERO_DEFAULTS
    # AutoEP's presets (what translate --to deepspeed says it picks from): one module each, imported by its registry
    registry = source("deepspeed", "module_inject/auto_ep_presets/registry.py")
    assert ds >= DS_AUTOEP and all(source("deepspeed", f"module_inject/auto_ep_presets/{name}.py") and
                                   re.search(rf"\b{name}\b", registry) for name in DS_AUTOEP_PRESETS)


def test_the_installed_accelerate_has_the_values_the_records_name():
    assert accelerate_matches(installed("accelerate"))[0]
    dataclasses_py = tree("accelerate", "utils/dataclasses.py")
    backends = set(members(class_body(dataclasses_py, "FP8BackendType")).values())
    assert set(ACCELERATE_FP8_BACKEND.values()) <= backends
    opt_level = next(n.value for n in dataclasses_py.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "OptLevel" for t in n.targets))
    assert isinstance(opt_level, ast.Subscript)
    assert tuple(ast.literal_eval(opt_level.slice)) == ACCELERATE_MSAMP_OPT_LEVELS
    assert set(map(int, re.findall(r"_features % (\d+) != 0", source("accelerate", "utils/ao.py")))) == \
        {ACCELERATE_AO_DIM_MULTIPLE}
    # what `accelerate launch` exports for an fp8 key it is not given (fp8dist/formats/accelerate/sections.py)
    launch: dict[str, Any] = {}
    for call in ast.walk(tree("accelerate", "commands/launch.py")):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument" and call.args \
                and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("--fp8_"):
            default = next((k.value for k in call.keywords if k.arg == "default"), None)
            value = ast.literal_eval(default) if default is not None else None
            name = call.args[0].value[len("--"):]
            name = name if name == "fp8_format" else name[len("fp8_"):]  # as fp8_config names them
            launch[name] = {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
    assert {k: launch[k] for k in LAUNCH_FP8_DEFAULTS if k in launch} == \
        {k: v for k, v in LAUNCH_FP8_DEFAULTS.items() if k in launch}
    assert set(LAUNCH_FP8_DEFAULTS) - set(launch) == {"use_mxfp8_block_scaling"}  # no launcher argument: read as false


def test_the_installed_peft_names_what_the_records_say():
    installed("peft")
    assert constant(tree("peft", "utils/constants.py"), "INCLUDE_LINEAR_LAYERS_SHORTHAND") == PEFT_ALL_LINEAR
    layer = class_body(tree("peft", "tuners/lora/layer.py"), "LoraLayer")
    names = next(ast.literal_eval(n.value) for n in layer if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "adapter_layer_names" and n.value is not None)
    assert names and all(is_lora_module(f"model.layers.0.self_attn.q_proj.{name}.default") for name in names)
    lora = field_defaults(class_body(tree("peft", "tuners/lora/config.py"), "LoraConfig"))
    assert {k: lora[k] for k in PEFT_LORA_DEFAULTS} == PEFT_LORA_DEFAULTS  # fp8dist/formats/peft/importer.py


def test_the_export_shard_is_save_pretrained_s():
    from huggingface_hub.serialization._base import parse_size_to_int

    installed("transformers")
    save = next(n for n in class_body(tree("transformers", "modeling_utils.py"), "PreTrainedModel")
                if isinstance(n, ast.FunctionDef) and n.name == "save_pretrained")
    arguments = save.args.args[-len(save.args.defaults):] if save.args.defaults else []
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(arguments, save.args.defaults)}
    defaults |= {a.arg: ast.literal_eval(d) for a, d in zip(save.args.kwonlyargs, save.args.kw_defaults) if d}
    assert parse_size_to_int(defaults["max_shard_size"]) == HF_MAX_SHARD_BYTES
