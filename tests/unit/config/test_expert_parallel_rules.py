"""The rules of parallel.expert_size: on DeepSpeed (AutoEP) refused where its swap of the MoE layers would drop the
FP8 experts and where DeepSpeed refuses AutoEP at ZeRO-3 (hybrid's hpZ included); on every engine refused next to
tensor or context parallel and adapters; on FSDP2 with hybrid or replicate sharding, params offload and compile; the mesh it borrows from the data-parallel ranks, refused where it does
not divide them, and the model's experts, refused where they do not split whole over it (or do not exist)."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.errors import ConfigError, Fp8distError

EMULATED_FP8 = {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}


def _issues(document: dict) -> dict[str, str]:
    """fp8dist key -> `message | fix` of each issue the config's rules raise ({} when it loads)."""
    try:
        load_config(document)
    except ConfigError as err:
        return {issue.path: f"{issue.message} | {issue.fix}" for issue in err.issues}
    return {}


def _ep(engine: str, **sections) -> dict:
    parallel = {"expert_size": 2, **sections.pop("parallel", {})}
    return {"engine": engine, "parallel": parallel, **sections}


# -- DeepSpeed: AutoEP ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["auto", "float8", "mxfp8"])
def test_deepspeed_expert_parallel_refuses_fp8_experts_autoep_would_drop(experts):
    precision = {**EMULATED_FP8, "fp8": {"torchao": {"emulate": True, "experts": experts}}}
    issues = _issues(_ep("deepspeed", precision=precision))
    assert set(issues) == {"parallel.expert_size"}, issues
    why = issues["parallel.expert_size"]
    assert "AutoEPMoELayer" in why and f"precision.fp8.torchao.experts={experts}" in why, why
    assert "silently dropped" in why and "experts=none" in why and "engine=fsdp2" in why, why
    # FSDP2's expert parallel keeps FP8 experts, and expert_size 1 swaps nothing
    assert _issues(_ep("fsdp2", precision=precision)) == {}
    assert _issues({"engine": "deepspeed", "precision": precision}) == {}


def test_deepspeed_expert_parallel_runs_the_experts_in_the_compute_dtype():
    precision = {**EMULATED_FP8, "fp8": {"torchao": {"emulate": True, "experts": "none"}}}
    assert _issues(_ep("deepspeed", precision=precision)) == {}
    assert _issues(_ep("deepspeed")) == {}


@pytest.mark.parametrize("key, value", [("zero_quantized_gradients", True), ("zero_hpz_partition_size", 2)])
def test_deepspeed_refuses_what_autoep_at_zero3_asserts(key, value):
    extra = {"deepspeed": {"extra": {"zero_optimization": {key: value}}}}
    issues = _issues(_ep("deepspeed", parallel={"sharding": "full"}, **extra))
    path = f"deepspeed.extra.zero_optimization.{key}"
    assert set(issues) == {path}, issues
    assert "_validate_zero3_moe_compatibility" in issues[path] and "parallel.sharding=grad_op" in issues[path]
    assert _issues(_ep("deepspeed", parallel={"sharding": "grad_op"}, **extra)) == {}
    assert _issues({"engine": "deepspeed", "parallel": {"sharding": "full"}, **extra}) == {}


def test_deepspeed_refuses_nvme_optimizer_swapping_with_autoep_at_zero3():
    nvme = {"offload_optimizer": "nvme", "nvme_path": "/nvme"}
    issues = _issues(_ep("deepspeed", parallel={"sharding": "full"}, deepspeed=nvme))
    assert set(issues) == {"deepspeed.offload_optimizer"}, issues
    assert "_save_moe_checkpoint" in issues["deepspeed.offload_optimizer"]
    assert _issues(_ep("deepspeed", parallel={"sharding": "full"}, deepspeed={"offload_optimizer": "cpu"})) == {}


