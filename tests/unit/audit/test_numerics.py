"""The FP8 numerics check (fp8dist.audit.numerics; `watch(..., numerics=True)`, `fp8dist audit --numerics`), one
process: issue 33's worked example (one weight row 10^6 times the rest) through fp8dist's FSDP2 engine on a one-rank
gloo group, the casts being torchao's own (each probe's dequantized product is the module's own result), the
MXFP8 experts, and what stays as it was without the check."""
import pytest
import torch
import torch.distributed as dist

from fp8dist.audit import watch
from fp8dist.audit.numerics import GEMMS, NumericsRecorder, Tally, Thresholds, document
from fp8dist.config.load import load_config

OUTLIER_MODULE = "model.layers.0.mlp.up_proj"
CONFIGS = {"tensorwise": "configs/fsdp2-torchao-float8.yaml", "rowwise": "configs/fsdp2-torchao-rowwise.yaml"}


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _audited(recipe: str, outlier: bool, numerics: bool = True) -> dict:
    """The report of step 2 of a tiny Llama under fp8dist's FSDP2 engine and `recipe` (emulated float8)."""
    from fp8dist.engines import fsdp2
    from fp8dist.runtime.models import load_model
    from tests.conftest import ROOT

    spec = load_config(str(ROOT / CONFIGS[recipe]))
    loaded = load_model("tiny-llama", spec.precision.load_dtype, seed=0)
    model = loaded.model
    if outlier:
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0] *= 1e6
    run = fsdp2.prepare(model, spec, audit="off")
    batch = loaded.make_batch(2, 32, 0)
    fsdp2.train_step(run, [batch], spec.train.gradient_clipping)
    with watch(run.model, run.optimizer, spec, on_mismatch="ignore", numerics=numerics) as audit:
        fsdp2.train_step(run, [batch], spec.train.gradient_clipping)
    return audit.report


@pytest.fixture(scope="module")
def reports(one_rank):
    return {(recipe, outlier): _audited(recipe, outlier) for recipe in CONFIGS for outlier in (False, True)}


def _row(report: dict) -> dict:
    return next(c for c in report["checks"] if c["phase"] == "numerics")


def _cast(report: dict, module: str, gemm: str, operand: str) -> dict:
    return next(c for c in report["numerics"]["casts"]
                if (c["module"], c["gemm"], c["operand"]) == (module, gemm, operand))


@pytest.mark.parametrize("recipe", list(CONFIGS))
def test_the_unmodified_model_passes(reports, recipe):
    report = reports[(recipe, False)]
    assert _row(report)["status"] == "ok" and _row(report)["observed"] == "healthy", _row(report)
    assert report["passed"], [c for c in report["checks"] if not c["ok"]]
    numerics = report["numerics"]
    assert {g["gemm"] for g in numerics["gemms"]} == set(GEMMS)
    assert len({g["module"] for g in numerics["gemms"]}) == 14  # every converted Linear, none left unmeasured
    assert not any(f["fails"] for f in numerics["worst"]) and "not measured" not in _row(report)["detail"]


def test_tensorwise_fails_naming_the_outlier_module(reports):
    report = reports[("tensorwise", True)]
    row = _row(report)
    assert row["status"] == "MISMATCH" and row["observed"] == "outside thresholds"
    assert _cast(report, OUTLIER_MODULE, "forward", "weight")["underflow"] >= 0.5
    assert f"{OUTLIER_MODULE} forward weight underflow" in row["detail"]
    fix = row["detail"].split("; fix: ")[1]
    assert fix.startswith("keep them in high precision: precision.fp8.modules.exclude: ['lm_head', ")  # kept
    assert OUTLIER_MODULE in fix and "recipe_name: rowwise" in fix
    failing = [f for f in report["numerics"]["worst"] if f["fails"]]
    assert failing[0]["module"] == OUTLIER_MODULE and failing[0]["metric"] == "underflow"
    assert [c["phase"] for c in report["checks"] if not c["ok"]] == ["numerics"]  # every dtype is as configured


