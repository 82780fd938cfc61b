"""Transformer Engine and MS-AMP backends. Neither library can be installed on a CPU machine, so the
module swap and the call sequence run against minimal stand-ins that record what fp8dist does;
every assertion is about fp8dist's behaviour (weights copied, filter honoured, arguments, order)."""
import contextlib
import copy
import sys
import types

import pytest
import torch

from fp8dist.backends.msamp import MSAMP
from fp8dist.backends.transformer_engine import TransformerEngine
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError, Fp8distError, UnsupportedEnvironment
from fp8dist.translate.deepspeed import to_deepspeed
from fp8dist.translate.fsdp2 import TERecipePlan, te_recipe_plan


def te_spec(**te):
    return load_config({"precision": {"preset": "te", "fp8": {"te": te}}})


def test_recipe_plan_passes_only_what_the_user_set():
    assert te_recipe_plan(te_spec(), (2, 20, 2)) == TERecipePlan(recipe_class="DelayedScaling", recipe_fields={},
                                                                 recipe_attributes={})
    plan = te_recipe_plan(te_spec(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="most_recent",
                                  margin=1), (2, 20, 2))
    assert plan.recipe_fields == {"fp8_format": "HYBRID", "margin": 1, "amax_history_len": 16,
                                  "amax_compute_algo": "most_recent"}
    plan = te_recipe_plan(te_spec(recipe="current", use_power_2_scales=True), (2, 8, 0))
    assert plan.recipe_fields == {"use_power_2_scales": True}
    assert plan.recipe_attributes == {"fp8_quant_fwd_inp.power_2_scale": True,
                                      "fp8_quant_fwd_weight.power_2_scale": True,
                                      "fp8_quant_bwd_grad.power_2_scale": True}


@pytest.mark.parametrize("te,version,key,first", [
    ({"recipe": "block"}, (2, 2, 0), "recipe", "2.3.0"),
    ({"recipe": "current", "use_power_2_scales": True}, (2, 7, 0), "use_power_2_scales", "2.8.0"),
    ({"recipe": "mxfp8", "enable_2d_quantization": False}, (2, 18, 0), "enable_2d_quantization", "2.19.0")])
def test_recipe_plan_refuses_what_the_release_lacks(te, version, key, first):
    with pytest.raises(ConfigError, match=rf"precision\.fp8\.te\.{key}: .*{first}"):
        te_recipe_plan(te_spec(**te), version)


@pytest.mark.parametrize("field,value", [("interval", 1), ("override_linear_precision", [False, False, True])])
def test_removed_te_fields_are_refused_with_version(field, value):
    with pytest.raises(ConfigError, match=f"precision.fp8.te.{field}.*removed from Transformer Engine"):
        te_spec(**{field: value})


def test_delayed_only_fields_refused_for_other_recipes():
    with pytest.raises(ConfigError, match="amax_history_len: not a field of recipe 'current'"):
        te_spec(recipe="current", amax_history_len=16)


class _FakeTE(types.ModuleType):
    """Just enough of transformer_engine.pytorch to observe what fp8dist does: te.Linear/te.LayerNorm are plain
    torch modules created with TE's constructor arguments, initialised to garbage on purpose; te.Linear defers
    its init only for device == "meta", a string compare, and otherwise allocates on CUDA (TE 2.20.2
    module/linear.py:2242, module/base.py:1820), which fails here; the autocasts and
    distributed.activation_recompute_forward record when they are entered."""

    def __init__(self, with_autocast=True):
        super().__init__("transformer_engine.pytorch")
        self.calls = []
        fake = self

        class Linear(torch.nn.Linear):
            def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
                fake.calls.append(("Linear", device))
                if device != "meta" and torch.device(device or "cpu").type == "meta":
                    raise RuntimeError("TE materialises meta parameters on CUDA unless device == 'meta'")
                super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
                if device != "meta":
                    torch.nn.init.constant_(self.weight, 123.0)

        class LayerNorm(torch.nn.LayerNorm):
            def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
                super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
                if torch.device(device or "cpu").type != "meta":
                    torch.nn.init.constant_(self.weight, 7.0)

        self.Linear, self.LayerNorm = Linear, LayerNorm
        if with_autocast:
            self.autocast = lambda **kw: _entered(fake.calls, "autocast", kw)
        self.fp8_autocast = lambda **kw: _entered(fake.calls, "fp8_autocast", kw)
        self.distributed = types.ModuleType("transformer_engine.pytorch.distributed")
        self.distributed.activation_recompute_forward = lambda activation_recompute=False, recompute_phase=False: \
            _entered(fake.calls, "activation_recompute_forward", (activation_recompute, recompute_phase))


