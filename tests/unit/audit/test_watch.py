"""`fp8dist.audit.watch` in one process (no process group): what it observes, what it cannot, and how a
mismatch is handled. Multi-rank loops and other frontends: tests/distributed/test_watch.py."""
import subprocess
import sys

import pytest
import torch

from fp8dist.audit import AuditMismatch, watch
from fp8dist.errors import Fp8distError
from fp8dist.engines.base import Engine, forward_loss
from fp8dist.runtime.models import infer_batch
from tests.audit_factories import ConvFirst, FeatureMLP, TokenMLP

FP32_SINGLE = {"precision": {"preset": "fp32"}}


def step(model, optimizer, batch):
    forward_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_plain_fp32_loop_is_observed_phase_by_phase():
    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = infer_batch(model)(2, 8, 0)
    with watch(model, optimizer, FP32_SINGLE, on_mismatch="ignore") as audit:
        step(model, optimizer, batch)
    cells = {c["phase"]: c for c in audit.report["checks"]}
    assert cells["training"]["observed"] == "fp32" and cells["training"]["status"] == "ok"
    assert cells["optimizer"]["observed"] == "fp32+fp32" and cells["weight_gradients"]["observed"] == "fp32"
    assert cells["master_weights"]["observed"] == "n/a"
    # a plain module is no FSDP2: the engine is the mismatch, and so is the verdict
    assert cells["engine"]["observed"] == "none" and cells["engine"]["status"] == "MISMATCH"
    assert audit.passed is False and "loading" in audit.report["outside_scope"]


def test_a_block_without_an_optimizer_step_is_not_measured():
    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    with watch(model, optimizer, FP32_SINGLE, on_mismatch="ignore") as audit:
        forward_loss(model, infer_batch(model)(2, 8, 0)).backward()
    cells = {c["phase"]: c for c in audit.report["checks"]}
    assert cells["weight_gradients"]["status"] == "NOT MEASURED" and cells["optimizer"]["status"] == "NOT MEASURED"


def test_raise_and_warn(capsys):
    model = TokenMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = infer_batch(model)(2, 8, 0)
    with pytest.raises(AuditMismatch) as raised:
        with watch(model, optimizer, FP32_SINGLE, on_mismatch="raise"):
            step(model, optimizer, batch)
    assert raised.value.exit_code == 1 and "engine" in str(raised.value)
    with watch(model, optimizer, FP32_SINGLE):  # warn: one table on stderr, the loop goes on
        step(model, optimizer, batch)
    err = capsys.readouterr().err
    assert err.count("fp8dist audit:") == 2 and "MISMATCH" in err  # the table's title and the warning line


def test_an_error_in_the_block_goes_through_and_nothing_stays_installed():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="boom"):
        with watch(model, optimizer, FP32_SINGLE) as audit:
            raise ValueError("boom")
    assert audit.report is None and _get_current_dispatch_mode() is None
    assert not optimizer._optimizer_step_pre_hooks


def test_a_finished_watch_keeps_nothing_of_the_run_alive():
    """After the block the Watch holds its report only: the model, the optimizer (and through them the process group
    and the tensors of a step's collectives) go when the loop lets go of them, the Watch kept or not."""
    import gc
    import weakref

    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    with watch(model, optimizer, FP32_SINGLE, on_mismatch="ignore") as audit:
        step(model, optimizer, infer_batch(model)(2, 8, 0))
    alive = [weakref.ref(model), weakref.ref(optimizer), weakref.ref(next(iter(optimizer.state.values()))["exp_avg"])]
    del model, optimizer
    gc.collect()
    assert audit.report is not None and audit.passed is not None
    assert [ref() for ref in alive] == [None, None, None]


def test_bad_arguments_are_clear():
    model = FeatureMLP()
    with pytest.raises(Fp8distError, match="on_mismatch='loud'"):
        watch(model, torch.optim.SGD(model.parameters()), FP32_SINGLE, on_mismatch="loud")
    with pytest.raises(Fp8distError, match="needs the optimizer"):
        with watch(model, None, FP32_SINGLE):
            pass


def test_inferred_inputs():
    tokens = infer_batch(TokenMLP())(2, 8, 0)
    assert list(tokens) == ["tokens"] and tokens["tokens"].dtype == torch.int64 and tokens["tokens"].max() < 128
    features = infer_batch(FeatureMLP().to(torch.bfloat16))(2, 8, 0)
    assert features["x"].shape == (2, 8, 48) and features["x"].dtype == torch.bfloat16
    assert infer_batch(ConvFirst()) is None


def test_importing_the_audit_and_integrations_packages_imports_no_torch():
    code = "import fp8dist.audit, fp8dist.integrations, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_yaml_off_means_off(tmp_path):
    from fp8dist.config.load import load_config

    path = tmp_path / "c.yaml"
    path.write_text("audit:\n  first_step: off\n")
    assert load_config(path).audit.first_step == "off"


class PlainRun(Engine):
    """The engine interface around a plain module and its optimizer (no engine of its own): enough to run the
    engines' first-step audit (fp8dist.engines.base.Engine.train_step), with a step that can be skipped."""

    def __init__(self, model, optimizer, spec, skip: bool):
        super().__init__(spec, backend=None, decisions=[])
        self.model, self.optimizer, self.skip = model, optimizer, skip

    def accumulate(self, batches):
        loss = forward_loss(self.model, batches[0])
        loss.backward()
        return loss.item()

    def apply_gradients(self):
        if not self.skip:
            self.optimizer.step()
        self.optimizer.zero_grad()
        return not self.skip

    @property
    def skipped_note(self):
        return "skipped (non-finite gradients)" if self.skip else None


def test_a_first_step_the_optimizer_skipped_is_audited_again_on_the_next(capsys):
    """fp16 loss scaling skips a step with non-finite gradients: nothing to observe of gradients or states,
    so the engines' first-step audit drops that observation and audits the next step instead."""
    model = FeatureMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = infer_batch(model)(2, 8, 0)
    run = PlainRun(model, optimizer, fp32_spec(), skip=True)
    run.train_step([batch])  # the step is skipped: nothing audited, nothing printed
    assert run.audit_report is None and "fp8dist audit" not in capsys.readouterr().out
    run.skip = False
    run.train_step([batch])
    assert run.audit_report is not None and capsys.readouterr().out.count("fp8dist audit:") == 1
    with run.first_step() as audit:
        step(model, optimizer, batch)
    assert audit is None  # done: later steps run with nothing installed


def fp32_spec():
    from fp8dist.config.load import load_config

    return load_config(FP32_SINGLE)


def test_the_deepspeed_step_hook_restores_what_was_there_and_nests():
    from fp8dist.engines.deepspeed import DeepSpeedInspector

    model = FeatureMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler_style = optimizer.step  # a wrapper already on the instance, as an LR scheduler leaves one
    optimizer.step = scheduler_style
    seen = []
    inspector = DeepSpeedInspector(model, optimizer)
    with inspector.capture_gradients(lambda grads, where: seen.append(where)):
        with inspector.capture_gradients(lambda grads, where: seen.append("inner " + where)):
            forward_loss(model, infer_batch(model)(2, 8, 0)).backward()
            optimizer.step()
        assert optimizer.__dict__["step"] is not scheduler_style  # the outer hook is back
    assert optimizer.__dict__["step"] is scheduler_style and len(seen) == 2
