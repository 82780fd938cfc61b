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
from fp8dist.translate.deepspeed import to_deepspeed


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


def msamp_spec(level="O2", **optimizer):
    return load_config({"precision": {"preset": f"msamp-{level.lower()}"}, "optimizer": optimizer})


class _LBAdamW(torch.optim.Optimizer):
    """The constructor contract of MS-AMP v0.4.0 msamp/optim/adamw_base.py LBAdamWBase: these keyword
    arguments and no others, `use_adam` False; LBAdam (msamp/optim/adam.py) only flips `use_adam`."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize))
        self.use_adam = False


class _LBAdam(_LBAdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 maximize=False, *args, **kwargs):
        super().__init__(params, lr, True, betas, eps, weight_decay, amsgrad, *args, maximize=maximize, **kwargs)
        self.use_adam = True


def _msamp_initialize(calls):
    """msamp.initialize as MS-AMP v0.4.0 msamp/__init__.py does it for the optimizer: Adam is tested before
    AdamW, the low-bit optimizer gets the torch optimizer's defaults minus four keys."""

    def initialize(model, optimizer=None, opt_level="O1", use_te=False):
        calls.append(("msamp.initialize", opt_level, use_te, dict(optimizer.defaults)))
        defaults = dict(optimizer.defaults, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
        for key in ("foreach", "capturable", "differentiable", "fused"):
            defaults.pop(key, None)
        cls = _LBAdam if isinstance(optimizer, torch.optim.Adam) else _LBAdamW
        return model, cls(optimizer.param_groups, **defaults)

    return initialize


@pytest.fixture
def fake_msamp(monkeypatch):
    calls = []
    package = types.ModuleType("msamp")
    package.initialize = _msamp_initialize(calls)
    ds = types.ModuleType("msamp.deepspeed")

    def ds_initialize(model, optimizer, config, **kwargs):
        calls.append(("msamp.deepspeed.initialize", config))
        _, low_bit = package.initialize(model, optimizer, config["msamp"]["opt_level"].replace("O3", "O2"))
        return types.SimpleNamespace(basic_optimizer=low_bit, module=model), low_bit, None, None

    ds.initialize = ds_initialize
    package.deepspeed = ds
    monkeypatch.setitem(sys.modules, "msamp", package)
    monkeypatch.setitem(sys.modules, "msamp.deepspeed", ds)
    return calls


def test_msamp_initialize_checks_then_calls_msamp(fake_msamp):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    new_model, low_bit = MSAMP(msamp_spec("O2")).initialize(model, opt)
    assert new_model is model and fake_msamp[0][:3] == ("msamp.initialize", "O2", False)
    # Without fp8dist's adaptation the LB constructor raises TypeError on torch's decoupled_weight_decay,
    # and an AdamW (a subclass of Adam in current torch) would step with L2 decay.
    assert "decoupled_weight_decay" not in fake_msamp[0][3]
    assert low_bit.use_adam is False  # decoupled decay, as AdamW asks
    assert low_bit.param_groups[0]["weight_decay"] == 0.1


def test_msamp_keeps_adam_as_adam(fake_msamp):
    model = torch.nn.Linear(16, 16)
    _, low_bit = MSAMP(msamp_spec("O1")).initialize(model, torch.optim.Adam(model.parameters(), weight_decay=0.1))
    assert isinstance(low_bit, _LBAdam) and low_bit.use_adam is True  # torch Adam's L2 decay, as asked


def test_msamp_refuses_what_its_optimizers_cannot_do(fake_msamp):
    model = torch.nn.Linear(16, 16)
    with pytest.raises(Fp8distError, match="Adam/AdamW only"):
        MSAMP(msamp_spec("O2")).initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(Fp8distError, match="amsgrad=False"):
        MSAMP(msamp_spec("O1")).initialize(model, torch.optim.Adam(model.parameters(), amsgrad=True))
    with pytest.raises(Fp8distError, match="O3 exists only inside DeepSpeed"):
        MSAMP(msamp_spec("O3")).initialize(model, torch.optim.AdamW(model.parameters()))
    assert fake_msamp == []  # refused before MS-AMP saw anything


def test_msamp_deepspeed_initialize_uses_the_alias_and_restores_decay(fake_msamp):
    import fp8dist.backends.msamp as backend_module
    import fp8dist.engines.deepspeed as engine_module

    spec = msamp_spec("O3")
    model = torch.nn.Linear(16, 16)
    config = to_deepspeed(spec, "0.13.1")
    engine, optimizer, _, _ = MSAMP(spec).deepspeed_initialize(model=model, optimizer=torch.optim.AdamW(
        model.parameters(), weight_decay=0.1), config=config, training_data=None, lr_scheduler=None)
    assert [c[0] for c in fake_msamp] == ["msamp.deepspeed.initialize", "msamp.initialize"]
    assert fake_msamp[0][1]["msamp"] == {"enabled": True, "opt_level": "O3", "use_te": False}
    assert engine.basic_optimizer.use_adam is False
    for module in (backend_module, engine_module):  # `from msamp import deepspeed` would bind it here (MS-AMP#183)
        assert vars(module).get("deepspeed") is not sys.modules["msamp.deepspeed"], module.__name__


def test_msamp_module_filter_reaches_msamp_through_its_flag():
    from fp8dist.runtime.models import load_model

    model = load_model("tiny-llama", "fp32").model
    decisions = MSAMP(load_config({"precision": {"preset": "msamp-o2", "fp8": {"modules": {
        "exclude": ["lm_head", "*.o_proj"]}}}})).convert_module(model)
    kept = {d.fqn for d in decisions if not d.convert}
    assert kept == {"lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # LinearReplacer skips exactly these (msamp/nn/linear.py)
            assert module.use_fp32_linear is (name in kept), name


def test_msamp_use_te_swaps_to_te_and_runs_te_autocast(fake_te):
    spec = load_config({"precision": {"preset": "msamp-o2", "fp8": {"msamp": {"use_te": True}}}})
    backend = MSAMP(spec)
    model = Block()
    backend.convert_module(model)
    assert isinstance(model.up, fake_te.Linear)  # MS-AMP's TeReplacer then takes the te weights
    backend.te.recipe = "RECIPE"
    with backend.forward_context():
        pass
    assert fake_te.calls[0][0] == "autocast"


def test_msamp_environment_error_lists_everything_missing_here():
    if "msamp" in sys.modules:
        pytest.skip("MS-AMP is importable here")
    with pytest.raises(UnsupportedEnvironment) as info:
        MSAMP(msamp_spec()).check_environment({"cuda_available": False})
    text = str(info.value)
    assert "MS-AMP is not installed, and not on PyPI" in text and "needs a CUDA GPU" in text
    assert "fix: run on a CUDA GPU machine with MS-AMP 0.4" in text
    import fp8dist.compat as compat
    if not compat.msamp_supports_deepspeed(compat.parse_version(compat.installed_version("deepspeed")))[0]:
        assert "0.12.4-0.17.4" in text  # this machine's DeepSpeed is outside MS-AMP 0.4's window too


@pytest.mark.parametrize("recipe,converted", [("delayed", {"up", "mid", "narrow"}), ("mxfp8", {"up", "mid"}),
                                              ("block", {"up"})])
def test_te_swap_uses_the_recipe_block_size(fake_te, recipe, converted):
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(128, 256))    # multiples of 16, 32 and 128
    model.add_module("mid", torch.nn.Linear(256, 96))    # 96: of 16 and 32, not of 128
    model.add_module("narrow", torch.nn.Linear(96, 48))  # 48: of 16, not of 32
    model.add_module("lm_head", torch.nn.Linear(48, 16))
    decisions = TransformerEngine(te_spec(recipe=recipe)).convert_module(model)
    assert {d.fqn for d in decisions if d.convert} == converted
    assert {fqn for fqn, m in model.named_children() if isinstance(m, fake_te.Linear)} == converted


def test_user_optimizer_follows_the_te_swap(fake_te):
    from fp8dist.engines.optim import rebind_optimizer, rebind_parameters

    model = Block()
    before = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [model.up.weight, model.up.bias], "lr": 0.1},
                                   {"params": [model.lm_head.weight]}])
    groups = [{"params": [model.up.weight], "weight_decay": 0.0}]
    TransformerEngine(te_spec()).convert_module(model)
    rebind_optimizer(optimizer, before, model)
    assert optimizer.param_groups[0]["params"][0] is model.up.weight  # the te.Linear's parameter
    assert optimizer.param_groups[0]["params"][1] is model.up.bias
    assert optimizer.param_groups[1]["params"][0] is model.lm_head.weight and model.lm_head.weight is before[
        "lm_head.weight"]  # not swapped: unchanged
    assert rebind_parameters(groups, before, model)[0]["params"][0] is model.up.weight


def test_optimizer_with_state_for_swapped_parameters_is_refused(fake_te):
    from fp8dist.engines.optim import rebind_optimizer

    model = Block()
    before = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.up(torch.ones(2, 32)).sum().backward()
    optimizer.step()
    TransformerEngine(te_spec()).convert_module(model)
    with pytest.raises(Fp8distError, match="already holds state"):
        rebind_optimizer(optimizer, before, model)
