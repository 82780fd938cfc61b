"""The checkpoint directory protocol (fp8dist.engines.checkpoint) on real directories: what counts as complete,
what is pruned, what is refused, a save and resume in one process; and the export's destination rules. The
engines' writing and reading run for real in tests/distributed/test_checkpoints.py."""
import json
import random

import pytest
import torch

from fp8dist.config.load import load_config
from fp8dist.engines.checkpoint import (HF_CONFIG_DIR, MANIFEST, EngineCheckpointing, check_compatible,
                                        check_run_directory, find_latest, model_key, prune, read_manifest, resume, save)
from fp8dist.errors import Fp8distError
from fp8dist.runtime.export import MARKER, check_destination


def make(directory, step, complete=True, files=None):
    path = directory / (f"step-{step:08d}" if complete else f".step-{step:08d}.partial")
    path.mkdir(parents=True)
    files = files or {"dcp/shard": b"x" * 10}
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    if complete:
        (path / MANIFEST).write_text(json.dumps({"fp8dist_checkpoint": 1, "step": step,
                                                 "files": {k: len(v) for k, v in files.items()}}))
    return path


def test_the_newest_complete_checkpoint_wins(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 10)
    make(tmp_path, 12, complete=False)  # a save a crash interrupted
    assert find_latest(tmp_path) == tmp_path / "step-00000010"
    assert find_latest(tmp_path / "step-00000002") == tmp_path / "step-00000002"  # one checkpoint named directly


def test_nothing_yet_is_not_an_error(tmp_path):
    assert find_latest(tmp_path / "missing") is None
    assert find_latest(tmp_path) is None
    make(tmp_path, 4, complete=False)
    assert find_latest(tmp_path) is None


def test_a_directory_of_other_things_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(Fp8distError, match="not an fp8dist checkpoint directory .it holds model.safetensors"):
        find_latest(tmp_path)
    with pytest.raises(Fp8distError, match="is a file, not a checkpoint directory"):
        find_latest(tmp_path / "model.safetensors")


def test_a_truncated_or_missing_file_is_named(tmp_path):
    path = make(tmp_path, 2, files={"dcp/a": b"1234", "rank-00000.pt": b"56"})
    assert read_manifest(path)["step"] == 2
    (path / "dcp" / "a").write_bytes(b"12")
    with pytest.raises(Fp8distError, match=r"dcp/a: truncated or changed since the save \(2 bytes, the manifest "
                                           r"says 4\)"):
        read_manifest(path)
    (path / "dcp" / "a").write_bytes(b"1234")
    (path / "rank-00000.pt").unlink()
    with pytest.raises(Fp8distError, match="rank-00000.pt: missing from the checkpoint"):
        read_manifest(path)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(Fp8distError, match="unreadable checkpoint manifest"):
        read_manifest(path)


def test_prune_keeps_the_newest_and_drops_unfinished_saves(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 8, complete=False)
    half_deleted = tmp_path / "step-00000001"  # a deletion a crash interrupted: no manifest left
    half_deleted.mkdir()
    prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006"]


