"""Real-size features on 4 gloo ranks, one job (tests/distributed/test_scaling.py reads the `case` result lines):

    torchrun --nproc_per_node 4 tests/distributed/scripts/scaling_runs.py SAVED_DIR TIED_DIR [NAME ...]

- strategies: the per-step losses of full, grad_op, hybrid (groups of 2) and replicate, on FSDP2 and DeepSpeed;
- efficient-loading: RAM-efficient loading against full loading of the same saved model (FSDP2 + float8
  all-gather, a tied-embedding model, DeepSpeed ZeRO-3 + float8): step-1 loss, weights, buffers, dtypes;
- activation-checkpointing: gradients and saved-tensor bytes with full / selective / no checkpointing.
Rank 0 prints a `case` result line per case (fp8dist.runtime.ranks.emit).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from fp8dist.runtime import process_group
from fp8dist.runtime.process_group import leave

from fp8dist.config.load import load_config
from fp8dist.runtime.data import batches_for
from fp8dist.runtime.loading import load_for_run
from fp8dist.engines.base import forward_loss
from fp8dist.runtime.models import load_model
from tests.distributed.case_runner import run_cases

STEPS = 3
BASE = {"train": {"steps": STEPS, "seq_len": 32, "gradient_clipping": 0}, "audit": {"first_step": "off"}}
FLOAT8 = {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}


def spec_for(engine: str, precision: dict, parallel: dict):
    return load_config({**BASE, "engine": engine, "precision": precision, "parallel": parallel})


def losses_of(spec, loaded, steps=STEPS) -> list[float]:
    if spec.engine == "deepspeed":
        from fp8dist.engines import deepspeed

        engine, *_ = deepspeed.initialize(loaded.model, spec)
        out = [deepspeed.train_step(engine, batches_for(loaded.make_batch, spec, s, dist.get_rank()))
               for s in range(steps)]
        engine.destroy()
        return out
    from fp8dist.engines import fsdp2

    run = fsdp2.prepare(loaded.model, spec, materialize=loaded.materialize)
    return [fsdp2.train_step(run, batches_for(loaded.make_batch, spec, s, dist.get_rank()), 0.0) for s in range(steps)]


def strategies() -> dict:
    out = {}
    for engine in ("fsdp2", "deepspeed"):
        for sharding in ("full", "grad_op", "hybrid", "replicate"):
            parallel = {"sharding": sharding, **({"shard_size": 2} if sharding == "hybrid" else {})}
            spec = spec_for(engine, {"preset": "fp32"}, parallel)
            out[f"{engine}/{sharding}"] = losses_of(spec, load_model("tiny-llama", "fp32", seed=0))
    return out


def full_weights(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        inner = getattr(value, "_tensor", value)  # torchao's float8 all-gather wrapper
        out[name.replace("_checkpoint_wrapped_module.", "")] = inner.detach().float().clone()
    return out


def efficient_vs_full(saved: str, precision: dict, parallel: dict, engine: str = "fsdp2") -> dict:
    spec_full = spec_for(engine, precision, parallel)
    spec_efficient = spec_for(engine, precision, {**parallel, "cpu_ram_efficient_loading": True})
    facts = {}
    for label, spec in (("full", spec_full), ("efficient", spec_efficient)):
        loaded = load_for_run(saved, spec)
        batch = batches_for(loaded.make_batch, spec, 0, dist.get_rank())
        if engine == "deepspeed":
            from fp8dist.engines import deepspeed

            engine_, *_ = deepspeed.initialize(loaded.model, spec, audit="ignore")
            facts[label] = {"loss": deepspeed.train_step(engine_, batch),
                            "audit_passed": engine_.fp8dist_run.audit_report["passed"],
                            "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in engine_.module.modules())}
            engine_.destroy()
            continue
        from fp8dist.engines import fsdp2

        run = fsdp2.prepare(loaded.model, spec, materialize=loaded.materialize, audit="ignore")
        weights = full_weights(run.model)
        buffers = {n: b.detach().clone() for n, b in run.model.named_buffers()}
        locals_ = [p.to_local() for p in run.model.parameters()]
        facts[label] = {
            "weights": weights, "buffers": buffers,
            "local_dtypes": sorted({str(getattr(t, "_tensor", t).dtype) for t in locals_}),
            "float8_all_gather_weights": sum(type(t).__name__ == "WeightWithDynamicFloat8CastTensor" for t in locals_),
            "tied": run.model.get_output_embeddings().weight is run.model.get_input_embeddings().weight,
            "loss": fsdp2.train_step(run, batch, 0.0), "audit_passed": run.audit_report["passed"],
        }
    if engine == "deepspeed":
        return {"loss": [facts["full"]["loss"], facts["efficient"]["loss"]],
                "audit_passed": facts["efficient"]["audit_passed"], "float8_linears": facts["efficient"]["float8_linears"]}
    full, efficient = facts["full"], facts["efficient"]
    return {
        "loss": [full["loss"], efficient["loss"]],
        "weights_equal": all(torch.equal(full["weights"][k], efficient["weights"][k]) for k in full["weights"])
        and full["weights"].keys() == efficient["weights"].keys(),
        "buffers_equal": all(torch.equal(full["buffers"][k], efficient["buffers"][k]) for k in full["buffers"]),
        "local_dtypes": [full["local_dtypes"], efficient["local_dtypes"]],
        "float8_all_gather_weights": [full["float8_all_gather_weights"], efficient["float8_all_gather_weights"]],
        "tied": [full["tied"], efficient["tied"]], "audit_passed": efficient["audit_passed"],
    }


def saved_bytes_and_grads(precision: dict, mode: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes kept for backward after one forward (activation_checkpointing.kept_for_backward), and the full
    gradients."""
    from fp8dist.engines import fsdp2
    from fp8dist.engines.activation_checkpointing import kept_for_backward

    spec = spec_for("fsdp2", precision, {"activation_checkpointing": mode})
    loaded = load_model("tiny-llama", spec.precision.load_dtype, seed=0)
    run = fsdp2.prepare(loaded.model, spec)
    batch = batches_for(loaded.make_batch, spec, 0, dist.get_rank())[0]
    with kept_for_backward() as kept:
        loss = forward_loss(run.model, batch)
    nbytes = kept()
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor().detach().clone()
             for n, p in run.model.named_parameters() if p.grad is not None}
    return nbytes, grads


