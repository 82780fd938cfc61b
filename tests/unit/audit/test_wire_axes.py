"""What the audit expects on the tensor-parallel axis (fp8dist.audit.expected), and the wire recorder
(fp8dist.audit.wire.WireRecorder) that sees it: it attributes each collective to the mesh axis of its process
group, one process: torch.distributed's c10d collectives and the functional collectives DTensor (tensor parallel)
issues, on a 1-rank gloo group (real collectives) and on rank 0 of torch's fake 4-rank group (a 2 x 2 mesh whose
groups hold different ranks; collectives return at once). The multi-rank audits are tests/distributed's."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fp8dist.audit.expected import expected
from fp8dist.audit.wire import WORLD, WireRecorder
from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines.mesh import axis_of, axis_ranks, build_meshes, merge_axes

TP_ALONE = {frozenset({0}): "tp"}
FLOAT8 = {"preset": "torchao-float8"}  # tensorwise


# ---- what the tp axis should carry ----

@pytest.mark.parametrize("precision, parallel, reduction, gather", [
    ({}, {"tensor_size": 2}, "bf16", "bf16"),  # sequence parallel (auto on FSDP2) gathers activations
    (FLOAT8, {"tensor_size": 2}, "bf16", "fp8"),  # torchao's float8 styles gather in float8
    ({"preset": "torchao-float8-rowwise"}, {"tensor_size": 2}, "bf16", "bf16"),
    ({"fp8": {"backend": "torchao", "torchao": {"recipe_name": "mxfp8"}}}, {"tensor_size": 2}, "bf16", "bf16"),
    ({"preset": "fp16-amp"}, {"tensor_size": 2}, "fp16", "fp16"),  # the compute dtype
    (FLOAT8, {"tensor_size": 2, "sequence_parallel": False}, "bf16", None),  # no sequence shards to gather
    (FLOAT8, {}, None, None),  # no tp axis
])
def test_the_tp_rows_expected(precision, parallel, reduction, gather):
    row = expected(load_config({"precision": precision, "parallel": parallel}), nproc=4)
    assert row.get("tp_reduction", (None,))[0] == reduction
    assert row.get("tp_all_gather", (None,))[0] == gather


def test_deepspeed_tensor_parallel_expects_reductions_and_no_sequence_gathers():
    row = expected(load_config({"engine": "deepspeed", "parallel": {"tensor_size": 2}}), nproc=4)
    assert row["tp_reduction"][0] == "bf16" and "tp_all_gather" not in row


# ---- the recorder ----


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def mesh_2x2():
    """Rank 0 of a dp_shard 2 x tp 2 mesh: its tp group is {0, 1}, its dp_shard group {0, 2}."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield build_meshes(ParallelDims(dp_shard=2, tp=2)).dense
    dist.destroy_process_group()


def _collectives(group) -> None:
    """A c10d all-reduce (fp32, 10 values), then functional ones as DTensor issues them (torch 2.13
    torch/distributed/tensor/_collective_utils.py): an all-gather (bf16, 12
    values) and an all-reduce (bf16, 6 values), each waited on."""
    dist.all_reduce(torch.ones(10), group=group)
    funcol.wait_tensor(funcol.all_gather_single(torch.ones(4, 3, dtype=torch.bfloat16), 0, group))
    funcol.wait_tensor(funcol.all_reduce(torch.ones(6, dtype=torch.bfloat16), "sum", group))


def test_collectives_land_on_the_axis_their_group_is(one_rank):
    with WireRecorder(axes=TP_ALONE) as recorder:
        _collectives(one_rank)
    assert dict(recorder.calls) == {("tp", "all_reduce", "fp32"): [1, 40, 10],
                                    ("tp", "all_gather", "bf16"): [1, 24, 12],
                                    ("tp", "all_reduce", "bf16"): [1, 12, 6]}
    assert recorder.by_axis() == {"tp": {"all_gather": {"bf16": {"calls": 1, "bytes": 24}},
                                         "all_reduce": {"bf16": {"calls": 1, "bytes": 12},
                                                        "fp32": {"calls": 1, "bytes": 40}}}}


def test_a_group_no_axis_names_is_the_world(one_rank):
    with WireRecorder(axes={}) as recorder:
        _collectives(one_rank)
    assert {axis for axis, _, _ in recorder.calls} == {WORLD}
    assert recorder.as_dict() == recorder.by_axis()[WORLD]


def test_dtypes_and_totals_read_only_the_axes_asked_for(one_rank):
    with WireRecorder(axes=TP_ALONE) as recorder:
        _collectives(one_rank)
        dist.all_reduce(torch.ones((), dtype=torch.float16), group=one_rank)  # a scalar (a norm, a flag): no payload
    assert recorder.dtypes({"all_reduce"}) == []  # the default axes are the data axes: tp traffic is not gradients
    assert recorder.dtypes({"all_reduce"}, axes=("tp",)) == ["bf16", "fp32"]
    assert recorder.dtypes({"all_gather", "all_reduce"}, axes=("tp",)) == ["bf16", "fp32"]
    assert recorder.as_dict(axes=("dp_shard",)) == {}
    assert recorder.as_dict(axes=("tp",))["all_reduce"]["fp16"] == {"calls": 1, "bytes": 2}