@contextlib.contextmanager
def _entered(calls, name, arguments):
    calls.append((name, arguments))
    yield


def install_te(monkeypatch, te):
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.distributed", te.distributed)
    return te


@pytest.fixture
def fake_te(monkeypatch):
    return install_te(monkeypatch, _FakeTE())


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
    te = install_te(monkeypatch, _FakeTE(with_autocast=new_api))
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
    fake_te.calls.clear()
    with backend.forward_context():
        pass
    assert fake_te.calls[0][0] == "autocast"
    assert backend.checkpoint_context_fn() is not None  # the recompute re-enters TE's autocast too


def test_msamp_environment_error_lists_everything_missing_here():
    if "msamp" in sys.modules:
        pytest.skip("MS-AMP is importable here")
    with pytest.raises(UnsupportedEnvironment) as info:
        MSAMP(msamp_spec()).check_environment({"cuda_available": False})
    text = str(info.value)
    assert "MS-AMP is not installed, and not on PyPI" in text and "needs a CUDA GPU" in text
    # its own environment (TE <= 1.7, torch 2.1), where fp8dist translates but its runtime cannot run
    assert "Transformer Engine <= 1.7" in text and "torch 2.1 (below fp8dist's torch floor 2.9)" in text
    assert "fp8dist translates O1, O2 and O3" in text and "own runtime, engines and audit cannot run there" in text
    assert "fix: write the DeepSpeed JSON with `fp8dist translate CONFIG --to deepspeed --deepspeed-version 0.13.1`" \
        in text
    from fp8dist.facts import versions
    from fp8dist.facts.msamp import msamp_supports_deepspeed
    from fp8dist.facts.versions import parse_version
    if not msamp_supports_deepspeed(parse_version(versions.installed_version("deepspeed")))[0]:
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


def test_msamp_says_when_the_installed_te_is_too_new_for_it(monkeypatch):
    import fp8dist.backends.msamp as backend_module

    monkeypatch.setattr(backend_module, "installed_te_version", lambda: (2, 20, 2))
    with pytest.raises(UnsupportedEnvironment, match=r"Transformer Engine 2\.20\.2 is installed: `import msamp` "
                                                     r"needs TE <= 1\.7"):
        MSAMP(msamp_spec()).check_environment({"cuda_available": True, "name": "NVIDIA H100"})


def test_te_linear_on_a_meta_model_is_built_on_meta_and_not_copied(fake_te):
    """RAM-efficient loading builds the model on meta; te.Linear must get the string "meta" (TE compares
    `device == "meta"`, and torch.device("meta") == "meta" is False), and no weight is copied: the loader fills them."""
    assert torch.device("meta") != "meta"
    with torch.device("meta"):
        model = Block()
    decisions = TransformerEngine(te_spec()).convert_module(model)
    built = [device for name, device in fake_te.calls if name == "Linear"]
    assert built == ["meta"] and type(built[0]) is str  # `up` only: odd's dims and lm_head are left out
    assert isinstance(model.up, fake_te.Linear) and model.up.weight.is_meta and model.norm.weight.is_meta
    assert {d.fqn for d in decisions if d.convert} == {"up", "norm"}


