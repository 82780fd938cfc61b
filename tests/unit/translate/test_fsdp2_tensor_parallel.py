"""`fp8dist translate --to fsdp2` with the tensor / context axes: the plan's `tensor_parallel` section (present only
with tensor_size > 1) says which styles and which order the run uses, and `sharding.mesh` names every axis of the
DeviceMesh the run builds (fp8dist.config.parallel.ParallelDims.mesh_shape)."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.translate import to_fsdp2

MXFP8 = {"fp8": {"backend": "torchao", "torchao": {"recipe_name": "mxfp8"}}}


def _plan(precision=None, **parallel) -> dict:
    return to_fsdp2(load_config({"precision": precision or {}, "parallel": parallel})).to_json()


@pytest.mark.parametrize("precision", [{}, {"preset": "torchao-float8"}, MXFP8])
def test_no_tensor_parallel_section_without_a_tp_axis(precision):
    plan = _plan(precision)
    assert "tensor_parallel" not in plan and plan["sharding"]["mesh"] == "1-D (shard over all ranks)"


@pytest.mark.parametrize("precision, float8_styles, order", [
    ({}, False, "tensor parallel, then activation checkpointing, compile and fully_shard"),
    ({"preset": "torchao-float8"}, True, "FP8 conversion, then tensor parallel"),
    ({"preset": "torchao-float8-rowwise"}, False, "FP8 conversion, then tensor parallel"),
    (MXFP8, False, "tensor parallel, then MXFP8 conversion"),
])
def test_the_section_says_the_styles_and_the_order_of_each_recipe(precision, float8_styles, order):
    """torchao's float8 styles for tensorwise only (they assume tensorwise scaling: torchtitan #3109); MXFP8 wraps
    the DTensor weights after the split, float8 conversion comes before it (torchao testing/training/
    dtensor_utils.py)."""
    section = _plan(precision, tensor_size=4)["tensor_parallel"]
    assert section["size"] == 4 and section["sequence_parallel"] is True
    assert section["float8_styles"] is float8_styles
    assert section["order"].startswith(order), section["order"]


def test_sequence_parallel_in_the_section_is_the_resolved_value():
    assert _plan(tensor_size=2, sequence_parallel=False)["tensor_parallel"]["sequence_parallel"] is False
    assert _plan(tensor_size=2, sequence_parallel=True)["tensor_parallel"]["sequence_parallel"] is True


@pytest.mark.parametrize("parallel, mesh, world", [
    ({"tensor_size": 2}, "2-D (shard = world / 2, tp = 2)", 8),
    ({"context_size": 2}, "2-D (shard = world / 2, cp = 2)", 8),
    ({"tensor_size": 2, "sharding": "hybrid", "shard_size": 2}, "3-D (replicate = world / 2 / 2, shard = 2, tp = 2)",
     8),
    ({"tensor_size": 4, "sharding": "replicate"}, "3-D (replicate = world / 4, shard = 1, tp = 4)", 8),
    ({"tensor_size": 2, "sharding": "grad_op"}, "2-D (shard = world / 2, tp = 2)", 4),
])
def test_the_mesh_in_words_has_the_dims_the_run_builds(parallel, mesh, world):
    assert _plan(**parallel)["sharding"]["mesh"] == mesh
    names, _ = ParallelDims.of(load_config({"parallel": parallel}), world).mesh_shape()
    assert mesh.startswith(f"{len(names)}-D")
    words = {"dp_replicate": "replicate = ", "dp_shard": "shard = ", "cp": "cp = ", "tp": "tp = "}
    positions = [mesh.index(words[name]) for name in names]
    assert positions == sorted(positions)  # outermost first, as the DeviceMesh orders them
