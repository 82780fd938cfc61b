"""The corpus of real configs (tests/data/corpus: Accelerate, Axolotl, DeepSpeed and TRL / alignment-handbook files
and PEFT adapter_config.json files copied from public repositories, each with its source in SOURCES.json and what its
own tool runs in MEANING.json) imports with no file changing meaning: each either imports with the source's engine,
sharding, precision, offload, activation checkpointing, micro batch, accumulation and FP8 (field by field against
MEANING.json; for TRL recipes also the load dtype, the master weights and the adapter; for PEFT files the adapter,
everything else at fp8dist's defaults), or is refused naming the key that fp8dist cannot keep. A DeepSpeed JSON whose
precision is "auto" (MEANING.json: the launching tool fills it) is refused naming --mixed-precision, and imports
with its meaning once the launch's precision is given."""
import json
import shutil
from pathlib import Path

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem, Launcher
from fp8dist.formats.importing import import_file
from fp8dist.translate import to_deepspeed
from tests.conftest import ROOT

CORPUS = ROOT / "tests" / "data" / "corpus"
SOURCES = json.loads((CORPUS / "SOURCES.json").read_text())
MEANING = json.loads((CORPUS / "MEANING.json").read_text())
# Refused, and the keys the refusal must name (what changes the run and fp8dist cannot keep): parallelism fp8dist
# does not build (DeepSpeed's Ulysses sequence parallel), adapters and quantised bases, QAT, partial
# fine-tuning, 8-bit optimizers under DeepSpeed, a batch that depends on the world size, and YAML that is not one
# document (a duplicate key).
REFUSED = {
    "accelerate/accelerate__tests_test_configs_0_30_0_sagemaker.yaml": [""],
    "accelerate/trl__examples_accelerate_configs_alst_ulysses_4gpu.yaml": ["parallelism_config.parallelism_config_sp_size"],
    "axolotl/axolotl__examples_alst_llama3-8b-deepspeed-alst.yaml": ["optimizer"],
    "axolotl/axolotl__examples_archived_dbrx_8bit-lora.yaml": ["load_in_8bit"],
    "axolotl/axolotl__examples_archived_dbrx_fft-ds-zero3.yaml": ["optimizer", "unfrozen_parameters"],
    "axolotl/axolotl__examples_archived_openllama-3b_lora.yml": ["load_in_8bit"],
    # Mxfp4Config with dequantize: true trains the dequantized weights: refused for the 8-bit Adam under DeepSpeed only
    "axolotl/axolotl__examples_gpt-oss_gpt-oss-20b-fft-deepspeed-zero3.yaml": ["optimizer"],
    # QLoRA (adapter: qlora + load_in_4bit) imports as an NF4 base; these are refused for their other keys
    "axolotl/axolotl__examples_jamba_qlora_deepspeed.yaml": ["optimizer"],
    "axolotl/axolotl__examples_jamba_qlora_fsdp_large.yaml": ["parallel.cpu_ram_efficient_loading"],
    "axolotl/axolotl__examples_kimi-linear_kimi-48b-lora.yaml": ["load_in_8bit"],
    "axolotl/axolotl__examples_llama-2_gptq-lora.yml": ["gptq"],
    "axolotl/axolotl__examples_llama-2_lora.yml": ["load_in_8bit"],
    "axolotl/axolotl__examples_llama-2_qlora-fsdp.yml": ["parallel.cpu_ram_efficient_loading"],
    "axolotl/axolotl__examples_llama-3_3b-qat-fsdp2.yaml": ["qat"],
    "axolotl/axolotl__examples_llama-3_3b-qat-nvfp4.yaml": ["qat"],
    "axolotl/axolotl__examples_llama-3_lora-1b-ray.yml": ["optimizer"],
    "axolotl/axolotl__examples_llama-3_qlora-fsdp-70b.yaml": ["parallel.cpu_ram_efficient_loading"],
    "axolotl/axolotl__examples_mistral_bigstral_bigstral-ds-zero3.yaml": ["optimizer", "unfrozen_parameters"],
    "axolotl/axolotl__examples_mistral_mixtral_mixtral.yml": ["optimizer"],
    "axolotl/axolotl__examples_mistral_mixtral_mixtral_22.yml": ["optimizer", "unfrozen_parameters"],
    "axolotl/axolotl__examples_nemotron-h_nano-30b-a3b-qlora-cp.yaml": ["optimizer", "quantize_moe_experts"],
    "axolotl/axolotl__examples_qwen3_reward-model.yaml": ["optimizer"],
    "deepspeed/deepspeedexamples__compression_cifar_config_ds_config.json": ["train_batch_size"],
    "deepspeed/deepspeedexamples__inference_sglang_ds_offload_nvme_aio.json": ["train_batch_size"],
    "deepspeed/deepspeedexamples__training_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": ["train_batch_size", "optimizer.type"],
    "deepspeed/deepspeedexamples__training_bingbertsquad_deepspeed_bsz24_config.json": ["train_batch_size"],
    "deepspeed/deepspeedexamples__training_deepspeed-zenflow_finetuning_zf_config.json": ["zero_optimization.zenflow", "train_batch_size"],
    "deepspeed/deepspeedexamples__training_gan_gan_deepspeed_config.json": ["train_batch_size"],
    "deepspeed/deepspeedexamples__training_imagenet_config_ds_fp16_z1_config.json": ["train_batch_size"],
    "deepspeed/deepspeedexamples__training_pipeline_parallelism_ds_config.json": ["train_batch_size"],
    "deepspeed/ms-amp__examples_ds_config.json": ["train_batch_size"],
    "deepspeed/ms-amp__examples_ds_config_msamp.json": ["train_batch_size"],
    "deepspeed/ms-amp__examples_ds_config_zero_msamp.json": ["train_batch_size"],
    "deepspeed/ms-amp__examples_ds_config_zero_te_msamp.json": ["train_batch_size"],
    "trl/alignment-handbook__recipes_constitutional-ai_dpo_config_anthropic.yaml": ["optim"],
    "trl/alignment-handbook__recipes_zephyr-7b-beta_dpo_config_lora.yaml": ["torch_dtype", "optim"],
    # QLoRA: TRL casts the adapters to bf16 over the 4-bit base, and paged_adamw_32bit keeps fp32 states over them
    "trl/alignment-handbook__recipes_zephyr-7b-beta_dpo_config_qlora.yaml": ["optim"],
    # modules_to_save imports (adapter.modules_to_save); the SEQ_CLS head PEFT adds to it is refused by task_type
    "peft/bert-gpt2-multitask-finetuning__adapter_config.json": ["task_type"],
    "peft/fine-tuning-gemma-2-9b-it-on-healthcare-dataset-using-qlora-trl-kaggle-p100-__adapter_config.json":
        ["layers_to_transform"],
}

