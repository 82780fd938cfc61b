"""`fp8dist compare --layer-steps / --fixed-routing` below the ranks: the routing replay on a real transformers MoE
model, the layer taps on a real Llama (activation checkpointing included), the SQNR report, the parent's refusals.
The runs themselves: tests/distributed/test_compare.py."""
import json
import math

import pytest
import torch

from fp8dist.runtime.layer_probes import NON_FINITE, Taps, layer_report, parse_steps, sqnr_db
from fp8dist.runtime.routing_replay import RoutingLog, routers
from fp8dist.errors import Fp8distError
from tests.conftest import ROOT, run_cli

CONFIGS = ROOT / "configs"


def _mixtral(seed: int):
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import tiny_moe_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_moe_config("mixtral"))


def _choices(model, ids) -> list[torch.Tensor]:
    """Each router's top-k indices in one forward, read from its own output."""
    seen = []
    hooks = [router.register_forward_hook(lambda m, a, out: seen.append(out[2].clone())) for _, router in
             routers(model)]
    try:
        model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_replay_sends_tokens_to_the_recorded_experts_with_the_runs_own_weights():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    recorded_model, other = _mixtral(0), _mixtral(1)  # different weights: different choices of their own
    own = _choices(other, ids)
    log = RoutingLog()
    log.install(recorded_model, replay=False)
    baseline = _choices(recorded_model, ids)
    log.remove()
    assert any(not torch.equal(a, b) for a, b in zip(own, baseline))  # the two models would route apart
    log.install(other, replay=True)
    replayed = _choices(other, ids)
    log.remove()
    assert all(torch.equal(a, b) for a, b in zip(replayed, baseline))
    log.check_consumed()
    # the routing weights are the replaying model's own probabilities at those experts, and train its router
    router = routers(other)[0][1]
    hidden = torch.randn(32, other.config.hidden_size)
    probs = torch.softmax(torch.nn.functional.linear(hidden, router.weight).float(), dim=-1)
    log.calls[routers(other)[0][0]].append(baseline[0][:32])
    log.install(other, replay=True)
    _, scores, indices = router(hidden)
    log.remove()
    picked = probs.gather(-1, baseline[0][:32])
    assert torch.equal(indices, baseline[0][:32])
    torch.testing.assert_close(scores, picked / picked.sum(-1, keepdim=True))
    scores.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_refuses_runs_that_do_not_step_alike():
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    model = _mixtral(0)
    log = RoutingLog()
    log.install(model, replay=False)
    model(input_ids=ids)
    model(input_ids=ids)
    log.remove()
    log.install(model, replay=True)
    model(input_ids=ids)
    log.remove()
    with pytest.raises(Fp8distError, match="fewer router calls"):
        log.check_consumed()
    model(input_ids=ids)  # uninstalled: no replay, no error
    log.install(model, replay=True)
    with pytest.raises(Fp8distError, match="routes .* tokens here"):
        model(input_ids=ids[:, :4])
    log.remove()


