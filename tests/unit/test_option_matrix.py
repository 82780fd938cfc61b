"""Every schema key and value is run for real (tests/distributed/test_option_runs.py) or refused clearly
(here, in-process); every refusal in config/rules/ is triggered; docs/options.md is current."""
import ast
import importlib
import importlib.util
import inspect
import pkgutil
from types import ModuleType

import pytest

import fp8dist.config.rules as rules
from fp8dist.config.load import load_config
from fp8dist.runtime.preflight import preflight
from fp8dist.errors import ConfigError, Fp8distError
from tests.conftest import ROOT
from tests.option_matrix import REFUSALS, RUN_BASE, RUNS, merge, render, required, uncovered


def test_every_key_and_value_is_run_or_refused():
    missing = uncovered()
    assert not missing, f"schema options with neither a run nor a refusal case in tests/option_matrix.py: {missing}"


def test_the_walk_sees_the_whole_schema():
    """The coverage check cannot pass by walking nothing: it sees every section and enum value."""
    needed = required()
    assert ("deepspeed.offload_optimizer", '"nvme"') in needed and ("parallel.offload", '"params"') in needed
    assert ("precision.fp8.te.recipe", '"nvfp4"') in needed and ("deepspeed.extra", "<set>") in needed
    assert len(needed) > 120


def test_case_ids_are_unique():
    ids = [c.id for c in RUNS] + [c.id for c in REFUSALS]
    assert len(ids) == len(set(ids))


def test_every_run_case_is_a_valid_config():
    for case in RUNS:
        load_config(merge(RUN_BASE, case.config))


def has_capability(name: str) -> bool:
    """Whether this machine has what lifts an environment refusal (the refusal is then not expected)."""
    if name in ("transformer_engine", "msamp"):
        return importlib.util.find_spec(name) is not None
    import torch

    if name == "cuda":
        return torch.cuda.is_available()
    if name == "fp8_gpu":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)
    if name == "mx_gpu":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (10, 0)
    if name == "deepspeed_fp16":
        from deepspeed.accelerator import get_accelerator

        return bool(get_accelerator().is_fp16_supported())
    if name == "libaio":
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    if name == "deepspeed_autoep":
        from fp8dist.engines.deepspeed.engine import autoep_registry_clash

        return autoep_registry_clash() is None
    raise ValueError(f"unknown capability {name!r}")


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_refusal(case):
    if case.kind == "config":
        with pytest.raises(ConfigError) as info:
            load_config(case.config)
    else:
        if case.unless and has_capability(case.unless):
            pytest.skip(f"this machine has {case.unless}: the refusal does not apply")
        spec = load_config(case.config)  # valid config: the environment refuses it
        with pytest.raises(Fp8distError) as info:
            preflight(spec)
    assert case.says in str(info.value), str(info.value)
    assert "fix:" in str(info.value), f"a refusal names the fix: {info.value}"


def _rule_modules() -> list[ModuleType]:
    """The package fp8dist.config.rules and every module in it."""
    names = [info.name for info in pkgutil.iter_modules(rules.__path__, rules.__name__ + ".")]
    return [rules, *(importlib.import_module(name) for name in names)]


def _issue_sites(module: ModuleType) -> set[int]:
    tree = ast.parse(inspect.getsource(module))
    return {node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Issue"}


def test_every_rule_refusal_is_triggered(monkeypatch):
    modules = _rule_modules()
    fired: set[tuple[str, int]] = set()  # (file, line) of each Issue() call that ran
    original = rules.Issue

    def recording_issue(*args, **kwargs):
        caller = inspect.currentframe().f_back
        fired.add((caller.f_code.co_filename, caller.f_lineno))
        return original(*args, **kwargs)

    for module in modules:
        if hasattr(module, "Issue"):
            monkeypatch.setattr(module, "Issue", recording_issue)
    for case in REFUSALS:
        if case.kind == "config":
            with pytest.raises(ConfigError):
                load_config(case.config)
    untriggered, count = {}, 0
    for module in modules:
        sites = _issue_sites(module)
        count += len(sites)
        # A call spanning lines reports the line the frame is on; map each fired line to its call site.
        covered = {max(site for site in sites if site <= line) for file, line in fired if file == module.__file__}
        if sites - covered:
            untriggered[module.__name__] = sorted(sites - covered)
    assert not untriggered, f"Issue() calls no refusal case triggers (module: lines): {untriggered}"
    assert {module.__name__.rsplit(".", 1)[-1] for module in modules} >= {"common", "fsdp2", "deepspeed", "torchao",
                                                                           "te", "msamp"}
    assert count >= 30


def test_options_doc_is_current():
    path = ROOT / "docs" / "options.md"
    assert path.read_text(encoding="utf-8") == render(), \
        "docs/options.md is stale: python -m tests.option_matrix > docs/options.md"