# MEANING.json has no loading dtype; Axolotl's (utils/config normalize_config torch_dtype: bf16 with bf16 or
# bfloat16, fp16 with fp16, float16 or load_in_8bit, else fp32; `bf16` left out is `auto`: on), read from each file.
AXOLOTL_LOAD_DTYPE = {
    "axolotl/axolotl__examples_archived_openllama-3b_config.yml": "fp16",  # float16: true, bf16/fp16 false
    "axolotl/axolotl__examples_archived_pythia-12b_config.yml": "fp16",  # float16: true, bf16/fp16 false
    "axolotl/axolotl__examples_archived_stablelm-2_1.6b_fft.yml": "bf16",  # bf16: auto
    "axolotl/axolotl__examples_eaft_eaft-example.yml": "bf16",  # bf16: auto
    "axolotl/axolotl__examples_gpt-oss_gpt-oss-120b-fft-fsdp2-offload.yaml": "bf16",
    "axolotl/axolotl__examples_gpt-oss_gpt-oss-20b-fft-fsdp2-offload.yaml": "bf16",  # bf16: true, MXFP4 dequantized
    "axolotl/axolotl__examples_llama-3_3b-fp8-fsdp2.yaml": "bf16",  # no bf16 key: Axolotl's default auto
    "axolotl/axolotl__examples_qwen2_adamw-pretrain-fsdp2.yaml": "bf16",  # bf16: auto
    "axolotl/axolotl__examples_mistral_mps_lora-mps.yml": "bf16",  # bf16: auto
    "axolotl/axolotl__examples_alst_llama3-8b-fsdp2-alst.yaml": "bf16",  # bf16: auto
    "axolotl/axolotl__examples_distributed-parallel_llama-3_1-8b-hsdp-tp.yaml": "bf16",  # bf16: true
    "axolotl/axolotl__examples_distributed-parallel_qwen3-8b-fsdp-tp-cp.yaml": "bf16",  # bf16: true
    "axolotl/axolotl__examples_expert_parallel_qwen3_30ba3b_ep_fsdp_fft_4gpu.yaml": "bf16",  # bf16: true
}


