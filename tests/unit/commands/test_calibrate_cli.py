"""`fp8dist calibrate`'s refusals before anything is launched: each names the flag or key, the value, why and the
fix, exits 2 without a traceback, and writes nothing."""
import pytest

from fp8dist.cli import main
from tests.conftest import ROOT

FLOAT8 = str(ROOT / "configs" / "fsdp2-torchao-float8.yaml")
BF16 = str(ROOT / "configs" / "fsdp2-bf16.yaml")


@pytest.mark.parametrize("args, says", [
    (["--nproc", "0"], ["--nproc 0: at least one rank calibrates", "fix: --nproc 1"]),
    (["--steps", "0"], ["--steps 0: the calibration runs at least one step's batches", "fix: --steps 1 or more"]),
    (["--timeout", "-1"], ["--timeout -1: a time bound is positive seconds", "fix: --timeout"]),
    (["parallel.tensor_size=2"], ["parallel.tensor_size", "runs each rank's whole model", "fix: set "
                                  "parallel.tensor_size=1 to calibrate"]),
])
def test_bad_flags_and_keys_are_refused_naming_them(tmp_path, capsys, args, says):
    out = tmp_path / "policy.yaml"
    assert main(["calibrate", "tiny-llama", "--config", FLOAT8, "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert all(fragment in err for fragment in says), err
    assert "Traceback" not in err and not out.exists() and list(tmp_path.iterdir()) == []


def test_a_config_without_torchao_and_an_output_nowhere_are_refused(tmp_path, capsys):
    out = tmp_path / "policy.yaml"
    assert main(["calibrate", "tiny-llama", "--config", BF16, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "precision.fp8.backend" in err and "fp8dist calibrate: the calibration casts" in err
    assert "fix: set precision.fp8.backend=torchao (preset torchao-float8)" in err and not out.exists()
    assert main(["calibrate", "tiny-llama", "--config", FLOAT8, "-o", str(tmp_path / "no" / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "nothing written" in err
