"""Export a checkpoint to Hugging Face format: `config.json` + safetensors that
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads in a process that never imports fp8dist.

The tensors are plain (torchao's float8 weight wrappers are stripped: safetensors cannot write them, "invalid
python storage", scaling.md 4.2), named as the model's own state dict names them (activation checkpointing
and torch.compile wrappers removed), in the export dtype (default: the run's `precision.load_dtype`; fp32
masters stay in the resumable checkpoint: instructlab#477's "fp32 checkpoints from bf16 training"). Files are
written into a scratch directory beside OUT_DIR and renamed at the end: an interrupted export leaves nothing
that looks like a model.

The source is read tensor by tensor, in groups of at most one output shard: FSDP2 checkpoints through
torch.distributed.checkpoint (no process group needed), DeepSpeed ones through DeepSpeed's own
zero_to_fp32 (the fp32 masters of ZeRO 1-3, lazily) or, without ZeRO, the module weights it saved.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import fp8dist.dtypes as dtypes
from fp8dist.engines.registry import checkpoint_reader
from fp8dist.errors import Fp8distError
from fp8dist.facts.transformers import HF_MAX_SHARD_BYTES
from fp8dist.runtime.files import share

MARKER = "fp8dist-export.json"  # says a directory is an fp8dist export, which a new export may replace
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
EXPORT_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Exported:
    directory: Path
    dtype: str
    files: tuple[str, ...]
    tensors: int
    bytes: int  # of the safetensors files
    source: Path | None = None  # the checkpoint exported (a --checkpoint-dir's newest)
    step: int | None = None     # the step it was taken after
    run: str = ""               # the run that wrote it, in words (fp8dist.engines.checkpoint.describe_run)

    def origin(self) -> str:
        """'step 8 of run 3f2a9c1e07b4 (tiny-qwen2, adapter lora, ...), from DIR/step-00000008'."""
        return f"step {self.step} of {self.run}, from {self.source}" if self.source is not None else ""


def check_destination(out_dir: str | os.PathLike) -> None:
    """OUT_DIR may be new (its parents are made), empty, or an earlier fp8dist export (which is replaced, known by
    its fp8dist-export.json); anything else is refused: a Hugging Face model directory is never overwritten."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise Fp8distError(f"{out}: is a file\n  fix: name a new directory for the export")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise Fp8distError(f"{out}: exists and holds files that fp8dist did not export (no {MARKER})"
                           "\n  fix: name a new or empty directory (an earlier fp8dist export there is replaced)")


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
              shard_bytes: int = HF_MAX_SHARD_BYTES, merge: bool = False) -> Exported:
    """Write the model of `checkpoint` (one checkpoint, or a --checkpoint-dir: its newest complete one) to
    `out_dir` in Hugging Face format, in `dtype` (fp32 | bf16 | fp16; default the run's load dtype). An adapter
    run's checkpoint holds the adapters (and its modules_to_save) only: it is written as a PEFT adapter directory
    (default dtype: the adapters' master dtype, as trained), or with `merge` as the base (read again from the run's
    MODEL) with the adapters merged in and the trained modules in place of the base's."""
    from fp8dist.engines.checkpoint import HF_CONFIG_DIR, describe_run, find_latest, read_manifest

    if not Path(checkpoint).is_dir():
        why = "is a file, not a directory" if Path(checkpoint).exists() else "does not exist"
        raise Fp8distError(f"{checkpoint}: {why}\n  fix: pass the --checkpoint-dir of a launch/train.py run, or one "
                           "step-NNNNNNNN checkpoint in it")
    path = find_latest(checkpoint)
    if path is None:
        raise Fp8distError(f"{checkpoint}: no complete checkpoint in it"
                           "\n  fix: pass a checkpoint directory written by launch/train.py --checkpoint-dir")
    manifest = read_manifest(path)
    config_file = path / HF_CONFIG_DIR / "config.json"
    if not config_file.is_file():
        raise Fp8distError(f"{path}: the model ({manifest['model'].get('name') or '?'}) is not a Hugging Face "
                           "model, so there is no config.json to export with it"
                           "\n  fix: export Hugging Face models; for others read the checkpoint with "
                           "torch.distributed.checkpoint (FSDP2) or DeepSpeed's zero_to_fp32.py")
    asked = dtype
    lora = manifest["config"].get("adapter", {}).get("kind", "none") != "none"
    precision = manifest["config"]["precision"]
    if lora and not merge and precision["master_weights"] in EXPORT_DTYPES:
        # The adapters as they were trained (their masters), as PEFT's save_pretrained keeps them: a few MiB,
        # where rounding to the base's load dtype would change the delta they add.
        dtype = dtype or precision["master_weights"]
    dtype = dtype or precision["load_dtype"]
    if dtype not in EXPORT_DTYPES:
        raise Fp8distError(f"--dtype {dtype}: not an export dtype\n  fix: use fp32, bf16 or fp16")
    check_destination(out_dir)
    if merge and not lora:
        raise Fp8distError(f"--merge: {path} is a full fine-tune's checkpoint, with no adapter to merge"
                           "\n  fix: drop --merge (the export is the whole trained model already)")

    from safetensors.torch import save_file

    from fp8dist.dtypes import torch_dtype

    target = torch_dtype(dtype)
    out = Path(out_dir)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.absolute().parent))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger and progress prints: not our output
            reader = _unless_unreadable(path, lambda: checkpoint_reader(path, manifest))
        origin = {"source": path, "step": manifest["step"], "run": describe_run(manifest)}
        if lora:
            return dataclasses.replace(_export_adapter(reader, manifest, path, scratch, out, dtype, merge), **origin)
        narrower = sorted(d for d in getattr(reader, "stored", ()) if d.itemsize < target.itemsize)
        if narrower:
            stored = dtypes.name_of(narrower[0])
            if asked:
                raise Fp8distError(f"{path}: a DeepSpeed checkpoint without ZeRO keeps the weights in {stored}; "
                                   f"a {dtype} export would be them upcast, not the fp32 masters"
                                   f"\n  fix: --dtype {stored}, or train with deepspeed.zero_stage >= 1 to export "
                                   "the masters")
            dtype, target = stored, torch_dtype(stored)  # the default: the weights as they were saved
        groups = list(_groups(reader.sizes(target), shard_bytes))
        names = [WEIGHTS] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                    for i in range(len(groups))]
        weight_map, tensors = {}, 0
        for name, group in zip(names, groups):
            shard = _unless_unreadable(path, lambda group=group: {key: _plain_cpu_copy(value, target)
                                                                  for key, value in reader.read(group)})
            save_file(shard, str(scratch / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            tensors += len(shard)
            del shard
        total = sum((scratch / name).stat().st_size for name in names)
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (scratch / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["dtype"] = dtypes.torch_name(dtype)
        (scratch / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _publish(scratch, out, path, manifest, dtype, names)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Exported(out, dtype, tuple(names), tensors, total, **origin)


def _publish(scratch: Path, out: Path, path: Path, manifest: dict, dtype: str, names: list[str]) -> None:
    """The marker, ordinary permissions, and the finished scratch directory renamed to OUT_DIR."""
    from fp8dist.engines.checkpoint import run_of

    (scratch / MARKER).write_text(json.dumps({"checkpoint": str(path.absolute()), "step": manifest["step"],
                                              "run": run_of(manifest), "dtype": dtype, "files": names},
                                             indent=1) + "\n")
    share(scratch)  # mkdtemp's directory and safetensors' files are private; an export is shared like any model
    if out.exists():
        shutil.rmtree(out)
    os.rename(scratch, out)


def _export_adapter(reader, manifest: dict, path: Path, scratch: Path, out: Path, dtype: str, merge: bool) -> Exported:
    """The adapters and the modules trained whole beside them (adapter.modules_to_save) of the checkpoint (the frozen
    base is not in it) as a PEFT adapter directory, or merged."""
    from fp8dist.dtypes import torch_dtype
    from fp8dist.backends.adapters import trained_beside_base
    from fp8dist.runtime.adapter_files import write_adapter, write_merged

    keys = [key for key in reader.sizes(torch_dtype(dtype)) if trained_beside_base(key)]
    tensors = _unless_unreadable(path, lambda: {key: _plain_cpu_copy(value, torch_dtype(dtype))
                                                for key, value in reader.read(keys)})
    model_name = manifest["model"]["name"]
    if merge:
        adapter_dir = Path(tempfile.mkdtemp(prefix="adapter-", dir=scratch))
        write_adapter(tensors, manifest["config"], model_name, adapter_dir)
        try:
            count = write_merged(adapter_dir, manifest["config"], model_name, dtype, scratch,
                                 world_size=manifest["world_size"])
        except Fp8distError:
            raise
        except Exception as exc:  # noqa: BLE001 - PEFT / transformers on the base read again: said, not a traceback
            raise Fp8distError(f"--merge: cannot merge the adapters into {model_name} ({type(exc).__name__}: {exc})"
                               "\n  fix: export without --merge (a PEFT adapter directory), or make MODEL the base "
                               "the run trained on") from None
        shutil.rmtree(adapter_dir)
    else:
        write_adapter(tensors, manifest["config"], model_name, scratch)
        count = len(tensors)
    names = sorted(f.name for f in scratch.glob("*.safetensors"))
    _publish(scratch, out, path, manifest, dtype, names)
    return Exported(out, dtype, tuple(names), count, sum((out / name).stat().st_size for name in names))


def _unless_unreadable(path: Path, read):
    """`read()`, with what the checkpoint's files or the libraries raise said as the checkpoint being unreadable
    (torch.distributed.checkpoint's CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return read()
    except Fp8distError:
        raise
    except ImportError as exc:
        raise Fp8distError(f"{path}: reading it needs {exc.name or 'a library'}, which is not installed"
                           "\n  fix: pip install -e '.[all]' (as for training)") from None
    except (Exception, CheckpointException) as exc:
        from fp8dist.engines.checkpoint import failure_text

        raise Fp8distError(f"{path}: cannot read the checkpoint ({failure_text(exc)})"
                           f"\n  fix: restore its files, or export the checkpoint before it") from None


def _plain_cpu_copy(value, dtype):
    """A plain, contiguous CPU tensor in `dtype` (floating tensors only are cast). Copying into a new plain
    tensor strips tensor subclasses (torchao's WeightWithDynamicFloat8CastTensor unwraps itself in copy_)."""
    import torch

    target = dtype if value.is_floating_point() else value.dtype
    plain = torch.empty(tuple(value.shape), dtype=target)
    plain.copy_(value)
    return plain


def _groups(sizes: dict[str, int], limit: int) -> Iterator[list[str]]:
    group: list[str] = []
    used = 0
    for key, size in sizes.items():
        if group and used + size > limit:
            yield group
            group, used = [], 0
        group.append(key)
        used += size
    if group:
        yield group