# DeepSpeed JSONs whose bf16 / fp16 "enabled" is "auto": the launch decides their precision, which the file does not say
LAUNCH_DECIDES = {relative for relative, meaning in MEANING.items()
                  if meaning["tool"] == "deepspeed" and meaning.get("mixed_precision") == "auto"}


def stage(relative: str, directory: Path) -> Path:
    """The file and the files it names (Accelerate's deepspeed_config_file, Axolotl's deepspeed), at the relative
    paths it names them by: the tools open those from the launch directory."""
    target = directory / Path(relative).name
    shutil.copy(CORPUS / relative, target)
    for named, copy in (SOURCES[relative].get("references") or {}).items():
        where = (directory / named).resolve()
        where.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CORPUS / copy, where)
    return target


def meaning_of(spec) -> dict:
    """The imported config in MEANING.json's terms."""
    p, par = spec.precision, spec.parallel
    out = {"mixed_precision": "fp8" if spec.fp8.enabled else {"none": "no"}.get(p.mixed_precision, p.mixed_precision),
           "activation_checkpointing": par.activation_checkpointing != "none",
           "micro_batch": spec.train.micro_batch_size, "grad_accum": spec.train.gradient_accumulation_steps,
           "fp8": spec.fp8.backend, "load_dtype": p.load_dtype, "master_weights": p.master_weights,
           "tp": par.tensor_size, "cp": par.context_size, "ep": par.expert_size,
           "adapter": None if spec.adapter.kind == "none" else {
               "kind": spec.adapter.kind, "r": spec.adapter.r, "alpha": spec.adapter.alpha,
               "dropout": spec.adapter.dropout, "target_modules": spec.adapter.target_modules}}
    if spec.engine == "deepspeed":
        out.update(engine="deepspeed", zero_stage=spec.deepspeed.zero_stage,
                   offload={"optimizer": spec.deepspeed.offload_optimizer, "param": spec.deepspeed.offload_param})
    else:
        sharding = "full" if par.sharding == "auto" else par.sharding
        offloaded = "cpu" if par.offload == "params" else "none"
        out.update(engine="ddp" if sharding == "replicate" else "fsdp", sharding=sharding,
                   offload={"optimizer": offloaded, "param": offloaded})
    return out


def differences(got: dict, want: dict) -> list[str]:
    """Every field MEANING.json decides (null: the file does not; "auto": the launching tool fills it)."""
    out = []
    engine = want.get("engine")
    engine = "ddp" if engine in ("ddp", "single") or (engine is None and want["tool"] in ("axolotl", "trl")) else engine
    if engine and got["engine"] != engine:
        out.append(f"engine {got['engine']} != {engine}")
    if got["engine"] == "deepspeed" and want.get("zero_stage") is not None and got["zero_stage"] != want["zero_stage"]:
        out.append(f"zero_stage {got['zero_stage']} != {want['zero_stage']}")
    if got["engine"] == "fsdp" and want.get("sharding") and got["sharding"] != want["sharding"]:
        out.append(f"sharding {got['sharding']} != {want['sharding']}")
    if want.get("mixed_precision") not in (None, "auto") and got["mixed_precision"] != want["mixed_precision"]:
        out.append(f"mixed_precision {got['mixed_precision']} != {want['mixed_precision']}")
    for half, value in (want.get("offload") or {}).items():
        if value is not None and got["offload"][half] != value:
            out.append(f"offload.{half} {got['offload'][half]} != {value}")
    if want.get("activation_checkpointing") is not None and \
            got["activation_checkpointing"] != want["activation_checkpointing"]:
        out.append(f"activation_checkpointing {got['activation_checkpointing']} != {want['activation_checkpointing']}")
    batch = want.get("batch") or {}
    for field in ("micro_batch", "grad_accum"):
        if isinstance(batch.get(field), int) and got[field] != batch[field]:
            out.append(f"{field} {got[field]} != {batch[field]}")
    sizes = want.get("parallel_sizes") or {}  # the sizes the file sets: the others are 1
    for axis in ("tp", "cp", "ep"):
        if got[axis] != sizes.get(axis, 1):
            out.append(f"{axis} {got[axis]} != {sizes.get(axis, 1)}")
    if (want.get("fp8") is None) != (got["fp8"] == "none"):
        out.append(f"fp8 {got['fp8']} != {want.get('fp8')}")
    for field in ("load_dtype", "master_weights"):  # written for TRL recipes (the source decides both)
        if want.get(field) is not None and got[field] != want[field]:
            out.append(f"{field} {got[field]} != {want[field]}")
    if want["tool"] in ("trl", "peft"):
        adapter = want.get("adapter")
        if adapter is not None:
            adapter = {**adapter, "target_modules": tuple(adapter["target_modules"])
                       if isinstance(adapter["target_modules"], list) else adapter["target_modules"]}
        if got["adapter"] != adapter:
            out.append(f"adapter {got['adapter']} != {adapter}")
    return out