# -- every engine (fp8dist.config.rules.common) -----------------------------------------------------------------
@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
@pytest.mark.parametrize("parallel, named", [
    ({"tensor_size": 2}, "parallel.tensor_size=2"),
    ({"context_size": 2}, "parallel.context_size=2"),
])
def test_expert_parallel_is_not_combined_with(engine, parallel, named):
    issues = _issues(_ep(engine, parallel=parallel))
    assert named in issues.get("parallel.expert_size", ""), issues
    assert "parallel.expert_size=1" in issues["parallel.expert_size"]


# -- FSDP2's expert parallel (fp8dist.config.rules.fsdp2) and DeepSpeed's sharding -------------------------------
@pytest.mark.parametrize("section, key, says", [
    ({"parallel": {"sharding": "hybrid", "shard_size": 2}}, "parallel.expert_size", "parallel.sharding=hybrid"),
    ({"parallel": {"sharding": "replicate"}}, "parallel.expert_size", "parallel.sharding=replicate"),
    ({"parallel": {"offload": "params"}}, "parallel.offload", "CPUOffloadPolicy over the experts'"),
    ({"compile": True}, "compile", "torch.compile of blocks whose experts dispatch tokens"),
])
def test_fsdp2_expert_parallel_refuses_what_it_has_not_run(section, key, says):
    issues = _issues(_ep("fsdp2", **section))
    assert set(issues) == {key} and says in issues[key] and "parallel.expert_size=1" in issues[key], issues


def test_deepspeed_expert_parallel_refuses_hybrid_and_keeps_replicate():
    """hybrid is ZeRO-3 + hpZ, which DeepSpeed refuses with AutoEP; replicate is ZeRO-0, which AutoEP runs."""
    issues = _issues(_ep("deepspeed", parallel={"sharding": "hybrid", "shard_size": 2}))
    assert set(issues) == {"parallel.sharding"} and "_validate_zero3_moe_compatibility" in issues["parallel.sharding"]
    assert _issues(_ep("deepspeed", parallel={"sharding": "replicate"})) == {}


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_expert_parallel_is_not_combined_with_adapters(engine):
    issues = _issues(_ep(engine, adapter={"kind": "lora"}))
    assert "LoRA adapters" in issues.get("parallel.expert_size", ""), issues


# -- the mesh and the model (fp8dist.config.parallel) -----------------------------------------------------------
def test_expert_parallel_borrows_its_ranks_from_the_data_parallel_shard():
    spec = load_config(_ep("fsdp2", parallel={"expert_size": 4}))
    dims = ParallelDims.of(spec, 8)
    assert (dims.world_size, dims.dp_shard, dims.ep, dims.efsdp, dims.data_size) == (8, 8, 4, 2, 8)
    assert dims.expert_mesh_shape() == (("efsdp", "ep"), (2, 4))
    with pytest.raises(Fp8distError) as err:
        ParallelDims.of(spec, 6)
    assert "parallel.expert_size=4 does not divide the 6 data-parallel ranks" in str(err.value)
    assert "fix:" in str(err.value)


@pytest.mark.parametrize("config, expert_size, fits, said", [
    ({"num_local_experts": 8}, 4, True, ""),                               # Mixtral's key
    ({"num_experts": 8}, 2, True, ""),                                     # Qwen2/3-MoE's key
    ({"num_local_experts": 8}, 3, False, "8 MoE experts do not split whole over parallel.expert_size=3"),
    ({"num_experts": 6}, 4, False, "6 MoE experts do not split whole over parallel.expert_size=4"),
    ({"hidden_size": 64}, 2, False, "no MoE experts for parallel.expert_size=2 to split"),
])
def test_the_model_must_have_experts_that_split_whole(config, expert_size, fits, said):
    spec = load_config(_ep("fsdp2", parallel={"expert_size": expert_size}))
    dims = ParallelDims.of(spec, 12)
    if fits:
        dims.check_model(config, 64, source="model")
        return
    with pytest.raises(Fp8distError) as err:
        dims.check_model(config, 64, source="model")
    assert said in str(err.value) and "fix:" in str(err.value), err.value
