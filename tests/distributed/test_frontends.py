"""One fp8dist config through Accelerate, audited with `fp8dist.audit.watch` on 2 gloo ranks (issue 14): the
dtypes observed through Accelerate equal those of the same config on fp8dist's own engine, phase by phase.

- DeepSpeed configs Accelerate can take from a file: `fp8dist translate --to accelerate -o FILE`, then
  `accelerate launch --config_file FILE --num_processes 2` of a user-style script.
- Every other example config Accelerate can express: `Accelerator(**accelerator_kwargs(CONFIG))` in one 2-rank
  job, next to fp8dist's engine. On CPU Accelerate 1.15 applies no FSDP plugin (the launched FSDP case below
  shows what runs instead), so the script sets the FSDP distributed type on the state as Accelerate does on
  a GPU (tests/distributed/scripts/frontend_runs.py says exactly what).
- The rest are refused by the translation with the key (GPU-only backends aside); the unit tests check the
  messages, this file checks that every example config is in one of these groups.
(HF Trainer with TrainingArguments from `training_arguments_kwargs`: tests/distributed/test_watch.py.)
"""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.distributed.launch import _env, describe, in_world
from tests.distributed.test_watch import parse

pytestmark = pytest.mark.distributed
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "frontend_runs.py"
LAUNCHED = ["deepspeed-bf16-zero1", "deepspeed-bf16-zero2", "deepspeed-bf16-zero3", "deepspeed-offload"]
KWARGS = ["deepspeed-bf16-zero1", "deepspeed-bf16-zero2", "deepspeed-bf16-zero3", "deepspeed-offload", "deepspeed-torchao-float8", "fp32",
          "fsdp2-bf16-pure", "fsdp2-bf16", "fsdp2-grad-op", "fsdp2-hybrid", "fsdp2-offload", "fsdp2-torchao-rowwise",
          "deepspeed-lora-zero3"]
# config -> the key Accelerate cannot express (accelerator_kwargs refuses it; docs/accelerate.md says why)
REFUSED = {"deepspeed-zero3-efficient": "parallel.activation_checkpointing", "fp16-amp": "precision.loss_scaling",
           "fsdp2-float8-efficient": "parallel.cpu_ram_efficient_loading", "fsdp2-replicate": "precision.master_weights",
           "fsdp2-torchao-float8": "precision.load_dtype", "fsdp2-lora-float8": "precision.load_dtype",
           # Accelerate converts nn.Linear only: MoE experts would stay in bf16
           "fsdp2-moe-mxfp8": "precision.fp8.torchao.experts", "deepspeed-moe-mxfp8": "precision.fp8.torchao.experts",
           # Accelerate's tensor parallel is transformers' tp_plan at load: no sequence parallel, FP8 converted after
           "fsdp2-tp-float8": "parallel.sequence_parallel",
           # Accelerate has no expert parallel
           "fsdp2-moe-ep-mxfp8": "parallel.expert_size",
           # Accelerate has no pipeline parallel over a Hugging Face model
           "fsdp2-pipeline-float8": "parallel.pipeline_size",
           # an NF4 base is fp8dist's own (torchao NF4); Accelerate's scripts load bitsandbytes 4-bit
           "fsdp2-qlora": "adapter.base_dtype"}
GPU_ONLY = {"deepspeed-fp16", "deepspeed-te", "te", "msamp-o1", "msamp-o2", "msamp-o3"}
VARIANTS = {  # a refused example with the refused key changed: what Accelerate can run of it
    "fsdp2-torchao-float8-fp32-load": "engine: fsdp2\nprecision:\n  preset: torchao-float8\n  load_dtype: fp32\n"
                                      "  fp8:\n    torchao:\n      emulate: true\n",
}
# fsdp2-replicate with the weights stepped as loaded: Accelerate's DDP (MULTI_GPU / MULTI_CPU here)
DDP = {"fsdp2-replicate-as-loaded": "engine: fsdp2\nprecision:\n  preset: bf16-pure\n  mixed_precision: bf16\n"
                                    "parallel:\n  sharding: replicate\n"}


def test_every_example_config_has_its_frontend_group():
    configs = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert configs == set(LAUNCHED) | set(KWARGS) | set(REFUSED) | GPU_ONLY


