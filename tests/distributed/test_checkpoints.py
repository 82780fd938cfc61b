"""Checkpoints on gloo (issue 12): exact resume on both engines, a rank killed during a save, export to Hugging
Face format loaded by a process that never imports fp8dist, and checkpoints that cannot be resumed."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli
from tests.distributed.launch import TRAIN, _env, cli_in_world, describe, free_port, in_world, losses

pytestmark = pytest.mark.distributed
N = 2  # steps before the stop; the straight run takes 2N
SHORT = ["--fp8dist-set", "train.seq_len=32", "--fp8dist-set", f"train.steps={2 * N}"]
RESUME_CASES = {  # config, extra overrides
    "fsdp2-bf16": ("fsdp2-bf16", []),
    "fsdp2-float8-all-gather": ("fsdp2-torchao-float8", []),
    "deepspeed-zero2-bf16": ("deepspeed-bf16-zero2", []),
    "deepspeed-zero3-bf16": ("deepspeed-bf16-zero3", []),
    "deepspeed-float8": ("deepspeed-torchao-float8", []),
}


def train(config, *args, sets=(), nproc=2):
    overrides = [item for key in sets for item in ("--fp8dist-set", key)]
    return in_world(TRAIN, "--fp8dist-config", ROOT / "configs" / f"{config}.yaml", *SHORT, *overrides, *args,
                    nproc=nproc)


def read_export(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per case: a straight run of 2N steps saving at N (and at 2N), and a run resumed from a copy of the
    step-N checkpoint; each exports at the end (bf16, from train.py) and, here, in fp32 (its masters)."""
    from fp8dist.runtime.export import export_hf

    root, out = tmp_path_factory.mktemp("resume"), {}
    for case, (config, sets) in RESUME_CASES.items():
        straight, stopped = root / case / "straight", root / case / "stopped"
        first = train(config, "--checkpoint-dir", straight, "--save-every", N, "--export-hf", root / case / "hf-a",
                      sets=sets)
        assert first.returncode == 0, describe(first)
        stopped.mkdir(parents=True)
        shutil.copytree(straight / f"step-{N:08d}", stopped / f"step-{N:08d}")
        second = train(config, "--checkpoint-dir", stopped, "--resume", "--export-hf", root / case / "hf-b", sets=sets)
        assert second.returncode == 0, describe(second)
        for name, run_dir in (("fp32-a", straight), ("fp32-b", stopped)):
            export_hf(run_dir, root / case / name, "fp32")
        out[case] = {"dir": root / case, "straight": first, "resumed": second}
    return out


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_continues_bit_for_bit(case, resumed):
    import torch

    run = resumed[case]
    straight, again = losses(run["straight"].stdout), losses(run["resumed"].stdout)
    assert len(straight) == 2 * N and len(again) == N, describe(run["resumed"])
    assert again == straight[N:], (straight, again)
    assert f"resumed from {run['dir'] / 'stopped' / f'step-{N:08d}'} (step {N})" in run["resumed"].stdout
    for kind in ("fp32", "hf"):
        a, b = read_export(run["dir"] / f"{kind}-a"), read_export(run["dir"] / f"{kind}-b")
        assert a.keys() == b.keys() and len(a) == 21
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, f"{case} {kind}: {different[:3]} differ after resuming"
    masters = read_export(run["dir"] / "fp32-a")
    assert {t.dtype for t in masters.values()} == {torch.float32}
    assert {t.dtype for t in read_export(run["dir"] / "hf-a").values()} == {torch.bfloat16}


