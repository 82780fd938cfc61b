"""Delayed scaling's histories in `audit --numerics` (fp8dist.audit.scaling_history). Transformer Engine cannot run
on this machine: a stand-in module keeps `fp8_meta` the way TE 2.x's DelayedScalingRecipeState does and updates
it as transformer_engine/pytorch/quantization.py does (a pass writes its amax into row 0; the update takes the
history's max, rolls row 0 to the last row, zeroes row 0 and sets scale = fp8_max / amax / 2^margin). Every
assertion is about what fp8dist reads from that state."""
import enum
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from fp8dist.audit.numerics import NumericsRecorder, Thresholds, describe, document, fix
from fp8dist.audit.scaling_history import history_row
from fp8dist.config.load import load_config


class _Helper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):  # TE's transformer_engine/common/recipe Format members used here
    E4M3 = _Helper(448, 448)
    HYBRID = _Helper(448, 57344)


@dataclass
class DelayedScaling:
    margin: int = 0
    amax_compute_algo: str = "max"
    amax_history_len: int = 8
    fp8_format: Format = Format.HYBRID


class TELinearStandIn(torch.nn.Module):
    """A Linear whose forward records the amaxes of its input and weight, and whose backward records its output
    gradient's, each followed by TE's update (one pass: the autocast's exit, the end of backward)."""

    def __init__(self, recipe: DelayedScaling):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
        self.fp8_meta = {"recipe": recipe}
        for key, count in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = SimpleNamespace(recipe=recipe, scale=torch.ones(count),
                                                 amax_history=torch.zeros(recipe.amax_history_len, count))

    def forward(self, x):
        state = self.fp8_meta["scaling_fwd"]
        state.amax_history[0, 0], state.amax_history[0, 1] = x.detach().abs().max(), self.weight.detach().abs().max()
        _update(state, 448.0)
        out = x @ self.weight.t()
        if out.requires_grad:
            out.register_hook(self._grad)
        return out

    def _grad(self, grad):
        state = self.fp8_meta["scaling_bwd"]
        state.amax_history[0, 0] = grad.abs().max()
        _update(state, 57344.0)


def _update(state, fp8_max):
    recipe, history = state.recipe, state.amax_history
    amax = history.max(dim=0).values if recipe.amax_compute_algo == "max" else history[0].clone()
    history.copy_(torch.roll(history, -1, 0))
    history[0].fill_(0.0)
    scale = (fp8_max / amax) / 2 ** recipe.margin
    scale = torch.where(amax > 0, scale, state.scale)
    state.scale.copy_(scale)


def _run(module, amaxes):
    """Passes whose input amax is each of `amaxes` (forward and backward)."""
    for amax in amaxes:
        x = torch.full((4, 8), amax / 2)
        x[0, 0] = amax
        module(x.requires_grad_()).sum().backward()


def _watched(module, amax):
    root = torch.nn.Sequential(module)
    with NumericsRecorder(root) as recorder:
        _run(module, [amax])
    return recorder.tally


def test_a_steady_tensor_uses_its_whole_range():
    module = TELinearStandIn(DelayedScaling())
    _run(module, [1.0] * 5)
    rows = {(r["direction"], r["tensor"]): r for r in _watched(module, 1.0).scaling}
    assert set(rows) == {("forward", "gemm1_input"), ("forward", "gemm1_weight"), ("backward", "gemm1_grad_output")}
    inp = rows[("forward", "gemm1_input")]
    assert inp["headroom_bits"] == 0.0 and inp["lagged_passes"] == 0 and inp["stale_passes"] == 0
    assert inp["format"] == "e4m3" and rows[("backward", "gemm1_grad_output")]["format"] == "e5m2"
    assert inp["passes"] == 1 and inp["history_len"] == 8 and inp["amax"] == 1.0