def test_a_float8_operand_is_recorded_by_its_float8_bytes(mesh_2x2):
    """torchao's float8 tensor-parallel styles hand the functional all-gather a Float8TrainingTensor: its logical
    dtype is bf16, its payload one byte a value. (On the fake group: gloo has no float8 collectives.)"""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    operand = hp_tensor_to_float8_dynamic(torch.randn(8, 16, dtype=torch.bfloat16), torch.float8_e4m3fn,
                                          LinearMMConfig())
    assert operand.dtype == torch.bfloat16
    with WireRecorder(axes=axis_ranks(mesh_2x2)) as recorder:
        gathered = funcol.all_gather_single(operand, 0, mesh_2x2["tp"].get_group())
        funcol.wait_tensor(gathered._data)
    assert gathered.shape == (16, 16) and gathered._data.dtype == torch.float8_e4m3fn
    assert dict(recorder.calls) == {("tp", "all_gather", "fp8_e4m3"): [1, 128, 128]}
    assert recorder.dtypes({"all_gather"}, axes=("tp",)) == ["fp8_e4m3"]


def test_each_axis_of_a_2d_mesh_is_told_apart_and_a_rank_counts_what_it_sends(mesh_2x2):
    axes = axis_ranks(mesh_2x2)
    assert axes == {frozenset({0, 1}): "tp", frozenset({0, 2}): "dp_shard"}
    tp, dp = mesh_2x2["tp"], mesh_2x2["dp_shard"]
    with WireRecorder(axes=axes) as recorder:
        # tensor parallel: DTensor's redistribution gathers a sequence shard over tp (functional collective)
        DTensor.from_local(torch.ones(2, 8, dtype=torch.bfloat16), tp, [Shard(0)]).redistribute(tp, [Replicate()])
        # FSDP2: a c10d reduce-scatter of fp32 gradients over dp_shard (16 values in, 8 out)
        dist.reduce_scatter_single(torch.empty(8), torch.ones(16), group=dp.get_group())
        dist.all_reduce(torch.ones(4))  # the default group: every rank, no mesh axis
    assert recorder.by_axis() == {
        "tp": {"all_gather": {"bf16": {"calls": 1, "bytes": 32}}},  # this rank's 16 values, not the 32 gathered
        "dp_shard": {"reduce_scatter": {"fp32": {"calls": 1, "bytes": 64}}},
        WORLD: {"all_reduce": {"fp32": {"calls": 1, "bytes": 16}}},
    }
    assert recorder.dtypes({"reduce_scatter", "all_reduce"}) == ["fp32"]  # the data axes and the world
    assert recorder.dtypes({"all_gather"}) == []


# ---- expert parallel: the ep axis ----

@pytest.mark.parametrize("precision, dispatched", [({}, "bf16"), ({"preset": "fp32"}, "fp32"),
                                                   ({"preset": "torchao-float8", "fp8": {"torchao": {
                                                       "experts": "mxfp8"}}}, "bf16")])
def test_the_dispatch_is_expected_in_the_compute_dtype(precision, dispatched):
    row = expected(load_config({"precision": precision, "parallel": {"expert_size": 2}}), nproc=2)
    assert row["ep_all_to_all"][0] == dispatched
    assert "ep_all_to_all" not in expected(load_config({"precision": precision}), nproc=2)


def test_an_ep_group_that_is_the_data_groups_ranks_keeps_both_names():
    """Expert parallel over every dp_shard rank: ep's group holds dp_shard's ranks. The all-to-alls are the
    dispatch's (ep); FSDP's gathers and reductions on the same ranks stay the data axis's."""
    axes = {frozenset({0, 1}): "dp_shard"}
    merge_axes(axes, {frozenset({0}): "efsdp", frozenset({0, 1}): "ep"})
    merge_axes(axes, {frozenset({0, 1}): "dp_shard"})  # a second mesh of the same layout changes nothing
    assert axes == {frozenset({0, 1}): "dp_shard|ep", frozenset({0}): "efsdp"}
    assert axis_of(axes[frozenset({0, 1})], "all_to_all") == "ep"
    assert {axis_of(axes[frozenset({0, 1})], kind) for kind in ("all_gather", "reduce_scatter")} == {"dp_shard"}
    assert axis_of("tp", "all_to_all") == "tp"  # one name: whatever the kind


def test_the_recorder_puts_an_all_to_all_on_ep_where_ep_shares_the_data_ranks(one_rank):
    with WireRecorder(axes={frozenset({0}): "dp_shard|ep"}) as recorder:
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        dist.all_reduce(torch.ones(4))
    assert recorder.by_axis() == {"ep": {"all_to_all": {"fp32": {"calls": 1, "bytes": 16}}},
                                  "dp_shard": {"all_reduce": {"fp32": {"calls": 1, "bytes": 16}}}}