def test_rowwise_keeps_the_forward_weight_and_the_input_gradient_gemm_underflows_under_both(reports):
    """Rowwise gives the outlier row its own scale in the forward GEMM; the input-gradient GEMM scales the weight
    per column (rowwise) or per tensor (tensorwise), so every column's outlier element flushes the rest."""
    assert _cast(reports[("rowwise", True)], OUTLIER_MODULE, "forward", "weight")["underflow"] < 0.05
    for recipe in CONFIGS:
        assert _cast(reports[(recipe, True)], OUTLIER_MODULE, "input_grad", "weight")["underflow"] >= 0.5
        assert _cast(reports[(recipe, False)], OUTLIER_MODULE, "input_grad", "weight")["underflow"] < 0.01


def test_the_table_prints_the_worst_modules(reports):
    from fp8dist.audit.report import table

    text = table(reports[("tensorwise", True)])
    assert "FP8 numerics, worst modules" in text
    assert f"! {OUTLIER_MODULE} forward weight: underflow 0.99" in text


def test_the_limits_come_from_the_config(reports):
    """audit.numerics: the same measurements judged with a looser underflow limit no longer fail on it."""
    spec = load_config({"audit": {"numerics": {"max_underflow": 1.0, "min_sqnr_db": {"weight_grad": 0}}}})
    assert Thresholds.of(spec).max_underflow == 1.0
    tally = Tally()
    report = reports[("tensorwise", True)]
    for c in report["numerics"]["casts"]:
        numel = 1000
        tally.casts[(c["module"], c["gemm"], c["operand"])] = [c["format"], round(c["underflow"] * numel), numel,
                                                               round(c["saturated"] * numel), numel]
    strict, loose = document(tally, Thresholds.of(load_config({}))), document(tally, Thresholds.of(spec))
    assert any(f["fails"] and f["metric"] == "underflow" for f in strict["worst"])
    assert not any(f["fails"] for f in loose["worst"])


def test_without_numerics_the_report_has_no_numerics(one_rank):
    report = _audited("tensorwise", outlier=True, numerics=False)
    assert "numerics" not in report and all(c["phase"] != "numerics" for c in report["checks"])
    assert report["passed"]  # the outlier is a numerics finding only: every dtype is as the config says


class Capturing(Tally):
    """A Tally that also keeps each GEMM's product of dequantized casts (the probe's FP8 result)."""

    def __init__(self):
        super().__init__()
        self.products = {}

    def gemm(self, module, owner, gemm, a, b, offsets=None, rows_grouped=False):
        def values(operand):
            return operand.values.float() if operand.cast is None else operand.cast.dequantized
        if a.cast is not None or b.cast is not None:
            self.products[gemm] = values(a) @ values(b)
        super().gemm(module, owner, gemm, a, b, offsets, rows_grouped)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_each_probe_casts_as_the_module_does(recipe):
    """The product of the probe's dequantized casts is the emulated module's own result, GEMM by GEMM: the casts
    are torchao's, with the scaling axis each GEMM uses."""
    from fp8dist.backends.base import get_backend

    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "recipe_name": recipe}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False))
    backend.convert_module(model)
    x = torch.randn(2, 32, 64, requires_grad=True)
    grad = torch.randn(2, 32, 96)
    recorder = NumericsRecorder(model)
    recorder.tally = tally = Capturing()
    with recorder:
        out = model(x)
        out.backward(grad)
    expected = {"forward": out.reshape(64, 96), "input_grad": x.grad.reshape(64, 64),
                "weight_grad": model[0].weight.grad}
    if recipe == "rowwise_with_gw_hp":  # its weight gradient runs in high precision: not an FP8 GEMM
        del expected["weight_grad"]
    assert set(tally.products) == set(expected)
    for gemm, result in expected.items():
        torch.testing.assert_close(tally.products[gemm], result.float(), rtol=1e-4, atol=1e-4, msg=gemm)
    assert tally.measured == {"0"} and not recorder.tally.unmeasured


