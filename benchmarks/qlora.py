"""QLoRA: the bytes a rank holds for an NF4 base, against the same LoRA on a bf16 base and against Accelerate + PEFT
+ bitsandbytes doing the same QLoRA run.

    python benchmarks/qlora.py [--steps N] [--layers N]
    python benchmarks/qlora.py --smoke           # 1 step of a 1-layer, hidden-256 model per side: not a measurement

configs/fsdp2-qlora.yaml (LoRA r=16 on every Linear but lm_head, fp32 adapter masters, bf16 compute, FSDP2) on a
Llama of hidden 1024, MLP 2816, 16 heads over 8 KV heads of 64, vocabulary 8192 and 8 layers by default (110M
parameters; every Linear splits into whole NF4 blocks on 2 ranks), saved once as a Hugging Face directory that
every side loads; 2 gloo ranks, N steps (default 3), each side in its own torchrun launch so that each process's
high-water mark is its own:
- qlora: fp8dist, `adapter.base_dtype: nf4` (torchao NF4, each weight quantized as it is read from the directory,
  before sharding: fp8dist.runtime.loading.load_nf4_base);
- lora: fp8dist, the same file without `base_dtype` (the base in bf16);
- accelerate-bnb: the script a user writes for the same run: `from_pretrained(..., quantization_config=
  BitsAndBytesConfig(load_in_4bit, nf4, bf16 compute, bf16 quant storage))` (bf16 storage: FSDP2 needs one dtype;
  uint8 storage trains wrong, accelerate#3983), `peft.get_peft_model`, AdamW over the trainable parameters,
  `Accelerator(**accelerator_kwargs(the lora file))` (FSDP2), `prepare`, `backward`. Accelerate 1.15 applies no
  FSDP plugin without a GPU (state.py): the side sets the state's FSDP fields as Accelerate's own __init__ does on
  a GPU, so that it shards here too.

Figures: the frozen base's bytes a rank holds after the steps, read by what the tensors store
(fp8dist.backends.storage: NF4 codes and scales, not their appearance dtype), QLoRA over the bf16 base (goal <= 0.45);
peak resident bytes per rank (VmHWM minus the resident size once every library is imported and the process group
is up), QLoRA over Accelerate + PEFT + bitsandbytes (goal <= 1.0) and over the bf16-base LoRA (info); the resident
size after the steps over the bf16-base LoRA's (info).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ROOT, SMOKE_HELP, measure_side, quiet_libraries, reset_peak_resident, result,  # noqa: E402
                     status_kib, under_torchrun)

CONFIG = ROOT / "configs" / "fsdp2-qlora.yaml"
SIDES = ("qlora", "lora", "accelerate-bnb")


def save_model(directory: str, layers: int, smoke: bool) -> None:
    """The benchmark's Llama (at --smoke: hidden 256, MLP 512, 4 heads over 2 KV heads), seeded, in bf16, as a
    Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, mlp, heads = (256, 512, 4) if smoke else (1024, 2816, 16)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, head_dim=64, vocab_size=8192, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)


def spec_for(side: str):
    from fp8dist import load_config

    document = yaml.safe_load(CONFIG.read_text())
    if side != "qlora":
        document["adapter"].pop("base_dtype")  # the bf16 base; Accelerate's side quantizes with bitsandbytes itself
    return load_config(document)


