"""precision.fp8.policy auto and `fp8dist calibrate` on the README's outlier model (tiny-llama, row 0 of
model.layers.0.mlp.up_proj x 10^6), 2 gloo ranks, emulated float8: the calibration keeps the outlier Linear and the
one its output feeds in the compute dtype, the written config loads and its run audits PASS (numerics included)
with the same recipe per Linear as the run that calibrates itself."""
import json

import pytest
import yaml

from fp8dist.config.load import load_config
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.distributed
KEPT = {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}


@pytest.fixture(scope="module")
def outlier(tmp_path_factory):
    import torch

    from fp8dist.runtime.models import load_model

    loaded = load_model("tiny-llama", "bf16", seed=0)
    with torch.no_grad():
        loaded.model.model.layers[0].mlp.up_proj.weight[0] *= 1e6
    path = tmp_path_factory.mktemp("outlier") / "my-outlier-llama"
    loaded.model.save_pretrained(path)
    return path


def recipes(report: dict) -> dict:
    return {m["fqn"]: m.get("recipe") if m["convert"] else None for m in report["fp8_modules"]}


def test_calibrate_writes_a_config_whose_run_audits_pass_as_the_auto_run(outlier, tmp_path):
    written = tmp_path / "policy.yaml"
    done = run_cli("calibrate", outlier, "--config", ROOT / "configs" / "fsdp2-torchao-float8.yaml", "-o", written,
                   "--nproc", "2", "--steps", "1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibrated 14 Linears on the first 1 step(s) (1 micro-batch(es) per rank, 2 rank(s))" in done.stdout
    assert "model.layers.0.mlp.up_proj: compute dtype (numerics: tensorwise fails (forward weight underflow" \
        in done.stderr and "numerics only" in done.stderr
    spec = load_config(str(written))  # the written file is a config fp8dist loads
    assert spec.fp8.policy == "manual"
    document = yaml.safe_load(written.read_text())
    assert document["precision"]["preset"] == "torchao-float8"  # the config as written, plus the decision
    by_recipe = {o["recipe"]: set(o["modules"]) for o in document["precision"]["fp8"]["overrides"]}
    assert by_recipe["none"] == KEPT and len(by_recipe["tensorwise"]) == 12
    assert "#   model.layers.0.mlp.down_proj: compute dtype" in written.read_text()

    audited = run_cli("audit", outlier, "--config", written, "--nproc", "2", "--numerics", "--format", "json",
                      timeout=600)
    report = json.loads(audited.stdout)
    assert audited.returncode == 0 and report["passed"], audited.stdout[-3000:]
    assert report["gemm_flops"]["policy"]["mismatches"] == []
    assert report["gemm_flops"]["policy"]["asked_fp8_share"] == report["gemm_flops"]["fp8_share"]

    auto = tmp_path / "auto.yaml"
    auto.write_text(yaml.safe_dump({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {"emulate": True}, "policy": "auto", "calibration_steps": 1}}}))
    calibrated = run_cli("audit", outlier, "--config", auto, "--nproc", "2", "--numerics", "--format", "json",
                         timeout=600)
    auto_report = json.loads(calibrated.stdout)
    assert calibrated.returncode == 0 and auto_report["passed"], calibrated.stdout[-3000:]
    assert "precision.fp8.policy auto: calibrated 14 Linears" in calibrated.stderr  # the start report
    assert recipes(auto_report) == recipes(report)
    assert {fqn for fqn, recipe in recipes(report).items() if recipe is None} == KEPT | {"lm_head"}


def test_with_the_speed_model_every_linear_below_min_speedup_stays_in_bf16_and_the_audit_expects_it(tmp_path):
    """tiny-llama's Linears at 128 tokens on an H100 (hardware.gpu; FP8 emulated here): predicted far below 1x, so
    the calibration keeps them all in the compute dtype, each with its predicted speedups; the gemm row expects
    bf16 for that reason."""
    auto = tmp_path / "auto.yaml"
    auto.write_text(yaml.safe_dump({"engine": "fsdp2", "hardware": {"gpu": "h100"}, "precision": {
        "preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}, "policy": "auto", "calibration_steps": 1,
                                             "min_speedup": 1.0}}}))
    done = run_cli("audit", "tiny-llama", "--config", auto, "--format", "json", timeout=600)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["passed"], done.stdout[-3000:]
    assert "compute dtype 14; speed model: H100" in done.stderr
    assert "at M=128 on H100, not compiled: below min_speedup, precision.fp8.min_speedup=1" in done.stderr
    gemm = next(row for row in report["checks"] if row["phase"] == "gemm")
    assert gemm["expected"] == gemm["observed"] == "bf16" and "policy auto kept every Linear" in gemm["why"]
