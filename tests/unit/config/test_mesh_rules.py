"""The tensor / sequence / context axes of `parallel` (issue 30): the mesh they carve out of a world size, what
`sequence_parallel: auto` resolves to, the model sizes each axis must divide, and the configs each engine and
backend refuses, each naming its key, with a fix that loads."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims, sequence_parallel
from fp8dist.errors import ConfigError, Fp8distError, UnsupportedEnvironment
from fp8dist.runtime.models import check_mesh_fits
from fp8dist.config.models import config_values
from fp8dist.runtime.preflight import preflight


def _parallel(**values):
    return load_config({"parallel": values})


# ---- the mesh: tp and cp first, the data axes what is left ----

@pytest.mark.parametrize("parallel, world, dims, names, shape", [
    ({"tensor_size": 2}, 8, ParallelDims(dp_shard=4, tp=2, sequence_parallel=True), ("dp_shard", "tp"), (4, 2)),
    ({"tensor_size": 2}, 2, ParallelDims(dp_shard=1, tp=2, sequence_parallel=True), ("dp_shard", "tp"), (1, 2)),
    ({"context_size": 4}, 8, ParallelDims(dp_shard=2, cp=4), ("dp_shard", "cp"), (2, 4)),
    ({"tensor_size": 2, "sharding": "hybrid", "shard_size": 2}, 8,
     ParallelDims(dp_replicate=2, dp_shard=2, tp=2, replicate_dim=True, sequence_parallel=True),
     ("dp_replicate", "dp_shard", "tp"), (2, 2, 2)),
    ({"tensor_size": 4, "sharding": "replicate"}, 8,
     ParallelDims(dp_replicate=2, dp_shard=1, tp=4, replicate_dim=True, sequence_parallel=True),
     ("dp_replicate", "dp_shard", "tp"), (2, 1, 4)),
])
def test_tensor_and_context_axes_come_first_and_the_data_axes_take_the_rest(parallel, world, dims, names, shape):
    got = ParallelDims.of(load_config({"parallel": parallel}), world)
    assert got == dims
    assert got.mesh_shape() == (names, shape)
    assert got.world_size == world and got.data_size == world // (got.tp * got.cp)


@pytest.mark.parametrize("parallel, batches", [
    ({"tensor_size": 2}, [0, 0, 1, 1, 2, 2, 3, 3]),
    ({"context_size": 4}, [0, 0, 0, 0, 1, 1, 1, 1]),
])
def test_the_ranks_of_one_tp_or_cp_group_read_the_same_batch(parallel, batches):
    dims = ParallelDims.of(load_config({"parallel": parallel}), 8)
    assert [dims.data_rank(rank) for rank in range(8)] == batches


@pytest.mark.parametrize("parallel, world, says, fix", [
    ({"tensor_size": 4}, 6, "parallel.tensor_size=4 does not divide the 6 ranks of this job",
     "run on a multiple of 4 ranks (torchrun --nproc_per_node 8 / deepspeed --num_gpus 8), or lower "
     "parallel.tensor_size to a divisor of 6"),
    ({"context_size": 4}, 6, "parallel.context_size=4 does not divide the 6 ranks",
     "lower parallel.context_size to a divisor of 6"),
])
def test_a_world_the_tp_and_cp_groups_do_not_fill_is_refused_naming_the_keys(parallel, world, says, fix):
    with pytest.raises(Fp8distError) as raised:
        ParallelDims.of(load_config({"parallel": parallel}), world)
    assert says in str(raised.value) and fix in str(raised.value), str(raised.value)


def test_hybrid_shard_size_must_divide_the_data_ranks_left_by_tp():
    spec = _parallel(tensor_size=2, sharding="hybrid", shard_size=4)
    assert ParallelDims.of(spec, 8) == ParallelDims(dp_replicate=1, dp_shard=4, tp=2, replicate_dim=True,
                                                    sequence_parallel=True)
    with pytest.raises(Fp8distError, match="parallel.shard_size=4 does not divide the 2 data-parallel ranks left by "
                                           r"tp: .*\n  fix: set parallel.shard_size to a divisor of 2"):
        ParallelDims.of(spec, 4)  # 4 ranks divide by shard_size 4, but only 2 are left for data after tp 2


def test_the_fix_names_the_flag_of_the_command_that_sets_the_world_size():
    """Each command names its own option, with a world size that fits (the README's expert-parallel compare line,
    run on 1 process, once said "launch a multiple of 2 ranks" without naming --nproc)."""
    spec = _parallel(expert_size=2)
    for flag in ("--nproc", "--world-size"):
        with pytest.raises(Fp8distError) as raised:
            ParallelDims.of(spec, 3, flag)
        assert f"fix: run on a multiple of 2 ranks ({flag} 4)" in str(raised.value), str(raised.value)


# ---- sequence_parallel: auto ----

@pytest.mark.parametrize("values, resolved", [
    ({"parallel": {"tensor_size": 2}}, True),  # FSDP2 + tp: on
    ({"parallel": {}}, False),  # no tp: nothing to shard over
    ({"parallel": {"tensor_size": 2, "sequence_parallel": False}}, False),
    ({"parallel": {"tensor_size": 2, "sequence_parallel": True}}, True),
    ({"engine": "deepspeed", "parallel": {"tensor_size": 2}}, False),  # AutoTP has none
])
def test_sequence_parallel_auto_is_on_only_for_fsdp2_tensor_parallel(values, resolved):
    assert sequence_parallel(load_config(values)) is resolved


# ---- what each axis must divide in the model ----

LLAMA = config_values("tiny-llama")  # 4 heads, 2 KV heads, hidden 64, MLP 128


def _fits(tp=1, cp=1, seq_len=64, sequence_split=False, config=LLAMA):
    ParallelDims(dp_shard=1, cp=cp, tp=tp, sequence_parallel=sequence_split and tp > 1).check_model(
        config, seq_len, source="tiny-llama")


def test_tensor_parallel_degrees_the_model_splits_on_pass():
    assert (LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]) == (4, 2)
    _fits(tp=2, sequence_split=True)
    _fits(tp=2, cp=2, seq_len=64, sequence_split=True)  # 64 divides by 2 x 2 x 2


def test_every_size_tp_does_not_divide_is_named_at_once():
    with pytest.raises(Fp8distError) as raised:
        _fits(tp=3)
    text = str(raised.value)
    assert text.startswith("tiny-llama: the model does not split on this mesh"), text
    for named in ("attention heads (num_attention_heads=4)", "KV heads (num_key_value_heads=2)",
                  "hidden size (hidden_size=64)", "MLP size (intermediate_size=128)"):
        assert f"{named} do not divide by parallel.tensor_size=3" in text, text
    assert "fix: a parallel.tensor_size that divides every size named" in text


def test_only_what_does_not_divide_is_named():
    with pytest.raises(Fp8distError) as raised:
        _fits(tp=4)  # 4 heads, 64 and 128 divide; 2 KV heads do not
    text = str(raised.value)
    assert "num_key_value_heads=2" in text and "num_attention_heads" not in text and "hidden_size" not in text


@pytest.mark.parametrize("tp, cp, seq_len, sequence_split, divisor", [
    (2, 1, 63, True, 2),  # sequence parallel: each tp rank holds seq_len / tp
    (1, 2, 66, False, 4),  # context parallel's load balancer cuts each of 2 cp shards in two
    (2, 2, 68, True, 8),
])
def test_the_sequence_must_divide_where_it_is_split(tp, cp, seq_len, sequence_split, divisor):
    with pytest.raises(Fp8distError, match=rf"train.seq_len={seq_len}\) does not divide by {divisor} ") as raised:
        _fits(tp=tp, cp=cp, seq_len=seq_len, sequence_split=sequence_split)
    fixed = -(-seq_len // divisor) * divisor  # the fix names the sequence length, not the tp degree
    assert f"fix: train.seq_len={fixed} (a multiple of {divisor})" in str(raised.value), str(raised.value)
    _fits(tp=tp, cp=cp, seq_len=seq_len - seq_len % divisor, sequence_split=sequence_split)


def test_without_sequence_parallel_tp_does_not_split_the_sequence():
    _fits(tp=2, seq_len=63, sequence_split=False)


def test_moe_experts_are_refused_under_tensor_parallel_only():
    mixtral = config_values("tiny-mixtral")
    with pytest.raises(Fp8distError) as raised:
        _fits(tp=2, config=mixtral)
    text = str(raised.value)
    assert f"it has {mixtral['num_local_experts']} MoE experts" in text
    assert text.endswith("fix: parallel.tensor_size=1 for this model"), text
    _fits(tp=1, cp=2, config=mixtral)


# ---- the built-in models, checked before any weight is loaded ----

def test_a_built_in_model_is_checked_against_the_mesh_by_name():
    check_mesh_fits(_parallel(tensor_size=2), "tiny-llama", 4)
    with pytest.raises(Fp8distError, match=r"^tiny-llama: .*num_key_value_heads=2\) do not divide by "
                                           "parallel.tensor_size=4"):
        check_mesh_fits(_parallel(tensor_size=4), "tiny-llama", 4)
    with pytest.raises(Fp8distError, match=r"^tiny-mixtral: .*MoE experts"):
        check_mesh_fits(_parallel(tensor_size=2), "tiny-mixtral", 2)
    check_mesh_fits(_parallel(), "tiny-mixtral", 2)  # no tp: nothing to split
    with pytest.raises(Fp8distError, match="parallel.tensor_size=2 does not divide the 3 ranks"):
        check_mesh_fits(_parallel(tensor_size=2), "tiny-qwen2", 3)


# ---- what the config rules refuse, and the fix each names ----

REFUSED = [
    # (config, key, what the message says, a config the fix makes)
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel", "parallel.tensor_size is 1",
     {"parallel": {"sequence_parallel": True, "tensor_size": 2}}),
    ({"adapter": {"kind": "lora"}, "parallel": {"tensor_size": 2}}, "parallel.tensor_size", "LoRA adapters",
     {"adapter": {"kind": "lora"}, "parallel": {"tensor_size": 1}}),
    ({"engine": "deepspeed", "precision": {"preset": "torchao-float8"}, "parallel": {"tensor_size": 2}},
     "parallel.tensor_size", "FP8 would be silently off (precision.fp8.backend=torchao)",
     {"engine": "fsdp2", "precision": {"preset": "torchao-float8"}, "parallel": {"tensor_size": 2}}),
    ({"engine": "deepspeed", "parallel": {"tensor_size": 2, "sharding": "hybrid", "shard_size": 2}},
     "parallel.sharding", "AutoTP does not compose with",
     {"engine": "deepspeed", "parallel": {"tensor_size": 2, "sharding": "full"}}),
    ({"engine": "deepspeed", "parallel": {"tensor_size": 2, "sequence_parallel": True}},
     "parallel.sequence_parallel", "DeepSpeed AutoTP has no sequence parallel",
     {"engine": "deepspeed", "parallel": {"tensor_size": 2, "sequence_parallel": "auto"}}),
    ({"engine": "deepspeed", "parallel": {"context_size": 2}}, "parallel.context_size", "which fp8dist does not wire",
     {"engine": "fsdp2", "parallel": {"context_size": 2}}),
    ({"precision": {"preset": "te"}, "parallel": {"tensor_size": 2}}, "parallel.tensor_size",
     "Transformer Engine's own Linear", {"precision": {"preset": "torchao-float8"}, "parallel": {"tensor_size": 2}}),
    ({"engine": "deepspeed", "precision": {"preset": "msamp-o1"}, "parallel": {"tensor_size": 2}},
     "parallel.tensor_size", "MS-AMP's FP8 tensor parallel exists only through Megatron-LM",
     {"engine": "deepspeed", "precision": {"preset": "msamp-o1"}, "parallel": {"tensor_size": 1}}),
]


@pytest.mark.parametrize("values, key, says, fixed", REFUSED, ids=[f"{r[1]}:{r[2][:30]}" for r in REFUSED])
def test_a_mesh_no_engine_or_backend_runs_is_refused_naming_the_key_and_a_fix_that_loads(values, key, says, fixed):
    with pytest.raises(ConfigError) as raised:
        load_config(values)
    (issue,) = [issue for issue in raised.value.issues if says in issue.message]
    assert issue.path == key and issue.fix, issue.render()
    assert f"{key}: " in str(raised.value) and "fix: " in str(raised.value)
    load_config(fixed)


def test_fsdp2_tensor_and_context_parallel_together_load():
    """torchtitan's FSDP x CP x TP: the config loads (a machine without CUDA refuses cp in preflight)."""
    spec = load_config({"parallel": {"tensor_size": 2, "context_size": 2}})
    assert (spec.parallel.tensor_size, spec.parallel.context_size) == (2, 2)


def test_deepspeed_tensor_parallel_without_fp8_loads():
    spec = load_config({"engine": "deepspeed", "parallel": {"tensor_size": 2}})
    assert spec.parallel.tensor_size == 2 and not spec.fp8.enabled


def test_a_refused_mesh_from_an_override_names_the_override():
    with pytest.raises(ConfigError, match=r"^invalid override 'parallel.tensor_size=2' of <dict>.*\n"
                                          r"  - parallel.tensor_size: .*Transformer Engine"):
        load_config({"precision": {"preset": "te"}}, overrides=["parallel.tensor_size=2"])


# ---- context parallel needs CUDA attention kernels: refused before any rank starts ----

def test_context_parallel_is_refused_on_a_machine_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: context parallel is allowed here")
    preflight(_parallel(tensor_size=2))  # tensor parallel runs on any device
    with pytest.raises(UnsupportedEnvironment) as raised:
        preflight(_parallel(context_size=2))
    text = str(raised.value)
    assert text.startswith("parallel.context_size=2: ") and "no CUDA device" in text
    assert "fix: run on GPUs, or set parallel.context_size=1" in text
