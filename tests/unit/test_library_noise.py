"""fp8dist.library_noise: the libraries' known-benign start-up messages are filtered, nothing else is."""
import logging
import subprocess
import sys

import pytest

from fp8dist import library_noise

BENIGN_TEXT = ("Failed to load", "register_constant", "Setting accelerator to CPU")


def test_importing_fp8dist_first_keeps_torchao_and_deepspeed_start_up_quiet():
    import os

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # let DeepSpeed auto-detect (and say so)
    script = "import fp8dist, torchao, deepspeed; from deepspeed.accelerator import get_accelerator; get_accelerator()"
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert not [t for t in BENIGN_TEXT if t in quiet.stdout + quiet.stderr], quiet.stdout + quiet.stderr
    # Without fp8dist the same imports say them: the filter, not a changed library, keeps them out.
    loud = subprocess.run([sys.executable, "-c", script.replace("import fp8dist, ", "import ")], capture_output=True,
                          text=True, env=env, timeout=300)
    said = loud.stdout + loud.stderr
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the CUDA-only messages are kept by design")
    assert all(t in said for t in BENIGN_TEXT), said


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    library_noise.install()
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "DeepSpeed")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.messages
    for logger in loggers:
        logger.removeHandler(handler)


def test_messages_about_the_run_get_through(records, monkeypatch):
    import enum

    import torch  # noqa: F401  (the CUDA condition reads torch)

    torchao, pytree, ds = (logging.getLogger(n) for n in ("torchao", "torch.utils._pytree", "DeepSpeed"))
    torchao.warning("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
    torchao.warning("Failed to load /x/torchao/_C_other.so: Could not load")  # not a known CUDA-only extension
    torchao.warning("float8 all-gather disabled: FSDP version too old")
    user_enum = enum.Enum("UserChoice", "A B")
    pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", user_enum)
    ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    kept = list(records)
    assert "Failed to load /x/torchao/_C_other.so: Could not load" in kept
    assert "float8 all-gather disabled: FSDP version too old" in kept
    assert any("UserChoice" in m for m in kept)  # only torchao's own enums are filtered
    if not torch.cuda.is_available():
        assert not any("_C_mxfp8" in m or "Setting accelerator" in m for m in kept)
    # On a machine with CUDA, the CUDA-only kernels' failures and DeepSpeed's fallback are the run's business.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    records.clear()
    torchao.warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load")
    ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    assert len(records) == 2

