"""Checkpoints that survive: save, exact resume, crash safety. One layout for both engines.

A save writes everything under a `.partial` name, rank 0 writes the manifest last and renames the directory (one
atomic rename on a POSIX filesystem), and only then deletes checkpoints beyond `checkpoint.keep_last` and
unfinished saves: a job killed during a save leaves the previous checkpoint as the newest complete one. Resuming
checks the manifest against the files (a truncated shard is named), the engine, the number of ranks where the
engine cannot reshard, and the model's parameters, before any weight is read. The checkpoint directory must be on
a filesystem every rank sees (as for torch.distributed.checkpoint and DeepSpeed).

Import the names below from here; by concern they live in
- layout: the directory layout (names, the manifest, complete and partial directories, find_latest, prune), and
  which run wrote each checkpoint (run_of, describe_run, foreign_checkpoints);
- protocol: save and resume with every rank, the one rule for another run's checkpoints (a save or a new run
  beside them is refused), the run directory's check, and `checkpoint_ranks` (the ranks checkpoints count);
- compatibility: what a resume refuses, and what it notes;
- interface: what an engine provides (`EngineCheckpointing`, `ModelReader`; implemented in
  fp8dist.engines.fsdp2.checkpointing and fp8dist.engines.deepspeed.checkpointing, reached through
  `Engine.checkpointing`);
- rng: the per-rank RNG states; files: the atomic write and the directory fsync.
The rank helpers (rank 0 acting for all, the barrier) are fp8dist.distributed's.
"""
from fp8dist.engines.checkpoint.compatibility import check_compatible, config_changes
from fp8dist.engines.checkpoint.interface import (WRAPPER_COMPONENTS, EngineCheckpointing, ModelReader,
                                                  checkpointing_for, exported_bytes, model_key)
from fp8dist.engines.checkpoint.layout import (FORMAT, HF_CONFIG_DIR, MANIFEST, complete_checkpoints, describe_run,
                                               find_latest, foreign_checkpoints, prune, read_manifest, run_of,
                                               step_name)
from fp8dist.engines.checkpoint.protocol import (Resumed, check_run_directory, checkpoint_ranks, failure_text, resume,
                                                 save)

__all__ = ["FORMAT", "HF_CONFIG_DIR", "MANIFEST", "WRAPPER_COMPONENTS", "EngineCheckpointing", "ModelReader",
           "Resumed", "check_compatible", "check_run_directory", "checkpoint_ranks", "checkpointing_for",
           "complete_checkpoints", "config_changes", "describe_run", "exported_bytes", "failure_text", "find_latest",
           "foreign_checkpoints", "model_key", "prune", "read_manifest", "resume", "run_of", "save", "step_name"]