def test_model_keys_drop_wrapper_components():
    assert model_key("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert model_key("_orig_mod.lm_head.weight") == "lm_head.weight"


def test_export_destination(tmp_path):
    check_destination(tmp_path / "new" / "deeper")  # made when written
    check_destination(tmp_path)  # empty
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face model directory (the --model, say): never replaced
    with pytest.raises(Fp8distError, match=f"holds files that fp8dist did not export .no {MARKER}"):
        check_destination(tmp_path)
    (tmp_path / MARKER).write_text("{}")
    check_destination(tmp_path)  # an earlier fp8dist export: replaced
    with pytest.raises(Fp8distError, match="is a file"):
        check_destination(tmp_path / "config.json")


def test_the_run_directory_is_checked_before_the_first_step(tmp_path):
    check_run_directory(tmp_path / "new" / "run", resuming=False)  # made
    assert (tmp_path / "new" / "run").is_dir()
    run = tmp_path / "run"
    make(run, 2)
    with pytest.raises(Fp8distError, match=r"(?s)holds checkpoints of an earlier run .newest step-00000002.*add --resume"):
        check_run_directory(run, resuming=False)
    check_run_directory(run, resuming=True)
    with pytest.raises(Fp8distError, match="names one checkpoint, not the directory of a run"):
        check_run_directory(run / "step-00000002", resuming=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(Fp8distError, match="is a file"):
        check_run_directory(tmp_path / "file", resuming=False)


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (8, 10):
        make(tmp_path, step)
    just_written = make(tmp_path, 2)
    prune(tmp_path, keep_last=1, keep=just_written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000010"]


def test_an_adapter_checkpoint_resumes_only_on_its_own_base(tmp_path):
    """A LoRA checkpoint holds the adapters only; the frozen base is read again from MODEL, so another MODEL would
    train these adapters on another base: refused. A full fine-tune's checkpoint holds every weight: a note."""
    engine = EngineCheckpointing(torch.nn.Linear(2, 2), model_name="other-llama")
    manifest = {"engine": "", "world_size": 1, "model": {"name": "tiny-llama", "parameters": engine.parameter_shapes()},
                "config": {"adapter": {"kind": "lora"}}}
    with pytest.raises(Fp8distError, match=r"(?s)adapters only.*fix: resume with --model tiny-llama"):
        check_compatible(manifest, tmp_path, engine, 1)
    manifest["config"]["adapter"]["kind"] = "none"
    assert "resumed with other-llama" in check_compatible(manifest, tmp_path, engine, 1)[0]


def test_a_resume_says_which_settings_it_changes_and_refuses_another_adapter_alpha(tmp_path):
    """Resuming under another config is said setting by setting (not the run's length or bookkeeping); another
    adapter.alpha is refused: the adapters were trained under the scaling alpha / r."""
    engine = EngineCheckpointing(torch.nn.Linear(2, 2), model_name="tiny-llama")
    saved = load_config("configs/fsdp2-lora-float8.yaml").to_dict()
    manifest = {"engine": "", "world_size": 1, "model": {"name": "tiny-llama", "parameters": engine.parameter_shapes()},
                "config": saved}
    assert check_compatible(manifest, tmp_path, engine, 1, saved) == []
    longer = load_config("configs/fsdp2-lora-float8.yaml", ["train.steps=40", "checkpoint.keep_last=5"]).to_dict()
    assert check_compatible(manifest, tmp_path, engine, 1, longer) == []
    other = load_config("configs/fsdp2-lora-float8.yaml", ["optimizer.lr=0.5", "adapter.dropout=0.0"]).to_dict()
    (note,) = check_compatible(manifest, tmp_path, engine, 1, other)
    assert "adapter.dropout 0.05 -> 0.0" in note and "optimizer.lr" in note and "train.steps" not in note
    scaled = load_config("configs/fsdp2-lora-float8.yaml", ["adapter.alpha=8"]).to_dict()
    with pytest.raises(Fp8distError, match=r"(?s)adapter.alpha is 32 in the checkpoint and 8.*fix: resume with "
                                           r"adapter.alpha=32"):
        check_compatible(manifest, tmp_path, engine, 1, scaled)
    qlora = load_config("configs/fsdp2-qlora.yaml").to_dict()
    with pytest.raises(Fp8distError, match=r"(?s)adapter.base_dtype is auto in the checkpoint and nf4.*fix: resume "
                                           r"with adapter.base_dtype=auto"):
        check_compatible(manifest, tmp_path, engine, 1, qlora)
    dora = load_config("configs/fsdp2-lora-float8.yaml", ["adapter.use_dora=true", "adapter.dropout=0",
                                                          "precision.fp8.torchao.enable_fsdp_float8_all_gather=false"])
    with pytest.raises(Fp8distError, match=r"(?s)adapter.use_dora is False in the checkpoint and True.*fix: resume "
                                           r"with adapter.use_dora=false"):
        check_compatible(manifest, tmp_path, engine, 1, dora.to_dict())
    engine.reshardable = True  # as FSDP2's
    on_two = {**manifest, "config": qlora}
    assert any("depends on the shard count" in note for note in check_compatible(on_two, tmp_path, engine, 2, qlora))


def test_merge_of_a_full_fine_tunes_checkpoint_is_refused(tmp_path):
    """`fp8dist export --merge` merges adapters: a checkpoint without any is refused (exit 2), nothing written."""
    from tests.conftest import run_cli

    path = make(tmp_path / "run", 2, files={f"{HF_CONFIG_DIR}/config.json": b"{}"})
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(model={"name": "tiny-llama", "parameters": {}},
                    config={"precision": {"load_dtype": "bf16"}, "adapter": {"kind": "none"}})
    (path / MANIFEST).write_text(json.dumps(manifest))
    result = run_cli("export", tmp_path / "run", tmp_path / "out", "--merge")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--merge:" in result.stderr and "no adapter to merge" in result.stderr and "fix: drop --merge" in result.stderr
    assert not (tmp_path / "out").exists()


class FileCheckpointing(EngineCheckpointing):
    """An engine's checkpointing that keeps the module's state dict in one file (the protocol around it is real)."""

    def write(self, directory):
        torch.save(self.module.state_dict(), directory / "weights.pt")

    def read(self, directory):
        self.module.load_state_dict(torch.load(directory / "weights.pt", weights_only=True))


def test_a_save_alone_resumes_its_weights_and_random_state(tmp_path, monkeypatch):
    """save / resume in one process without a process group: rank 0 of 1 whatever RANK a launcher left behind, the
    manifest written last with every file, and the RNG states restored, so the run continues exactly."""
    monkeypatch.setenv("RANK", "1")
    spec = load_config(None, ["checkpoint.keep_last=1"])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    path = save(FileCheckpointing(model), tmp_path, 4, spec=spec)
    assert path == tmp_path / "step-00000004" and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    manifest = read_manifest(path)
    assert (manifest["step"], manifest["world_size"], manifest["config"]) == (4, 1, spec.to_dict())
    assert set(manifest["files"]) == {"weights.pt", "rank-00000.pt"}
    assert manifest["versions"]["torch"] == torch.__version__
    after_save = (random.random(), torch.rand(2).tolist())

    fresh = torch.nn.Linear(3, 2)
    assert not torch.equal(fresh.weight, model.weight)
    resumed = resume(FileCheckpointing(fresh), tmp_path)
    assert (resumed.path, resumed.step, resumed.data_position, resumed.notes) == (path, 4, 4, ())
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert (random.random(), torch.rand(2).tolist()) == after_save


def test_the_same_step_saved_again_replaces_it_and_older_ones_are_pruned(tmp_path):
    spec = load_config(None, ["checkpoint.keep_last=1"])
    model = torch.nn.Linear(2, 2)
    save(FileCheckpointing(model), tmp_path, 2, spec=spec)
    save(FileCheckpointing(model), tmp_path, 4, spec=spec)
    with torch.no_grad():
        model.weight.fill_(7.0)
    path = save(FileCheckpointing(model), tmp_path, 4, spec=spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]  # no .replaced or .partial left
    assert torch.load(path / "weights.pt", weights_only=True)["weight"].eq(7.0).all()


def test_another_use_dora_is_refused_before_the_parameters_it_adds_are_compared(tmp_path):
    """A DoRA checkpoint holds a magnitude vector per adapter that a LoRA run lacks: the refusal names
    adapter.use_dora, not a parameter of another model."""
    dora = load_config({"adapter": {"kind": "lora", "use_dora": True}}).to_dict()
    engine = EngineCheckpointing(torch.nn.Linear(2, 2), model_name="tiny-llama")
    shapes = {**engine.parameter_shapes(), "q_proj.lora_magnitude_vector.default.weight": [2]}
    manifest = {"engine": "", "world_size": 1, "model": {"name": "tiny-llama", "parameters": shapes},
                "config": dora}
    with pytest.raises(Fp8distError, match=r"(?s)adapter.use_dora is True in the checkpoint and False.*magnitude "
                                           r"vector.*fix: resume with adapter.use_dora=true"):
        check_compatible(manifest, tmp_path, engine, 1, load_config({"adapter": {"kind": "lora"}}).to_dict())


def test_a_key_added_since_the_checkpoint_is_no_change_at_its_default():
    """A checkpoint written before adapter.modules_to_save existed resumes without a note about it; a key this run
    sets away from its default is still said."""
    from fp8dist.config.load import load_config
    from fp8dist.engines.checkpoint.compatibility import config_changes

    here = load_config({"adapter": {"kind": "lora"}}).to_dict()
    older = {**here, "adapter": {k: v for k, v in here["adapter"].items() if k != "modules_to_save"}}
    assert config_changes(older, here) == []
    saving = load_config({"adapter": {"kind": "lora", "modules_to_save": ["lm_head"]}}).to_dict()
    assert config_changes(older, saving) == [("adapter.modules_to_save", [], ["lm_head"])]


def test_a_checkpoint_without_a_run_id_is_another_runs_until_resumed(tmp_path):
    """Checkpoints saved before manifests named their run: a fresh run's save beside them is refused (they may be
    any run's); a run that resumed from one continues it, under an id of its own that the directory then holds
    beside them without being taken for a second run."""
    spec = load_config(None, ["checkpoint.keep_last=5"])
    old = save(FileCheckpointing(torch.nn.Linear(2, 2)), tmp_path, 2, spec=spec)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["run"]  # as fp8dist wrote it before
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(Fp8distError, match=r"(?s)holds checkpoints of an earlier run .newest step-00000002., a run "
                                           r"without a recorded id .*fix: save this run into a new or empty directory"):
        save(FileCheckpointing(torch.nn.Linear(2, 2)), tmp_path, 4, spec=spec)
    resumed = torch.nn.Linear(2, 2)
    assert resume(FileCheckpointing(resumed), tmp_path).step == 2
    new = save(FileCheckpointing(resumed), tmp_path, 4, spec=spec)
    assert isinstance(read_manifest(new)["run"], str) and find_latest(tmp_path) == new
