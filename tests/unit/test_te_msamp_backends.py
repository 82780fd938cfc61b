"""Transformer Engine and MS-AMP backends. Neither library can be installed on a CPU machine, so the
module swap and the call sequence run against minimal stand-ins that record what fp8dist does;
every assertion is about fp8dist's behaviour (weights copied, filter honoured, arguments, order)."""
import sys
import types

import pytest
import torch

from fp8dist.backends.msamp import MSAMP
from fp8dist.backends.transformer_engine import TransformerEngine, recipe_kwargs
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError, Fp8distError, UnsupportedEnvironment


def te_spec(**te):
    return load_config({"precision": {"preset": "te", "fp8": {"te": te}}})


def test_recipe_kwargs_pass_only_what_the_user_set():
    assert recipe_kwargs(te_spec(), (2, 20, 0)) == ("DelayedScaling", {})
    name, kwargs = recipe_kwargs(te_spec(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="most_recent",
                                         margin=1), (2, 20, 0))
    assert name == "DelayedScaling" and kwargs == {"fp8_format": "HYBRID", "amax_history_len": 16,
                                                   "amax_compute_algo": "most_recent", "margin": 1}
    assert recipe_kwargs(te_spec(recipe="current", use_power_2_scales=True), (2, 20, 0)) == \
        ("Float8CurrentScaling", {"use_power_2_scales": True})
    assert recipe_kwargs(te_spec(recipe="mxfp8"), (2, 20, 0))[0] == "MXFP8BlockScaling"


def test_recipe_needs_a_te_that_has_it():
    with pytest.raises(UnsupportedEnvironment, match="Float8BlockScaling needs Transformer Engine >= 2.3.0"):
        recipe_kwargs(te_spec(recipe="block"), (2, 2, 0))


@pytest.mark.parametrize("field,value", [("interval", 1), ("override_linear_precision", [False, False, True])])
def test_removed_te_fields_are_refused_with_version(field, value):
    with pytest.raises(ConfigError, match=f"precision.fp8.te.{field}.*removed from Transformer Engine"):
        te_spec(**{field: value})


def test_delayed_only_fields_refused_for_other_recipes():
    with pytest.raises(ConfigError, match="amax_history_len: not a field of recipe 'current'"):
        te_spec(recipe="current", amax_history_len=16)


class _FakeTE(types.ModuleType):
    """Just enough of transformer_engine.pytorch to observe the swap: te.Linear/te.LayerNorm are plain
    torch modules created with TE's constructor arguments, initialised to garbage on purpose."""

    def __init__(self, with_autocast=True):
        super().__init__("transformer_engine.pytorch")
        self.calls = []
        fake = self

        class Linear(torch.nn.Linear):
            def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
                super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
                torch.nn.init.constant_(self.weight, 123.0)

        class LayerNorm(torch.nn.LayerNorm):
            def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
                super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
                torch.nn.init.constant_(self.weight, 7.0)

        self.Linear, self.LayerNorm = Linear, LayerNorm
        if with_autocast:
            self.autocast = lambda **kw: fake.calls.append(("autocast", kw)) or _nullcontext()
        self.fp8_autocast = lambda **kw: fake.calls.append(("fp8_autocast", kw)) or _nullcontext()


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


@pytest.fixture
def fake_te(monkeypatch):
    te = _FakeTE()
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    return te


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.up = torch.nn.Linear(32, 64)
        self.odd = torch.nn.Linear(32, 24)   # 24 is not a multiple of 16
        self.lm_head = torch.nn.Linear(64, 32)


def test_swap_copies_weights_and_honours_filter(fake_te):
    model = Block()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    decisions = TransformerEngine(te_spec()).convert_module(model)
    assert isinstance(model.up, fake_te.Linear) and isinstance(model.norm, fake_te.LayerNorm)
    assert type(model.odd) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), key  # TE's own init (123, 7) was overwritten
    reasons = {d.fqn: d.reason for d in decisions}
    assert "not multiples of 16" in reasons["odd"] and "excluded" in reasons["lm_head"]


@pytest.mark.parametrize("new_api", [True, False])
def test_forward_context_uses_autocast_where_it_exists(monkeypatch, new_api):
    te = _FakeTE(with_autocast=new_api)
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    backend = TransformerEngine(te_spec())
    backend.recipe = "RECIPE"
    with backend.forward_context():
        pass
    name, kwargs = te.calls[0]
    if new_api:
        assert name == "autocast" and kwargs["recipe"] == "RECIPE"
    else:
        assert name == "fp8_autocast" and kwargs["fp8_recipe"] == "RECIPE"


def test_te_refused_clearly_without_the_library():
    if "transformer_engine" in sys.modules:
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(UnsupportedEnvironment, match="Transformer Engine is not installed"):
        TransformerEngine(te_spec()).check_environment({"capability": None, "cuda": None})


def msamp_spec(level="O2"):
    return load_config({"precision": {"preset": f"msamp-{level.lower()}"}})


def test_msamp_initialize_checks_then_calls_msamp(monkeypatch):
    calls = []
    fake = types.ModuleType("msamp")
    fake.initialize = lambda model, optimizer, opt_level, use_te: calls.append((model, optimizer, opt_level, use_te)) \
        or (model, optimizer)
    monkeypatch.setitem(sys.modules, "msamp", fake)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    assert MSAMP(msamp_spec("O2")).initialize(model, opt) == (model, opt)
    assert calls == [(model, opt, "O2", False)]
    with pytest.raises(Fp8distError, match="Adam/AdamW only"):
        MSAMP(msamp_spec("O2")).initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(Fp8distError, match="amsgrad=False"):
        MSAMP(msamp_spec("O1")).initialize(model, torch.optim.Adam(model.parameters(), amsgrad=True))
    with pytest.raises(Fp8distError, match="O3 exists only inside DeepSpeed"):
        MSAMP(msamp_spec("O3")).initialize(model, opt)
    assert len(calls) == 1


def test_msamp_refused_clearly_without_the_library():
    if "msamp" in sys.modules:
        pytest.skip("MS-AMP is importable here")
    with pytest.raises(UnsupportedEnvironment, match="MS-AMP is not installed. It is not on PyPI"):
        MSAMP(msamp_spec()).check_environment({"cuda_available": False})
