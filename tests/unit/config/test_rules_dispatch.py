"""The rules package finds each engine's and backend's rules by name in one place, and only there."""
import ast
import importlib
import inspect
import pkgutil

import pytest

import fp8dist.config.rules as rules
from fp8dist.config.engines import TRAITS
from fp8dist.config.load import load_config
from fp8dist.config.schema import schema
from fp8dist.errors import ConfigError


def test_every_engine_and_backend_of_the_schema_has_its_rules():
    properties = schema()["properties"]
    engines = set(properties["engine"]["enum"])
    backends = set(properties["precision"]["properties"]["fp8"]["properties"]["backend"]["enum"]) - {"none"}
    assert set(rules.ENGINE_RULES) == engines == set(TRAITS)
    assert set(rules.BACKEND_RULES) == backends


def _compared_engine_names(source: str) -> list[str]:
    """The engine names a module's source compares something to (==, !=, in)."""
    engines = set(schema()["properties"]["engine"]["enum"])
    return [node.value for compare in ast.walk(ast.parse(source)) if isinstance(compare, ast.Compare)
            for node in ast.walk(compare) if isinstance(node, ast.Constant) and node.value in engines]


def test_only_the_dispatch_knows_engine_names():
    names = [info.name for info in pkgutil.iter_modules(rules.__path__, rules.__name__ + ".")]
    sources = {name: inspect.getsource(importlib.import_module(name)) for name in names}
    asking = {name: found for name, source in sources.items() if (found := _compared_engine_names(source))}
    assert asking == {}
    assert _compared_engine_names("x = engine == 'fsdp2'") == ["fsdp2"]  # the scan sees a comparison


def test_optimizer_offload_at_zero0_is_said_once_on_the_key_written():
    """parallel.offload=optimizer decides deepspeed.offload_optimizer: at ZeRO-0 the refusal names the key the user
    wrote, not also the DeepSpeed key it derived."""
    with pytest.raises(ConfigError) as caught:
        load_config({"engine": "deepspeed", "parallel": {"sharding": "replicate", "offload": "optimizer"}})
    assert [issue.path for issue in caught.value.issues] == ["parallel.offload"]
    with pytest.raises(ConfigError) as caught:
        load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": 0, "offload_optimizer": "cpu"}})
    assert [issue.path for issue in caught.value.issues] == ["deepspeed.offload_optimizer"]
    # another engine's keys: noted, not refused
    load_config({"engine": "fsdp2", "deepspeed": {"zero_stage": 0, "offload_optimizer": "cpu"}})
