"""Expert parallel on FSDP2: each MoE layer's routed experts split whole over the mesh's `ep` axis, tokens sent to
their experts' ranks and back with all-to-all, in the manner of torchtitan's `ExpertParallel`
(torchtitan/distributed/expert_parallel.py: expert weights `Shard(0)` over ep, uneven all-to-all dispatch and
combine, split sizes read on the host).

The experts live on a mesh of their own, (efsdp, ep) over the dp_shard ranks (fp8dist.config.parallel): the weights
become DTensors sharded by expert over `ep`, then FSDP2 shards each rank's experts over `efsdp` (a 2-D parameter as
under tensor parallel: FSDP2 needs the two meshes to share a root, torch 2.13 _fsdp_param.py). The dense layers and
the routers stay on the data mesh as without EP, so routing is the same. fp8dist's experts forward
(fp8dist.backends.experts.experts_forward) does the dispatch through the `TokenDispatch` set on each experts module;
a model whose experts do not run it yet (experts kept in high precision) is switched to its unquantized form.

Gradients: an expert's gradient on its rank sums every rank's tokens (the all-to-all's backward brings them), and
FSDP2 then reduces it over efsdp only; the data-parallel mean divides by all dp_shard ranks, so the experts' FSDP
modules divide by dp_shard, not by efsdp (torchtitan sets the same `set_gradient_divide_factor` on its experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fp8dist.backends.experts import expert_parameters, experts_modules, is_fp8dist_implementation, register
from fp8dist.errors import Fp8distError


@dataclass(frozen=True)
class Route:
    """How one call's rows travelled: the split sizes both ways and the order they were regrouped in."""
    sent: list[int]      # rows this rank sent to each ep rank
    received: list[int]  # rows each ep rank sent here
    order: torch.Tensor  # received rows (by source rank, then local expert) -> rows by local expert, then source


class TokenDispatch:
    """The all-to-all of one experts module over the ep group. `send` takes this rank's rows sorted by global expert
    with the count per global expert and returns the rows of this rank's experts (from every ep rank), grouped by
    local expert, with their counts; `receive` returns the experts' outputs to the ranks the rows came from, in the
    order they were sent."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def send(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Route]:
        local_experts = counts.numel() // self.size
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)  # from each rank: its rows per expert of mine
        incoming = incoming.view(self.size, local_experts)
        sent = counts.view(self.size, local_experts).sum(1).tolist()
        received = incoming.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows.contiguous(), received, sent, self.group)
        # each arrived row's (source, local expert) segment, regrouped by local expert then source
        segment = torch.repeat_interleave(torch.arange(incoming.numel(), device=counts.device), incoming.flatten())
        order = torch.argsort((segment % local_experts) * self.size + segment // local_experts, stable=True)
        return arrived[order], incoming.sum(0), Route(sent, received, order)

    def receive(self, out: torch.Tensor, route: Route) -> torch.Tensor:
        by_source = out[torch.argsort(route.order)]
        return all_to_all_single_autograd(by_source.contiguous(), route.sent, route.received, self.group)


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What `apply` did: the experts modules split, their experts per rank, and the implementation they run."""
    modules: tuple[str, ...]
    experts: int
    size: int
    implementation: str

    def summary(self) -> str:
        return (f"{len(self.modules)} experts modules split over ep {self.size}: {self.experts // self.size} of "
                f"{self.experts} experts per rank, tokens dispatched by all-to-all ({self.implementation})")


def apply(model: torch.nn.Module, ep) -> ExpertParallelPlan:
    """Shard every experts module of `model` by expert over the expert-parallel mesh `ep` (Meshes.expert_parallel)
    and give it its token dispatch. Run after the FP8 conversions (they choose the experts implementation) and
    before FSDP2 (`shard`)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    found = experts_modules(model)
    if not found:
        raise Fp8distError(f"parallel.expert_size={ep.size()}: {type(model).__name__} has no MoE experts modules "
                           "(transformers experts with 3-D parameters) to split\n  fix: parallel.expert_size=1")
    if not is_fp8dist_implementation(model):  # experts kept in high precision: fp8dist's forward, unquantized
        if not hasattr(model, "set_experts_implementation"):
            raise Fp8distError(f"parallel.expert_size={ep.size()}: {type(model).__name__} is not a transformers "
                               "PreTrainedModel, whose experts implementation fp8dist can switch to its dispatching "
                               "forward\n  fix: parallel.expert_size=1")
        getattr(model, "set_experts_implementation")(register("none", emulate=False))  # noqa: B009 - mypy: Any
    counts = set()
    for name, module in found:
        experts = module.num_experts
        split = {id(param) for _, param in expert_parameters(module)}
        others = [n for n, param in module.named_parameters() if id(param) not in split]
        if others:  # e.g. a post-expert norm: it runs on this rank's experts' rows, and its gradient would be reduced
            # over efsdp only, the ep peers' copies drifting apart
            raise Fp8distError(f"{name}: parameters that are not per expert ({', '.join(others)}) sit inside the "
                               "experts module; expert parallel shards that module over the expert mesh, where they "
                               "would not be kept equal across ranks\n  fix: parallel.expert_size=1 for this model")
        if experts % ep.size():
            raise Fp8distError(f"{name}: {experts} experts do not split whole over parallel.expert_size="
                               f"{ep.size()}\n  fix: a parallel.expert_size that divides {experts}")
        counts.add(experts)
        for param_name, param in expert_parameters(module):
            sharded = distribute_tensor(param.data, ep, [Shard(0)])
            module.register_parameter(param_name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.fp8dist_token_dispatch = TokenDispatch(ep.get_group(), ep.size())
    implementation = str(getattr(model, "config")._experts_implementation)  # noqa: B009 - mypy: Any
    return ExpertParallelPlan(tuple(name for name, _ in found), max(counts), ep.size(), implementation)


def shard(model: torch.nn.Module, efsdp, data_size: int, **fully_shard_kwargs) -> None:
    """FSDP2 over the expert-data mesh `efsdp` (Meshes.expert_data) for each experts module (before its block's
    `fully_shard`, which then leaves its parameters alone), dividing gradients by the `data_size` dp_shard ranks
    (module docstring)."""
    from torch.distributed.fsdp import fully_shard

    for _, module in experts_modules(model):
        fully_shard(module, mesh=efsdp, **fully_shard_kwargs)
        module.set_gradient_divide_factor(float(data_size))
        if dist.get_backend() == "gloo" and efsdp.size() > 1:
            # A factor other than the group's size reduce-scatters with NCCL's PREMUL_SUM, which gloo lacks: sum,
            # then divide. Not on a 1-rank efsdp, where foreach_reduce divides by the factor without a collective
            # and would divide again after it (torch 2.13 _fsdp_collectives.py foreach_reduce).
            module.set_force_sum_reduction_for_comms(True)
