"""The defects of issue 16, each pinned by a test that failed before its fix: an unmeasured audit row never
makes a PASS, the fp16 loss scaler's schedule, light imports, the torch floor, version-pinned goldens,
moved keys, and the audit launcher's bounds."""
import json
import subprocess
import sys
import time
import tomllib

import pytest

from fp8dist.audit.report import build, table
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError
from fp8dist.facts import versions
from fp8dist.facts.torch import TORCH_FLOOR
from fp8dist.facts.torchao import NEWEST_KNOWN_TORCHAO
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.translate import to_fsdp2
from fp8dist.translate.fsdp2 import TorchaoFloat8Plan
from tests.conftest import ROOT, run_cli


def _observed_everything(spec, **override):
    from fp8dist.audit.expected import expected

    observed = {phase: {"observed": value, "detail": "", "measured": True}
                for phase, (value, _) in {**expected(spec, nproc=2), "engine": (spec.engine, "")}.items()}
    observed.update(override)
    return observed


def test_an_unmeasured_row_never_makes_a_pass():
    spec = load_config(ROOT / "configs" / "deepspeed-bf16-zero2.yaml")
    passing = build(spec, "tiny-llama", _observed_everything(spec), nproc=2)
    assert passing["passed"] is True
    read_from_setting = {"observed": "fp32", "detail": "engine.communication_data_type", "measured": False}
    result = build(spec, "tiny-llama", _observed_everything(spec, communication=read_from_setting), nproc=2)
    row = next(c for c in result["checks"] if c["phase"] == "communication")
    assert result["passed"] is False and row["ok"] is False and row["status"] == "NOT MEASURED"
    text = table(result)
    assert "NOT MEASURED" in text and "cannot say PASS" in text and "PASS:" not in text


def test_a_missing_row_is_not_measured_either():
    spec = load_config(ROOT / "configs" / "fsdp2-bf16.yaml")
    observed = _observed_everything(spec)
    del observed["gemm"]
    result = build(spec, "tiny-llama", observed, nproc=2)
    assert not result["passed"] and {c["phase"]: c["status"] for c in result["checks"]}["gemm"] == "NOT MEASURED"


def test_a_one_process_audit_says_its_communication_row_was_not_observed():
    """Issue 46 item 11: one rank reduces no gradients, so `reduce_dtype: bf16` is unchecked there: the verdict
    names the row it could not observe (table, markdown, JSON) instead of "every phase was measured"."""
    from fp8dist.audit.expected import expected
    from fp8dist.audit.report import markdown, verdict

    spec = load_config(ROOT / "configs" / "fsdp2-bf16.yaml")
    observed = {phase: {"observed": value, "detail": "", "measured": True}
                for phase, (value, _) in {**expected(spec, nproc=1), "engine": (spec.engine, "")}.items()}
    result = build(spec, "tiny-llama", observed, nproc=1)
    assert result["passed"] is True and "communication" not in {c["phase"] for c in result["checks"]}
    assert result["not_observed"]["communication"]["expected"] == spec.precision.reduce_dtype
    assert "every phase was measured" not in verdict(result)
    assert "not observed on 1 process: communication" in verdict(result)
    assert "? communication: expected" in table(result) and "not observed" in table(result)
    assert "| communication |" in markdown(result)
    two = build(spec, "tiny-llama", _observed_everything(spec), nproc=2)
    assert two["not_observed"] == {} and verdict(two).startswith("PASS: every phase was measured")


def _scaler(**settings):
    from fp8dist.config.spec import LossScalingSpec
    from fp8dist.engines.loss_scaling import DynamicLossScaler

    base = dict(loss_scale=0, initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2)
    return DynamicLossScaler(LossScalingSpec(**{**base, **settings}))


def test_loss_scaler_follows_deepspeeds_schedule():
    scaler = _scaler()
    assert scaler.scale == 16
    assert scaler.update(True).scale_after == 16  # hysteresis 2: the first overflow is absorbed
    assert scaler.update(True).scale_after == 8  # the second halves
    scales = [scaler.update(False).scale_after for _ in range(3)]
    assert scales == [8, 8, 16]  # doubles after loss_scale_window clean steps since the overflow
    for _ in range(10):
        scaler.update(True)
    assert scaler.scale == 2  # never below min_loss_scale


def test_static_loss_scale_skips_but_never_moves():
    scaler = _scaler(loss_scale=128)
    outcome = scaler.update(True)
    assert outcome.skipped and scaler.scale == 128 and scaler.update(False).scale_after == 128


