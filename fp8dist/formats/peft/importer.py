"""A PEFT `adapter_config.json` (written by `PeftModel.save_pretrained` beside a LoRA adapter) -> an fp8dist config.

The file is PEFT's LoraConfig as JSON (peft 0.21 tuners/lora/config.py LoraConfig and config.py PeftConfig; older
PEFT wrote fewer keys, PEFT < 0.3 also `enable_lora` and `merge_weights`). It says which adapter trains and nothing
else: the output is an fp8dist config whose `adapter` section has the file's meaning, every other section at
fp8dist's defaults (said in a `# resolved:` comment). What runs, with the sources this rests on:
- fp8dist builds `LoraConfig(r, lora_alpha, lora_dropout, target_modules, bias="none", modules_to_save, use_dora)`
  with every other field at PEFT's default (fp8dist/backends/adapters.py lora_config): the default initialisation
  (`init_lora_weights: true`, lora_B zero), the update scaled by alpha / r, LoRA (or DoRA) on the named modules only,
  the modules to save trained whole. Keys that change one of those (rsLoRA, per-layer ranks or layer selection, a
  trained bias, another initialisation...) are refused where their value does so, and noted where it does not
  (`use_dora: false`, `rank_pattern: {}`);
- the file is the same over a 16-bit and over a bitsandbytes 4-bit base (QLoRA): only the base's config.json says
  which (transformers writes `quantization_config` there when it saves a quantized model). Where
  `base_model_name_or_path` is a local model directory, its NF4 base is adapter.base_dtype nf4, another quantization
  is refused; a base fp8dist cannot read (a Hub id) is noted: its quantization is unknown;
- `target_modules`: a list is matched by PEFT against module-name suffixes, as fp8dist's list is; the string
  `all-linear` is fp8dist's `auto`; any other string is a regular expression PEFT fullmatches against the full
  module name (peft tuners_utils check_target_module_exists), which fp8dist's list does not express;
- `fan_in_fan_out` has no effect: PEFT sets it from the layer's class (True for transformers' Conv1D, False for
  nn.Linear, with a warning: peft 0.21 tuners/lora/layer.py dispatch_default);
- `task_type` SEQ_CLS / TOKEN_CLS / QUESTION_ANS make PEFT train the task head beside the adapters (peft_model.py
  PeftModelForSequenceClassification ...: `classifier` / `score` / `qa_outputs` added to modules_to_save).
Every key is in KEYS with its class (fp8dist/formats/keys.py: kept, no effect, refused); docs/import.md prints it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import fp8dist.config.schema as schema
from fp8dist.errors import Issue
from fp8dist.facts.peft import PEFT_ALL_LINEAR
from fp8dist.formats.common import (pop_switch, NF4_SCALES, NF4_STORAGE, Imported, ImportProblem, Notes, WrongShape,
                                   integer, module_names, read_document, truthy)
from fp8dist.formats.keys import Table, disabled, kept, no_effect, refused

# LoraConfig's defaults for r, lora_alpha and lora_dropout (peft 0.21 tuners/lora/config.py): what an
# adapter_config.json that leaves them out means.
DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}
_HEADS = ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS")  # task types whose PeftModel trains a head (modules_to_save)
_ALL_LINEAR = PEFT_ALL_LINEAR  # compared lower-case, as PEFT does

_INIT_ONLY = ("read by PEFT only with the matching init_lora_weights (which is refused); with any other "
              "init_lora_weights PEFT ignores it with a warning (peft 0.21 LoraConfig.__post_init__)")
_VARIANT = "a LoRA variant fp8dist does not run (fp8dist builds plain LoRA: backends/adapters.py lora_config)"
_BOOKKEEPING = "bookkeeping PEFT writes about the saved adapter, not how it trains"

KEYS = Table("PEFT", {
    # kept
    "peft_type": kept("the kind of adapter: LORA is adapter.kind lora (fp8dist has LoRA only; other kinds are "
                      "refused)", example="LORA"),
    "r": kept("adapter.r (PEFT's default 8)", example=16),
    "lora_alpha": kept("adapter.alpha (PEFT's default 8)", example=32),
    "lora_dropout": kept("adapter.dropout (PEFT's default 0.0)", example=0.1),
    "target_modules": kept("adapter.target_modules (a list: those names; `all-linear`: auto; another string, a "
                           "regular expression, and null are refused)", example=["q_proj", "v_proj"]),
    # refused where the value changes which parameters train or the numerics
    "use_rslora": refused("rank-stabilised LoRA: scales the update by alpha / sqrt(r), not alpha / r",
                          "remove it (or scale lora_alpha by sqrt(r) yourself)", unless=disabled,
                          otherwise="off: changes nothing"),
    "use_dora": kept("adapter.use_dora (DoRA: a trained magnitude vector beside each adapter; false: plain LoRA, "
                     "noted)"),
    "modules_to_save": kept("adapter.modules_to_save (modules trained whole beside the adapters, e.g. embed_tokens "
                            "and lm_head for new tokens)", example=["lm_head"]),
    "base_model_name_or_path": kept("adapter.base_dtype nf4 where it is a local model directory whose config.json "
                                    "holds a bitsandbytes 4-bit NF4 quantization_config (QLoRA; other quantizations "
                                    "are refused); elsewhere its quantization is unknown (noted); the model itself: "
                                    "the script loads it", example="x/y"),
    "layers_to_transform": refused("adapters on some layers only, which fp8dist's target_modules (every layer's "
                                   "modules of that name) does not express", "remove it (adapters on every layer)",
                                   unless=disabled, otherwise="empty or unset: changes nothing", example=[0, 1]),
    "layers_pattern": refused("names the layer list of layers_to_transform: adapters on some layers only",
                              "remove it with layers_to_transform", unless=disabled,
                              otherwise="empty or unset: changes nothing", example="layers"),
    "rank_pattern": refused("a rank other than r for some modules", "remove it (one rank for every adapter), or "
                            "set r", unless=disabled, otherwise="empty or unset: changes nothing",
                            example={"q_proj": 4}),
    "alpha_pattern": refused("an alpha other than lora_alpha for some modules", "remove it (one alpha for every "
                             "adapter)", unless=disabled, otherwise="empty or unset: changes nothing",
                             example={"q_proj": 4}),
    "bias": refused("trains biases beside the adapters (all: every bias; lora_only: those of the adapted layers)",
                    "set it to none", unless=lambda value: value == "none",
                    otherwise="none: no bias trains, as in fp8dist", example="all"),
    "lora_bias": refused("a trained bias on lora_B", "remove it", unless=disabled, otherwise="off: changes nothing"),
    "target_parameters": refused("adapters on parameters (e.g. MoE experts), which fp8dist's `adapter` does not "
                                 "run", "remove it", unless=disabled, otherwise="empty or unset: changes nothing",
                                 example=["experts.down_proj"]),
    "init_lora_weights": refused("an initialisation other than PEFT's default (lora_B zero), which fp8dist uses "
                                 "(backends/adapters.py lora_config leaves init_lora_weights at true)",
                                 "set it to true", unless=lambda value: value is True,
                                 otherwise="true: PEFT's default, which fp8dist uses", example="gaussian"),
    "exclude_modules": refused("leaves modules out of target_modules; fp8dist's `adapter` has no exclusion "
                               "(it excludes only MoE routers under auto)", "remove it and list the modules to "
                               "adapt in target_modules", unless=disabled, otherwise="empty or unset: changes nothing",
                               example=["lm_head"]),
    "use_qalora": refused("QA-LoRA (pooled adapters over a GPTQ base)", "remove it", unless=disabled,
                          otherwise="off: changes nothing"),
    # peft 0.21 tuners/lora/tp_layer.py LoraParallelLinear: the adapters split as Megatron-Core's parallel Linears;
    # the dict is Megatron's TransformerConfig, whose tensor_model_parallel_size / pipeline_model_parallel_size are
    # the layout of the Megatron model it was saved from
    "megatron_config": refused("LoRA on Megatron-Core's ColumnParallelLinear / RowParallelLinear layers (the adapters "
                               "split with them; its TransformerConfig's tensor_model_parallel_size and "
                               "pipeline_model_parallel_size are that Megatron model's layout), which fp8dist does "
                               "not build: its LoRA adapts the Hugging Face model's nn.Linear layers",
                               "remove it (fp8dist's layout is its config's parallel.tensor_size / "
                               "parallel.pipeline_size)", unless=disabled, otherwise="empty or unset: changes nothing",
                               example={"tensor_model_parallel_size": 2}),
    "trainable_token_indices": refused("trains some rows of the embedding beside the adapters", "remove it",
                                       unless=disabled, otherwise="empty or unset: changes nothing", example=[0, 1]),
    "layer_replication": refused("repeats layers of the model (a larger model with shared base weights)",
                                 "remove it", unless=disabled, otherwise="empty or unset: changes nothing",
                                 example=[[0, 4], [2, 5]]),
    "ensure_weight_tying": refused("ties the adapters of tied layers (embedding and output) into one",
                                   "remove it", unless=disabled, otherwise="off: changes nothing"),
    "enable_lora": refused("PEFT < 0.3 MergedLinear: adapters on some parts of a fused projection only",
                           "remove it and list the modules", unless=disabled,
                           otherwise="empty or unset: changes nothing", example=[True, False, True]),
    "task_type": refused("a task whose PeftModel trains the task head beside the adapters (SEQ_CLS: classifier / "
                         "score, TOKEN_CLS, QUESTION_ANS: qa_outputs, as modules_to_save)",
                         "train that head yourself, or use CAUSAL_LM",
                         unless=lambda value: value not in _HEADS, otherwise="no head is trained for this task: "
                         "the adapters are the same", example="SEQ_CLS"),
    **{key: refused(_VARIANT, "remove it", unless=disabled, otherwise="empty or unset: changes nothing",
                    example=example)
       for key, example in (("velora_config", {"rank": 2}), ("alora_invocation_tokens", [1, 2]),
                            ("monteclora_config", {"num_samples": 2}), ("use_bdlora", {"nblocks": 2}),
                            ("arrow_config", {"top_k": 3}), ("kasa_config", {"beta": 1.0}))},
    # no effect
    "fan_in_fan_out": no_effect("PEFT sets it from the layer's class (true for Conv1D, false for nn.Linear: peft "
                                "0.21 tuners/lora/layer.py dispatch_default); fp8dist's PEFT does the same"),
    **{key: no_effect(_INIT_ONLY, example={"x": 1}) for key in (
        "loftq_config", "eva_config", "corda_config", "lora_ga_config")},
    "megatron_core": no_effect("the module megatron_config's layers come from; read only with megatron_config",
                               example="megatron.core"),
    "qalora_group_size": no_effect("read only with use_qalora", example=16),
    "runtime_config": no_effect("ephemeral GPU offload of DoRA's initialisation: where the magnitude vectors are "
                                "computed, not their values",
                                example={"ephemeral_gpu_offload": False}),
    "merge_weights": no_effect("PEFT < 0.3: merge the adapters into the weights for evaluation; not training"),
    "inference_mode": no_effect("how PEFT loads the saved adapter (frozen for inference); fp8dist trains it"),
    "revision": no_effect("which revision of the model: the script loads it", example="main"),
    "auto_mapping": no_effect("the classes of a custom base model: " + _BOOKKEEPING,
                              example={"base_model_class": "X"}),
    "peft_version": no_effect(_BOOKKEEPING, example="0.21.0"),
}, unknown_why="check that it changes neither the adapters' numerics nor which parameters train (peft "
               "tuners/lora/config.py LoraConfig)")


def convert(document: dict[str, Any], text: str, source: str) -> Imported:
    notes = Notes()
    issues: list[Issue] = []
    cfg = dict(document)
    _peft_type(cfg, issues)
    adapter: dict[str, Any] = {"kind": "lora"}
    for key, target in (("r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
        value = cfg.pop(key, None)
        if value is None:
            adapter[target] = DEFAULTS[key]
            notes.resolved(key, DEFAULTS[key], "left out: PEFT's LoraConfig default")
        elif key == "r":
            adapter[target] = integer(value, key)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise WrongShape(key, value, "a number")
        else:
            adapter[target] = value
    _targets(cfg, adapter, notes, issues)
    saved = module_names(cfg.pop("modules_to_save", None), "modules_to_save")
    if saved:
        adapter["modules_to_save"] = saved
    if pop_switch(cfg, "use_dora", notes, "off: changes nothing"):  # off: PEFT's default, plain LoRA
        adapter["use_dora"] = True
    _base(cfg.pop("base_model_name_or_path", None), adapter, notes, issues)
    for key, value in cfg.items():
        KEYS.settle(key, value, notes, issues)
    if issues:
        raise ImportProblem(issues, source, "peft")
    defaults = schema.defaults()
    p, t = defaults["precision"], defaults["train"]
    notes.resolved("precision / engine / batch", "fp8dist's defaults", "an adapter_config.json says only the "
                   f"adapter: engine {defaults['engine']}, load_dtype {p['load_dtype']}, mixed_precision "
                   f"{p['mixed_precision']}, master_weights {p['master_weights']}, micro_batch_size "
                   f"{t['micro_batch_size']}, gradient_accumulation_steps {t['gradient_accumulation_steps']}; set "
                   "them in this config, or import the run's Accelerate / DeepSpeed / TRL file and add this adapter")
    return Imported("peft", {"adapter": adapter}, notes)


def _peft_type(cfg: dict[str, Any], issues: list[Issue]) -> None:
    """PEFT picks the config class by `peft_type` (PeftConfig.from_pretrained); fp8dist runs LoRA only."""
    value = cfg.pop("peft_type", None)
    if value != "LORA":
        issues.append(Issue("peft_type", "fp8dist trains LoRA adapters only (peft_type LORA)" if value is not None
                            else "left out: PEFT cannot tell which adapter the file describes", value,
                            "import the adapter_config.json of a LoRA adapter (peft_type: LORA)"))


def _targets(cfg: dict[str, Any], adapter: dict[str, Any], notes: Notes, issues: list[Issue]) -> None:
    modules = cfg.pop("target_modules", None)
    if modules is None:
        issues.append(Issue("target_modules", "null: PEFT chose its per-architecture default for the base model "
                            "(e.g. q_proj, v_proj for Llama), which this file does not name", None,
                            "list the adapted modules (the names in adapter_model.safetensors), or all-linear"))
    elif isinstance(modules, str) and modules.lower() == _ALL_LINEAR:
        adapter["target_modules"] = "auto"
        notes.resolved("target_modules", "auto", "PEFT's all-linear: every Linear but the output layer; fp8dist's "
                       "auto also leaves MoE routers that are nn.Linear without adapters")
    elif isinstance(modules, str):
        issues.append(Issue("target_modules", "a string is a regular expression PEFT fullmatches against the full "
                            "module name, which fp8dist's list of module names does not express", modules,
                            "list the module names (e.g. [q_proj, v_proj]), or all-linear"))
    elif isinstance(modules, list) and not modules:
        issues.append(Issue("target_modules", "empty: no module gets an adapter (PEFT then adapts "
                            "target_parameters only)", modules, "list the modules to adapt"))
    elif isinstance(modules, list) and all(isinstance(name, str) and name for name in modules):
        adapter["target_modules"] = list(modules)
    else:
        raise WrongShape("target_modules", modules, "all-linear or a list of module names")


# transformers' BitsAndBytesConfig (quantizers/quantization_config.py): the quant_method it writes into config.json,
# and its default 4-bit data type
_BITSANDBYTES, _BNB_DEFAULT_4BIT = "bitsandbytes", "fp4"
_UNKNOWN_BASE = ("so whether the adapter was trained over a quantized base (QLoRA: bitsandbytes 4-bit) is unknown; "
                 "fp8dist trains over the base as it loads, in 16 bit: if it was NF4, set adapter.base_dtype: nf4")


def _base(name: Any, adapter: dict[str, Any], notes: Notes, issues: list[Issue]) -> None:
    """`base_model_name_or_path` (PEFT's from_pretrained loads the adapter onto it): a local model directory whose
    config.json holds a bitsandbytes quantization_config (transformers writes it when it saves a quantized model;
    a path as transformers' from_pretrained opens it) -> adapter.base_dtype; another base is noted as unknown."""
    config_file = Path(name) / "config.json" if isinstance(name, str) and name else None
    if config_file is None or not config_file.is_file():
        where = (f"{name!r} is not a local model directory with a config.json fp8dist can read" if name else
                 "the file does not name its base")
        notes.resolved("base_model_name_or_path", "adapter.base_dtype auto", f"{where}, {_UNKNOWN_BASE}")
        return
    document, _ = read_document(config_file)
    quantization = document.get("quantization_config") if isinstance(document, Mapping) else None
    if quantization is None:
        notes.resolved("base_model_name_or_path", "adapter.base_dtype auto", f"{config_file} has no "
                       "quantization_config: the adapter was trained over the base as it loads")
        return
    if not isinstance(quantization, Mapping):
        raise WrongShape(f"{config_file} quantization_config", quantization, "a mapping")
    shown = f"{config_file} quantization_config."
    method = quantization.get("quant_method")
    four_bit, eight_bit = truthy(quantization.get("load_in_4bit")), truthy(quantization.get("load_in_8bit"))
    kind = quantization.get("bnb_4bit_quant_type", _BNB_DEFAULT_4BIT)
    # transformers 5.24 quantizers/auto.py AutoQuantizationConfig.from_dict: load_in_4bit / load_in_8bit mean
    # bitsandbytes whatever quant_method says (an older config has none)
    if method != _BITSANDBYTES and not (four_bit or eight_bit):
        issues.append(Issue(shown + "quant_method", f"the base is quantized with {method}, and fp8dist's only "
                            "quantized base is NF4 (bitsandbytes' QLoRA base)", method, "train over the "
                            "unquantized model (adapter.base_dtype auto), or an NF4 one (adapter.base_dtype nf4)"))
    elif eight_bit:
        issues.append(Issue(shown + "load_in_8bit", "an 8-bit bitsandbytes base (LLM.int8; fp8dist's "
                            "adapter.base_dtype int8), which fp8dist does not build", True, "train over the "
                            "unquantized model (adapter.base_dtype auto), or a 4-bit NF4 one (adapter.base_dtype nf4)"))
    elif not four_bit:
        issues.append(Issue(shown + "load_in_4bit", "a bitsandbytes quantization_config that is neither 4-bit nor "
                            "8-bit: not one fp8dist can tell the meaning of", quantization.get("load_in_4bit"),
                            "train over the unquantized model (adapter.base_dtype auto)"))
    elif kind != "nf4":
        issues.append(Issue(shown + "bnb_4bit_quant_type", "bitsandbytes' FP4 data type" + (
            " (left out: BitsAndBytesConfig's default)" if "bnb_4bit_quant_type" not in quantization else "") +
                            ", not NF4: fp8dist's 4-bit base is NF4 only", kind,
                            "train over an NF4 base (bnb_4bit_quant_type nf4), or the unquantized model"))
    else:
        _nf4_base(quantization, shown, adapter, notes, issues)


# Skip-list names fp8dist's NF4 base leaves in 16 bit anyway: output layers by the names transformers' models give
# them (lm_head; GPT-NeoX embed_out; output), MoE routers (gate, router: backends/module_filter.is_router), and
# embeddings, which no 4-bit base quantizes (bitsandbytes replaces Linears only: transformers 5.24
# integrations/bitsandbytes.py replace_with_bnb_linear).
KEPT_OUT_OF_NF4 = ("lm_head", "embed_out", "output", "gate", "router", "embed_tokens", "wte", "wpe", "word_embeddings")


def _nf4_base(quantization: Mapping[str, Any], shown: str, adapter: dict[str, Any], notes: Notes,
              issues: list[Issue]) -> None:
    """A bitsandbytes 4-bit NF4 base -> adapter.base_dtype nf4, with what of its options fp8dist's NF4 changes."""
    adapter["base_dtype"] = "nf4"
    compute = quantization.get("bnb_4bit_compute_dtype")
    notes.resolved(shown + "bnb_4bit_quant_type nf4", "adapter.base_dtype=nf4", "QLoRA: the adapter was trained over "
                   "a bitsandbytes NF4 base; fp8dist quantizes the frozen Linears but the output layer, MoE routers "
                   "and modules to save with torchao's NF4 at load (FSDP2 only), and dequantizes them to the run's "
                   f"compute dtype (bitsandbytes computed in {compute or 'float32, its default'})")
    if not truthy(quantization.get("bnb_4bit_use_double_quant", False)):
        notes.dropped(shown + "bnb_4bit_use_double_quant", quantization.get("bnb_4bit_use_double_quant", False),
                      NF4_SCALES)
    if quantization.get("bnb_4bit_quant_storage") not in (None, "uint8"):
        notes.dropped(shown + "bnb_4bit_quant_storage", quantization["bnb_4bit_quant_storage"], NF4_STORAGE)
    skipped = quantization.get("llm_int8_skip_modules") or []
    if not isinstance(skipped, list):
        raise WrongShape(shown + "llm_int8_skip_modules", skipped, "a list of module names")
    beyond = [name for name in skipped if name not in (*KEPT_OUT_OF_NF4, *adapter.get("modules_to_save", ()))]
    if beyond:
        issues.append(Issue(shown + "llm_int8_skip_modules", "keeps these modules of the base out of 4 bit; fp8dist's "
                            "NF4 base covers every frozen Linear but the output layer, MoE routers and "
                            "adapter.modules_to_save", skipped, "train over a base that quantizes them, or the "
                            "unquantized model (adapter.base_dtype auto)"))
