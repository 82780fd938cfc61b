"""What crosses the wire: every collective issued through a torch ProcessGroup, whoever issues it, by mesh axis.

torch.distributed's collectives reach the backend through the dispatcher as `c10d` ops
(`c10d.allreduce_`, `c10d._reduce_scatter_base_`, `c10d._allgather_base_`, ...; torch 2.13
torch/csrc/distributed/c10d/ProcessGroup.hpp), so one TorchDispatchMode sees the collectives of FSDP2,
DeepSpeed (deepspeed.comm calls torch.distributed), DDP and user code alike, with the real tensors. DTensor's
redistributions (tensor parallel) call the functional collectives instead (`_c10d_functional.all_gather_into_tensor`,
... torch 2.13 torch/distributed/_functional_collectives.py), which name their process group by its name; torchao's
float8 tensor-parallel styles hand them a Float8TrainingTensor, whose bytes are its float8 `_data`
(fp8dist.backends.storage reads them). Each collective is attributed to the mesh axis of its process group
(`axes`: the ranks of each axis's group -> axis, from the engine's inspector, fp8dist.engines.inspector); one on a
group of other ranks is `world`.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8dist.backends.storage import storage
from fp8dist.config.parallel import DATA_AXES as MESH_DATA_AXES
from fp8dist.engines.mesh import axis_of

# c10d op name -> kind. Reductions carry gradients; gathers carry weights.
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "reduce_": "reduce",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "broadcast_": "broadcast", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    # point to point (pipeline parallel's activations and their gradients); a recv's bytes are those it received
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}
# The functional collectives (torch 2.13 torch/csrc/distributed/c10d/Functional.cpp): the input first, the group's
# name last.
FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
REDUCTIONS = {"all_reduce", "reduce", "reduce_scatter"}
# Gathers and reduce-scatters take (outputs, inputs); the others reduce or broadcast their first argument
# in place (torch 2.13 c10d op schemas, torch/csrc/distributed/c10d/Ops.cpp).
INPUT_SECOND = {"all_gather", "reduce_scatter", "all_to_all"}
WORLD = "world"  # a group that is no mesh axis's (the default group of a run without a mesh)
# where gradients reduce and FSDP gathers weights: the layout's data axes, and the world without a mesh
DATA_AXES = MESH_DATA_AXES + (WORLD,)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_ranks(group) -> frozenset[int] | None:
    import torch.distributed as dist

    try:
        return frozenset(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):  # a group this rank is not in, or one already destroyed
        return None


def _c10d_group(args) -> frozenset[int] | None:
    """The ranks of a c10d op's process group: the dispatcher hands the group as a ScriptObject, which
    ProcessGroup.unbox turns back into the group (torch 2.13 torch/csrc/distributed/c10d/init.cpp); the op's other
    ScriptObject (its ReduceOp) does not unbox."""
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
            return _group_ranks(group)
    return None


def _functional_group(name) -> frozenset[int] | None:
    """The ranks of a functional collective's group, named as the functional collectives resolve it (torch 2.13
    torch/distributed/_functional_collectives.py -> distributed_c10d._resolve_process_group)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not isinstance(name, str):
        return None
    try:
        return _group_ranks(_resolve_process_group(name))  # type: ignore[arg-type]  # GroupName is a str NewType
    except (RuntimeError, ValueError, KeyError):
        return None


class WireRecorder(TorchDispatchMode):
    """Record (axis, kind, dtype) -> [calls, bytes sent by this rank, largest tensor numel] inside the block.
    `axes`: the ranks of a process group -> its mesh axis (a group not in it counts as `world`)."""

    def __init__(self, axes: dict[frozenset[int], str] | None = None):
        super().__init__()
        self.axes = axes or {}
        self.calls: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, sent, group = None, [], None
        if func.namespace == "c10d":
            kind = KINDS.get(func._opname)
            if kind is not None:
                sent = _tensors(args[1] if kind in INPUT_SECOND else args[0])
                group = _c10d_group(args)
        elif func.namespace == "_c10d_functional":
            kind = FUNCTIONAL_KINDS.get(func._opname)
            if kind is not None:
                sent, group = _tensors(args[0]), _functional_group(args[-1])
        if kind is not None:
            axis = axis_of(self.axes.get(group, WORLD), kind) if group is not None else WORLD
            for tensor in sent:
                held = storage(tensor)
                entry = self.calls[(axis, kind, held.format)]
                entry[0] += 1
                entry[1] += held.nbytes
                entry[2] = max(entry[2], held.numel)
        return func(*args, **kwargs)

    def dtypes(self, kinds, min_numel: int = 2, axes=DATA_AXES) -> list[str]:
        """dtypes seen for these kinds on these axes, ignoring scalars (norms, overflow flags, float8 amaxes: not
        payload)."""
        return sorted({dtype for (axis, kind, dtype), (_, _, largest) in self.calls.items()
                       if kind in kinds and axis in axes and largest >= min_numel})

    def as_dict(self, axes=None) -> dict:
        """{kind: {dtype: {calls, bytes}}}, summed over `axes` (default: all)."""
        out: dict = {}
        for (axis, kind, dtype), (calls, nbytes, _) in sorted(self.calls.items()):
            if axes is not None and axis not in axes:
                continue
            entry = out.setdefault(kind, {}).setdefault(dtype, {"calls": 0, "bytes": 0})
            entry["calls"] += calls
            entry["bytes"] += nbytes
        return out

    def by_axis(self) -> dict:
        """{axis: {kind: {dtype: {calls, bytes}}}}: the audit JSON's communication_bytes_by_axis."""
        return {axis: self.as_dict(axes=(axis,)) for axis in sorted({axis for axis, _, _ in self.calls})}
