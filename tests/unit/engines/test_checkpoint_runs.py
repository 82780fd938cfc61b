"""Another run's checkpoints, refused in the checkpoint layer (issue 46 item 2): a script of its own calling
`fp8dist.engines.checkpoint.save` (examples/own_train.py) wrote its step 4 beside a LoRA run's step 8, and `fp8dist
export` of the directory then exported the LoRA run's newer step with exit 0. Real FSDP2 runs on a one-rank gloo
group, saved through the public `save`; `fp8dist export` as users run it."""
import json

import pytest
import torch.distributed as dist

from fp8dist.config.load import load_config
from fp8dist.engines import fsdp2
from fp8dist.engines.checkpoint import MANIFEST, read_manifest, resume, run_of, save
from fp8dist.errors import Fp8distError
from fp8dist.runtime.loading import load_for_run
from tests.conftest import ROOT, run_cli

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(overrides=()):
    """A fresh FSDP2 run of MODEL (its own model object: a run as checkpoints count them), one step taken."""
    spec = load_config(str(ROOT / "configs" / "fsdp2-bf16.yaml"), ["checkpoint.keep_last=5", *overrides])
    loaded = load_for_run(MODEL, spec)
    run = fsdp2.prepare(loaded.model, spec, audit="off", optimizer=loaded.make_optimizer)
    fsdp2.train_step(run, [loaded.make_batch(2, 16, 0)], spec.train.gradient_clipping)
    return run, spec


def test_a_save_beside_another_runs_checkpoint_is_refused_and_export_names_the_run(one_rank, tmp_path):
    ckpt = tmp_path / "ckpt"
    lora, lora_spec = _run(["adapter.kind=lora"])
    save(lora, ckpt, 8, spec=lora_spec, model_name=MODEL)
    lora_run = run_of(read_manifest(ckpt / "step-00000008"))
    assert lora_run is not None and len(lora_run) == 12

    own, own_spec = _run()  # another run, saving through the public path into the same directory
    with pytest.raises(Fp8distError) as refused:
        save(own, ckpt, 4, spec=own_spec, model_name=MODEL)
    message = str(refused.value)
    assert message.startswith(f"{ckpt}: holds checkpoints of an earlier run (newest step-00000008), run {lora_run} "
                              f"({MODEL}, adapter lora, fsdp2 on 1 rank(s), saved "), message
    assert "fix: save this run into a new or empty directory" in message and "resume from the directory" in message
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000008"]  # nothing written, not even a .partial

    # its own saves go on (a run's history is its own); a new directory takes the other run
    save(lora, ckpt, 10, spec=lora_spec, model_name=MODEL)
    elsewhere = save(own, tmp_path / "own", 4, spec=own_spec, model_name=MODEL)
    assert run_of(read_manifest(elsewhere)) not in (None, lora_run)

    # a run that resumed from the directory continues that run: its saves carry the id, and are allowed there
    resumer, _ = _run(["adapter.kind=lora"])
    assert resume(resumer, ckpt, model_name=MODEL).step == 10
    continued = save(resumer, ckpt, 12, spec=lora_spec, model_name=MODEL)
    assert run_of(read_manifest(continued)) == lora_run

    # export says which run and step it exports
    result = run_cli("export", ckpt, tmp_path / "out", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"exported step 12 of run {lora_run} ({MODEL}, adapter lora, fsdp2 on 1 rank(s), "
                                    f"saved "), result.stdout
    assert f"from {continued}\n  to {tmp_path / 'out'} (bf16" in result.stdout, result.stdout
    assert json.loads((tmp_path / "out" / "fp8dist-export.json").read_text())["run"] == lora_run


def test_a_directory_holding_two_runs_has_no_newest_checkpoint(one_rank, tmp_path):
    """Checkpoints of two runs in one directory (copied there by hand, or saved before the guard): a resume or an
    export of the directory is refused naming each run's newest; the checkpoint named itself still exports."""
    first, spec = _run()
    second, _ = _run()
    save(first, tmp_path / "a", 8, spec=spec, model_name=MODEL)
    save(second, tmp_path / "b", 4, spec=spec, model_name=MODEL)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for source in (tmp_path / "a" / "step-00000008", tmp_path / "b" / "step-00000004"):
        (mixed / source.name).mkdir()
        for file in source.rglob("*"):
            if file.is_file():
                target = mixed / source.name / file.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(file.read_bytes())
    runs = {run_of(read_manifest(mixed / name)) for name in ("step-00000004", "step-00000008")}
    assert len(runs) == 2 and None not in runs
    result = run_cli("export", mixed, tmp_path / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{mixed}: holds checkpoints of 2 runs" in result.stderr and "step-00000004: run " in result.stderr
    assert f"fix: name the checkpoint itself ({mixed / 'step-00000008'}, say)" in result.stderr
    assert not (tmp_path / "out").exists()
    fresh, _ = _run()
    with pytest.raises(Fp8distError, match="holds checkpoints of 2 runs"):
        resume(fresh, mixed, model_name=MODEL)
    named = run_cli("export", mixed / "step-00000004", tmp_path / "out")
    assert named.returncode == 0 and named.stdout.startswith("exported step 4 of run "), named.stderr[-3000:]
    assert (mixed / "step-00000004" / MANIFEST).is_file()
    # the directory: the older run's newest step written before checkpoints had a run id
    manifest_file = mixed / "step-00000008" / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    del manifest["run"]
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(Fp8distError, match=r"holds checkpoints of 2 runs .*step-00000008: a run without a recorded id"):
        resume(fresh, mixed, model_name=MODEL)