def test_loss_scaler_unscales_and_finds_inf_without_a_process_group():
    import torch

    scaler = _scaler()
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 32.0)
    assert scaler.found_inf_anywhere([param]) is False
    scaler.unscale_([param])
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    param.grad[1] = float("nan")
    assert scaler.found_inf_anywhere([param]) is True


def test_fsdp2_plan_has_a_loss_scaler_exactly_for_fp16_compute():
    scaling = to_fsdp2(load_config(ROOT / "configs" / "fp16-amp.yaml")).loss_scaling
    assert scaling is not None and scaling.dynamic is True
    assert to_fsdp2(load_config(ROOT / "configs" / "fsdp2-bf16.yaml")).loss_scaling is None


def test_importing_the_fsdp2_engine_loads_no_private_collectives():
    code = ("import sys, fp8dist.engines.fsdp2; "
            "print('fp8dist.engines.fsdp2.collectives' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_pyproject_torch_floor_is_the_one_in_the_facts():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_req = next(r for r in project["project"]["optional-dependencies"]["train"] if r.startswith("torch>="))
    assert parse_version(torch_req.split(">=")[1]) == TORCH_FLOOR


def test_goldens_hold_whatever_torchao_is_installed(monkeypatch):
    from tests.golden.regenerate import golden_cases, translate

    monkeypatch.setattr(versions, "installed_version", lambda name: "0.11.0" if name == "torchao" else None)
    for config, spec, target, version in golden_cases():
        golden = json.loads((ROOT / "tests" / "golden" / f"{config.stem}.{target}.json").read_text())
        assert translate(spec, target, version) == golden, config.name


def test_installed_torchao_is_what_an_unpinned_plan_uses(monkeypatch):
    spec = load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml")
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.11.0" if name == "torchao" else None)
    plan = to_fsdp2(spec).float8
    assert isinstance(plan, TorchaoFloat8Plan)
    assert (plan.torchao_version, plan.torchao_version_origin) == ("0.11.0", "installed")
    assert plan.force_recompute_fp8_weight_in_bwd.value is True  # 0.11 still needs it with float8 all-gather
    monkeypatch.setattr(versions, "installed_version", lambda name: None)
    plan = to_fsdp2(spec).float8
    assert isinstance(plan, TorchaoFloat8Plan)
    assert plan.torchao_version == fmt(NEWEST_KNOWN_TORCHAO) and "newest known" in plan.torchao_version_origin
    pinned = to_fsdp2(spec, torchao_version="0.18.0").float8
    assert isinstance(pinned, TorchaoFloat8Plan) and pinned.torchao_version_origin == "given with --torchao-version"


def test_translate_takes_a_torchao_version_and_refuses_it_for_deepspeed():
    result = run_cli("translate", "configs/fsdp2-torchao-float8.yaml", "--to", "fsdp2", "--torchao-version", "0.11.0")
    assert result.returncode == 0 and json.loads(result.stdout)["float8"]["torchao_version"] == "0.11.0"
    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "deepspeed", "--torchao-version", "0.11")
    assert result.returncode == 2 and "--torchao-version applies to --to fsdp2 only" in result.stderr


def test_the_moved_fp16_section_names_its_new_key(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("engine: deepspeed\ndeepspeed:\n  fp16: {loss_scale: 0}\n")
    result = run_cli("validate", config)
    assert result.returncode == 2 and "deepspeed.fp16: this key moved to `precision.loss_scaling`" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(ConfigError, match="loss scaling acts only on fp16 compute"):
        load_config({"precision": {"loss_scaling": {"loss_scale": 8}}})


def test_audit_refuses_before_launching_what_cannot_run_here():
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed's accelerator here supports fp16: nothing to refuse")
    started = time.monotonic()
    result = run_cli("audit", "tiny-llama", "--config", ROOT / "configs" / "deepspeed-fp16.yaml")
    assert result.returncode == 2 and "does not support" in result.stderr, result.stderr[-2000:]
    assert "torch.distributed.elastic" not in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 60  # decided in the parent: no ranks were started


def test_audit_run_is_bounded_in_time():
    result = run_cli("audit", "tiny-llama", "--timeout", "0.5")
    assert result.returncode == 2 and "did not finish within 0.5 s" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_preflight_refuses_a_torch_below_the_floor(monkeypatch):
    from fp8dist.runtime.preflight import preflight
    from fp8dist.errors import UnsupportedEnvironment

    spec = load_config(ROOT / "configs" / "fsdp2-bf16.yaml")
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.8.0" if name == "torch" else None)
    with pytest.raises(UnsupportedEnvironment, match="older than fp8dist's floor 2.9.0"):
        preflight(spec)