def test_straight_run_keeps_the_last_checkpoints(resumed):
    """--save-every 2 over 4 steps: steps 2 and 4 are kept (checkpoint.keep_last defaults to 2)."""
    names = sorted(p.name for p in (resumed["fsdp2-bf16"]["dir"] / "straight").iterdir())
    assert names == ["step-00000002", "step-00000004"]
    manifest = json.loads((resumed["fsdp2-bf16"]["dir"] / "straight" / "step-00000004" /
                           "fp8dist-checkpoint.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["engine"] == "fsdp2"
    assert manifest["config"]["precision"]["master_weights"] == "fp32" and "model.norm.weight" in manifest["model"][
        "parameters"]


PLAIN_LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
gen = torch.Generator().manual_seed(7)
ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
with torch.no_grad():
    loss = model(input_ids=ids, labels=ids).loss.item()
params = dict(model.named_parameters())
print(json.dumps({"loss": loss, "missing": sorted(info["missing_keys"]),
                  "unexpected": sorted(info["unexpected_keys"]),
                  "dtypes": sorted({str(p.dtype) for p in params.values()}),
                  "plain": all(type(p.data) is torch.Tensor for p in params.values()),
                  "fp8dist_imported": any(m.startswith("fp8dist") for m in sys.modules)}))
"""


def load_plainly(directory):
    done = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(directory)], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["fsdp2-float8-all-gather", "deepspeed-zero3-bf16"])
def test_export_loads_in_plain_transformers(case, resumed):
    """The bf16 export (float8 wrappers stripped, ZeRO-3 partitions gathered) loads without fp8dist; its loss
    equals the fp32 masters' loss within bf16 rounding."""
    bf16, fp32 = load_plainly(resumed[case]["dir"] / "hf-a"), load_plainly(resumed[case]["dir"] / "fp32-a")
    assert bf16["missing"] == [] and bf16["unexpected"] == [] and not bf16["fp8dist_imported"]
    assert bf16["dtypes"] == ["torch.bfloat16"] and fp32["dtypes"] == ["torch.float32"] and bf16["plain"]
    assert abs(bf16["loss"] - fp32["loss"]) <= 0.02 * abs(fp32["loss"]), (bf16, fp32)
    line = [x for x in resumed[case]["straight"].stdout.splitlines() if x.startswith("exported ")][0]
    size = (resumed[case]["dir"] / "hf-a" / "model.safetensors").stat().st_size
    assert f"{size} bytes" in line and "(bf16, 21 tensors" in line


def test_a_sharded_export_loads_the_same(resumed, tmp_path):
    """Shards of at most 60 kB (the default is transformers' 50 GB): several files and an index that
    from_pretrained follows to the same model."""
    from fp8dist.runtime.export import export_hf

    done = export_hf(resumed["fsdp2-bf16"]["dir"] / "straight", tmp_path / "sharded", shard_bytes=60_000)
    assert len(done.files) > 1 and done.files[0] == f"model-00001-of-{len(done.files):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(done.files) and len(index["weight_map"]) == 21
    sharded, whole = load_plainly(tmp_path / "sharded"), load_plainly(resumed["fsdp2-bf16"]["dir"] / "hf-a")
    assert sharded["missing"] == [] and sharded["loss"] == whole["loss"], (sharded, whole)


def test_offline_export_cli(resumed, tmp_path):
    result = run_cli("export", resumed["deepspeed-zero2-bf16"]["dir"] / "straight", tmp_path / "out", "--dtype", "fp16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fp16" in result.stdout and (tmp_path / "out" / "config.json").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left behind


def test_a_rank_killed_during_a_save(tmp_path):
    """Rank 1 SIGKILLs itself inside the save of step 4 (its shards written, the checkpoint not complete). Rank
    0 stops within the timeout with a message; the step-2 checkpoint stays the newest complete one and
    `--resume` continues from it, to the same weights as an uninterrupted run."""
    directory, config = tmp_path / "ckpt", ROOT / "configs" / "fsdp2-bf16.yaml"
    port, env = free_port(), {**_env(), "FP8DIST_KILL_RANK": "1", "FP8DIST_KILL_AT_STEP": "4",
                              "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    env["MASTER_PORT"] = str(port)
    cmd = [sys.executable, str(TRAIN), "--model", "tests.fault_injection:tiny_llama_killed_in_save",
           "--fp8dist-config", str(config), *SHORT, "--fp8dist-set", "train.steps=6",
           "--fp8dist-set", "train.process_group_timeout_s=20", "--checkpoint-dir", str(directory), "--save-every", "2"]
    ranks = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in (0, 1)]
    ranks[1].wait(timeout=300)
    killed_at = time.monotonic()
    out, err = ranks[0].communicate(timeout=60)
    waited = time.monotonic() - killed_at
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 3, f"rc={ranks[0].returncode}\n{out}\n{err[-3000:]}"
    assert waited < 20 and "another rank died or stopped answering (after step 4)" in err, (waited, err[-2000:])
    assert "rerun with --resume" in err and "Traceback" not in err
    assert (directory / "step-00000002" / "fp8dist-checkpoint.json").is_file()
    assert not (directory / "step-00000004").exists() and (directory / ".step-00000004.partial").is_dir()

    model = "tests.fault_injection:tiny_llama_killed_in_save"  # without the variables: the same model, no fault
    again = in_world(TRAIN, "--model", model, "--fp8dist-config", config, *SHORT, "--fp8dist-set", "train.steps=6",
                     "--checkpoint-dir", directory, "--resume", "--save-every", "2",
                     "--fp8dist-set", "checkpoint.keep_last=1")
    assert again.returncode == 0, describe(again)
    assert "resumed from" in again.stdout and "(step 2)" in again.stdout and len(losses(again.stdout)) == 4
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000006"]  # keep_last=1; the partial is gone
    straight = in_world(TRAIN, "--model", model, "--fp8dist-config", config, *SHORT, "--fp8dist-set", "train.steps=6")
    assert losses(again.stdout) == losses(straight.stdout)[2:], (again.stdout, straight.stdout)


def test_checkpoints_that_cannot_be_resumed(resumed, tmp_path):
    """Not a checkpoint directory, another model, another world size under ZeRO, a truncated shard: the job
    stops before training with the path, why and the fix; an empty directory starts from step 0."""
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("hello")
    result = train("fsdp2-bf16", "--checkpoint-dir", stranger, "--resume")
    assert result.returncode != 0 and "not an fp8dist checkpoint directory (it holds notes.txt" in result.stderr

    fsdp2 = resumed["fsdp2-bf16"]["dir"] / "straight"
    result = train("fsdp2-bf16", "--checkpoint-dir", fsdp2, "--resume", "--model", "small-llama")
    assert result.returncode != 0 and "a checkpoint of another model (tiny-llama" in result.stderr, describe(result)

    zero2 = resumed["deepspeed-zero2-bf16"]["dir"] / "straight"
    result = train("deepspeed-bf16-zero2", "--checkpoint-dir", zero2, "--resume", nproc=1)
    assert result.returncode != 0 and "written by 2 ranks; this job has 1" in result.stderr, describe(result)

    broken = tmp_path / "broken"
    shutil.copytree(fsdp2, broken)
    shard = sorted((broken / "step-00000004" / "dcp").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    result = cli_in_world("export", broken, tmp_path / "out")
    assert result.returncode == 2 and f"{shard}: truncated or changed since the save (100 bytes" in result.stderr
    assert "fix: restore the file, or delete" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    result = train("fsdp2-bf16", "--checkpoint-dir", broken, "--resume")
    assert result.returncode != 0 and "truncated or changed since the save" in result.stderr

    corrupt = tmp_path / "corrupt"  # the same size, other bytes: caught when read
    shutil.copytree(fsdp2, corrupt)
    shard = sorted((corrupt / "step-00000004" / "dcp").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[:2000] = bytes(2000)
    shard.write_bytes(bytes(data))
    result = cli_in_world("export", corrupt, tmp_path / "out")
    assert result.returncode == 2 and "cannot read the checkpoint (rank 0: " in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()

    result = train("fsdp2-bf16", "--checkpoint-dir", fsdp2, sets=["train.steps=1"])  # a new run, no --resume
    assert result.returncode != 0 and "holds checkpoints of an earlier run (newest step-00000004)" in result.stderr
    assert "step 1 loss" not in result.stdout  # refused before the first step

    empty = tmp_path / "empty"
    result = train("fsdp2-bf16", "--checkpoint-dir", empty, "--resume", sets=["train.steps=1"])
    assert result.returncode == 0 and f"no complete checkpoint in {empty}: starting from step 0" in result.stdout


def test_library_resume_with_a_scheduler_and_float8_weights(tmp_path):
    result = in_world(ROOT / "tests" / "distributed" / "scripts" / "checkpoint_roundtrip.py",
                      ROOT / "configs" / "fsdp2-torchao-float8.yaml", tmp_path / "ckpt")
    assert result.returncode == 0, describe(result)
    assert "resumed_step=2 weights_identical=True losses_identical=True lr=0.0002" in result.stdout, describe(result)
    assert "WeightWithDynamicFloat8CastTensor" in result.stdout  # the float8 all-gather weights came back as such


def test_a_lora_run_checkpoints_its_adapters_resumes_exactly_and_exports_for_peft(tmp_path):
    """LoRA (r=2, bf16 base, fp32 adapters) on small-llama: the checkpoint holds the adapters, their optimizer state, RNG and step
    (under a tenth of the full fine-tune's on the same model), the resume reads the base again and is bitwise (also
    with the frozen base in torchao float8 Linears and float8 all-gather),
    and the export loads with PEFT and, merged, with transformers alone, giving the trained model's logits."""
    import torch
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fp8dist.runtime.export import export_hf
    from fp8dist.runtime.models import load_model

    sizes = {}
    float8 = {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}  # frozen base under float8 all-gather
    for name, adapter, precision in (("lora", {"kind": "lora", "r": 2, "alpha": 4}, {"preset": "bf16"}),
                                     ("full", {"kind": "none"}, {"preset": "bf16"}),
                                     ("lora-float8", {"kind": "lora", "r": 2, "alpha": 4}, float8)):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"precision": precision, "adapter": adapter}))
        result = in_world(ROOT / "tests" / "distributed" / "scripts" / "checkpoint_roundtrip.py", config,
                          tmp_path / name, "small-llama")
        assert result.returncode == 0, describe(result)
        assert "resumed_step=2 weights_identical=True losses_identical=True" in result.stdout, describe(result)
        sizes[name] = int(result.stdout.split("checkpoint_bytes=")[1].split()[0])
    assert sizes["lora"] * 10 < sizes["full"], sizes

    trained = torch.load(tmp_path / "lora" / "logits-step2.pt")
    batch = load_model("small-llama", "bf16").make_batch(2, 16, 123)
    adapter = export_hf(tmp_path / "lora", tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert adapter.dtype == "fp32"  # the adapters as trained (their fp32 masters), not rounded to the base's bf16
    peft_model = PeftModel.from_pretrained(load_model("small-llama", "bf16").model, tmp_path / "adapter")
    export_hf(tmp_path / "lora", tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        for model in (peft_model, merged):
            logits = model(**batch).logits.float()
            assert torch.allclose(logits, trained, atol=0.05, rtol=0.02), (logits - trained).abs().max()


def test_a_deepspeed_zero3_lora_run_resumes_exactly(tmp_path):
    """ZeRO-3 + LoRA through launch/train.py: DeepSpeed saves no frozen parameter (exclude_frozen_parameters), the
    resumed run builds the base again and continues with the same losses; both exports hold the same adapters."""
    import torch
    from safetensors.torch import load_file

    from fp8dist.runtime.export import export_hf

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    first = train("deepspeed-lora-zero3", "--checkpoint-dir", straight, "--save-every", N)
    assert first.returncode == 0, describe(first)
    stopped.mkdir()
    shutil.copytree(straight / f"step-{N:08d}", stopped / f"step-{N:08d}")
    second = train("deepspeed-lora-zero3", "--checkpoint-dir", stopped, "--resume")
    assert second.returncode == 0, describe(second)
    assert losses(second.stdout) == losses(first.stdout)[N:], (losses(first.stdout), losses(second.stdout))
    rescaled = train("deepspeed-lora-zero3", "--checkpoint-dir", stopped, "--resume", "--steps", str(3 * N),
                     sets=("adapter.alpha=8",))
    assert rescaled.returncode != 0, describe(rescaled)  # train.py exits 2; torchrun reports a failed child as 1
    assert "adapter.alpha is 32 in the checkpoint and 8 in this config" in rescaled.stderr, describe(rescaled)
    saved = torch.load(next((straight / f"step-{N:08d}" / "deepspeed").glob("*mp_rank_00_model_states.pt")),
                       weights_only=False)["module"]
    assert saved and all(".lora_" in key for key in saved), sorted(saved)[:3]
    a, b = (load_file(export_hf(run, tmp_path / f"adapter-{run.name}").directory / "adapter_model.safetensors")
            for run in (straight, stopped))
    assert a.keys() == b.keys() and len(a) == 2 * 4 * 2 and all(torch.equal(a[k], b[k]) for k in a)