def test_mxfp8_experts_are_measured_and_nothing_stays_installed():
    from transformers.integrations.moe import ExpertsInterface

    from fp8dist.backends.base import get_backend
    from fp8dist.runtime.models import load_model

    from tests.conftest import ROOT

    spec = load_config(str(ROOT / "configs" / "fsdp2-moe-mxfp8.yaml"))
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    loaded = load_model("tiny-mixtral", "bf16", seed=0)
    model = loaded.model
    backend.convert_module(model)
    implementation = model.config._experts_implementation
    registered = ExpertsInterface._global_mapping[implementation]
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    recorder = NumericsRecorder(model)
    with recorder:
        model(**loaded.make_batch(2, 32, 0)).loss.backward()
    assert ExpertsInterface._global_mapping[implementation] is registered
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    numerics = document(recorder.tally, Thresholds.of(spec))
    experts = {(g["module"], g["gemm"]): g for g in numerics["gemms"] if ".experts." in g["module"]}
    names = {f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")}
    assert set(experts) == {(name, gemm) for name in names for gemm in GEMMS}
    assert all(g["format"] == "mxfp8" and g["sqnr_db"] > 20 for g in experts.values()), experts
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= recorder.tally.measured


def test_the_cli_flag_reaches_the_ranks(monkeypatch):
    import fp8dist.commands.audit as command
    from fp8dist.commands.audit_worker import NUMERICS
    from fp8dist.cli import build_parser

    seen = []
    monkeypatch.setattr(command, "launch", lambda module, args, *rest: seen.append(args) or {"passed": True})
    command.measure("tiny-llama", None, 1, 1, numerics=True)
    command.measure("tiny-llama", None, 1, 1)
    assert seen[0][4] == NUMERICS and seen[1][4] == ""
    assert build_parser().parse_args(["audit", "tiny-llama", "--numerics"]).numerics is True
    assert build_parser().parse_args(["audit", "tiny-llama"]).numerics is False


def test_activation_checkpointing_is_measured_once():
    """A checkpointed block's forward runs again in backward: the recompute is not measured a second time, and the
    step's numbers are the ones without checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fp8dist.backends.base import get_backend
    from fp8dist.runtime.models import load_model

    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True}}}})
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    documents = []
    for checkpointed in (False, True):
        loaded = load_model("tiny-llama", "fp32", seed=0)
        model = loaded.model
        backend.convert_module(model)
        if checkpointed:
            model.config.use_cache = False
            for index, layer in enumerate(model.model.layers):
                model.model.layers[index] = checkpoint_wrapper(layer)
        recorder = NumericsRecorder(model)
        with recorder:
            model(**loaded.make_batch(2, 32, 0)).loss.backward()
        documents.append(document(recorder.tally, Thresholds.of(spec)))
    plain, checkpointed = documents
    assert len(plain["gemms"]) == 14 * 3 and checkpointed["casts"] == plain["casts"]
    assert checkpointed["gemms"] == plain["gemms"]


def test_fp8_gemms_no_probe_measures_keep_the_row_not_measured():
    """Transformer Engine's or MS-AMP's FP8 GEMMs (counted by the ledger, not probed): the row cannot say healthy."""
    from fp8dist.audit.gemm_flops import WeightGemmLedger
    from fp8dist.audit.numerics import observe

    spec = load_config({"precision": {"preset": "torchao-float8"}})
    ledger = WeightGemmLedger()
    ledger.flops[("transformer_engine", "fp8_e4m3")] = 1000
    cell, numerics = observe(Tally(), ledger, spec)
    assert cell["measured"] is False and cell["observed"] == "not measured"
    assert "transformer_engine (no numerics probe for its FP8 GEMMs)" in cell["detail"]
    assert numerics == {"casts": [], "gemms": [], "scaling_history": [], "worst": []}
    bf16 = load_config({"precision": {"preset": "bf16"}})
    assert observe(Tally(), WeightGemmLedger(), bf16)[0] == {"observed": "n/a", "measured": True,
                                                             "detail": "no FP8 weight GEMM in the step"}


def test_a_failing_probe_leaves_its_module_not_measured_and_the_step_goes_on(monkeypatch):
    import fp8dist.audit.numerics as numerics

    class Failing:
        def __init__(self, module, name, tally, full_weight):
            self.name = name

        def forward(self, x, weight):
            raise RuntimeError("no such cast")

        def backward(self, saved, grad_output):
            raise AssertionError("a failed forward measures no backward")

    monkeypatch.setattr(numerics, "PROBES", [lambda m: Failing if isinstance(m, torch.nn.Linear) else None])
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    recorder = NumericsRecorder(model)
    with recorder:
        model(x).sum().backward()
    assert model[0].weight.grad is not None
    assert recorder.tally.unmeasured == {"0": "its probe failed: RuntimeError: no such cast"}