@pytest.mark.parametrize("config, key", sorted(REFUSED.items()))
def test_what_accelerate_cannot_express_is_refused_naming_the_key(config, key):
    from fp8dist.integrations import accelerator_kwargs
    from fp8dist.formats.accelerate.translate import NotExpressible

    with pytest.raises(NotExpressible) as refused:
        accelerator_kwargs(ROOT / "configs" / f"{config}.yaml", world_size=2)
    assert f"- {key}:" in str(refused.value) and "fix:" in str(refused.value)


@pytest.fixture(scope="module")
def through_kwargs(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    paths = [ROOT / "configs" / f"{name}.yaml" for name in KWARGS]
    for name, text in {**VARIANTS, **DDP}.items():
        (root / f"{name}.yaml").write_text(text)
        paths.append(root / f"{name}.yaml")
    result = in_world(SCRIPT, "kwargs", *paths, timeout=900)
    assert result.returncode == 0, describe(result)
    found = parse(result)
    errors = {name: case["traceback"] for name, case in found.items() if "error" in case}
    assert not errors, errors
    return found


@pytest.mark.parametrize("config", KWARGS + list(VARIANTS))
def test_accelerator_kwargs_run_the_dtypes_of_fp8dist_own_engine(config, through_kwargs):
    accelerate, own = through_kwargs[f"kwargs:{config}"], through_kwargs[f"fp8dist:{config}"]
    assert own["passed"] is True, own
    assert accelerate["observed"] == own["observed"], (accelerate, own)
    assert accelerate["passed"] is True


@pytest.mark.parametrize("config", list(DDP))
def test_a_replicated_config_runs_the_same_dtypes_under_accelerates_ddp(config, through_kwargs):
    """translate --to accelerate writes replicated configs as Accelerate's DDP where the dtypes agree: every phase is
    observed the same as fp8dist's own replicated FSDP2 run, the engine itself being the one difference named."""
    accelerate, own = through_kwargs[f"kwargs:{config}"], through_kwargs[f"fp8dist:{config}"]
    assert own["passed"] is True, own
    assert accelerate["observed"]["engine"] == "ddp" and accelerate["distributed_type"] == "DistributedType.MULTI_CPU"
    differ = {phase for phase in own["observed"] if accelerate["observed"].get(phase) != own["observed"][phase]}
    assert differ == {"engine"}, json.dumps([accelerate["observed"], own["observed"]])


def launch(config, tmp_path):
    translated = tmp_path / f"{config}.yaml"
    done = subprocess.run([sys.executable, "-m", "fp8dist", "translate", str(ROOT / "configs" / f"{config}.yaml"),
                           "--to", "accelerate", "-o", str(translated)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(translated), "--num_processes",
           "2", str(SCRIPT), "launched", str(ROOT / "configs" / f"{config}.yaml")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=400, cwd=ROOT)
    assert result.returncode == 0, describe(result)
    return parse(result)[f"launched:{config}"]


@pytest.mark.parametrize("config", LAUNCHED)
def test_accelerate_launch_with_the_translated_file_runs_the_dtypes_of_fp8dist_own_engine(config, tmp_path,
                                                                                          through_kwargs):
    case = launch(config, tmp_path)
    assert case["distributed_type"] == "DistributedType.DEEPSPEED", case
    assert case["observed"] == through_kwargs[f"fp8dist:{config}"]["observed"], case
    assert case["passed"] is True, case


def test_accelerate_launch_of_an_fsdp2_file_on_cpu_trains_each_rank_alone(tmp_path, through_kwargs):
    """The difference, named: Accelerate 1.15 applies no FSDP plugin without a GPU (state.py), and with the file's
    `use_cpu: false` it sets up no process group either (DistributedType.NO): each of the 2 processes trains
    its own unsharded copy. The dtypes of fsdp2-bf16-pure are the same; the audit's engine and communication
    rows say the rest."""
    case = launch("fsdp2-bf16-pure", tmp_path)
    own = through_kwargs["fp8dist:fsdp2-bf16-pure"]["observed"]
    assert case["distributed_type"] == "DistributedType.NO" and case["observed"]["engine"] == "none"
    differ = {phase for phase in own if case["observed"].get(phase) != own[phase]}
    assert differ == {"engine", "communication", "weight_all_gather"}, json.dumps([case["observed"], own])
    assert case["observed"]["communication"] == "none" and case["failing"] == sorted(differ)