def _te_backend(monkeypatch, version, device=None):
    """The TE backend's check_environment against a stand-in TE `version` whose recipe classes record their
    arguments (transformer_engine.common.recipe: a frozen QParams per fp8_quant_* class attribute)."""
    import dataclasses
    import enum

    import fp8dist.backends.transformer_engine as backend_module

    @dataclasses.dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    class Float8CurrentScaling:
        fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams()

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = enum.Enum("Format", "E4M3 HYBRID")
    recipe.Float8CurrentScaling = Float8CurrentScaling
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    install_te(monkeypatch, _FakeTE())
    sys.modules["transformer_engine"].common = common
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    monkeypatch.setattr(backend_module, "installed_te_version", lambda: version)
    backend = TransformerEngine(te_spec(recipe="current", use_power_2_scales=True, fp8_format="E4M3"))
    backend.check_environment(device or {"capability": [9, 0], "cuda": "12.8"})
    return backend


def test_runtime_builds_the_recipe_for_the_installed_te(monkeypatch):
    recipe = _te_backend(monkeypatch, (2, 20, 2)).recipe
    assert recipe.use_power_2_scales is True and recipe.fp8_format.name == "E4M3"
    assert all(getattr(recipe, q).power_2_scale for q in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                                          "fp8_quant_bwd_grad"))  # what te.Linear reads
    assert type(recipe).fp8_quant_fwd_inp.power_2_scale is False  # set on the object, not the class


def test_runtime_refuses_a_field_the_installed_te_lacks(monkeypatch):
    with pytest.raises(ConfigError, match=r"use_power_2_scales: Float8CurrentScaling in Transformer Engine 2\.7\.0 "
                                          r"has no field use_power_2_scales \(the first release that keeps it is 2\.8\.0"):
        _te_backend(monkeypatch, (2, 7, 0))


def test_runtime_refuses_te_releases_fp8dist_does_not_support(monkeypatch):
    with pytest.raises(UnsupportedEnvironment, match=r"fp8dist supports Transformer Engine 2\.1\.0-2\.20\.2 .*1\.13\.0 "
                                                     r"is older"):
        _te_backend(monkeypatch, (1, 13, 0))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_inside_te_autocast(fake_te, monkeypatch, mode):
    """torch's checkpoint recomputes a block in backward, after the forward's te.autocast has exited: the
    wrapper's context_fn enters it again (after TE's activation_recompute_forward, as TE's own checkpoint),
    and with `selective` together with the selective policy's own contexts."""
    import fp8dist.engines.activation_checkpointing as activation_checkpointing

    selective = []
    original = activation_checkpointing._selective_context
    monkeypatch.setattr(activation_checkpointing, "_selective_context",
                        lambda: selective.append(1) or original())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)))
    reference = copy.deepcopy(model)
    backend = TransformerEngine(te_spec())
    backend.recipe = "RECIPE"
    backend.convert_module(model)
    activation_checkpointing.apply(model, [("0", model[0])], mode, backend)
    fake_te.calls.clear()
    x = torch.randn(4, 32, requires_grad=True)
    with backend.forward_context():
        loss = model(x).square().sum()
    assert [c[0] for c in fake_te.calls] == ["autocast", "activation_recompute_forward"]
    assert fake_te.calls[1][1] == (True, False)  # the forward stashes delayed-scaling state for the recompute
    fake_te.calls.clear()
    loss.backward()
    assert fake_te.calls == [("activation_recompute_forward", (True, True)),
                             ("autocast", {"enabled": True, "recipe": "RECIPE", "amax_reduction_group": None})]
    assert len(selective) == (mode == "selective")
    grad = x.grad.clone()
    x.grad = None
    reference(x).square().sum().backward()  # the same weights, not checkpointed
    assert torch.allclose(grad, x.grad)
