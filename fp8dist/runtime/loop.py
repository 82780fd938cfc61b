"""The run loop, written once: process group, preflight, loading, engine setup, the first-step audit, steps,
checkpoints, resume and export. launch/train.py runs all of it (`run`); the audit's ranks
(fp8dist.commands.audit_worker) and `fp8dist compare` start a Session and step it.

    session = start(spec, loaded)              # the engine the config names, around the loaded model
    loss, note = session.step(0)               # one optimizer step on the run's batches of step 0
    train(session, TrainOptions(steps=8, checkpoint_dir="ckpt"), on_step=..., say=...)

The first-step audit is the engines' (fp8dist.engines.base.Engine.train_step); a caller above the audit layer may
hand in its own (`first_step_audit=`), this module never imports the audit.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, cast

import torch
import torch.distributed as dist

import fp8dist.engines.checkpoint as checkpoint
from fp8dist.config.spec import Spec
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines import registry
from fp8dist.engines.advice import advise
from fp8dist.engines.base import Engine, FirstStepAudit
from fp8dist.engines.mesh import build_meshes
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Checks, Fp8distError
from fp8dist.runtime import process_group
from fp8dist.runtime.data import SYNTHETIC_BATCHES, BatchMaker, batches_for
from fp8dist.runtime.loading import check_efficient_loading, load_for_run
from fp8dist.runtime.models import LoadedModel, check_mesh_fits
from fp8dist.runtime.preflight import preflight
from fp8dist.translate import EnginePlan


@dataclass
class Session:
    """A prepared run on this rank: the engine, and the batches of each step."""

    spec: Spec
    loaded: LoadedModel
    engine: Engine
    make_batch: BatchMaker
    dims: ParallelDims  # the mesh axes whose data-parallel ranks pick the batches (the run's, unless start was told)
    pool: int | None = SYNTHETIC_BATCHES  # synthetic data cycles this many batches per rank; None: fresh ones

    def batches(self, index: int) -> list[dict]:
        """The micro-batches of optimizer step `index` on this rank (its data-parallel rank's), on the engine's
        input device."""
        device, rank = self.engine.input_device, self.dims.data_rank(process_group.rank())
        return [{k: v.to(device) for k, v in batch.items()}
                for batch in batches_for(self.make_batch, self.spec, index, rank, pool=self.pool)]

    def step(self, index: int) -> tuple[float, str | None]:
        """One optimizer step on the batches of step `index`: (mean loss, why it was skipped or None)."""
        loss = self.engine.train_step(self.batches(index))
        return loss, self.engine.skipped_note


def start(spec: Spec, loaded: LoadedModel, *, plan: EnginePlan | None = None, audit: str | None = None,
          first_step_audit: FirstStepAudit | None = None, make_batch=None, pool: int | None = SYNTHETIC_BATCHES,
          batch_dims: ParallelDims | None = None, dims: ParallelDims | None = None) -> Session:
    """The engine `spec.engine` names around `loaded` (the process group is up). `audit`: the first-step audit's
    mode (default audit.first_step); `make_batch`/`pool`: the data (default: the model's synthetic batches);
    `batch_dims`: the dims whose data-parallel ranks pick each rank's batches (default the run's own; `fp8dist
    compare` hands a tensor-parallel run's to its baseline, so both train on the same batches); `dims`: the run's
    layout, built once by the process (prepare_run; default: `spec`'s on this world)."""
    profile, dims = profile_for(spec), dims or ParallelDims.of(spec, process_group.world_size())
    if torch.cuda.is_available() and loaded.materialize is None and not profile.moves_model_to_device:
        loaded.model.to("cuda")  # a meta-built model is allocated on the device by the engine
    if spec.fp8.enabled and spec.fp8.policy == "auto":
        spec = calibrated(spec, loaded, make_batch or loaded.make_batch, batch_dims or dims, pool)
    meshes = {"meshes": build_meshes(dims)} if profile.uses_device_mesh else {}
    engine = registry.setup(loaded.model, spec, optimizer=loaded.make_optimizer, audit=audit, plan=plan,
                            first_step_audit=first_step_audit, materialize=loaded.materialize, **meshes)
    return Session(spec, loaded, engine, make_batch or loaded.make_batch, batch_dims or dims, pool)


def calibration_steps(spec: Spec, make_batch: BatchMaker, dims: ParallelDims, pool: int | None,
                      device: str) -> list[list[dict]]:
    """The micro-batches of the run's first precision.fp8.calibration_steps steps on this rank, on `device`: the
    batches precision.fp8.policy auto calibrates on (the run then trains on the same ones)."""
    rank = dims.data_rank(process_group.rank())
    return [[{k: v.to(device) for k, v in batch.items()} for batch in batches_for(make_batch, spec, index, rank, pool)]
            for index in range(spec.fp8.calibration_steps)]


def calibrated(spec: Spec, loaded: LoadedModel, make_batch: BatchMaker, dims: ParallelDims,
               pool: int | None) -> Spec:
    """precision.fp8.policy auto: the spec with the calibration's overrides (fp8dist.audit.calibration, handed in by
    the composition root), measured on this rank's whole model and the run's first batches."""
    from fp8dist.engines.base import provided_calibration
    from fp8dist.facts.hardware import run_gpu
    from fp8dist.machine import device_info

    calibrate = provided_calibration()
    if calibrate is None:
        raise Fp8distError("precision.fp8.policy=auto: no calibration is installed (import fp8dist, whose composition "
                           "root installs it)")
    if any(p.is_meta or hasattr(p, "ds_tensor") for p in loaded.model.parameters()):
        raise Fp8distError("precision.fp8.policy=auto calibrates on each rank's whole model before sharding, and this "
                           "model's weights are not loaded whole on the rank (built on meta or partitioned)\n  fix: "
                           "set parallel.cpu_ram_efficient_loading=false, or run `fp8dist calibrate` and train with "
                           "its overrides (policy manual)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = run_gpu(spec.hardware.gpu, device_info().get("name"))
    return calibrate(spec, loaded.model, calibration_steps(spec, make_batch, dims, pool, device), gpu,
                     process_group.rank())


@dataclass(frozen=True)
class TrainOptions:
    """What `train` does beyond stepping (launch/train.py's flags). Not a plan: fp8dist's plans are translations
    (fp8dist.translate)."""

    steps: int  # the step the run ends at (with resume, counted from step 0)
    model_name: str = ""
    checkpoint_dir: str | None = None
    save_every: int | None = None
    resume: bool = False
    export_hf: str | None = None


def train(session: Session, options: TrainOptions, on_step: Callable[[int, float, str | None], None],
          say: Callable[[str], None]) -> tuple[Path, bool] | None:
    """Resume, step to `options.steps`, checkpoint. With `export_hf`, returns (the checkpoint to export from, whether
    it is a scratch one to delete afterwards)."""
    engine, spec = session.engine, session.spec
    if options.export_hf and checkpoint.checkpointing_for(engine).hf_config() is None:  # said before training
        raise Fp8distError(f"--export-hf: the model {options.model_name} is not a Hugging Face model (no `config` with "
                           "to_json_file), so there is no config.json to export\n  fix: drop --export-hf and keep "
                           "--checkpoint-dir, or train a transformers model")
    first, latest = 0, None  # latest: this run's newest checkpoint (step, path)
    if options.checkpoint_dir:
        checkpoint.check_run_directory(options.checkpoint_dir, options.resume)
    if options.resume:
        # launch/train.py refuses --resume without --checkpoint-dir
        resumed = checkpoint.resume(engine, cast(str, options.checkpoint_dir), model_name=options.model_name)
        if resumed is None:
            say(f"no complete checkpoint in {options.checkpoint_dir}: starting from step 0")
        else:
            first, latest = resumed.step, (resumed.step, resumed.path)
            say(f"resumed from {resumed.path} (step {resumed.step})")
            for resume_note in resumed.notes:
                say(f"note: {resume_note}")
            if first >= options.steps:
                say(f"the checkpoint is at step {first}, --steps is {options.steps}: no step to run")
    for index in range(first, options.steps):
        loss, note = session.step(index)
        on_step(index, loss, note)
        done = index + 1
        if options.checkpoint_dir and ((options.save_every and done % options.save_every == 0)
                                       or done == options.steps):
            latest = (done, checkpoint.save(engine, options.checkpoint_dir, done, spec=spec,
                                            model_name=options.model_name))
            say(f"saved {latest[1]}")
    if not options.export_hf:
        return None
    final = max(options.steps, first)
    if latest is not None and latest[0] == final:
        return latest[1], False
    # A run that keeps no checkpoint of its last step exports from a scratch one beside the export: the same files
    # as `fp8dist export` makes later.
    parent = os.path.dirname(os.path.abspath(options.export_hf))
    if process_group.rank() == 0:
        os.makedirs(parent, exist_ok=True)
    scratch = [tempfile.mkdtemp(prefix=".fp8dist-export-", dir=parent) if process_group.rank() == 0 else None]
    dist.broadcast_object_list(scratch, src=0)
    scratch_dir = cast(str, scratch[0])  # broadcast_object_list gave every rank rank 0's directory
    return checkpoint.save(engine, scratch_dir, final, spec=spec, model_name=options.model_name), True


def export(source: Path, scratch: bool, destination: str, say: Callable[[str], None]) -> None:
    """Rank 0, after the process group is gone (an export of a large model must not hold the others in a
    collective that times out)."""
    from fp8dist.runtime.export import export_hf

    try:
        exported = export_hf(source, destination)
        say(f"exported {exported.directory} ({exported.dtype}, {exported.tensors} tensors, {exported.bytes} bytes)")
    finally:
        if scratch:
            shutil.rmtree(source.parent, ignore_errors=True)


STEP_LINE = re.compile(r"^step \d+ loss ([-\d.naif]+)$", flags=re.M)


def step_line(index: int, loss: float) -> str:
    """What launch/train.py prints (rank 0) after optimizer step `index` (from 0)."""
    return f"step {index + 1} loss {loss:.4f}"


def losses(stdout: str) -> list[float]:
    """The losses of launch/train.py's step lines, in order (what tests and benchmarks read)."""
    return [float(x) for x in STEP_LINE.findall(stdout)]


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank died or stopped answering (gloo raises a plain RuntimeError
    naming its transport; NCCL and the store raise torch.distributed.DistError)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "gloo", "Timed out")))


def check_before_launch(spec: Spec, model_name: str, *, export_hf: str | None = None,
                        world_size: int | None = None) -> EnginePlan:
    """What one process can refuse before any rank starts: the backend's library and hardware, the engine's own
    refusals, the export destination, the model name; every refusal at once (Problems). Returns the run's
    translation. (launch/train.py --check runs it alone, so the launch scripts refuse with one message before
    torchrun or deepspeed starts a rank; they pass `world_size`, so the mesh is checked too.)"""
    checks, plan = Checks(), None
    with checks.one():
        plan = preflight(spec)
    if export_hf:
        from fp8dist.runtime.export import check_destination

        with checks.one():
            check_destination(export_hf)
    with checks.one():
        check_efficient_loading(model_name, spec)
    if world_size is not None:  # the mesh and the model's sizes on it (the ranks check again before loading)
        with checks.one():
            check_mesh_fits(spec, model_name, world_size)
    checks.raise_found()
    return plan


def prepare_run(spec: Spec, model_name: str, *, export_hf: str | None = None
                ) -> tuple[LoadedModel, EnginePlan, ParallelDims]:
    """Everything before the first step, in order: what can be refused before the process group (the backend's
    library and hardware, the engine's own refusals, the export destination, the model name), the process group,
    the world size a hybrid shard group needs (before any weight is loaded), the notes for this config, and the
    model as the run loads it. Returns (the loaded model, the run's translation, its layout: built here once and
    handed to `start`)."""
    plan = check_before_launch(spec, model_name, export_hf=export_hf)
    process_group.init(spec.train.process_group_timeout_s, deepspeed=profile_for(spec).deepspeed_process_group)
    dims = check_mesh_fits(spec, model_name, process_group.world_size())
    advise(spec, process_group.world_size())
    return load_for_run(model_name, spec, plan=plan, dims=dims), plan, dims