def activation_checkpointing() -> dict:
    out = {}
    for label, precision in (("fp32", {"preset": "fp32"}), ("float8", FLOAT8)):
        base_bytes, base_grads = saved_bytes_and_grads(precision, "none")
        for mode in ("full", "selective"):
            nbytes, grads = saved_bytes_and_grads(precision, mode)
            out[f"{label}/{mode}"] = {
                "bytes": [base_bytes, nbytes],
                "max_grad_diff": max(float((grads[k] - base_grads[k]).abs().max()) for k in base_grads),
                "same_keys": grads.keys() == base_grads.keys()}
    return out


def main(saved: str, tied: str) -> int:
    process_group.init(300, deepspeed=True)  # gloo; serves the FSDP2 cases too
    only = sys.argv[3:]
    cases = {
        "strategies": strategies,
        "efficient-loading-float8": lambda: efficient_vs_full(saved, FLOAT8, {"activation_checkpointing": "full"}),
        "efficient-loading-tied": lambda: efficient_vs_full(tied, {"preset": "bf16"}, {}),
        "efficient-loading-deepspeed-zero3-float8": lambda: efficient_vs_full(saved, FLOAT8, {"sharding": "full"},
                                                                              "deepspeed"),
        "activation-checkpointing": activation_checkpointing,
    }
    run_cases(cases, only)
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2]))