def accelerate_bnb(model_dir: str, spec):
    """Accelerate + PEFT + bitsandbytes: (the prepared model, optimizer, accelerator)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from fp8dist.engines.optim import build_optimizer
    from fp8dist.integrations import accelerator_kwargs
    from fp8dist.backends.adapters import lora_config

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    model = get_peft_model(model, lora_config(spec.adapter))
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], spec)
    kwargs = accelerator_kwargs(spec)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **kwargs)
    if not torch.cuda.is_available():  # what AcceleratorState.__init__'s FSDP branch does on a GPU (accelerate 1.15)
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = kwargs["fsdp_plugin"]
        kwargs["fsdp_plugin"].set_mixed_precision(kwargs["mixed_precision"])
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator


def run_side(side: str, model_dir: str, steps: int) -> None:
    """One side on this rank (under torchrun): build, train `steps` steps, print the figures."""
    quiet_libraries()
    import accelerate  # noqa: F401  every side imports the same libraries before the baseline
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed as dist
    import torchao.quantization  # noqa: F401

    from fp8dist.backends.storage import bnb_4bit_quant_states, held_of, storage
    from fp8dist.engines.inspector import local
    from fp8dist.runtime import process_group
    from fp8dist.runtime.data import batches_for
    from fp8dist.runtime.models import causal_lm_batch
    from fp8dist.runtime.ranks import emit

    process_group.init()
    spec = spec_for(side)
    rank = dist.get_rank()
    make_batch = causal_lm_batch(8192)
    dist.barrier()
    baseline = status_kib("VmRSS") * 1024
    reset_peak_resident()
    if side == "accelerate-bnb":
        model, optimizer, accelerator = accelerate_bnb(model_dir, spec)
        for step in range(steps):
            for batch in batches_for(make_batch, spec, step, rank):
                accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    else:
        from fp8dist import load_model
        from fp8dist.engines.fsdp2 import prepare, train_step

        run = prepare(load_model(model_dir, spec).model, spec, audit="off")
        model = run.model
        for step in range(steps):
            train_step(run, batches_for(make_batch, spec, step, rank), spec.train.gradient_clipping)
    quant_states = bnb_4bit_quant_states(model)  # FSDP2 leaves bitsandbytes' codes a plain shard: read via the module
    held = [storage(held_of(p, local(p), quant_states)) for p in model.parameters() if not p.requires_grad]
    figures = {"peak": status_kib("VmHWM") * 1024 - baseline, "after": status_kib("VmRSS") * 1024 - baseline,
               "frozen_bytes": sum(s.nbytes for s in held),
               "frozen_formats": sorted({s.format for s in held})}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if rank == 0:  # the larger rank of each figure
        emit("side", side, {key: max(g[key] for g in gathered) if key != "frozen_formats" else figures[key]
                            for key in figures})
    process_group.leave(0)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, under torchrun
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.layers = 1, 1
    if args.side:
        assert under_torchrun(), "--side runs under torchrun (python benchmarks/qlora.py launches it)"
        return run_side(args.side, args.model_dir, args.steps)
    with tempfile.TemporaryDirectory(prefix="fp8dist-qlora-bench-") as model_dir:
        save_model(model_dir, args.layers, args.smoke)
        sides = {side: measure_side(__file__, side, "--model-dir", model_dir, "--steps", str(args.steps)) for side in SIDES}
    mib = 2 ** 20
    print(f"per rank, {args.layers}-layer Llama (hidden 1024), {args.steps} steps, 2 ranks (MiB above the imported "
          "baseline): " + "; ".join(f"{side}: peak {f['peak'] / mib:.1f}, after the steps {f['after'] / mib:.1f}, "
                                    f"frozen base {f['frozen_bytes'] / mib:.1f} ({'+'.join(f['frozen_formats'])})"
                                    for side, f in sides.items()))
    qlora, lora, accelerate = sides["qlora"], sides["lora"], sides["accelerate-bnb"]
    result("qlora_frozen_bytes_over_bf16_base", qlora["frozen_bytes"] / lora["frozen_bytes"], "<=0.45",
           "the frozen base's bytes a rank holds, NF4 base / bf16 base (lm_head, embeddings, norms stay bf16)")
    result("qlora_peak_over_accelerate_bnb", qlora["peak"] / accelerate["peak"], "<=1.0",
           "peak resident bytes per rank, fp8dist QLoRA / Accelerate + PEFT + bitsandbytes, same run")
    result("qlora_peak_over_bf16_base_lora", qlora["peak"] / lora["peak"], "info",
           "peak resident bytes per rank, QLoRA / LoRA on the bf16 base (loading included)")
    result("qlora_after_steps_over_bf16_base_lora", qlora["after"] / lora["after"], "info",
           "resident bytes per rank after the steps, QLoRA / LoRA on the bf16 base")


if __name__ == "__main__":
    main()
