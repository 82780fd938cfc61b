"""The audit's `speed` row (fp8dist/audit/speed_row.py): info from the weight GEMMs a step ran, never a failure."""
import fp8dist.speed as speed
from fp8dist.audit.probes import MatmulRecorder
from fp8dist.audit.report import build, table
from fp8dist.audit.speed_row import speed_row
from fp8dist.backends.base import get_backend
from fp8dist.config.load import load_config
from fp8dist.runtime.models import _from_hf_config, causal_lm_batch
from fp8dist.config.models import tiny_config


def _spec(gpu="auto", exclude=("lm_head",)):
    return load_config({"hardware": {"gpu": gpu}, "train": {"micro_batch_size": 2, "seq_len": 32},
                        "precision": {"fp8": {"backend": "torchao", "torchao": {"emulate": True},
                                              "modules": {"exclude": list(exclude)}}}})


def _ledger(spec):
    model = _from_hf_config(tiny_config("llama"), "fp32", 0)
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    backend.convert_module(model)
    recorder = MatmulRecorder()
    batch = causal_lm_batch(model.config.vocab_size)(2, 32, 0)
    with recorder.ledger.owners(model), recorder:
        model(**batch).loss.backward()
    return recorder.ledger


def test_the_ledger_keeps_each_linears_forward_shape():
    ledger = _ledger(_spec())
    assert ledger.shapes["model.layers.0.self_attn.k_proj"] == (64, 64, 32)
    assert ledger.shapes["lm_head"] == (64, 64, 256)


def test_on_a_named_gpu_the_row_predicts_the_run_as_it_ran_and_names_the_losers():
    spec = _spec("h100", exclude=("lm_head", "*.mlp.*"))
    row = speed_row(spec, _ledger(spec), None)
    formats = {r["module"]: r["format"] for r in row["linears"]}
    assert formats["lm_head"] == "bf16" and formats["model.layers.0.mlp.up_proj"] == "bf16"
    assert formats["model.layers.0.self_attn.q_proj"] == "fp8"
    # tiny shapes: every FP8 GEMM loses, and the ratio is the model's over the Linears as they ran
    losing = {r["module"] for r in row["losing"]}
    assert losing == {m for m, f in formats.items() if f == "fp8"}
    times = {r["module"]: speed.linear_times(r["m"], r["k"], r["n"], "tensorwise", "h100", compiled=False)
             for r in row["linears"]}
    ran = sum(t.fp8 if formats[m] == "fp8" else t.bf16 for m, t in times.items())
    assert row["fp8_over_bf16"] == round(sum(t.bf16 for t in times.values()) / ran, 3) < 1
    assert "on H100" in row["detail"] and "q_proj 64x64 at M=64" in row["detail"]


def test_without_a_known_gpu_it_says_why_and_the_audit_does_not_fail_on_it():
    spec = _spec()
    row = speed_row(spec, _ledger(spec), None)
    assert row["observed"] == "no prediction" and "set hardware.gpu" in row["detail"]
    assert speed_row(spec, _ledger(spec), "NVIDIA A100-SXM4-80GB")["detail"].count("A100") == 1
    result = build(spec, "tiny-llama", {"_speed": row}, 1)
    assert "speed" not in {c["phase"] for c in result["checks"]}  # info: never a check the verdict counts
    assert "speed (info): no prediction" in table(result)


def test_a_recipe_the_gpu_lacks_is_said_not_predicted():
    spec = load_config({"precision": {"fp8": {"backend": "torchao", "torchao": {"emulate": True,
                                                                                   "recipe_name": "mxfp8"}}}})
    row = speed_row(spec, _ledger(_spec()), "NVIDIA H100 80GB HBM3")
    assert row["observed"] == "no prediction" and "mxfp8 does not run on h100" in row["detail"]


def test_watch_puts_the_row_in_the_report():
    import torch

    from fp8dist.audit import watch
    from fp8dist.engines.base import forward_loss
    from fp8dist.runtime.models import infer_batch
    from tests.audit_factories import FeatureMLP

    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    config = {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}},
              "hardware": {"gpu": "h100"}}
    with watch(model, optimizer, config, on_mismatch="ignore") as audit:  # a model nobody converted: all bf16
        forward_loss(model, infer_batch(model)(2, 8, 0)).backward()
        optimizer.step()
    row = audit.report["speed"]
    assert row["gpu"] == "h100" and row["fp8_over_bf16"] == 1.0 and row["linears"], row
    assert {r["format"] for r in row["linears"]} == {"bf16"} and row["losing"] == []


def test_a_run_without_fp8_has_no_speed_row():
    spec = load_config({"hardware": {"gpu": "h100"}})  # bf16 preset: nothing to compare
    assert speed_row(spec, _ledger(_spec()), None) is None
