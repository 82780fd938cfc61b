"""QLoRA on FSDP2 for real (2 gloo ranks, torchrun): an unseen Qwen2 shape whose Linears split into whole NF4 blocks,
its frozen base in torchao's NF4 (configs/fsdp2-qlora.yaml). Against the same LoRA on a bf16 base (same weights,
adapters and batches): the loss; the audit of what the base really holds; a resume from an adapter-only
checkpoint; the merged export on the base the run computed with."""
import json

import pytest
import torch

from tests.conftest import ROOT, run_cli
from tests.distributed.launch import cases, cli_in_world, describe, in_world

pytestmark = pytest.mark.distributed
MODEL = "tests.tp_models:unseen_qwen2_qlora"
QLORA = ROOT / "configs" / "fsdp2-qlora.yaml"
TRAIN = ROOT / "launch" / "train.py"


def test_qlora_tracks_the_bf16_base_and_its_audit_reads_the_nf4_bytes(tmp_path):
    bf16_base = tmp_path / "lora-bf16.yaml"
    bf16_base.write_text(QLORA.read_text().replace("  base_dtype: nf4\n", ""))
    result = cli_in_world("compare", "--config", QLORA, "--baseline", bf16_base, "--model", MODEL, "--steps", "8",
                     "--nproc", "2", "--format", "json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout)["losses"]
    gaps = [abs(a - b) for a, b in zip(losses["config"], losses["baseline"])]
    assert 0 < max(gaps) < 0.05, losses  # NF4's rounding, and no more
    assert min(losses["config"][-3:]) < losses["config"][0]  # it trains
    audit = cli_in_world("audit", MODEL, "--config", QLORA, "--nproc", "2", "--format", "json", timeout=600)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    report = json.loads(audit.stdout)
    rows = {check["phase"]: check for check in report["checks"]}
    assert rows["frozen_weights"]["observed"] == "bf16+nf4" and rows["frozen_state"]["observed"] == "none"
    # the codes (0.5 byte), an int8 scale per 64 values and a bf16 factor per 64 x 256: 0.5166 measured
    assert 0.51 < report["frozen_bytes_by_format"]["nf4"] < 0.53 and report["frozen_bytes_by_format"]["bf16"] == 2
    # the adapters are all that trains: r=16 on 7 Linears of 2 layers
    assert report["parameters"]["trainable"] == 2 * 16 * (256 + 256) * 2 + 2 * 16 * (256 + 128) * 2 \
        + 2 * 16 * (256 + 512) * 3


def test_qlora_on_one_rank_keeps_the_nf4_weights_out_of_fsdp2():
    """One rank is QLoRA's most common run. torch 2.13's FSDP2 skips the all-gather on a shard group of one and
    hands NF4Tensor's post-all-gather hook one tensor of its three (pytorch/pytorch#197999, open): the NF4 weights
    stay outside FSDP2 there, and the run trains and audits as on two ranks."""
    audit = cli_in_world("audit", MODEL, "--config", QLORA, "--nproc", "1", "--format", "json", timeout=600)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    report = json.loads(audit.stdout)
    rows = {check["phase"]: check for check in report["checks"]}
    assert report["passed"] and rows["frozen_weights"]["observed"] == "bf16+nf4", rows
    assert 0.51 < report["frozen_bytes_by_format"]["nf4"] < 0.53


def test_qlora_resumes_bitwise_and_merges_into_the_base_it_computed_with(tmp_path):
    """From a Hugging Face directory, whose base is quantized tensor by tensor as it is read
    (fp8dist.runtime.loading.load_nf4_base). A shape with no whole 64 x 256-value scaler block per shard (MLP 704,
    k/v 64 x 256 on 2 ranks): every frozen Linear but lm_head in NF4 all the same, its scales double-quantized per
    the largest count under 256 that a shard holds whole."""
    from tests.tp_models import unseen_qwen2_qlora_704

    model = tmp_path / "model"
    torch.manual_seed(0)
    unseen_qwen2_qlora_704()["model"].to(torch.bfloat16).save_pretrained(model)
    checkpoints = tmp_path / "ckpt"
    common = ["--model", model, "--fp8dist-config", QLORA, "--checkpoint-dir", checkpoints]
    straight = in_world(TRAIN, "--model", model, "--fp8dist-config", QLORA, "--steps", "6", timeout=600)
    first = in_world(TRAIN, *common, "--steps", "3", timeout=600)
    resumed = in_world(TRAIN, *common, "--steps", "6", "--resume", timeout=600)
    for done in (straight, first, resumed):
        assert done.returncode == 0, describe(done)
    assert "14 frozen Linears in NF4; kept in their dtype: lm_head (the output layer" in straight.stdout + straight.stderr
    final = [line for line in straight.stdout.splitlines() if line.startswith("final_loss=")]
    assert final and final[0].split()[0] in resumed.stdout  # the same final loss, to the last digit printed
    merged = tmp_path / "merged"
    export = cli_in_world("export", checkpoints, merged, "--merge", "--dtype", "fp32", timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    adapter = tmp_path / "adapter"
    assert run_cli("export", checkpoints, adapter, timeout=300).returncode == 0
    from peft import PeftModel
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():  # the base the run computed with: every Linear but lm_head through NF4 and back, its
        # scales per the most (up to 256) that divide a shard's blocks of 64: 176 for the MLP, 128 for k/v, 256 q/o
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                blocks = module.weight.numel() // 64 // 2
                scaler_block = max(size for size in range(1, 257) if blocks % size == 0)
                module.weight.copy_(to_nf4(module.weight.detach(), 64, scaler_block).get_original_weight())
    expected = PeftModel.from_pretrained(base.float(), str(adapter)).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_accelerate_peft_bitsandbytes_loops_audit_by_what_the_base_holds(tmp_path):
    """The QLoRA loop people write (Accelerate FSDP2 + PEFT + bitsandbytes 4-bit), watched against the fsdp2-qlora
    config: bf16 quant storage passes (its codes read as nf4 though FSDP2 made them a plain bf16 shard); uint8
    storage fails naming the unsharded base; PEFT's prepare_model_for_kbit_training fails naming the fp32 norms."""
    from tests.tp_models import unseen_qwen2_qlora

    unseen_qwen2_qlora()["model"].to(torch.bfloat16).save_pretrained(tmp_path / "model")
    found = cases(ROOT / "tests" / "distributed" / "scripts" / "qlora_loops.py", tmp_path / "model", nproc=2)
    recipe, uint8, upcast = found["bf16-storage"], found["uint8-storage"], found["peft-upcast"]
    assert recipe["passed"] and recipe["frozen_weights"] == "bf16+nf4", recipe
    # this rank's half of the codes (0.5 byte per value) and bitsandbytes' fp32 absmax per 64 values whole (the
    # module's attribute: FSDP2 does not shard it): 0.5 + 2 * 4 / 64 = 0.625 bytes per value held
    assert 0.62 < recipe["frozen_bytes_by_format"]["nf4"] < 0.63, recipe
    # the logical elements of the base, as fp8dist's own NF4 run counts them (not the packed storage's)
    assert recipe["parameters"]["frozen"] == uint8["parameters"]["frozen"] == 1_444_096, recipe["parameters"]
    assert uint8["failing"] == ["frozen_weights"] and uint8["frozen_weights"] == "bf16+nf4+unsharded", uint8
    assert "whole on every rank" in uint8["detail"] and "bnb_4bit_quant_storage=torch.bfloat16" in uint8["detail"]
    assert upcast["failing"] == ["frozen_weights"] and upcast["frozen_weights"] == "fp32+nf4", upcast