class _TwoStageRouter(torch.nn.Module):
    """A router that calls top-k twice per forward (group-limited routing, as DeepSeek-V3's)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.calls = weight, 0

    def forward(self, hidden):
        self.calls += 1
        scores = torch.softmax(hidden @ self.weight.t(), dim=-1)
        _, groups = torch.topk(scores.view(-1, 2, 4).sum(-1), 1, dim=-1)
        values, indices = torch.topk(scores, 2, dim=-1)
        return values, indices, groups


def test_replay_repeats_every_choice_of_a_forward_in_its_recompute_under_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fp8dist.runtime import routing_replay

    torch.manual_seed(0)
    hidden = torch.randn(6, 16, requires_grad=True)
    baseline, replayed = {}, {}
    for name, weight, out in (("baseline", torch.randn(8, 16), baseline), ("config", torch.randn(8, 16), replayed)):
        router = _TwoStageRouter(torch.nn.Parameter(weight))
        model = torch.nn.Module()
        model.block = checkpoint_wrapper(torch.nn.Sequential()) if name == "config" else torch.nn.Sequential()
        inner = model.block._checkpoint_wrapped_module if name == "config" else model.block
        inner.add_module("gate", router)
        log = baseline.get("log") or routing_replay.RoutingLog()
        found = [("block._checkpoint_wrapped_module.gate" if name == "config" else "block.gate", router)]
        original = routing_replay.routers
        routing_replay.routers = lambda m: found  # the stand-in block has no experts module to find it by
        try:
            log.install(model, replay=name == "config")
        finally:
            routing_replay.routers = original
        values, indices, groups = model.block(hidden)
        (values.sum() * 1.0).backward()  # the config's block recomputes its router in backward
        log.remove()
        out.update(log=log, indices=indices, groups=groups, grad=router.weight.grad, calls=router.calls)
    assert torch.equal(replayed["indices"], baseline["indices"]) and torch.equal(replayed["groups"],
                                                                                 baseline["groups"])
    assert replayed["grad"] is not None and replayed["grad"].abs().sum() > 0
    assert (baseline["calls"], replayed["calls"]) == (1, 2)  # the config's router ran again in backward
    baseline["log"].check_consumed()


def test_a_dense_model_has_no_router_to_replay():
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import tiny_llama_config

    with pytest.raises(Fp8distError, match="no experts module"):
        routers(AutoModelForCausalLM.from_config(tiny_llama_config()))


@pytest.fixture(scope="module")
def llama_and_spec():
    from transformers import AutoModelForCausalLM

    from fp8dist.config.load import load_config
    from fp8dist.config.models import tiny_llama_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config()), load_config(CONFIGS / "fsdp2-bf16.yaml")


def _tapped(model, spec, ids) -> Taps:
    taps = Taps()
    taps.install(model, spec)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        taps.remove()
    model.zero_grad(set_to_none=True)
    return taps


def test_taps_record_each_blocks_output_and_its_gradient_once_under_activation_checkpointing(llama_and_spec):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model, spec = llama_and_spec
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    plain = _tapped(model, spec, ids)
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert set(plain.tensors) == {(b, kind) for b in blocks for kind in ("activation", "gradient")}
    assert plain.tensors[(blocks[0], "activation")].shape == (2, 16, model.config.hidden_size)
    assert plain.tensors[(blocks[-1], "gradient")].abs().sum() > 0
    import copy

    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    again = _tapped(checkpointed, spec, ids)  # the recompute in backward is not a second forward
    assert set(again.tensors) == set(plain.tensors)
    for key, tensor in plain.tensors.items():
        torch.testing.assert_close(again.tensors[key], tensor, rtol=0, atol=0)


def test_layer_report_sqnr_and_first_parting(llama_and_spec):
    model, spec = llama_and_spec
    names = ("l0", "l1", "l2")
    base = Taps({(name, kind): torch.ones(4, 8) for name in names for kind in ("activation", "gradient")})
    got = Taps({key: value.clone() for key, value in base.tensors.items()})
    got.tensors[("l1", "activation")] = torch.full((4, 8), 1.1)  # noise power 1/100 of the signal: 20 dB
    report = layer_report(3, base, got, spec.audit.numerics)
    assert report["step"] == 3 and report["loss"] == {"baseline": None, "config": None, "relative_gap": None}
    assert report["layers"][0] == {"layer": "l0", "activation_sqnr_db": None, "gradient_sqnr_db": None}
    assert report["layers"][1]["activation_sqnr_db"] == pytest.approx(20.0)
    assert report["first_parting"] is None and report["first_parting_gradient"] is None  # 20 dB >= 18
    got.tensors[("l2", "activation")] = torch.full((4, 8), 2.0)  # 0 dB < 18
    got.tensors[("l0", "gradient")] = torch.full((4, 8), 2.0)
    got.tensors[("l1", "gradient")] = torch.full((4, 8), float("inf"))  # an overflowed gradient: no number
    report = layer_report(3, base, got, spec.audit.numerics)
    assert report["first_parting"] == {"layer": "l2", "sqnr_db": 0.0, "limit": 18}
    # gradients part from the loss down: l1 comes before l0 in backward order
    assert report["first_parting_gradient"] == {"layer": "l1", "sqnr_db": NON_FINITE, "limit": 12}
    json.dumps(report, allow_nan=False)  # strict JSON, as compare --format json writes it
    from fp8dist.commands.compare import parting_text

    assert parting_text(report) == ("activations first part at l2 (0.00 dB < 18); gradients first part at l1 "
                                    "(non-finite dB < 12); `fp8dist audit --numerics` names the GEMMs inside it")
    with pytest.raises(Fp8distError, match="different layers"):
        layer_report(1, base, Taps({("l0", "activation"): torch.ones(4, 8)}), spec.audit.numerics)
    assert sqnr_db(1.0, 0.0) is None and sqnr_db(0.0, 0.0) is None
    assert sqnr_db(1.0, math.inf) == sqnr_db(0.0, 1.0) == NON_FINITE


def test_fp16_loss_scale_is_taken_out_of_the_tapped_gradients():
    taps = Taps({("l0", "activation"): torch.ones(2), ("l0", "gradient"): torch.full((2,), 1024.0)})
    taps.unscale(1024.0)
    assert torch.equal(taps.tensors[("l0", "gradient")], torch.ones(2))
    assert torch.equal(taps.tensors[("l0", "activation")], torch.ones(2))


@pytest.mark.parametrize("text, says", [("0", "between 1 and --steps"), ("9", "between 1 and --steps"),
                                        ("a,b", "separated by commas"), (",", "between 1 and --steps")])
def test_layer_steps_must_name_steps_of_the_run(text, says):
    with pytest.raises(Fp8distError, match=says):
        parse_steps(text, 8)
    assert parse_steps("8,1,1", 8) == (1, 8)


@pytest.mark.parametrize("args, says", [
    (["--config", CONFIGS / "deepspeed-bf16-zero2.yaml", "--layer-steps", "1"], "cannot run a probe pass"),
    (["--config", CONFIGS / "fsdp2-bf16.yaml", "--layer-steps", "1", "compile=true"], "compiles its blocks"),
    (["--config", CONFIGS / "fsdp2-bf16.yaml", "--fixed-routing"], "tiny-llama has no experts"),
    (["--config", CONFIGS / "fsdp2-bf16.yaml", "--layer-steps", "30"], "between 1 and --steps"),
    (["--config", CONFIGS / "fsdp2-tp-float8.yaml", "--layer-steps", "1"], "parallel.tensor_size=2"),
    (["--config", CONFIGS / "te.yaml", "--layer-steps", "1"], "keep FP8 state"),
    (["--config", CONFIGS / "fsdp2-qlora.yaml", "--layer-steps", "1"], "holds an NF4 base"),
])
def test_the_parent_refuses_before_launching(args, says):
    result = run_cli("compare", "--baseline", CONFIGS / "fsdp2-bf16.yaml", *args, timeout=120)
    assert result.returncode == 2 and says in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "torchrun" not in result.stderr