def test_a_jump_the_history_has_not_seen_clamps_and_fails_naming_the_tensor():
    module = TELinearStandIn(DelayedScaling())
    _run(module, [1.0] * 5)
    tally = _watched(module, 4.0)
    inp = next(r for r in tally.scaling if r["tensor"] == "gemm1_input")
    assert inp["headroom_bits"] == -2.0 and inp["lagged_passes"] == 1
    assert inp["next_headroom_bits"] == 0.0  # the update has caught up for the next pass
    spec = load_config({"precision": {"preset": "te"}})
    numerics = document(tally, Thresholds.of(spec))
    failing = [f for f in numerics["worst"] if f["fails"]]
    assert [(f["gemm"], f["operand"], f["metric"]) for f in failing] == [("forward", "gemm1_input", "lagged_passes")]
    assert "lagged a new amax in 1 pass" in describe(failing[0])
    assert "precision.fp8.te.recipe: current" in fix(failing, tally, spec)
    assert numerics["scaling_history"] == tally.scaling


def test_a_spike_holds_the_scale_up_for_the_length_of_the_history():
    module = TELinearStandIn(DelayedScaling(margin=1))
    _run(module, [1.0, 100.0, 1.0, 1.0])
    inp = next(r for r in _watched(module, 1.0).scaling if r["tensor"] == "gemm1_input")
    assert inp["lagged_passes"] == 0  # 1.0 under a scale set by 100 (and a margin): nothing clamps
    assert inp["headroom_bits"] == pytest.approx(math.log2(100) + 1, abs=0.01)
    assert inp["next_headroom_bits"] == pytest.approx(math.log2(100) + 1, abs=0.01)
    assert inp["stale_passes"] == 3  # the spike was 3 passes before the newest


def test_most_recent_follows_the_newest_pass_and_a_single_row_history_is_not_read():
    module = TELinearStandIn(DelayedScaling(amax_compute_algo="most_recent"))
    _run(module, [1.0, 100.0, 1.0])
    inp = next(r for r in _watched(module, 2.0).scaling if r["tensor"] == "gemm1_input")
    assert inp["lagged_passes"] == 1 and inp["headroom_bits"] == -1.0 and inp["stale_passes"] == 0
    single = TELinearStandIn(DelayedScaling(amax_history_len=1))
    _run(single, [1.0])
    assert _watched(single, 1.0).scaling == []  # TE zeroes its only row at the update


def test_every_pass_of_a_step_is_checked_against_the_scale_it_was_cast_with():
    """Steps of several micro-batches: against the stand-in's own count of clamped casts (each pass's amax x its
    scale beyond 448), over random amax sequences with jumps, for both amax_compute_algo values."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        algo = ("max", "most_recent")[trial % 2]
        module = TELinearStandIn(DelayedScaling(amax_compute_algo=algo, amax_history_len=5))
        history = (torch.rand(6, generator=generator) * 10).tolist()
        _run(module, history)
        step = (torch.rand(3, generator=generator) * 30).tolist()  # three micro-batches
        clamped, state = 0, module.fp8_meta["scaling_fwd"]
        root = torch.nn.Sequential(module)
        with NumericsRecorder(root) as recorder:
            for amax in step:
                clamped += amax * float(state.scale[0]) > 448 * (1 + 1e-6)
                _run(module, [amax])
        inp = next(r for r in recorder.tally.scaling if r["tensor"] == "gemm1_input")
        assert inp["passes"] == 3 and inp["lagged_passes"] == clamped, (algo, history, step)


def test_histories_created_in_the_watched_step_start_from_tes_initial_state():
    """TE creates fp8_meta's scaling states at a module's first forward under autocast: a step watched from the
    start (the audit's) still reads them, with TE's initial unit scale."""
    module = TELinearStandIn(DelayedScaling())
    states = {key: module.fp8_meta.pop(key) for key in ("scaling_fwd", "scaling_bwd")}
    real_forward = module.forward

    def first_forward(x):
        module.fp8_meta.update(states)
        return real_forward(x)

    module.forward = first_forward
    inp = next(r for r in _watched(module, 1000.0).scaling if r["tensor"] == "gemm1_input")
    assert inp["lagged_passes"] == 1 and inp["headroom_bits"] == round(math.log2(448 / 1000), 2)


def test_a_step_longer_than_the_history_and_a_non_finite_amax():
    column = torch.tensor([0.0, 1.0, 2.0])
    assert history_row(column, column, 448.0, 224.0, passes=3, fp8_max=448.0, margin=0, algo="max") is None
    before, after = torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, 1.0, 2.0])
    row = history_row(before, after, 448.0, 224.0, passes=1, fp8_max=448.0, margin=0, algo="max")
    assert row["lagged_passes"] == 1 and row["stale_passes"] == 0
