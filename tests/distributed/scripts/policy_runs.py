"""The per-Linear precision policy and the precision schedule on 2 ranks (FSDP2, torchao emulated), one job:

    torchrun --nproc_per_node 2 tests/distributed/scripts/policy_runs.py [NAME ...]

- three-recipes: tiny-llama with attention rowwise (the run's recipe), the MLPs tensorwise with float8 all-gather,
  the last block in bf16 (keep_last_layers: 1); step 1 audited against the same config (must PASS), and against a
  config whose policy puts attention in tensorwise (must FAIL naming the attention Linears).
- schedule: 6 steps with the forward GEMMs switched to bf16 from step 3 (the engine audits step 1 and step 3, on
  raise); checkpoints after steps 2 and 4; runs resumed from each must end with the same weights bit for bit. A run
  without the switch watched as step 4 of the schedule must FAIL naming the forward GEMMs.
"""
from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist

import fp8dist.engines.checkpoint as checkpoint
from fp8dist.audit import watch
from fp8dist.config.load import load_config
from fp8dist.engines.fsdp2 import prepare, train_step
from fp8dist.runtime import process_group
from fp8dist.runtime.data import batches_for
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.process_group import leave
from tests.distributed.case_runner import run_cases

EMULATED = {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}
THREE = {"precision": {**EMULATED, "fp8": {"torchao": {"emulate": True, "recipe_name": "rowwise"},
                                           "overrides": [{"modules": ["*.mlp.*"], "recipe": "tensorwise"}],
                                           "keep_last_layers": 1}},
         "train": {"seq_len": 32}}
ATTENTION_TENSORWISE = {"precision": {**EMULATED, "fp8": {
    "torchao": {"emulate": True, "recipe_name": "rowwise"}, "keep_last_layers": 1,
    "overrides": [{"modules": ["*.mlp.*", "*.self_attn.*"], "recipe": "tensorwise"}]}}, "train": {"seq_len": 32}}
SCHEDULE = {"precision": {**EMULATED, "fp8": {"torchao": {"emulate": True, "enable_fsdp_float8_all_gather": False}},
                          "schedule": {"from_step": 3}},
            "train": {"seq_len": 32, "steps": 6}, "audit": {"first_step": "raise"}}


def _step(spec, loaded, run, index):
    return train_step(run, batches_for(loaded.make_batch, spec, index, dist.get_rank()), 1.0)


def _watched(spec, audited_spec, step: int = 1) -> dict:
    """One step of a run prepared under `spec`, watched against `audited_spec` as step `step` of its run."""
    loaded = load_for_run("tiny-llama", spec)
    run = prepare(loaded.model, spec, audit="off")
    with watch(run.model, run.optimizer, audited_spec, on_mismatch="ignore", step=step) as audit:
        _step(spec, loaded, run, 0)
    gemm = next(c for c in audit.report["checks"] if c["phase"] == "gemm")
    return {"passed": audit.passed, "gemm": gemm, "flops": audit.report["gemm_flops"],
            "failing": sorted(c["phase"] for c in audit.report["checks"] if not c["ok"]),
            "all_gather": next((c["observed"] for c in audit.report["checks"] if c["phase"] == "weight_all_gather"),
                               None),
            "recipes": {m["fqn"]: m.get("recipe") for m in audit.report["fp8_modules"]},
            "kinds": sorted({type(m).__name__ for m in run.model.modules() if isinstance(m, torch.nn.Linear)})}


def three_recipes() -> dict:
    return _watched(load_config(THREE), load_config(THREE))


def three_recipes_audited_against_another_policy() -> dict:
    return _watched(load_config(THREE), load_config(ATTENTION_TENSORWISE))


def unswitched_run_watched_after_the_switch() -> dict:
    spec = load_config(SCHEDULE)
    plain = load_config({**SCHEDULE, "precision": {**SCHEDULE["precision"], "schedule": {}}})
    return _watched(plain, spec, step=4)


def _weights(run) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().float().clone() for n, p in run.model.named_parameters()}


def schedule_resumed_across_the_switch() -> dict:
    spec = load_config(SCHEDULE)
    directory = [tempfile.mkdtemp(prefix="fp8dist-schedule-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    loaded = load_for_run("tiny-llama", spec)
    run = prepare(loaded.model, spec)  # audit.first_step=raise: steps 1 and 3 audited
    losses, audited = [], []
    for index in range(6):
        losses.append(_step(spec, loaded, run, index))
        if index == 0 or (index == 2 and run.switch_audited):
            audited.append(index + 1)
        if index + 1 in (2, 4):
            checkpoint.save(run, f"{directory[0]}/{index + 1}", index + 1, spec=spec, model_name="tiny-llama")
    reference = _weights(run)
    configs = [str(m.config.cast_config_input.scaling_type) for m in run.model.modules()
               if type(m).__name__ == "Float8Linear"]
    same = {}
    for saved in (2, 4):
        loaded = load_for_run("tiny-llama", spec)
        again = prepare(loaded.model, spec, audit="off")
        resumed = checkpoint.resume(again, f"{directory[0]}/{saved}", model_name="tiny-llama")
        tail = [_step(spec, loaded, again, index) for index in range(resumed.step, 6)]
        weights = _weights(again)
        same[saved] = {"weights": all(torch.equal(reference[n], weights[n]) for n in reference),
                       "losses": tail == losses[saved:], "step_number": again.step_number}
    return {"losses": losses, "audited": audited, "first_report_passed": run.audit_report["passed"],
            "forward_casts_after": sorted(set(configs)), "resumed": same}


CASES = {"three-recipes": three_recipes, "another-policy": three_recipes_audited_against_another_policy,
         "unswitched-after-switch": unswitched_run_watched_after_the_switch,
         "schedule-resume": schedule_resumed_across_the_switch}


def main(ids: list[str]) -> int:
    process_group.init()
    run_cases(CASES, ids)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
