"""What expert parallel's dispatch keeps for backward, measured: a built-in MoE model runs fp8dist's experts forward
(backends/experts.py) once without a dispatch and once with the FSDP2 engine's TokenDispatch
(engines/fsdp2/expert_parallel.py) over a 1-rank gloo group, where the all-to-alls hand every row back (balanced
routing, trivially); the difference of the bytes autograd saves is what the dispatch adds. Prints it as JSON, beside
`fp8dist estimate`'s figure for the same model and micro batch under expert parallel.

    python tests/unit/estimate/one_rank_dispatch.py MODEL CONFIG KEY=VALUE...
"""
import json
import sys

import torch
import torch.distributed as dist

from fp8dist.backends.experts import experts_modules, register
from fp8dist.config.load import load_config
from fp8dist.engines.fsdp2.expert_parallel import TokenDispatch
from fp8dist.estimate.memory import estimate
from fp8dist.runtime.models import load_model
from tests.unit.estimate.saved_bytes import kept_for_backward


def main(name: str, config: str, overrides: list[str]) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = load_config(config, overrides=overrides)
    model = load_model(name, spec.precision.compute_dtype).model
    model.set_experts_implementation(register("none", emulate=False))  # what the engine runs under EP
    t = spec.train
    ids = torch.randint(0, model.config.vocab_size, (t.micro_batch_size, t.seq_len))
    batch = {"input_ids": ids, "labels": ids}
    without = kept_for_backward(model, batch)
    for _, module in experts_modules(model):
        module.fp8dist_token_dispatch = TokenDispatch(dist.group.WORLD, 1)
    measured = kept_for_backward(model, batch) - without
    estimated = estimate(name, spec, spec.parallel.expert_size).expert_parallel.dispatch_kept
    print(json.dumps({"measured": measured, "estimated": estimated}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