def test_the_corpus_is_real_and_large_enough():
    tools = [source["tool"] for source in SOURCES.values()]
    assert len(SOURCES) >= 60 and all(tools.count(tool) >= 15 for tool in ("accelerate", "axolotl", "deepspeed"))
    assert tools.count("trl") >= 12 and tools.count("peft") >= 6
    for relative, source in SOURCES.items():
        assert (CORPUS / relative).is_file() and relative in MEANING, relative
        assert source["repo"].count("/") == 1 and source["path"] and len(source["commit"]) == 40, relative


@pytest.mark.parametrize("relative", sorted(MEANING), ids=lambda r: Path(r).stem[:60])
def test_a_real_config_imports_with_its_meaning_or_is_refused_naming_the_key(relative, tmp_path, monkeypatch):
    path = stage(relative, tmp_path)
    monkeypatch.chdir(tmp_path)
    if SOURCES[relative]["tool"] == "peft":  # MEANING.json names the refused keys itself
        assert MEANING[relative]["refused"] == REFUSED.get(relative), relative
    launcher = Launcher()
    if relative in LAUNCH_DECIDES and relative not in REFUSED:
        with pytest.raises(ImportProblem) as unsaid:
            import_file(path.name)
        assert [issue.path.rsplit(".", 1)[-1] for issue in unsaid.value.issues] == ["enabled"], unsaid.value
        assert "--mixed-precision no|fp16|bf16" in unsaid.value.issues[0].fix
        launcher = Launcher(mixed_precision="bf16")
    try:
        text = import_file(path.name, launcher=launcher)
    except ImportProblem as exc:
        named = {issue.path for issue in exc.issues}
        assert relative in REFUSED, f"refused, but it keeps its meaning in fp8dist: {exc}"
        assert set(REFUSED[relative]) <= named, f"the refusal does not name {set(REFUSED[relative]) - named}: {exc}"
        assert all(issue.fix for issue in exc.issues if issue.path), exc
        return
    assert relative not in REFUSED, f"imported, but it changes a run fp8dist cannot keep ({REFUSED.get(relative)})"
    (tmp_path / "imported.yaml").write_text(text)
    spec = load_config(tmp_path / "imported.yaml")
    got = meaning_of(spec)
    assert not differences(got, MEANING[relative]), (differences(got, MEANING[relative]), text)
    if launcher.mixed_precision:
        assert got["mixed_precision"] == "bf16", text
    if SOURCES[relative]["tool"] == "peft":  # the file says only the adapter: the rest is fp8dist's defaults
        assert yaml.safe_load(text).keys() == {"adapter"} and "# resolved: precision / engine / batch" in text, text
        assert spec == load_config({"adapter": yaml.safe_load(text)["adapter"]})
    if SOURCES[relative]["tool"] == "axolotl":
        assert spec.precision.load_dtype == AXOLOTL_LOAD_DTYPE[relative], text
    if spec.parallel.tensor_size > 1 and spec.engine == "fsdp2":  # transformers' tp_plan: no sequence parallel
        assert spec.parallel.sequence_parallel is False, text
    if spec.engine == "deepspeed" and spec.fp8.backend != "msamp":  # back to DeepSpeed: its own parser accepts it
        from deepspeed.runtime.config import DeepSpeedConfig

        parsed = DeepSpeedConfig(to_deepspeed(spec))  # without a process group it assumes world size 1
        assert parsed.zero_optimization_stage == spec.deepspeed.zero_stage
        assert parsed.train_micro_batch_size_per_gpu == spec.train.micro_batch_size
