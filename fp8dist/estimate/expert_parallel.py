"""What expert parallel splits in the model an estimate counts: the parameters of each MoE layer's experts module
(transformers 5 `*Experts`: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I) and their optional (E, ...) biases,
found as the FP8 backend finds them, backends/experts.py), split whole over the `ep` ranks and FSDP-sharded over the
`efsdp = dp_shard / ep` ranks that hold the same experts (config/parallel.py ParallelDims).

Per rank, the experts' sharded stores are E / (ep x efsdp) = E / dp_shard experts' worth: what plain FSDP holds, so
they are divided by the engine's shard counts as every other parameter's are (memory.py). What expert parallel
changes is
- the gathered working set: FSDP all-gathers a block's experts over efsdp only, so a rank gathers its E / ep experts,
  not all E (memory.transient_bytes);
- the dispatch (fp8dist's experts forward, backends/experts.py, through the engine's TokenDispatch,
  engines/fsdp2/expert_parallel.py): each MoE layer sends its tokens' top-k rows (tokens x top_k rows of the hidden
  size, compute dtype) to the experts' ranks with all_to_all and gets the experts' outputs back the same way. With
  balanced routing a rank receives tokens x top_k rows: the received rows the grouped GEMM keeps and the combined
  output the routing weights multiply take the place of the sorted rows and the expert outputs a forward without
  EP keeps, so the meta forward measures them already. On top, each layer keeps the two int64 regroup indices of
  its rows (received rows regrouped by local expert, and back) for the backward of those gathers
  (model.activation_bytes counts them in their block), and the all-to-all's send and receive buffers
  (tokens x top_k x hidden each) are in flight one layer at a time: in backward, the combined output's gradient
  and its reverse all-to-all (memory.transient_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from fp8dist.backends.experts import expert_parameters, experts_modules
from fp8dist.config.engines import TRAITS
from fp8dist.config.spec import Spec
from fp8dist.errors import Fp8distError

if TYPE_CHECKING:
    import torch

INDEX_BYTES = 8  # torch.argsort's indices are int64


@dataclass(frozen=True)
class ExpertSplit:
    """The model's MoE experts and the `ep` ranks they are split over; names are fqns of the meta model."""
    ep: int
    modules: tuple[str, ...]  # the experts modules, one per MoE layer
    parameters: frozenset[str]  # their per-expert parameters (leading dim: the experts)

    def gathered_numels(self, local: Mapping[str, int]) -> dict[str, int]:
        """Parameter fqn -> the elements FSDP's all-gather puts together on one rank: `local` (a tp rank's
        elements of each parameter), of an expert parameter the rank's E / ep experts (gathered over efsdp)."""
        return {fqn: numel // self.ep if fqn in self.parameters else numel for fqn, numel in local.items()}

    def kept_bytes(self, rows: int) -> int:
        """What one MoE layer's dispatch keeps for backward beyond a forward without expert parallel: the int64
        regroup index of its `rows` (tokens x top_k) received rows and its inverse, saved by the two gathers
        (`arrived[order]`, `out[argsort(order)]`); none without expert parallel."""
        return 2 * rows * INDEX_BYTES if self.ep > 1 else 0

    def in_flight_bytes(self, rows: int, hidden: int, element_size: int) -> int:
        """The send and receive buffers of one MoE layer's all-to-all, `rows` rows of `hidden` each; none without
        expert parallel."""
        return 2 * rows * hidden * element_size if self.ep > 1 else 0


def expert_split(model: torch.nn.Module, spec: Spec) -> ExpertSplit:
    """What `parallel.expert_size` splits in `model` (the meta model). The experts' count dividing by ep is
    ParallelDims.check_model's refusal; a model with no experts module for ep > 1 to split is refused
    here (its config may name experts that transformers does not build as an experts module)."""
    ep = spec.parallel.expert_size
    if ep > 1 and not TRAITS[spec.engine].own_expert_parallel:
        raise Fp8distError(f"parallel.expert_size={ep} with engine={spec.engine}: the estimate models fp8dist's FSDP2 "
                           "expert parallel (its expert mesh and token dispatch); DeepSpeed's AutoEP keeps its own "
                           "layer and layout, which it does not model\n  fix: engine=fsdp2 to estimate expert "
                           "parallel, or parallel.expert_size=1")
    modules, parameters = [], set()
    for name, module in experts_modules(model):
        modules.append(name)
        parameters |= {f"{name}.{key}" for key, _ in expert_parameters(module)}  # what the engine splits
    if ep > 1 and not modules:
        raise Fp8distError(f"parallel.expert_size={ep}: expert parallel splits transformers MoE experts modules "
                           f"(3-D expert parameters), and {type(model).__name__} has none\n  fix: "
                           "parallel.expert_size=1 for this model")
    return ExpertSplit(ep=ep, modules=tuple(modules), parameters=frozenset(parameters))
