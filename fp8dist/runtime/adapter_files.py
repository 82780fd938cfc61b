"""The files an adapter run exports: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
`PeftModel.from_pretrained` loads, its model card, and the adapters merged into their base as one Hugging Face model.
The adapters themselves are applied by fp8dist.backends.adapters."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

from fp8dist.backends.adapters import ADAPTER_NAME, lora_config
from fp8dist.config.load import load_config
from fp8dist.dtypes import torch_dtype
from fp8dist.errors import Fp8distError
from fp8dist.facts.peft import DORA_MAGNITUDE, SAVED_COPY


def peft_key(name: str, adapter_name: str = ADAPTER_NAME) -> str:
    """A parameter name of the adapted model -> its key in PEFT's adapter_model.safetensors: the PeftModel's
    `base_model.model.` in front, the adapter's name left out, a module to save under its own name (peft 0.21
    utils/save_and_load.py get_peft_model_state_dict, ModulesToSaveWrapper.adapter_state_dict:
    `lm_head.modules_to_save.default.weight` is saved as `base_model.model.lm_head.weight`), and DoRA's magnitude
    vector without its `.weight` (tuners/lora/model.py LoraModel._get_adapter_state_dict keeps the key it had before
    the vector became a DoraLinearLayer's weight: `q_proj.lora_magnitude_vector.default.weight` is saved as
    `base_model.model.q_proj.lora_magnitude_vector`; from_pretrained appends the `.weight` again)."""
    name = f".{name}".replace(f".{SAVED_COPY}.{adapter_name}.", ".")[1:]
    magnitude = f".{DORA_MAGNITUDE}.{adapter_name}.weight"
    if name.endswith(magnitude):
        name = name[:-len(magnitude)] + f".{DORA_MAGNITUDE}"
    return "base_model.model." + name.replace(f".{adapter_name}.", ".")


def write_adapter(tensors: dict, config: dict, model_name: str, directory: Path) -> None:
    """A PEFT adapter directory that `PeftModel.from_pretrained(base, directory)` loads: adapter_config.json (the
    run's LoraConfig, naming the base it was trained on and the modules it trained whole) and
    adapter_model.safetensors (the adapters and those modules)."""
    from safetensors.torch import save_file

    spec = load_config(config)  # a checkpoint's config: keys added since, at their defaults
    lora = lora_config(spec.adapter)
    lora.base_model_name_or_path = model_name
    lora.save_pretrained(str(directory))
    save_file({peft_key(name): value.contiguous() for name, value in tensors.items()},
              str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "README.md").write_text(model_card(spec, model_name), encoding="utf-8")


def model_card(spec, model_name: str) -> str:
    """The adapter's model card, as PEFT writes one (peft 0.21 peft_model.py create_or_update_model_card: the
    `library_name: peft` and `base_model` metadata, the quantization used during training under "## Training
    procedure"). adapter_config.json has no field for the base's quantization: the card is where PEFT records
    it, and a user who loads the adapter onto a 16-bit base must know the run computed with an NF4 one."""
    precision, adapter = spec.precision, spec.adapter
    base = f"base_model: {json.dumps(model_name)}\n" if model_name else ""  # JSON's string: a YAML one too
    if adapter.base_dtype == "nf4":
        from fp8dist.facts.torchao import NF4_BLOCK, NF4_SCALER_BLOCK

        held = (f"torchao NF4 (`torchao.quantization.to_nf4`, block_size {NF4_BLOCK}, scaler_block_size "
                f"{NF4_SCALER_BLOCK}, or the largest count under it that divides a shard's blocks) on every frozen "
                f"Linear but the output layer and MoE routers (fp8dist adapter.base_dtype: nf4), the rest in "
                f"{precision.load_dtype}; `fp8dist export --merge` merges into "
                "that NF4-dequantized base")
    else:
        held = precision.load_dtype
    return (f"---\nlibrary_name: peft\n{base}tags:\n- lora\n- fp8dist\n---\n\n# LoRA adapter trained with fp8dist\n\n"
            f"## Training procedure\n\n- adapter: LoRA r={adapter.r}, alpha={adapter.alpha:g}, trained in "
            f"{precision.weight_dtype}, computed in {precision.compute_dtype}\n- frozen base during training: {held}\n")


def write_merged(adapter_dir: Path, config: dict, model_name: str, dtype: str, directory: Path,
                 world_size: int = 1) -> int:
    """The base model, read again from MODEL as the run loaded it (an NF4 base: quantized and dequantized as the run
    on `world_size` ranks held it), with the adapters merged into its weights (peft merge_and_unload): a model
    directory transformers alone loads. Returns how many tensors it holds."""
    from peft import PeftModel

    from fp8dist.runtime.models import load_model

    if not model_name:
        raise Fp8distError("--merge: the checkpoint does not name the MODEL it was trained on, so there is no base "
                           "to merge into\n  fix: export without --merge (a PEFT adapter directory), or save with "
                           "model_name= (launch/train.py does)")

    nf4 = config["adapter"].get("base_dtype") == "nf4"
    with _no_progress_bars():
        base = load_model(model_name, config["precision"]["load_dtype"] if nf4 else dtype,
                          seed=config["train"]["seed"]).model
        if nf4:  # merge into the base the run computed with: its NF4 weights, dequantized, then in the export dtype
            from fp8dist.backends.nf4 import dequantize_like_training
            from fp8dist.config.parallel import ParallelDims

            # the layout the run trained on (its saved config on the world size it saved from)
            dequantize_like_training(base, ParallelDims.of(load_config(config), world_size).fsdp_size)
            base.to(torch_dtype(dtype))
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.to(torch_dtype(dtype)).save_pretrained(str(directory))
    return len(merged.state_dict())


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off ("Loading weights", "Writing model shards": tqdm lines for the few files of
    an export, whose one result line `fp8dist export` prints), as they were after."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
